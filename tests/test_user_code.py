"""The user's code cannot stop a run (rl/tasks/calls.py, rl/rollout/episodes.py; issue 44).

* `UserCalls`: an exception or a call past `task.timeout_s` ends one sample (status `error` /
  `timeout`, reward 0) with on_error=skip, and stops the run with on_error=raise; the deadline
  works off the main thread (no signals); a hung call is abandoned, counted while it runs, and
  too many of them stop the run;
* rewards and environments: each failure is one sample's, the others keep their rewards;
* every sample gets its own meta; a stochastic environment gets a per-sample seed, so its
  episodes repeat with the same seed (and differ with another);
* end to end: a run whose reward raises on 10% of the calls and hangs on 1% finishes, counted.
"""

from __future__ import annotations

import json
import logging
import math
import random
import threading
import time

import pytest
import torch
from testing.inprocess import SMALL, compose, trainer
from test_arithmetic import tiny_llama  # noqa: F401 - fixture
from test_tasks import tokenizer, tokenizer_dir  # noqa: F401 - fixtures

from model.models import build_model
from packing import Experience
from rl.rollout.engine import HFRolloutEngine
from rl.rollout.episode import environment_seed
from rl.rollout.episodes import episode_metrics, run_episodes
from rl.tasks.base import Task
from rl.tasks.calls import CallTimeout, OnError, Status, TooManyHung, UserCalls, assign_rewards
from rl.tasks.registry import build_task

RELEASE = threading.Event()  # what hung calls wait for; set when a test ends


def _by_name():
    """This module as `task.reward_fn=tests.test_user_code:...` imports it (pytest's copy is another)."""
    import importlib

    return importlib.import_module("tests.test_user_code")


@pytest.fixture(autouse=True)
def _release_hung_calls():
    events = {id(e): e for e in (RELEASE, _by_name().RELEASE)}.values()
    for e in events:
        e.clear()
    yield
    for e in events:
        e.set()  # the abandoned threads end


def _hang():
    RELEASE.wait(30)
    return 1.0


# ------------------------------------------------------------------ UserCalls
def test_an_exception_ends_the_sample_with_skip_and_stops_the_run_with_raise():
    skip = UserCalls("skip", None)
    with (guard := skip.guard("reward f")):
        skip.run(lambda: 1 / 0)
    assert guard.status is Status.ERROR and isinstance(guard.error, ZeroDivisionError)
    with (fine := skip.guard("reward f")):
        assert skip.run(lambda x: x + 1, 1) == 2
    assert fine.status is None  # the control: nothing failed
    strict = UserCalls("raise", None)
    with pytest.raises(ZeroDivisionError):
        with strict.guard("reward f"):
            strict.run(lambda: 1 / 0)
    with pytest.raises(KeyboardInterrupt):  # never swallowed, whatever on_error says
        with skip.guard("reward f"):
            raise KeyboardInterrupt
    with pytest.raises(ValueError, match=r"task.on_error='ignore': expected one of skip, raise$"):
        UserCalls("ignore")
    with pytest.raises(ValueError, match=r"task.timeout_s=0"):
        UserCalls("skip", 0)


def test_a_timeout_works_off_the_main_thread_and_a_hung_call_is_abandoned():
    """The deadline is a wait on a worker thread, not a signal: it works on the rollout thread.
    The hung call goes on in its abandoned thread (counted by `hung`) until it returns."""
    calls = UserCalls("skip", 0.2)
    out = {}

    def on_a_thread():
        with (guard := calls.guard("reward hang")):
            calls.run(_hang, what="reward hang")
        out["status"] = guard.status
        with (again := calls.guard("reward quick")):
            out["value"] = calls.run(lambda: 7.0)  # a fresh worker: the hung one is let go
        out["again"] = again.status

    t0 = time.perf_counter()
    thread = threading.Thread(target=on_a_thread)
    thread.start()
    thread.join(10)
    assert out == {"status": Status.TIMEOUT, "value": 7.0, "again": None}
    assert time.perf_counter() - t0 < 5
    assert calls.hung == 1
    RELEASE.set()
    for _ in range(100):
        if calls.hung == 0:
            break
        time.sleep(0.05)
    assert calls.hung == 0  # it returned: its thread ended
    with pytest.raises(CallTimeout, match=r"reward hang ran past task.timeout_s=0.2"):
        RELEASE.clear()
        UserCalls("raise", 0.2).run(_hang, what="reward hang")


