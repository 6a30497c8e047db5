"""The rollout scheduler (rl/rollout/scheduler.py), one class parameterised by
`rollout.max_staleness` k: 0 (the default) generates at the step's start; 1 generates step j+1's
rollout in a thread while step j trains, with the policy before step j's update (the metrics of
the retired one_step_off producer, recorded in tests/one_step_off_metrics.json); k >= 2 generates
rollout j with version j - k through a staged copy of the weights. Stale rollouts are dropped and
counted; the queued rollouts survive a checkpoint round trip; `rollout.mode` is an alias; each
refused combination names its field."""

import json
import threading
import time
from pathlib import Path

import pytest
import torch
from testing.inprocess import SMALL, compose, matches_recorded, trainer

from packing.experience import Experience
from rl.config import max_staleness
from rl.rollout.scheduler import Buffered, RolloutScheduler, pack_rollouts
from rl.trainer.guard import DivergenceError

OFF = ("rollout.mode=one_step_off", "algo.tis_cap=2.0", "eval.every=0")
K1 = ("rollout.max_staleness=1", "algo.tis_cap=2.0", "eval.every=0")
ASYNC = ("rollout.mode=async", "algo.tis_cap=2.0", "eval.every=0")
FIXTURE = Path(__file__).with_name("one_step_off_metrics.json")
TIMING = {"tokens_per_s", "rollout_tokens_per_s", "train_tokens_per_s", "rollout_s", "step_s", "weight_sync_s",
          "rollout_generate_s", "rollout_wait_s", "rollout_overlap", "rollout_publish_wait_s", "rollout_queue"}


def test_sync_is_the_default_the_mode_is_an_alias_and_refused_combinations_name_their_field():
    cfg = compose(*SMALL)
    assert cfg.rollout.mode is None and cfg.rollout.max_staleness is None and max_staleness(cfg.rollout) == 0
    for overrides, k in [(("rollout.mode=sync",), 0), (OFF, 1), (K1, 1), (ASYNC, 1),
                         ((*ASYNC, "rollout.max_staleness=2"), 2),
                         (("rollout.max_staleness=2", "algo.tis_cap=2.0"), 2)]:
        assert max_staleness(compose(*SMALL, *overrides).rollout) == k, overrides
    compose(*SMALL, "rollout.mode=one_step_off", "algo.old_log_probs=rollout")  # the other correction
    for extra, match in [
        (("rollout.mode=async", "rollout.replica=sharded"), r"rollout\.mode=async with rollout\.replica=sharded"),
        (("rollout.mode=async", "rollout.max_staleness=0"), r"rollout\.max_staleness=0 with rollout\.mode=async"),
        (("rollout.max_staleness=-1",), r"rollout\.max_staleness=-1: expected >= 0"),
        (("rollout.max_staleness=0",), r"rollout\.max_staleness=0 with rollout\.mode=one_step_off"),
        (("rollout.max_staleness=2",), r"rollout\.max_staleness=2 with rollout\.mode=one_step_off"),
        (("rollout.mode=sync", "rollout.max_staleness=1"), r"rollout\.max_staleness=1 with rollout\.mode=sync"),
        (("rollout.replica=sharded",), r"rollout\.mode=one_step_off with rollout\.replica=sharded"),
        (("algo.dynamic_sampling=true",), r"rollout\.mode=one_step_off with algo\.dynamic_sampling=true"),
        (("algo.tis_cap=null",), r"rollout\.mode=one_step_off with algo\.tis_cap=null and algo\.old_log_probs"),
    ]:
        with pytest.raises(ValueError, match=match):
            compose(*SMALL, *OFF, *extra)
    with pytest.raises(ValueError, match=r"rollout\.max_staleness=2 with algo\.dynamic_sampling=true"):
        compose(*SMALL, "rollout.max_staleness=2", "algo.tis_cap=2.0", "algo.dynamic_sampling=true")
    compose(*SMALL, "algo.dynamic_sampling=true")  # the control: dynamic sampling at max_staleness=0


def _tokens(records: list[Experience]) -> list[list[int]]:
    return [r.sequences.tolist() for r in records]


def _untimed(metrics: dict) -> dict:
    return {k: v for k, v in metrics.items() if k not in TIMING}


