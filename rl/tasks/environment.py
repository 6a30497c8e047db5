"""`environment`: the user's multi-turn environment, played one episode per sample
(rl/rollout/episodes.py). The user's class plugs in by `module:Class`, detected by its interface
(`task.options.interface=auto`), with no base class to inherit:

* `text` (the `Environment` protocol, rl/tasks/base.py): `reset(prompt_line) -> messages`,
  `step(reply_text) -> (observation or None, reward, done)`; prompts from `task.prompts_path`.
* `messages` (message-level): `reset(prompt_line) -> messages`, `step(messages) -> (new messages,
  reward, done)`: the conversation so far (the model's reply last, as an assistant message) in,
  the messages that follow it (one user message while the episode goes on) and the reward out;
  detected by `step`'s parameter named `messages` (or annotated as a list); prompts from
  `task.prompts_path`.
* `gym` (gym-style): `reset(seed=None, options=None) -> (observation, info)`, `step(action) ->
  (observation, reward, terminated, truncated, info)`; detected by a `reset` that takes no
  positional argument. Its prompts are its first observations: prompt k of a step resets an
  instance with a seed drawn from the step's seed (training seeds in [0, 2^31), held-out ones from
  2^31 on: never the same game), and each sample of that prompt's group resets with the same
  seed (its first observation must be the prompt's tokens); no `task.prompts_path`.

`TextArena` adapts a TextArena game (the `textarena` package: `ta.make(env_id)`, `reset(num_players,
seed)`, `get_observation()`, `step(action) -> (done, info)`, `close() -> (rewards, info)`) to the
gym-style interface, so `task.options.environment=rl.tasks.environment:TextArena
task.options.environment_options.env_id=GuessTheNumber-v0` plays a single-player game.
"""

from __future__ import annotations

import inspect
import os
from typing import Any

import torch

from rl.choice import Choice, did_you_mean
from rl.tasks.base import Environment, Prompt, load_callable
from rl.tasks.chat import chat_encoder, load_tokenizer, observation_encoder, thinking_ids, user_turn
from rl.tasks.files import LineTask, read_prompts

_HELDOUT_SEEDS = 1 << 31  # a gym-style environment's training seeds are below, its held-out ones from here


class Interface(Choice):
    """`task.options.interface`: how the user's environment class is called."""

    AUTO = "auto"  # detected from the class's reset/step signatures
    TEXT = "text"  # reset(prompt) -> messages; step(reply_text) -> (observation | None, reward, done)
    MESSAGES = "messages"  # reset(prompt) -> messages; step(messages) -> (messages, reward, done)
    GYM = "gym"  # reset(seed=, options=) -> (observation, info); step(action) -> (obs, reward, terminated, truncated, info)


def environment_class(spec: str | type | None, key: str = "task.options.environment") -> type:
    """The user's environment class from `task.options.environment` ('module:Class', or the class);
    a ValueError naming `key` when it is missing or does not import."""
    if spec is None:
        raise ValueError(f"task=environment needs {key}: the class 'module:Class' (an Environment: reset(prompt) -> "
                         "messages, step(reply) -> (observation, reward, done); or gym-style, or message-level: "
                         "rl/tasks/environment.py)")
    if not isinstance(spec, str):
        return spec
    try:
        return load_callable(spec, key)
    except (ImportError, AttributeError, TypeError) as e:
        raise ValueError(str(e)) from None