def test_a_signal_based_timeout_fails_off_the_main_thread_and_is_counted():
    """What math-verify's own timeout does on the rollout thread: `signal` refuses; counted as an error."""
    import signal

    calls, out = UserCalls("skip", 1.0), {}

    def on_a_thread():
        with (guard := calls.guard("reward with alarm")):
            calls.run(signal.signal, signal.SIGALRM, lambda *a: None)
        out["status"] = guard.status

    thread = threading.Thread(target=on_a_thread)
    thread.start()
    thread.join(10)
    assert out["status"] is Status.ERROR


def test_too_many_hung_calls_stop_the_run():
    calls = UserCalls("skip", 0.05)
    calls.max_hung = 3
    for _ in range(2):
        with calls.guard("reward hang"):
            calls.run(_hang, what="reward hang")
    with pytest.raises(TooManyHung, match=r"3 calls past task.timeout_s=0.05 are still running \(reward hang\)"):
        with calls.guard("reward hang"):
            calls.run(_hang, what="reward hang")


# --------------------------------------------------------------------- rewards
class _Flaky(Task):
    """A task whose reward raises, hangs or returns NaN on chosen responses (the first token says which)."""

    min_vocab_size, stop_token_id, reward_name = 16, None, "tests:flaky"

    def prompts(self, n, seed):
        raise NotImplementedError("the records are made by hand")

    def reward(self, prompt_ids, response_ids, meta):
        meta["seen"] = meta.get("seen", 0) + 1  # a reward that writes into its meta
        kind = int(response_ids[0])
        if kind == 1:
            raise RuntimeError("the grader is down")
        if kind == 2:
            return _hang()
        if kind == 3:
            return math.nan
        return float(meta["seen"])