def test_max_staleness_1_trains_as_one_step_off_did_and_2_on_rollouts_two_versions_old():
    """max_staleness=1 gives the retired one_step_off producer's metrics, step for step (recorded
    with it: tests/one_step_off_metrics.json), and rollout.mode=one_step_off is the same run.
    max_staleness=2 (the control: other metrics from step 2): step 3's samples are exactly those
    a trainer holding version 1 (one step trained, synced) generates for step 3."""
    def run(*extra):
        tr = trainer(*SMALL, *extra, "trainer.max_steps=4")
        taken, records = {}, tr.source.records
        tr.source.records = lambda step, round_, version: taken.setdefault(step, records(step, round_, version))
        return [tr.step(s) for s in range(4)], taken

    want = json.loads(FIXTURE.read_text())
    one, _ = run(*K1)
    off, _ = run(*OFF)
    two, taken = run(*ASYNC, "rollout.max_staleness=2")
    assert matches_recorded([_untimed(m) for m in one], want) and matches_recorded([_untimed(m) for m in off], want)
    assert not matches_recorded([_untimed(m) for m in two], want)
    assert [m["rollout_staleness_max"] for m in one] == [0.0, 1.0, 1.0, 1.0]
    assert [m["rollout_staleness_max"] for m in two] == [0.0, 1.0, 2.0, 2.0]  # rollout j: version max(0, j - 2)
    assert two[2]["loss"] != pytest.approx(one[2]["loss"], rel=1e-3)
    assert all(m["rollout_stale_dropped"] == 0 for m in one + two)

    v1 = trainer(*SMALL, "algo.tis_cap=2.0", "eval.every=0", "trainer.max_steps=4")
    v1.step(0)  # version 1 in its engine
    want3 = v1.source.records(3, 0, 1)
    assert _tokens(want3) == _tokens(taken[3])
    assert all(torch.equal(a.rollout_log_probs, b.rollout_log_probs) for a, b in zip(want3, taken[3]))
    v1.step(1)  # the control: version 2 generates step 3's prompts otherwise
    assert not all(torch.equal(a.rollout_log_probs, b.rollout_log_probs)
                   for a, b in zip(v1.source.records(3, 0, 2), taken[3]))


def test_max_staleness_1_generates_the_next_rollout_during_training_with_the_previous_policy():
    """Step 1's rollout is generated while step 0 trains (the generation waits until the train
    stage has begun: run in the foreground it would find it not begun), with the policy before
    step 0's update: exactly the records a fresh trainer (version 0) generates for step 1; the
    control, a trainer after step 0's update (version 1), generates other samples. Step 1 trains
    on those records, corrected against their behaviour log-probs (staleness 1 reported). No
    stage: the sync writes the engine once the thread is idle."""
    tr = trainer(*SMALL, *K1, "trainer.max_steps=3")
    assert tr.rollout_scheduler.stage is None
    training = threading.Event()
    seen = []
    records, train = tr.source.records, tr.train

    def records_when_training(step, round_, version):
        if step > 0:
            seen.append((step, training.wait(timeout=120)))  # True only if the train stage began meanwhile
        return records(step, round_, version)

    def train_and_signal(minibatches):
        training.set()
        return train(minibatches)

    tr.source.records, tr.train = records_when_training, train_and_signal
    first = tr.step(0)
    assert seen == [(1, True)]
    buffered = tr.rollout_scheduler.queue[1]
    assert (buffered.step, buffered.version) == (1, 0)
    assert all(int(r.policy_version) == 0 for r in buffered.records)  # every sample records its version
    assert first["rollout_staleness_max"] == 0.0 and 0.0 <= first["rollout_overlap"] <= 1.0

    fresh = trainer(*SMALL, *K1, "trainer.max_steps=3")  # policy version 0
    same = fresh.source.records(1, 0, 0)
    assert _tokens(same) == _tokens(buffered.records)
    assert all(torch.equal(a.rollout_log_probs, b.rollout_log_probs) for a, b in zip(same, buffered.records))
    sync = trainer(*SMALL, "algo.tis_cap=2.0", "eval.every=0", "trainer.max_steps=3")
    assert sync.step(0)["rollout_staleness_max"] == 0.0  # k=0: every sample by the policy the step starts from
    # the control: version 1 generates step 1's prompts otherwise
    newer = sync.source.records(1, 0, 1)
    assert [int(r.prompt_index) for r in newer] == [int(r.prompt_index) for r in buffered.records]
    assert not all(torch.equal(a.rollout_log_probs, b.rollout_log_probs) for a, b in zip(newer, buffered.records))

    second = tr.step(1)
    assert second["rollout_staleness_mean"] == 1.0 and second["rollout_stale_dropped"] == 0.0
    assert second["rollout_logprob_abs_diff"] > 0  # version 1 scores version 0's samples: the TIS weight is not 1
    third = tr.step(2)
    assert "rollout_overlap" not in third and not tr.rollout_scheduler.queue  # nothing generated past max_steps