def check_environment_options(env_class: type, options: dict,
                              key: str = "task.options.environment_options") -> None:
    """`options` are keywords `env_class(**options)` takes, by its constructor's signature: a
    misspelt one names `key`, the class and the closest keyword; a required one not given, too."""
    name = f"{getattr(env_class, '__module__', '?')}:{getattr(env_class, '__qualname__', env_class)}"
    try:
        params = list(inspect.signature(env_class).parameters.values())
    except (TypeError, ValueError):  # no signature to read (a builtin): Python checks the call itself
        return
    named = [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    if not any(p.kind is p.VAR_KEYWORD for p in params):
        for option in options:
            if option not in named:
                raise ValueError(f"{key}.{option}: {name} takes no keyword {option!r}{did_you_mean(option, named)} "
                                 f"(its constructor's keywords: {', '.join(named) or 'none'})")
    missing = [p.name for p in params if p.default is p.empty and p.name in named and p.name not in options]
    if missing:
        raise ValueError(f"{key}: {name} needs {', '.join(missing)} (its constructor has no default for them); set "
                         f"{key}.{missing[0]}=...")
    try:
        inspect.signature(env_class).bind(**options)
    except TypeError as e:  # a positional-only parameter: it cannot be given by name
        raise ValueError(f"{key}={options!r}: {name} cannot be built with them ({e})") from None


def detect_interface(env_class: Any, key: str = "task.options.environment") -> Interface:
    """The interface of a user's environment class, from its `reset` and `step` signatures (see the
    module docstring); an error naming `key` when it has neither."""
    methods = {}
    for name in ("reset", "step"):
        method = inspect.getattr_static(env_class, name, None)
        if method is None or not callable(method):
            raise ValueError(f"{key}: {env_class!r} has no `{name}` method; an environment has reset and step "
                            f"(text: step(reply) -> (observation, reward, done); gym-style: reset(seed=) -> "
                            f"(observation, info), step(action) -> (observation, reward, terminated, truncated, info))")
        methods[name] = [p for p in list(inspect.signature(method).parameters.values())[1:]
                         if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if not any(p.default is p.empty for p in methods["reset"]):
        return Interface.GYM
    first = methods["step"][0] if methods["step"] else None
    if first is not None and (first.name == "messages" or str(first.annotation).startswith(("list", "List"))):
        return Interface.MESSAGES
    return Interface.TEXT


class GymAdapter:
    """A gym-style environment as an `Environment`: reset with the prompt's seed (the group's first
    observation is the prompt's), each observation the next user turn, done = terminated or truncated."""

    def __init__(self, env: Any) -> None:
        self.env = env

    def reset(self, prompt: dict) -> list[dict]:
        observation, _ = self.env.reset(seed=int(prompt["seed"]))
        return user_turn(str(observation))

    def step(self, response_text: str) -> tuple[str | None, float, bool]:
        observation, reward, terminated, truncated, _ = self.env.step(response_text)
        done = bool(terminated) or bool(truncated)
        return (None if done else str(observation)), reward, done


class MessagesAdapter:
    """A message-level environment as an `Environment`: it sees the whole conversation (the reply as
    an assistant message) and answers with the messages that follow; one user message while the
    episode goes on (its text is the next turn). The per-sample seed reaches its `reset` if it takes one."""

    def __init__(self, env: Any) -> None:
        self.env, self.messages = env, []

    def reset(self, prompt: dict, seed: int | None = None) -> list[dict]:
        takes_seed = "seed" in inspect.signature(self.env.reset).parameters
        self.messages = list(self.env.reset(prompt, **({"seed": seed} if takes_seed else {})))
        return self.messages

    def step(self, response_text: str) -> tuple[str | None, float, bool]:
        self.messages.append({"role": "assistant", "content": response_text})
        new, reward, done = self.env.step(list(self.messages))
        new = list(new or [])
        self.messages += new
        if done:
            return None, reward, True
        if len(new) != 1 or new[0].get("role") != "user" or not isinstance(new[0].get("content"), str):
            raise ValueError(f"{type(self.env).__name__}.step returned {new!r} with done=False: a message-level "
                             f"environment that goes on answers with one user message")
        return new[0]["content"], reward, False


class TextArena:
    """A single-player TextArena game (`env_id`, e.g. GuessTheNumber-v0, Wordle-v0, TowerOfHanoi-v0) as a
    gym-style environment. TextArena's observation is the whole game so far: each step's observation is
    the part that is new since the last one (the game's answer to the reply). The reward is the game's
    for player 0 at the end (close()), 0 before."""

    def __init__(self, env_id: str, **kwargs: Any) -> None:
        import textarena

        self.env, self.seen = textarena.make(env_id, **kwargs), ""

    def _observation(self) -> str:
        _, observation = self.env.get_observation()
        observation = str(observation)
        new = observation[len(self.seen):] if observation.startswith(self.seen) else observation
        self.seen = observation
        return new.strip()

    def reset(self, seed: int | None = None, options: dict | None = None) -> tuple[str, dict]:
        self.env.reset(num_players=1, seed=seed)
        self.seen = ""
        return self._observation(), {}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict]:
        done, info = self.env.step(action)
        if not done:
            return self._observation(), 0.0, False, False, dict(info or {})
        rewards, _ = self.env.close()
        return "", float(rewards[0]), True, False, dict(info or {})


class EnvironmentTask(LineTask):
    """`environment`: the user's multi-turn task. `environment` is a class `module:Class` (or the
    class), built as `Class(**environment_options)` once per sample, with one of the interfaces of
    the module docstring (`interface`: auto = detected). A `text` or `messages` environment plays
    the lines of `prompts_path`, a JSONL of `{"prompt": str, ...}`: its `reset` receives the line
    (every key) and must return the first turn as messages (`[{"role": "user", "content":
    line["prompt"]}]` renders to the prompt's ids). A `gym` environment's prompts are its first
    observations (no `prompts_path`; `max_prompt_len`: the longest, in tokens, None = the longest
    of 16 resets, a guess). The episode's reward is the sum of its turns' (`task.reward` is not
    used). Held-out problems for `eval.every`: the first `eval.num_prompts` lines of `heldout_path`
    (text, messages) or resets with seeds past the training ones (gym). `max_observation_len`: the
    longest environment answer, in tokens (a longer one is cut, status `truncated`)."""

    has_heldout = True  # text and messages environments: with task.options.heldout_path

    def __init__(self, prompts_path: str | os.PathLike | None = None, tokenizer_path: str | os.PathLike | None = None,
                 *, environment: str | type | None = None, environment_options: dict | None = None,
                 interface: Interface | str = Interface.AUTO, max_turns: int = 2, max_observation_len: int = 64,
                 heldout_path: str | os.PathLike | None = None, max_prompt_len: int | None = None,
                 strip_thinking: bool = False, chat_template: str | None = "tokenizer", system_prompt: str | None = None,
                 enable_thinking: bool | None = None, vocab_size: int | None = None,
                 stop_token_id: int | None = None) -> None:
        if tokenizer_path is None:
            raise ValueError("task=environment needs task.tokenizer_path (a local tokenizer folder)")
        self.env_class = environment_class(environment)  # the options checked by check_options (build_task)
        self.env_options = dict(environment_options or {})
        interface = Interface.parse(interface, "task.options.interface")
        self.interface = detect_interface(self.env_class) if interface is Interface.AUTO else interface
        self.reward_name = f"{getattr(self.env_class, '__module__', '?')}:{self.env_class.__qualname__}.step"
        self.max_turns, self.max_observation_len = max_turns, max_observation_len
        self.tokenizer = tokenizer = load_tokenizer(tokenizer_path)
        self.encode_messages = chat_encoder(tokenizer, chat_template, system_prompt, tokenizer_path, enable_thinking)
        self.observation_ids = observation_encoder(tokenizer, chat_template, enable_thinking)
        self.stop_token_id = stop_token_id if stop_token_id is not None else tokenizer.eos_token_id
        self.strip_thinking = bool(strip_thinking)
        if self.strip_thinking:
            thinking_ids(tokenizer)  # the option's tokens exist
        if self.interface is Interface.GYM:
            if prompts_path is not None or heldout_path is not None:
                raise ValueError(f"task.prompts_path / task.options.heldout_path with a gym-style environment "
                                 f"({self.reward_name}): its prompts are its first observations; leave them null")
            self.items = self.heldout_items = None
            every = [ids for ids, _ in self._resets(range(_HELDOUT_SEEDS - 16, _HELDOUT_SEEDS))]
            self.max_prompt_len = max_prompt_len if max_prompt_len is not None else max(len(ids) for ids in every)
        else:
            if prompts_path is None:
                raise ValueError(f"task=environment with a {self.interface.value} environment ({self.reward_name}) "
                                 f"needs task.prompts_path (a JSONL of {{\"prompt\": ...}} lines)")
            encode = lambda text: self.encode_messages(user_turn(text))  # noqa: E731
            read = lambda path, key: read_prompts(path, encode, vocab_size, required=("prompt",), key=key,  # noqa: E731
                                                   keep_prompt=True)
            self.items = read(prompts_path, "task.prompts_path")
            self.heldout_items = read(heldout_path, "task.options.heldout_path") if heldout_path is not None else None
            every = [ids for ids, _ in self.items + (self.heldout_items or [])]
            self.max_prompt_len = max(len(ids) for ids in every)
        self.min_vocab_size = 1 + max(max(max(ids) for ids in every), self.stop_token_id or 0)

    @classmethod
    def check_options(cls, options: dict) -> None:
        """The environment class: it imports, has reset and step (the interface asked, or one
        detected), and its constructor takes `environment_options`; max_turns, max_observation_len."""
        env_class = environment_class(options.get("environment"))
        Interface.parse(options["interface"], "task.options.interface")
        detect_interface(env_class)
        check_environment_options(env_class, dict(options.get("environment_options") or {}))
        if options["max_turns"] < 1 or options["max_observation_len"] < 1:
            raise ValueError(f"task.options.max_turns={options['max_turns']}, task.options.max_observation_len="
                             f"{options['max_observation_len']}: expected >= 1 each")

    def environment(self) -> Environment:
        env = self.env_class(**self.env_options)
        if self.interface is Interface.GYM:
            return GymAdapter(env)
        return MessagesAdapter(env) if self.interface is Interface.MESSAGES else env

    def _resets(self, seeds) -> list[tuple[list[int], dict]]:
        """A gym-style environment's first observations at `seeds`, as prompts (meta: seed, prompt)."""
        out = []
        for seed in seeds:
            messages = GymAdapter(self.env_class(**self.env_options)).reset({"seed": int(seed)})
            out.append((self.encode_messages(messages), {"seed": int(seed), "prompt": messages[0]["content"]}))
        return out

    def prompts(self, n: int, seed: int) -> list[Prompt]:
        if self.interface is not Interface.GYM:
            return super().prompts(n, seed)
        g = torch.Generator().manual_seed(int(seed))
        return [(torch.tensor(ids, dtype=torch.int64), meta)
                for ids, meta in self._resets(torch.randint(0, _HELDOUT_SEEDS, (n,), generator=g).tolist())]

    def step_prompts(self, n: int, *, seed: int, run_seed: int, start: int | None) -> list[Prompt]:
        """JSONL lines in seeded epochs (`LineTask`); a gym-style environment's resets drawn from `seed`."""
        if self.interface is Interface.GYM:
            return self.prompts(n, seed=seed)
        return super().step_prompts(n, seed=seed, run_seed=run_seed, start=start)

    def heldout(self, n: int) -> list[Prompt]:
        """The first n lines of `heldout_path`; for a gym-style environment, resets at seeds 2^31.. ."""
        if self.interface is Interface.GYM:
            return [(torch.tensor(ids, dtype=torch.int64), meta)
                    for ids, meta in self._resets(range(_HELDOUT_SEEDS, _HELDOUT_SEEDS + n))]
        if self.heldout_items is None:
            raise ValueError("eval.every > 0 with task=environment needs task.options.heldout_path (a JSONL of "
                             "held-out prompts), or eval.every=0")
        if n > len(self.heldout_items):
            raise ValueError(f"eval.num_prompts={n}: task.options.heldout_path holds {len(self.heldout_items)} prompts")
        return [(torch.tensor(ids, dtype=torch.int64), dict(meta)) for ids, meta in self.heldout_items[:n]]
