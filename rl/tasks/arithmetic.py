"""`arithmetic`: problems such as "What is 38 + 17?" generated in code, answered in text, with a
held-out split disjoint from training; `arithmetic_retry`: the same as a two-turn episode. Both (and
`python_tool`, rl/tasks/tool_task.py) draw their problems from `ArithmeticProblems`, a prompt
source with no reward: `arithmetic` adds the single-turn reward, the others an environment."""

from __future__ import annotations

import os
from typing import Any

import torch

from rl.tasks.answers import math_reward
from rl.tasks.base import Prompt, Task
from rl.tasks.chat import chat_encoder, load_tokenizer, observation_encoder, thinking_ids, user_turn


class ArithmeticProblems(Task):
    """Problems such as "What is 38 + 17?" generated in code, to be answered in text: the prompt
    source (and chat renderer) of `arithmetic`, `arithmetic_retry` and `python_tool`; no reward.

    A problem is `operands` integers drawn from [low, high] joined by operators drawn from
    `operators` (a string of `+-*`), evaluated with the usual precedence. Every problem
    belongs to exactly one split, decided by a hash of its text: one in `heldout_every` is
    held out, so the training prompts (`prompts(n, seed)`) and the held-out evaluation
    problems (`heldout(n)`, a fixed list) can never share a problem, whatever the seeds.
    The prompt is `template` with the problem as one user message in the tokenizer's chat
    template (`chat_template="tokenizer"`; a Jinja string works too; None = plain text);
    generation stops at the tokenizer's end-of-turn token (its EOS).
    """

    has_heldout = True

    def __init__(self, tokenizer_path: str | os.PathLike, *, operands: int = 2, low: int = 10, high: int = 99,
                 operators: str = "+", heldout_every: int = 8,
                 template: str = "What is {problem}? Start your reply with the result.",
                 chat_template: str | None = "tokenizer", system_prompt: str | None = None,
                 enable_thinking: bool | None = None, vocab_size: int | None = None,
                 stop_token_id: int | None = None) -> None:
        self.operands, self.low, self.high, self.operators = operands, low, high, operators
        self.heldout_every, self.template = heldout_every, template
        self.space = (high - low + 1) ** operands * len(operators) ** (operands - 1)  # distinct problems
        self.tokenizer = tokenizer = load_tokenizer(tokenizer_path)
        self.encode_messages = chat_encoder(tokenizer, chat_template, system_prompt, tokenizer_path, enable_thinking)
        self.chat_template, self.enable_thinking = chat_template, enable_thinking
        self.reward_name = "rl.tasks.answers:math_reward"
        self.stop_token_id = stop_token_id if stop_token_id is not None else tokenizer.eos_token_id
        longest = self.encode_messages(self.messages(f" {operators[0]} ".join([str(high)] * operands)))
        self.max_prompt_len = len(longest) + 4  # digits tokenize one by one: the widest operands, plus slack
        self.min_vocab_size = 1 + max(max(longest), self.stop_token_id or 0)
        if vocab_size is not None and self.min_vocab_size > vocab_size:
            raise ValueError(f"task 'arithmetic': the tokenizer's ids reach {self.min_vocab_size - 1}, outside the "
                             f"model's vocabulary of {vocab_size}")

    @classmethod
    def check_options(cls, options: dict) -> None:
        """operands, low .. high, operators, heldout_every and template."""
        operands, low, high, operators = (options[k] for k in ("operands", "low", "high", "operators"))
        if operands < 2:
            raise ValueError(f"task.options.operands={operands}: expected >= 2")
        if not 0 <= low <= high:
            raise ValueError(f"task.options.low={low}, task.options.high={high}: expected 0 <= low <= high")
        if not operators or set(operators) - set("+-*"):
            raise ValueError(f"task.options.operators={operators!r}: expected a non-empty string of '+', '-', '*'")
        if options["heldout_every"] < 2:
            raise ValueError(f"task.options.heldout_every={options['heldout_every']}: expected >= 2 (1 in k "
                             "problems held out)")
        if "{problem}" not in options["template"]:
            raise ValueError(f"task.options.template={options['template']!r} has no '{{problem}}' field")

    # ---------------------------------------------------------------- problems
    def _draw(self, g: torch.Generator) -> str:
        nums = torch.randint(self.low, self.high + 1, (self.operands,), generator=g).tolist()
        ops = torch.randint(len(self.operators), (self.operands - 1,), generator=g).tolist()
        text = str(nums[0])
        for op, num in zip(ops, nums[1:]):
            text += f" {self.operators[op]} {num}"
        return text

    def is_heldout(self, problem: str) -> bool:
        import hashlib

        return int.from_bytes(hashlib.sha1(problem.encode()).digest()[:8], "little") % self.heldout_every == 0

    def _problems(self, n: int, seed: int, heldout: bool) -> list[str]:
        g = torch.Generator().manual_seed(int(seed))
        out: list[str] = []
        seen: set[str] = set()
        for _ in range(200 * n + 1000):  # rejection sampling; the held-out split is ~1/heldout_every
            if len(out) == n:
                return out
            problem = self._draw(g)
            if self.is_heldout(problem) == heldout and (not heldout or problem not in seen):
                out.append(problem)
                seen.add(problem)
        raise ValueError(f"task 'arithmetic': could not draw {n} {'held-out' if heldout else 'training'} problems "
                         f"from a space of {self.space}")

    def messages(self, problem: str) -> list[dict]:
        """The first turn: `template` with the problem, as one user message."""
        return user_turn(self.template.format(problem=problem))

    def _prompt(self, problem: str) -> Prompt:
        answer = arithmetic_value(problem)
        ids = self.encode_messages(self.messages(problem))
        return torch.tensor(ids, dtype=torch.int64), {"answer": answer, "problem": problem}

    def prompts(self, n: int, seed: int) -> list[Prompt]:
        """n training prompts (never a held-out problem), drawn from `seed`."""
        return [self._prompt(p) for p in self._problems(n, seed, heldout=False)]

    def heldout(self, n: int) -> list[Prompt]:
        """The first n problems of the held-out split: distinct, the same list in every run."""
        limit = self.space // self.heldout_every
        if n > limit // 2:
            raise ValueError(f"eval.num_prompts={n}: the held-out split of task 'arithmetic' has ~{limit} problems "
                             f"(1 in task.options.heldout_every={self.heldout_every} of {self.space}); ask for "
                             f"at most {limit // 2}, or widen the operands")
        return [self._prompt(p) for p in self._problems(n, seed=-1 & 0xFFFF_FFFF, heldout=True)]



