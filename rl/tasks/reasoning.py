"""`reasoning_gym`: prompts and scoring from the reasoning-gym package's procedural datasets.

    task=reasoning_gym task.options.dataset=basic_arithmetic
    task=reasoning_gym task.options.datasets='{chain_sum: {weight: 2}, basic_arithmetic: {weight: 1}}'

Problems are generated offline, in this process, by the package's own generators (nothing is
downloaded): `size` training problems from seed `dataset_seed` (a reasoning-gym `CompositeDataset`,
so several datasets mix with their weights, each with its own `config`), walked in seeded epochs
like a JSONL task (rl/tasks/files.py `LineTask.prompts_at`). The held-out problems come from a
disjoint seed range (every training item's generator is seeded within `dataset_seed ..
dataset_seed + k + size - 1`, k the number of datasets; the held-out ones start past it), and a
held-out problem whose question is also a training question is dropped, so `eval.every` never
scores a problem the run trains on, in a small problem space too.

A reply is scored by the dataset's own `score_answer(answer, entry)`: the answer is the text in
the reply's last `<answer>...</answer>` (`answer_tag`, reasoning-gym's convention; an empty tag: the
whole reply, stripped), or, with `answer_pattern` (a regular expression), its last match in the
reply (none: no answer), for models that answer in prose ("9 + 8 = 17"). reasoning-gym's default
scorer gives 1.0 for the exact answer and len(answer) / len(reply) when the reply contains it.
"""

from __future__ import annotations

import os
import re
from typing import Any

import torch

from rl.choice import did_you_mean
from rl.tasks.base import Prompt
from rl.tasks.chat import chat_encoder, load_tokenizer, user_turn
from rl.tasks.files import LineTask


class ReasoningGymTask(LineTask):
    """`reasoning_gym` (see the module docstring). `dataset` (one name, with `dataset_config`) or
    `datasets` ({name: {weight, config}}) pick the problems; `template` wraps a question as the
    user turn (`{question}`); `system_prompt` (None: none) goes before it."""

    has_heldout = True

    def __init__(self, tokenizer_path: str | os.PathLike, *, dataset: str | None = None,
                 dataset_config: dict | None = None, datasets: dict | None = None, size: int = 1000,
                 dataset_seed: int = 0, answer_tag: str = "answer", answer_pattern: str | None = None,
                 template: str = "{question}",
                 chat_template: str | None = "tokenizer", system_prompt: str | None = None,
                 enable_thinking: bool | None = None, vocab_size: int | None = None,
                 stop_token_id: int | None = None) -> None:
        from reasoning_gym.composite import CompositeConfig, CompositeDataset, DatasetSpec

        specs = _specs(dataset, dataset_config, datasets)  # checked with the rest by check_options (build_task)
        self.answer_tag, self.answer_pattern, self.template = answer_tag, answer_pattern, template
        self.tokenizer = tokenizer = load_tokenizer(tokenizer_path)
        self.encode_messages = chat_encoder(tokenizer, chat_template, system_prompt, tokenizer_path, enable_thinking)

        def composite(seed: int, n: int) -> Any:
            try:
                return CompositeDataset(CompositeConfig(size=n, seed=seed, datasets=[
                    DatasetSpec(name, weight, dict(config)) for name, weight, config, _ in specs]))
            except (ValueError, AssertionError, TypeError, KeyError) as e:  # an unknown name, a bad config field
                raise ValueError(f"task.options.dataset(s) {[s[0] for s in specs]}: reasoning-gym refused the "
                                 f"datasets ({type(e).__name__}: {e})") from None

        self.data = composite(dataset_seed, size)
        self.train_seeds = range(dataset_seed, dataset_seed + len(specs) + size)  # every training item's RNG seeds
        self.heldout_seed = dataset_seed + len(specs) + size  # the held-out items' seeds start past them
        self.items = [self._item(self.data[i]) for i in range(size)]
        self.train_questions = {meta["question"] for _, meta in self.items}
        self.reward_name = f"reasoning_gym:{'+'.join(s[0] for s in specs)}.score_answer"
        self.stop_token_id = stop_token_id if stop_token_id is not None else tokenizer.eos_token_id
        self.min_vocab_size = 1 + max(max(max(ids) for ids, _ in self.items), self.stop_token_id or 0)
        self.max_prompt_len = max(len(ids) for ids, _ in self.items)
        if vocab_size is not None and self.min_vocab_size > vocab_size:
            raise ValueError(f"task 'reasoning_gym': the tokenizer's ids reach {self.min_vocab_size - 1}, outside "
                             f"the model's vocabulary of {vocab_size}")
        self._heldout: list[tuple[list[int], dict]] = []
        self._composite = composite

    @classmethod
    def check_options(cls, options: dict) -> None:
        """dataset or datasets (not both), each a reasoning-gym dataset with its config's fields
        (did-you-mean for a misspelt name or field), size, template and answer_pattern."""
        for name, _, config, key in _specs(options.get("dataset"), options.get("dataset_config"),
                                           options.get("datasets")):
            _check_dataset(name, config, key)
        if options["size"] < 1:
            raise ValueError(f"task.options.size={options['size']}: expected >= 1 training problems")
        if "{question}" not in options["template"]:
            raise ValueError(f"task.options.template={options['template']!r} has no '{{question}}' field")
        if options.get("answer_pattern") is not None:
            try:
                re.compile(options["answer_pattern"])
            except re.error as e:
                raise ValueError(f"task.options.answer_pattern={options['answer_pattern']!r}: not a regular "
                                 f"expression ({e})") from None

    def _item(self, entry: dict) -> tuple[list[int], dict]:
        ids = self.encode_messages(user_turn(self.template.format(question=entry["question"])))
        return ids, {"question": entry["question"], "answer": entry["answer"], "metadata": entry["metadata"]}

    def heldout(self, n: int) -> list[Prompt]:
        """The first n held-out problems: from the held-out seed range, distinct, none a training
        question; the same list in every run."""
        if len(self._heldout) < n:
            pool = self._composite(self.heldout_seed, 4 * n + 100)
            seen = {meta["question"] for _, meta in self._heldout}
            for i in range(len(pool)):
                if len(self._heldout) == n:
                    break
                entry = pool[i]
                if entry["question"] not in self.train_questions and entry["question"] not in seen:
                    seen.add(entry["question"])
                    self._heldout.append(self._item(entry))
            if len(self._heldout) < n:
                raise ValueError(f"eval.num_prompts={n}: only {len(self._heldout)} held-out problems of "
                                 f"{self.reward_name.split(':')[1].split('.')[0]} differ from the "
                                 f"{len(self.items)} training ones; lower eval.num_prompts or task.options.size")
        return [(torch.tensor(ids, dtype=torch.int64), dict(meta)) for ids, meta in self._heldout[:n]]

    def answer(self, text: str) -> str | None:
        """The answer in a reply: the last match of `answer_pattern` when given, else its last
        `<answer_tag>` block (None when it has none), or the whole reply stripped when `answer_tag` is empty."""
        if self.answer_pattern is not None:
            found = re.findall(self.answer_pattern, text)
            return found[-1] if found else None
        if not self.answer_tag:
            return text.strip()
        from reasoning_gym.utils import extract_answer

        return extract_answer(text, tag_name=self.answer_tag)

    def reward(self, prompt_ids: Any, response_ids: Any, meta: dict) -> float:
        return float(self.data.score_answer(self.answer(self.decode(response_ids)), meta))

    def signal_hint(self) -> str:
        """Where the answer is read from (`answer`): the usual reason a model is never rewarded."""
        if self.answer_pattern is not None:
            return (f"the answer is the last match of task.options.answer_pattern={self.answer_pattern!r} in the "
                    f"reply: check that the replies hold the answer in that form")
        if self.answer_tag:
            return (f"the answer is the reply's last <{self.answer_tag}>...</{self.answer_tag}> "
                    f"(task.options.answer_tag={self.answer_tag}): a model that answers in prose never writes it; "
                    f"set task.options.answer_pattern (e.g. '-?\\d+': the reply's last number) or ask for the tag "
                    f"in task.options.template")
        return ("the answer is the whole reply (task.options.answer_tag=''): a reply with more than the answer "
                "scores at most len(answer) / len(reply); set task.options.answer_pattern to pick the answer out")