# ------------------------------------------------------------------ the scheduler alone, with stand-ins
class _Engine:
    """A rollout engine that records the versions loaded into it (the weight's value)."""

    needs_sync, holds_base, sync_bucket_bytes, replica = True, False, None, None

    def __init__(self):
        self.version, self.loads, self.slept = 0, [], 0

    def sleep(self):
        self.slept += 1

    def load_weights(self, items):
        self.version = int(dict(items)["weight"].item())
        self.loads.append(self.version)


class _Source:
    """Records of `step` that name the engine's version, checked unchanged over a generation
    that takes `hold` seconds; `fail_at`: the step whose generation raises."""

    def __init__(self, engine, *, fail_at=None, hold=0.0):
        self.engine, self.fail_at, self.hold, self.seen = engine, fail_at, hold, []

    def records(self, step, round_, version):
        if step == self.fail_at:
            raise FloatingPointError("non-finite logits")
        held = self.engine.version
        time.sleep(self.hold)
        assert version == held == self.engine.version, (step, version, held, self.engine.version)
        self.seen.append((step, version))
        return [Experience(sequences=torch.tensor([step, version]), prompt_index=torch.tensor(step))]


def _scheduler(engine, k, *, max_steps=6, **source):
    return RolloutScheduler(_Source(engine, **source), engine, max_staleness=k, max_steps=max_steps,
                            samples_per_step=4, rank=0, device=torch.device("cpu"))


def _train(s, steps, model):
    """The trainer's side of `steps`: take, then publish the update (version step + 1)."""
    got = []
    for step in steps:
        got.append([r.sequences.tolist() for r in s.take(step).records])
        model.weight.data.fill_(step + 1)
        s.sync(model)
    return got


def test_max_staleness_1_syncs_into_the_engine_once_the_thread_is_idle():
    """k=1 over 6 steps: rollout j with version max(0, j - 1), the engine unchanged during each
    generation (held 50 ms) and written by every sync. The control: a sync that does not wait
    for the thread writes the engine while a rollout is generating, which that rollout sees."""
    model = torch.nn.Linear(1, 1, bias=False)
    engine = _Engine()
    s = _scheduler(engine, 1, hold=0.05)
    assert s.stage is None
    assert _train(s, range(6), model) == [[[j, max(0, j - 1)]] for j in range(6)]
    assert engine.loads == [1, 2, 3, 4, 5, 6]  # the last too: the final evaluation reads the engine

    engine = _Engine()
    s = _scheduler(engine, 1, hold=0.2)
    s._done_with = lambda v: True  # the control: a sync that does not wait
    with pytest.raises(AssertionError):
        _train(s, range(3), model)


def test_at_max_staleness_0_extra_rounds_are_generated_now_and_the_engine_sleeps_after_the_rollout():
    """k=0: `more` generates dynamic sampling's round r with the policy the step starts from, and
    `rest` (the rollout stage over) sleeps the engine until the sync. Control: at k=1 the thread's
    engine never sleeps and an extra round is refused (rl.config.validate forbids the pair)."""
    model = torch.nn.Linear(1, 1, bias=False)
    engine = _Engine()
    s = _scheduler(engine, 0)
    assert _train(s, [0], model) == [[[0, 0]]]
    assert [r.sequences.tolist() for r in s.more(1, 2)] == [[1, 1]] and s.source.seen[-1] == (1, 1)
    s.rest()
    assert engine.slept == 1
    engine = _Engine()
    s = _scheduler(engine, 1)
    s.rest()
    assert engine.slept == 0
    with pytest.raises(RuntimeError, match="max_staleness=0, got 1"):
        s.more(0, 1)


def test_a_stale_rollout_is_dropped_counted_and_its_prompts_generated_again():
    def state(step, version):
        rec = Experience(sequences=torch.tensor([step, version]), prompt_index=torch.tensor(step))
        return pack_rollouts([Buffered(step, version, [rec])], rank=0)

    model = torch.nn.Linear(1, 1, bias=False)
    engine = _Engine()
    engine.version = 3  # the checkpoint's policy, loaded by the trainer
    s = _scheduler(engine, 1, max_steps=4)  # the last step: nothing generated ahead
    s.load_state_dict(state(step=3, version=2), step=3)  # 1 behind: kept (the control)
    assert _train(s, [3], model) == [[[3, 2]]] and s.source.seen == []
    engine = _Engine()
    engine.version = 3
    s = _scheduler(engine, 1)
    s.load_state_dict(state(step=3, version=1), step=3)  # 2 behind: dropped, step 3's prompts generated again
    assert s.take(3).records[0].sequences.tolist() == [3, 3]  # by the resumed policy
    model.weight.data.fill_(4)
    assert s.sync(model)["rollout_stale_dropped"] == 4
    assert (s.queue[4].step, s.queue[4].version) == (4, 3)  # the next one, generated meanwhile
    with pytest.raises(ValueError, match="buffered rollout is step 3's, the checkpoint has 4 steps done"):
        _scheduler(_Engine(), 1).load_state_dict(state(step=3, version=2), step=4)


