"""Environments users already have (rl/tasks/environment.py): a class plugs in by `module:Class`,
detected by its interface: the text protocol, message-level (messages in, messages and reward
out) or gym-style (`reset(seed=) -> (observation, info)`, `step(action) -> (observation, reward,
terminated, truncated, info)`); and a real third-party multi-turn text environment, a TextArena
game, played by the tiny model of tests/test_multiturn.py from the config."""

from __future__ import annotations

import json
import math
import random

import pytest
from testing.inprocess import trainer
from test_arithmetic import tiny_llama  # noqa: F401 - fixture
from test_multiturn import SayNumber
from test_tasks import tokenizer, tokenizer_dir  # noqa: F401 - fixtures

from rl.tasks.environment import GymAdapter, Interface, MessagesAdapter, TextArena, detect_interface
from rl.tasks.registry import build_task

SEEDS = 1 << 31


class GuessDigit:
    """Gym-style: guess a digit drawn from the reset's seed; `hint` after a wrong guess."""

    def __init__(self, hint: str = "No.") -> None:
        self.hint, self.digit = hint, None

    def reset(self, seed: int | None = None, options: dict | None = None):
        self.digit = str(random.Random(seed).randrange(10))
        return f"Guess my digit (game {seed % 1000}).", {"digit": self.digit}

    def step(self, action: str):
        right = self.digit in action
        return ("" if right else self.hint), float(right), right, False, {}


class SayNumberMessages:
    """Message-level SayNumber: it reads the whole conversation, the reply last; it records the
    reset's seed and what it saw."""

    seen: list = []

    def reset(self, prompt: dict, seed: int | None = None) -> list[dict]:
        self.number, self.seed = str(prompt["number"]), seed
        return [{"role": "user", "content": prompt["prompt"]}]

    def step(self, messages: list[dict]):
        SayNumberMessages.seen.append((self.seed, [m["role"] for m in messages]))
        if self.number in messages[-1]["content"]:
            return [], 1.0, True
        return [{"role": "user", "content": "No. Say the number."}], 0.0, False


def test_an_environment_class_is_detected_by_its_interface():
    assert detect_interface(SayNumber) is Interface.TEXT
    assert detect_interface(SayNumberMessages) is Interface.MESSAGES
    assert detect_interface(GuessDigit) is Interface.GYM and detect_interface(TextArena) is Interface.GYM

    class NoStep:
        def reset(self, prompt):
            return []

    with pytest.raises(ValueError, match=r"task.options.environment: .*NoStep.* has no `step` method"):
        detect_interface(NoStep)


def test_the_adapters_speak_the_episode_protocol():
    gym = GymAdapter(GuessDigit())
    first = gym.reset({"seed": 12})
    assert first == [{"role": "user", "content": "Guess my digit (game 12)."}]
    digit = str(random.Random(12).randrange(10))
    wrong = str((int(digit) + 1) % 10)
    assert gym.step(wrong) == ("No.", 0.0, False) and gym.step(f"it is {digit}") == (None, 1.0, True)
    env = MessagesAdapter(SayNumberMessages())
    assert env.reset({"prompt": "What is 2 plus 3?", "number": 5}, seed=9)[0]["content"] == "What is 2 plus 3?"
    SayNumberMessages.seen.clear()
    assert env.step("4") == ("No. Say the number.", 0.0, False) and env.step("5") == (None, 1.0, True)
    assert SayNumberMessages.seen == [(9, ["user", "assistant"]), (9, ["user", "assistant", "user", "assistant"])]


def _gym_run(tiny_llama, tokenizer_dir, environment, *extra):
    return ("model=pretrained", f"model.pretrained_path={tiny_llama}", "model.dtype=float32", "task=environment",
            f"task.tokenizer_path={tokenizer_dir}", f"task.options.environment={environment}",
            "task.prompts_per_step=2", "task.samples_per_prompt=3", "task.max_new_tokens=6",
            "trainer.progress=false", "trainer.lr=1e-3", *extra)