def _specs(dataset: str | None, dataset_config: dict | None, datasets: dict | None) -> list[tuple]:
    """[(name, weight, config, (name's key, config's key))] from `task.options.dataset` (+ `dataset_config`)
    or `task.options.datasets`: each dataset with the config keys that name it."""
    if dataset is None and datasets is None:
        raise ValueError("task=reasoning_gym needs task.options.dataset=NAME (e.g. basic_arithmetic) or "
                         "task.options.datasets={NAME: {weight: W, config: {...}}, ...}; neither is set")
    if dataset is not None and datasets is not None:
        raise ValueError(f"task.options.dataset={dataset!r} and task.options.datasets={dict(datasets)!r}: give one "
                         "of the two, not both (datasets mixes several: {NAME: {weight: W, config: {...}}})")
    if dataset is not None:
        return [(str(dataset), 1.0, dict(dataset_config or {}), ("task.options.dataset", "task.options.dataset_config"))]
    if dataset_config:
        raise ValueError("task.options.dataset_config goes with task.options.dataset; with task.options.datasets "
                         "give each its own config: {NAME: {weight: W, config: {...}}}")
    out = []
    for name, spec in dict(datasets).items():
        spec = dict(spec or {})
        unknown = sorted(set(spec) - {"weight", "config"})
        if unknown:
            raise ValueError(f"task.options.datasets.{name}: unknown keys {unknown}; expected weight and config")
        weight = float(spec.get("weight", 1.0))
        if not weight > 0:
            raise ValueError(f"task.options.datasets.{name}.weight={weight}: expected > 0")
        key = f"task.options.datasets.{name}"
        out.append((str(name), weight, dict(spec.get("config") or {}), (key, f"{key}.config")))
    if not out:
        raise ValueError("task.options.datasets is empty")
    return out


def _check_dataset(name: str, config: dict, keys: tuple[str, str]) -> None:
    """`name` is a reasoning-gym dataset (reasoning_gym.factory.DATASETS) and `config` fits its
    config class (field names, then the class's own validate()); errors name the keys (name's, config's)."""
    import dataclasses

    from reasoning_gym.factory import DATASETS

    if name not in DATASETS:
        raise ValueError(f"{keys[0]}: {name!r} is not a reasoning-gym dataset{did_you_mean(name, DATASETS)} (the "
                         f"{len(DATASETS)} datasets: reasoning_gym.factory.DATASETS, e.g. basic_arithmetic, chain_sum, "
                         "countdown)")
    config_cls = DATASETS[name][1]
    fields = [f.name for f in dataclasses.fields(config_cls)]
    for field in config:
        if field not in fields:
            raise ValueError(f"{keys[1]}.{field}: {name}'s config ({config_cls.__name__}) has no such field"
                             f"{did_you_mean(field, fields) or '.'} Its fields: {', '.join(fields)}")
    try:
        made = config_cls(**config)
        if hasattr(made, "validate"):
            made.validate()
    except (ValueError, AssertionError, TypeError) as e:
        raise ValueError(f"{keys[1]}={config!r}: reasoning-gym's {config_cls.__name__} refused it "
                         f"({type(e).__name__}: {e})") from None