def _records(kinds):
    out = []
    for i, k in enumerate(kinds):
        seq = torch.tensor([5, 6, k, 9])
        out.append(Experience(sequences=seq, response_length=torch.tensor(2), prompt_index=torch.tensor(i // 2)))
    return out


def test_a_failing_reward_ends_its_sample_only():
    meta = {"answer": 1}
    metas = [meta] * 5  # one dict for every sample, as a prompt group hands it out
    records = assign_rewards(_Flaky(), _records([0, 1, 2, 3, 0]), metas, UserCalls("skip", 0.3))
    assert [int(r.status) for r in records] == [Status.DONE, Status.ERROR, Status.TIMEOUT, Status.ERROR, Status.DONE]
    assert [float(r.rewards) for r in records] == [1.0, 0.0, 0.0, 0.0, 5.0]  # shared meta: the count went on
    assert episode_metrics(records) == {"episodes_done": 2.0, "episodes_max_turns": 0.0, "episodes_truncated": 0.0,
                                        "episodes_error": 2.0, "episodes_timeout": 1.0}
    with pytest.raises(RuntimeError, match="the grader is down"):  # the control: raise stops at the first
        assign_rewards(_Flaky(), _records([0, 1]), [{}, {}], UserCalls("raise", 0.3))


class _Echo:
    """An 'engine' that answers every prompt with its first token (no model: the rewards are the test)."""

    stop_token_id = None

    def generate(self, prompts, *, prompt_indices, max_new_tokens, temperature, seed):
        from rl.rollout.engine import make_record

        return [make_record(p, p[:1].clone(), torch.zeros(1), int(i), None) for p, i in zip(prompts, prompt_indices)]


def test_every_sample_gets_its_own_meta():
    """run_episodes copies the meta per sample: the reward's write into sample 0's does not reach
    sample 4's, although the caller passed one dict (the control: assign_rewards on the same dict
    does show the leak, above)."""
    task = _Flaky()
    task.calls = UserCalls("skip", None)
    meta = {"answer": 1}
    prompts = [torch.tensor([0, 7]), torch.tensor([0, 7])]
    records = run_episodes(_Echo(), task, prompts, [meta, meta], prompt_indices=[0, 0], max_new_tokens=1,
                           temperature=1.0, seed=0)
    assert [float(r.rewards) for r in records] == [1.0, 1.0] and meta == {"answer": 1}


# ----------------------------------------------------------------- environments
class Moody:
    """A user's stochastic environment: each reply gets one of several answers, drawn from the
    seed `reset` receives; it raises on prompts whose number is 3 and hangs on 5."""

    WORDS = ["Again.", "No, try again.", "Wrong. Once more.", "Nope.", "Say it again."]

    def __init__(self) -> None:
        self.rng = None

    def reset(self, prompt: dict, seed: int | None = None) -> list[dict]:
        self.rng, self.number = random.Random(seed), int(prompt["number"])
        return [{"role": "user", "content": prompt["prompt"]}]

    def step(self, response_text: str):
        if self.number == 3:
            raise KeyError("no such cell")
        if self.number == 5:
            return _hang(), 0.0, False
        return self.rng.choice(self.WORDS), self.rng.random(), False


class Steady(Moody):
    """The control: draws from its own fixed generator, not from the seed it is given."""

    def reset(self, prompt: dict) -> list[dict]:
        return super().reset(prompt, seed=1234)


def _env_task(tokenizer_dir, tmp_path, env, **calls):
    rows = [{"prompt": f"What is {n} plus 0?", "number": n} for n in range(8)]
    path = tmp_path / "lines.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return build_task("environment", prompts_path=str(path), tokenizer_path=str(tokenizer_dir), environment=env,
                      max_turns=3, max_observation_len=40, calls=UserCalls(**calls) if calls else None)


def _play(task, engine, seed):
    drawn = [(torch.tensor(ids), dict(meta)) for ids, meta in task.items]
    ids = [p for p, _ in drawn for _ in range(2)]
    metas = [m for _, m in drawn for _ in range(2)]
    return run_episodes(engine, task, ids, metas, prompt_indices=[i for i in range(len(drawn)) for _ in range(2)],
                        max_new_tokens=4, temperature=0.0, seed=seed)


def test_a_failing_environment_ends_its_episode_only_and_a_seeded_one_repeats(tiny_llama, tokenizer_dir, tmp_path):
    """Greedy decoding draws nothing, so the records differ between seeds only where the
    environment used its seed."""
    task = _env_task(tokenizer_dir, tmp_path, Moody, on_error="skip", timeout_s=0.3)
    engine = HFRolloutEngine(build_model(None, pretrained_path=str(tiny_llama)), stop_token_id=task.stop_token_id)
    a, b, c = _play(task, engine, seed=11), _play(task, engine, seed=11), _play(task, engine, seed=12)
    status = [Status(int(r.status)) for r in a]
    assert status[6:8] == [Status.ERROR] * 2 and status[10:12] == [Status.TIMEOUT] * 2
    assert all(s is Status.MAX_TURNS for k, s in enumerate(status) if k // 2 not in (3, 5))
    assert all(float(r.rewards) == 0.0 for r in a[6:8] + a[10:12]) and all(int(r.turns) == 1 for r in a[6:8])
    assert sum(float(r.rewards) > 0 for r in a) >= 10  # the others keep their rewards
    same = all(torch.equal(x.sequences, y.sequences) and float(x.rewards) == float(y.rewards) for x, y in zip(a, b))
    assert same  # the same seed: the same episodes
    assert any(not torch.equal(x.sequences, y.sequences) for x, y in zip(a, c))  # another seed: other answers
    assert float(a[0].rewards) != float(a[1].rewards)  # two samples of one prompt: their own seeds
    assert environment_seed(11, 0, 0) != environment_seed(11, 0, 1) != environment_seed(12, 0, 1)
    # the control: an environment that ignores the seed plays the same episodes under both seeds
    steady = _env_task(tokenizer_dir, tmp_path, Steady, on_error="skip", timeout_s=0.3)
    d, e = _play(steady, engine, seed=11), _play(steady, engine, seed=12)
    assert all(torch.equal(x.sequences, y.sequences) for x, y in zip(d, e))
    # and with on_error=raise the first failure stops the rollout
    strict = _env_task(tokenizer_dir, tmp_path, Moody, on_error="raise", timeout_s=0.3)
    with pytest.raises(KeyError, match="no such cell"):
        _play(strict, engine, seed=11)


def test_a_chat_template_failure_names_the_sample_its_prompt_index_and_turn(tiny_llama, tokenizer_dir, tmp_path,
                                                                            caplog):
    """task.on_error=skip: an answer the chat template cannot render ends its episode, and the log
    names where, as every other failure of an episode does (`Episode.where`)."""
    task = _env_task(tokenizer_dir, tmp_path, Steady, on_error="skip", timeout_s=0.3)
    task.observation_ids = lambda text: 1 / 0
    engine = HFRolloutEngine(build_model(None, pretrained_path=str(tiny_llama)), stop_token_id=task.stop_token_id)
    with caplog.at_level(logging.DEBUG, logger="rl.tasks.calls"):
        records = _play(task, engine, seed=11)
    assert Status(int(records[0].status)) is Status.ERROR
    assert any(m.startswith("run_episodes: sample 3 (prompt index 1), turn 1: chat template of ")
               for m in caplog.messages), caplog.messages


# ----------------------------------------------------------------- the config
def test_the_config_names_on_error_and_timeout():
    cfg = compose(*SMALL)
    assert cfg.task.on_error is OnError.SKIP and cfg.task.timeout_s == 60.0
    assert compose(*SMALL, "task.on_error=raise", "task.timeout_s=null").task.timeout_s is None
    for bad, match in (("task.on_error=ignore", r"task.on_error"), ("task.timeout_s=0", r"task.timeout_s=0")):
        with pytest.raises(ValueError, match=match):
            compose(*SMALL, bad)


# ------------------------------------------------------------------ end to end
CALLS: list[str] = []


def unreliable(prompt_ids, response_ids):
    """A reward that raises on every 10th call and hangs on the 50th (10% and 1% of 100)."""
    CALLS.append("ok")
    k = len(CALLS)
    if k % 10 == 3:
        CALLS[-1] = "raised"
        raise ConnectionError("the grader is down")
    if k % 100 == 50:
        CALLS[-1] = "hung"
        return _hang()
    return float(sum(int(t) == 7 for t in response_ids)) / max(len(response_ids), 1)


@pytest.mark.slow
def test_a_run_whose_reward_raises_and_hangs_finishes_with_them_counted(tmp_path):
    """The done-when of issue 44: rewards on the rollout thread (rollout.mode=one_step_off), 4
    steps of 32 samples, a 0.5 s deadline: every step trains, and the step metrics count exactly
    the calls that raised and hung."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt_ids": [4 + i, 5, 6]}) + "\n" for i in range(8)))
    tr = trainer("task=file", f"task.prompts_path={prompts}", "task.reward_fn=tests.test_user_code:unreliable",
                 "task.prompts_per_step=4", "task.samples_per_prompt=8", "task.max_new_tokens=4",
                 "task.timeout_s=0.5", "rollout.mode=one_step_off", "algo.tis_cap=2.0", "trainer.max_steps=4", "trainer.progress=false")
    calls = _by_name().CALLS
    calls.clear()  # the start-up probe called it once
    metrics = [tr.step(s) for s in range(4)]
    assert all(math.isfinite(m["loss"]) for m in metrics)
    assert len(calls) == 4 * 32
    assert sum(m["episodes_error"] for m in metrics) == calls.count("raised") == 13
    assert sum(m["episodes_timeout"] for m in metrics) == calls.count("hung") == 1
    assert sum(m["episodes_done"] for m in metrics) == calls.count("ok")
    assert max(m["calls_hung"] for m in metrics) >= 1  # the abandoned call, until it is released
