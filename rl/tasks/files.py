"""The user's JSONL tasks: `file` (prompts and a reward on token ids) and `math` (text prompts
with a reference answer, rewarded on the decoded response).

`LineTask` is their prompt source (and that of `reasoning_gym` and `environment`): lines walked
in seeded epochs, no reward. `FileTask` is the user's task: a JSONL file of prompts and a
`module:function` reward on token ids. `MathTask` (`math`) is a text task: a JSONL of
`{"prompt", "answer"}`, a local tokenizer folder, an optional chat template, and a reward on the
decoded response text, `fn(response_text, **meta)`; the default reward is the rule-based answer
checker `math_reward` (rl/tasks/answers.py: the last `\\boxed{...}`, else the last number, against
`answer`). Both walk their lines in seeded epochs without replacement (`prompts_at`).
"""

from __future__ import annotations

import json
import os
from typing import Any, Callable, Sequence

import torch

from rl.seeds import derive
from rl.tasks.answers import math_reward
from rl.tasks.base import Prompt, Task, as_ids, reward_callable
from rl.tasks.chat import chat_encoder, load_tokenizer, user_turn


class LineTask(Task):
    """A prompt source of lines: `items`, [(prompt ids, meta)], set by the kind that reads them; no
    reward (a kind adds its own, or an environment).

    The trainer walks the lines in epochs (`prompts_at`): epoch e is every line once, in an
    order shuffled by (the run's seed, e), and step k takes the next `prompts_per_step`
    positions of that stream, k * prompts_per_step on: each line is seen once per epoch, and
    where a step starts is a function of the seed and the step, so a resumed run takes exactly
    the prompts the uninterrupted one would (no state to save). `prompts(n, seed)` takes n
    prompts in an order shuffled by `seed` (cycling if n exceeds the file): what dynamic
    sampling's extra rounds draw.
    """

    items: list[tuple[list[int], dict]]

    def __len__(self) -> int:
        return len(self.items)

    def prompts(self, n: int, seed: int) -> list[Prompt]:
        g = torch.Generator().manual_seed(int(seed))
        order = torch.randperm(len(self.items), generator=g).tolist()
        picks = [order[i % len(order)] for i in range(n)]
        return [(torch.tensor(self.items[j][0], dtype=torch.int64), dict(self.items[j][1])) for j in picks]

    def prompts_at(self, start: int, n: int, seed: int) -> list[Prompt]:
        """The prompts at positions start, ..., start + n - 1 of the run's stream of lines: position
        p is line `order(p // len)[p % len]`, where order(e) is a permutation of every line drawn
        from (`seed`, e) (see the class docstring)."""
        orders: dict[int, list[int]] = {}
        out = []
        for position in range(start, start + n):
            epoch, k = divmod(position, len(self.items))
            if epoch not in orders:
                g = torch.Generator().manual_seed(derive(seed, epoch))  # epoch `epoch`'s order
                orders[epoch] = torch.randperm(len(self.items), generator=g).tolist()
            ids, meta = self.items[orders[epoch][k]]
            out.append((torch.tensor(ids, dtype=torch.int64), dict(meta)))
        return out

    def step_prompts(self, n: int, *, seed: int, run_seed: int, start: int | None) -> list[Prompt]:
        """Positions `start`.. of the run's stream (`prompts_at`, seeded by `run_seed`); `start=None`
        (dynamic sampling's extra rounds): `prompts(n, seed)`."""
        return self.prompts(n, seed=seed) if start is None else self.prompts_at(start, n, run_seed)


class FileTask(LineTask):
    """Prompts from a JSONL file, reward from a `module:function`.

    Each non-blank line is a JSON object holding `prompt_ids` (a list of ints) or `prompt`
    (text, tokenized with the tokenizer: `tokenizer_path`, a local tokenizer folder, or
    `tokenizer`, a Hugging Face tokenizer object or such a folder); every other key goes
    to the reward as a keyword: `fn(prompt_ids: list[int], response_ids: list[int], **meta)
    -> float`. `stop_token_id` defaults to the tokenizer's EOS when a tokenizer is given.
    The lines are walked as a `LineTask`'s.
    """

    def __init__(self, prompts_path: str | os.PathLike, reward_fn: str | Callable, tokenizer: Any = None, *,
                 tokenizer_path: str | os.PathLike | None = None, vocab_size: int | None = None,
                 stop_token_id: int | None = None) -> None:
        self.reward_fn, self.reward_name = reward_callable(reward_fn)
        if tokenizer is not None and tokenizer_path is not None:
            raise ValueError("FileTask: give tokenizer or tokenizer_path (task.tokenizer_path), not both")
        if tokenizer_path is not None:
            tokenizer = load_tokenizer(tokenizer_path)
        elif isinstance(tokenizer, (str, os.PathLike)):
            tokenizer = load_tokenizer(tokenizer, key="tokenizer")
        self.tokenizer = tokenizer
        encode = None if tokenizer is None else (lambda text: list(tokenizer.encode(text)))
        self.items = read_prompts(prompts_path, encode, vocab_size, reserved=("response_ids",))
        self.stop_token_id = stop_token_id if stop_token_id is not None else getattr(tokenizer, "eos_token_id", None)
        self.min_vocab_size = 1 + max(max(max(ids) for ids, _ in self.items), self.stop_token_id or 0)
        self.max_prompt_len = max(len(ids) for ids, _ in self.items)

    def reward(self, prompt_ids: Any, response_ids: Any, meta: dict) -> Any:
        """The reward function's value as returned (`assign_rewards` checks it is a finite real number)."""
        return self.reward_fn(as_ids(prompt_ids), as_ids(response_ids), **meta)