def test_k2_hands_each_rollout_its_version_through_the_stage_and_a_checkpoint_keeps_the_queue():
    """max_staleness=2 over 6 steps: rollout j is generated with version max(0, j - 2), each
    version loaded once (none past the last that a rollout needs). Saved after 3 steps, the
    checkpoint holds rollouts 3 and 4 (versions 1 and 2: the resumed run could not generate them
    again); the resumed scheduler trains on them and generates step 5 with version 3, as the
    uninterrupted one did. Resumed with max_staleness=1 (the control), both are dropped and counted."""
    model = torch.nn.Linear(1, 1, bias=False)
    engine = _Engine()
    s = _scheduler(engine, 2)
    assert _train(s, range(6), model) == [[[j, max(0, j - 2)]] for j in range(6)]
    assert sorted(s.source.seen) == [(j, max(0, j - 2)) for j in range(6)] and engine.loads == [1, 2, 3]

    s = _scheduler(_Engine(), 2)
    _train(s, range(3), model)
    state = s.state_dict()
    assert state["buffered_step"] == 3 and [j for j, _ in s.source.seen] == [0, 1, 2, 3, 4]
    engine2 = _Engine()
    engine2.version = 3  # the checkpoint's policy, loaded by the trainer
    resumed = _scheduler(engine2, 2)
    resumed.load_state_dict(state, step=3)
    assert _train(resumed, range(3, 6), model) == [[[3, 1]], [[4, 2]], [[5, 3]]]
    assert resumed.source.seen == [(5, 3)] and engine2.loads == []

    engine3 = _Engine()
    engine3.version = 3
    stale = _scheduler(engine3, 1)
    stale.load_state_dict(state, step=3)
    assert [r.sequences.tolist() for r in stale.take(3).records] == [[3, 3]]
    assert stale.sync(model)["rollout_stale_dropped"] == 8


@pytest.mark.parametrize("k", [1, 2])
def test_a_rollout_failure_in_the_thread_surfaces_in_the_take_that_waits_for_it(k):
    model = torch.nn.Linear(1, 1, bias=False)
    s = _scheduler(_Engine(), k, fail_at=2)
    _train(s, range(2), model)
    with pytest.raises(FloatingPointError):
        s.take(2)


# ------------------------------------------------------------------------------ the trainer
def test_a_thread_rollout_failure_is_the_divergence_error_of_the_step_that_takes_it():
    tr = trainer(*SMALL, *K1, "trainer.max_steps=3")
    records = tr.source.records

    def diverge(step, round_, version):
        if step == 1:
            raise FloatingPointError("non-finite logits at decode step 0")
        return records(step, round_, version)

    tr.source.records = diverge
    tr.step(0)
    with pytest.raises(DivergenceError, match="step 1: non-finite logits in the rollout"):
        tr.step(1)


def test_the_rollout_stage_rolls_out_dynamic_sampling_rounds_until_the_step_has_its_varied_groups():
    """algo.dynamic_sampling at k=0, one call (`RolloutScheduler.rollouts`): the groups whose rewards
    are all equal are dropped, round 1 is generated (`more`) and task.prompts_per_step varied groups
    kept; the engine sleeps once, after the last round. The control: the same step without dynamic
    sampling holds a uniform group."""
    from rl.tasks.reward import varied_groups

    tr = trainer(*SMALL, "trainer.max_steps=1", "eval.every=0", "algo.dynamic_sampling=true")
    rounds, slept, records, sleep = [], [], tr.source.records, tr.engine.sleep
    tr.source.records = lambda step, round_, version: rounds.append(round_) or records(step, round_, version)
    tr.engine.sleep = lambda: slept.append(list(rounds)) or sleep()
    rollouts = tr.rollout(0)
    assert rollouts.sampling == {"sampling_rounds": 2, "dropped_groups": 2, "kept_groups": 4} and rounds == [0, 1]
    assert len({int(r.prompt_index) for r in rollouts.samples}) == 4 and varied_groups(rollouts.samples) == 1.0
    assert slept == [[0, 1]]
    plain = trainer(*SMALL, "trainer.max_steps=1", "eval.every=0")
    assert varied_groups(plain.rollout(0).samples) < 1.0