class ArithmeticTask(ArithmeticProblems):
    """`arithmetic`: `ArithmeticProblems` answered in one reply, rewarded by the rule-based checker
    `math_reward` on the decoded response (its last number against the answer): 1.0 or 0.0."""

    def reward(self, prompt_ids: Any, response_ids: Any, meta: dict) -> float:
        return math_reward(self.decode(response_ids), meta["answer"])


class ArithmeticRetryTask(ArithmeticProblems):
    """`arithmetic_retry`: `arithmetic` as a two-turn episode. A wrong first answer gets
    `feedback` ("Incorrect, try again.") as the next user turn and the model answers again;
    the reward is the last answer's (`math_reward`, 1.0 or 0.0), so a problem solved on the
    second try scores as one solved on the first. `max_turns` model turns at most."""

    def __init__(self, tokenizer_path: str | os.PathLike, *, feedback: str = "Incorrect, try again.",
                 max_turns: int = 2, strip_thinking: bool = False, **kwargs: Any) -> None:
        super().__init__(tokenizer_path, **kwargs)
        self.strip_thinking = bool(strip_thinking)
        if self.strip_thinking:
            thinking_ids(self.tokenizer)  # the option's tokens exist
        self.feedback, self.max_turns = feedback, max_turns
        self.observation_ids = observation_encoder(self.tokenizer, self.chat_template, self.enable_thinking)
        self.max_observation_len = len(self.observation_ids(feedback))

    @classmethod
    def check_options(cls, options: dict) -> None:
        super().check_options(options)
        if options["max_turns"] < 1:
            raise ValueError(f"task.options.max_turns={options['max_turns']}: expected >= 1")

    def environment(self) -> "RetryEnvironment":
        return RetryEnvironment(self)


class RetryEnvironment:
    """An `arithmetic_retry` episode: the problem, then `feedback` after each wrong answer
    until the answer is right or the task's `max_turns` replies are spent."""

    def __init__(self, task: ArithmeticRetryTask) -> None:
        self.task, self.answer, self.turns = task, None, 0

    def reset(self, prompt: dict) -> list[dict]:
        self.answer, self.turns = prompt["answer"], 0
        return self.task.messages(prompt["problem"])

    def step(self, response_text: str) -> tuple[str | None, float, bool]:
        self.turns += 1
        reward = math_reward(response_text, self.answer)
        if reward == 1.0 or self.turns >= self.task.max_turns:
            return None, reward, True
        return self.task.feedback, 0.0, False


def arithmetic_value(problem: str) -> int:
    """The value of "a op b op c ..." (integers, `+ - *`, single spaces), `*` binding tighter."""
    tokens = problem.split()
    terms, sign, product = [], 1, int(tokens[0])
    for op, num in zip(tokens[1::2], tokens[2::2]):
        if op == "*":
            product *= int(num)
        else:
            terms.append(sign * product)
            sign, product = (1 if op == "+" else -1), int(num)
    return sum(terms) + sign * product