class MathTask(LineTask):
    """`math`: text prompts with a reference answer, rewarded on the decoded response text.

    `prompts_path` is a JSONL of `{"prompt": str, "answer": str | number, ...}` (every key
    but `prompt` goes to the reward). `tokenizer_path` is a local tokenizer folder (as
    written by `save_pretrained`; nothing is downloaded). `chat_template`: "tokenizer" (the
    default, as for the other text tasks) = wrapped as one user message (after
    `system_prompt`, if any) with the tokenizer's own chat template and its generation
    prompt; any other string = a Jinja chat template used the same way; None = the prompt
    text is tokenized as is.
    The reward is `fn(response_text, **meta) -> float` on the response decoded without
    special tokens; `reward_fn` (a callable or "module:function") defaults to `math_reward`.
    """

    def __init__(self, prompts_path: str | os.PathLike, tokenizer_path: str | os.PathLike, *,
                 reward_fn: str | Callable | None = None, chat_template: str | None = "tokenizer",
                 system_prompt: str | None = None, enable_thinking: bool | None = None,
                 vocab_size: int | None = None, stop_token_id: int | None = None) -> None:
        self.reward_fn, self.reward_name = reward_callable(reward_fn if reward_fn is not None else math_reward)
        self.tokenizer = tokenizer = load_tokenizer(tokenizer_path)
        encode = chat_encoder(tokenizer, chat_template, system_prompt, tokenizer_path, enable_thinking)
        self.items = read_prompts(prompts_path, lambda text: encode(user_turn(text)), vocab_size,
                                   required=("prompt", "answer"),
                                   reserved=("response_text",))
        self.stop_token_id = stop_token_id if stop_token_id is not None else tokenizer.eos_token_id
        self.min_vocab_size = 1 + max(max(max(ids) for ids, _ in self.items), self.stop_token_id or 0)
        self.max_prompt_len = max(len(ids) for ids, _ in self.items)

    def reward(self, prompt_ids: Any, response_ids: Any, meta: dict) -> Any:
        return self.reward_fn(self.decode(response_ids), **meta)


def read_prompts(path: str | os.PathLike, encode: Callable[[str], list[int]] | None, vocab_size: int | None, *,
                  required: Sequence[str] = (), reserved: Sequence[str] = (),
                  key: str = "task.prompts_path", keep_prompt: bool = False) -> list[tuple[list[int], dict]]:
    """[(prompt ids, meta)] from a JSONL file; `encode` tokenizes a `prompt` text (None: no
    tokenizer; `keep_prompt`: the text stays in the meta). Every line must hold the `required`
    keys and none of the `reserved` ones."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{key}: prompts file '{path}' does not exist")
    items = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{key}: {where} is not valid JSON ({e.msg})") from e
            if not isinstance(obj, dict):
                raise ValueError(f"{key}: {where} is a JSON {type(obj).__name__}, expected an object")
            missing = [k for k in required if k not in obj]
            if missing:
                raise ValueError(f"{key}: {where} has no {missing} (keys: {sorted(obj)})")
            if "prompt_ids" in obj:
                ids = obj.pop("prompt_ids")
                if not keep_prompt:
                    obj.pop("prompt", None)
                if not isinstance(ids, list) or not ids or not all(isinstance(v, int) and not isinstance(v, bool) for v in ids):
                    raise ValueError(f"{key}: {where}: 'prompt_ids' must be a non-empty list of ints")
            elif "prompt" in obj:
                text = obj["prompt"] if keep_prompt else obj.pop("prompt")
                if encode is None:
                    raise ValueError(
                        f"{key}: {where} gives 'prompt' text but no tokenizer was given; set "
                        f"task.tokenizer_path=<local tokenizer folder> or give 'prompt_ids'"
                    )
                if not isinstance(text, str):
                    raise ValueError(f"{key}: {where}: 'prompt' must be a string, got {type(text).__name__}")
                ids = encode(text)
                if not ids:
                    raise ValueError(f"{key}: {where}: 'prompt' tokenizes to no tokens")
            else:
                raise ValueError(f"{key}: {where} has neither 'prompt_ids' nor 'prompt' (keys: {sorted(obj)})")
            for name in reserved:
                if name in obj:
                    raise ValueError(f"{key}: {where}: '{name}' is reserved "
                                     f"(the reward receives the response under that name)")
            bad = [v for v in ids if v < 0 or (vocab_size is not None and v >= vocab_size)]
            if bad:
                raise ValueError(f"{key}: {where}: prompt id {bad[0]} is outside the vocabulary [0, {vocab_size})")
            items.append((ids, obj))
    if not items:
        raise ValueError(f"{key}: prompts file '{path}' holds no prompts")
    return items