def test_a_rollout_thread_refuses_an_engine_that_generates_from_the_training_shards():
    """rollout.replica=auto resolves to sharded when the copy does not fit the budget: that engine
    has no weights of its own to generate with while the policy trains (validate cannot know)."""
    trainer(*SMALL, *OFF, "rollout.memory_budget_gb=100")  # the control: the copy fits, the scheduler builds
    with pytest.raises(ValueError, match=r"rollout\.max_staleness=1 needs the rollout engine's own copy.*"
                                         r"rollout\.replica=auto -> sharded"):
        trainer(*SMALL, *OFF, "rollout.memory_budget_gb=0.000001")


def test_a_checkpoint_holds_the_buffered_rollout_and_one_without_it_generates_it_again(tmp_path):
    """max_staleness=1, saved after step 0: the loaded trainer holds step 1's buffered records,
    field by field, with their version. A sync run's checkpoint (no buffered rollout) resumed with
    max_staleness=1 generates step 1's prompts with the resumed policy (staleness 0): nothing skipped."""
    from rl.trainer.checkpoint import load_checkpoint, save_checkpoint

    tr = trainer(*SMALL, *OFF, "trainer.max_steps=3")
    tr.step(0)
    save_checkpoint(tr, tmp_path / "off", 1, tr.cfg, tr.dims)
    saved = tr.rollout_scheduler.queue[1]
    again = trainer(*SMALL, *OFF, "trainer.max_steps=3")
    assert load_checkpoint(again, tmp_path / "off" / "step_00000001", again.dims) == 1
    got = again.rollout_scheduler.queue[1]
    assert (got.step, got.version, len(got.records)) == (saved.step, saved.version, len(saved.records)) == (1, 0, 16)
    for a, b in zip(got.records, saved.records):
        assert dict(a.items()).keys() == dict(b.items()).keys()
        assert all(torch.equal(v, getattr(b, k)) for k, v in a.items())

    sync = trainer(*SMALL, "algo.tis_cap=2.0", "eval.every=0", "trainer.max_steps=3")
    sync.step(0)
    save_checkpoint(sync, tmp_path / "sync", 1, sync.cfg, sync.dims)
    off = trainer(*SMALL, *OFF, "trainer.max_steps=3")
    load_checkpoint(off, tmp_path / "sync" / "step_00000001", off.dims)
    assert not off.rollout_scheduler.queue
    step1 = off.step(1)
    assert step1["rollout_staleness_max"] == 0.0 and step1["rollout_stale_dropped"] == 0.0


def test_a_k2_checkpoint_holds_the_queued_rollouts_with_their_versions_and_the_stage_is_one_model(tmp_path):
    """Saved after step 0 at max_staleness=2: rollouts 1 and 2 need version 0, which a resumed run
    (version 1) could not generate again, so the save waits for them; the loaded trainer holds
    them, tokens and versions. The held-out evaluation at k=2 generates from the policy itself
    (the engine is the thread's, holding an older version); at k=1 from the engine. The stage
    holds one full copy of the policy's weights: what a full weight sync sends."""
    from model.parallelize import full_parameters
    from rl.trainer.checkpoint import load_checkpoint, save_checkpoint

    run = (*SMALL, *ASYNC, "rollout.max_staleness=2", "trainer.max_steps=3")
    tr = trainer(*run)
    assert tr.eval_engine is not tr.engine and not tr.eval_engine.needs_sync
    off = trainer(*SMALL, *OFF)
    assert off.eval_engine is off.engine
    tr.step(0)
    staged = sum(t.numel() * t.element_size() for _, t in tr.rollout_scheduler.stage.items())
    assert staged == sum(t.numel() * t.element_size() for _, t in full_parameters(tr.actor.model)) > 0
    assert staged == off.step(0)["weight_sync_bytes"]  # k=1: the sync into the engine
    save_checkpoint(tr, tmp_path, 1, tr.cfg, tr.dims)
    queued = sorted(tr.rollout_scheduler.queue)
    assert queued == [1, 2]
    again = trainer(*run)
    assert load_checkpoint(again, tmp_path / "step_00000001", again.dims) == 1
    assert sorted(again.rollout_scheduler.queue) == queued
    for j in queued:
        a, b = again.rollout_scheduler.queue[j], tr.rollout_scheduler.queue[j]
        assert (a.step, a.version) == (b.step, b.version) and a.version == max(0, j - 2)
        assert _tokens(a.records) == _tokens(b.records)
    assert again.step(1)["rollout_staleness_max"] == 1.0  # rollout 1, version 0, trained by version 1