@pytest.mark.slow
def test_a_gym_style_environment_trains_with_its_first_observations_as_prompts(tiny_llama, tokenizer_dir):
    """Prompts are resets at seeds drawn from the step's seed (a group shares its prompt's seed, so
    its first observation); held-out resets use seeds past every training seed."""
    tr = trainer(*_gym_run(tiny_llama, tokenizer_dir, "test_environments:GuessDigit", "task.options.max_turns=3",
                           "eval.every=1", "eval.num_prompts=4"))
    assert tr.task.interface is Interface.GYM and tr.task.max_prompt_len > 0
    heldout = [m["seed"] for _, m in tr.heldout]
    assert heldout == [SEEDS + i for i in range(4)]
    drawn = tr.task.step_prompts(2, seed=5, run_seed=0, start=0)
    assert drawn[0][1]["seed"] < SEEDS and [m for _, m in drawn] == [m for _, m in tr.task.step_prompts(2, seed=5,
                                                                                                        run_seed=0, start=0)]
    for ids, meta in drawn:
        assert tr.task.decode(ids).strip().endswith(f"Guess my digit (game {meta['seed'] % 1000}).")
    records = tr.source.records(0, 0, 0)
    assert len(records) == 6 and all(1 <= int(r.turns) <= 3 for r in records)
    metrics = [tr.step(s) for s in range(2)]
    assert all(math.isfinite(m["loss"]) for m in metrics) and "eval_turns_mean" in metrics[0]
    with pytest.raises(ValueError, match=r"task.prompts_path / task.options.heldout_path with a gym-style"):
        build_task("environment", tokenizer_path=str(tokenizer_dir), prompts_path="x.jsonl",
                   environment="test_environments:GuessDigit")


@pytest.mark.slow
def test_a_message_level_environment_sees_the_conversation_and_a_seed_per_sample(tiny_llama, tokenizer_dir,
                                                                                    tmp_path):
    lines = [{"prompt": f"What is {a} plus {b}?", "number": a + b} for a in range(4) for b in range(2)]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    tr = trainer(*_gym_run(tiny_llama, tokenizer_dir, "test_environments:SayNumberMessages",
                           f"task.prompts_path={tmp_path / 'train.jsonl'}", "task.options.max_observation_len=24"))
    assert tr.task.interface is Interface.MESSAGES
    SayNumberMessages.seen.clear()
    records = tr.source.records(0, 0, 0)
    seeds = {seed for seed, _ in SayNumberMessages.seen}
    assert len(seeds) == len(records) == 6  # one seed per sample, even within a prompt's group
    assert all(roles[-1] == "assistant" and roles[0] == "user" for _, roles in SayNumberMessages.seen)
    assert any(len(roles) == 4 for _, roles in SayNumberMessages.seen)  # a second turn saw the whole conversation
    assert math.isfinite(tr.step(0)["loss"])


# ------------------------------------------------------------------- TextArena
def test_a_textarena_game_is_seeded_and_answers_each_move():
    def play(seed):
        game = TextArena("GuessTheNumber-v0")
        first, _ = game.reset(seed=seed)
        moves = [game.step(f"[{g}]") for g in (5, 10, 15)]
        return first, moves

    first, moves = play(3)
    assert "Guess The Number" in first and all(isinstance(o, str) for o, *_ in moves)
    assert not any(first in o for o, *_ in moves)  # each step's observation is only what is new
    assert play(3) == (first, moves)  # the seed decides the game
    assert any(play(s)[1] != moves for s in (4, 5, 6))  # control: other seeds, other numbers
    game = TextArena("GuessTheNumber-v0")
    game.reset(seed=3)
    for guess in range(1, 21):
        observation, reward, terminated, truncated, _ = game.step(f"[{guess}]")
        if terminated:
            break
    assert terminated and reward == 1.0  # the number found: the game's reward for player 0


@pytest.mark.slow
def test_a_textarena_game_trains_from_the_config(tiny_llama, tokenizer_dir):
    """The documented command's shape: task=environment with rl.tasks.environment:TextArena."""
    tr = trainer(*_gym_run(tiny_llama, tokenizer_dir, "rl.tasks.environment:TextArena",
                           "+task.options.environment_options.env_id=GuessTheNumber-v0", "task.options.max_turns=2",
                           "task.options.max_observation_len=96", "eval.every=0"))
    assert tr.task.interface is Interface.GYM
    records = tr.source.records(0, 0, 0)
    assert "Guess The Number" in tr.task.decode(records[0].sequences)
    assert any(int(r.turns) == 2 for r in records)  # a random model's guesses do not end the game: a second turn
    metrics = tr.step(0)
    assert math.isfinite(metrics["loss"]) and metrics["turns_mean"] > 1.0
