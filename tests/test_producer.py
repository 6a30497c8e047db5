"""rollout.mode (rl/rollout/producer.py): sync is the default; one_step_off generates step k+1's
rollout in a background thread, while step k trains, with the policy before step k's update;
async generates rollout j with version j - max_staleness through a staged copy of the weights
(at max_staleness=1: one_step_off's metrics); stale rollouts are dropped and counted; the
buffered rollouts survive a checkpoint round trip; each refused combination names its field."""

import threading

import pytest
import torch
from inprocess import SMALL, compose, trainer

from packing.experience import Experience
from rl.rollout.producer import AsyncProducer, OneStepOffProducer, RolloutMode
from rl.trainer.guard import DivergenceError

OFF = ("rollout.mode=one_step_off", "algo.tis_cap=2.0", "eval.every=0")


def test_sync_is_the_default_and_refused_combinations_name_their_field():
    cfg = compose(*SMALL)
    assert cfg.rollout.mode is RolloutMode.SYNC and cfg.rollout.max_staleness == 1
    compose(*SMALL, *OFF)  # the control: a valid one_step_off config passes
    compose(*SMALL, "rollout.mode=one_step_off", "algo.old_log_probs=rollout")  # the other correction
    compose(*SMALL, *OFF, "rollout.mode=async", "rollout.max_staleness=2")
    for extra, match in [
        (("rollout.mode=async", "rollout.replica=sharded"), r"rollout\.mode=async with rollout\.replica=sharded"),
        (("rollout.mode=async", "rollout.max_staleness=0"), r"rollout\.max_staleness=0 with rollout\.mode=async"),
        (("rollout.max_staleness=-1",), r"rollout\.max_staleness=-1: expected >= 0"),
        (("rollout.max_staleness=0",), r"rollout\.max_staleness=0 with rollout\.mode=one_step_off"),
        (("rollout.replica=sharded",), r"rollout\.mode=one_step_off with rollout\.replica=sharded"),
        (("algo.dynamic_sampling=true",), r"rollout\.mode=one_step_off with algo\.dynamic_sampling=true"),
        (("algo.tis_cap=null",), r"rollout\.mode=one_step_off with algo\.tis_cap=null and algo\.old_log_probs"),
    ]:
        with pytest.raises(ValueError, match=match):
            compose(*SMALL, *OFF, *extra)


def _tokens(records: list[Experience]) -> list[list[int]]:
    return [r.sequences.tolist() for r in records]


def test_one_step_off_generates_the_next_rollout_during_training_with_the_previous_policy():
    """Step 1's rollout is generated while step 0 trains (the generation waits until the train
    stage has begun: run in the foreground it would find it not begun), with the policy before
    step 0's update: exactly the records a fresh trainer (version 0) generates for step 1; the
    control, a trainer after step 0's update (version 1), generates other samples. Step 1 trains
    on those records, corrected against their behaviour log-probs (staleness 1 reported)."""
    tr = trainer(*SMALL, *OFF, "trainer.max_steps=3")
    training = threading.Event()
    seen = []
    generate, train = tr.producer._generate, tr.train

    def generate_when_training(step, version):
        if step > 0:
            seen.append((step, training.wait(timeout=120)))  # True only if the train stage began meanwhile
        return generate(step, version)

    def train_and_signal(minibatches):
        training.set()
        return train(minibatches)

    tr.producer._generate, tr.train = generate_when_training, train_and_signal
    first = tr.step(0)
    assert seen == [(1, True)]
    buffered = tr.producer.buffer
    assert (buffered.step, buffered.version) == (1, 0)
    assert all(int(r.policy_version) == 0 for r in buffered.records)  # every sample records its version
    assert first["rollout_staleness_max"] == 0.0 and 0.0 <= first["rollout_overlap"] <= 1.0

    fresh = trainer(*SMALL, *OFF, "trainer.max_steps=3")  # policy version 0
    same = fresh._records(1, 0, 0)
    assert _tokens(same) == _tokens(buffered.records)
    assert all(torch.equal(a.rollout_log_probs, b.rollout_log_probs) for a, b in zip(same, buffered.records))
    sync = trainer(*SMALL, "algo.tis_cap=2.0", "eval.every=0", "trainer.max_steps=3")
    assert sync.step(0)["rollout_staleness_max"] == 0.0  # sync: every sample by the policy the step starts from
    # the control: version 1 generates step 1's prompts otherwise
    newer = sync._records(1, 0, 1)
    assert [int(r.prompt_index) for r in newer] == [int(r.prompt_index) for r in buffered.records]
    assert not all(torch.equal(a.rollout_log_probs, b.rollout_log_probs) for a, b in zip(newer, buffered.records))

    second = tr.step(1)
    assert second["rollout_staleness_mean"] == 1.0 and second["rollout_stale_dropped"] == 0.0
    assert second["rollout_logprob_abs_diff"] > 0  # version 1 scores version 0's samples: the TIS weight is not 1
    third = tr.step(2)
    assert "rollout_overlap" not in third and tr.producer.buffer is None  # nothing generated past max_steps


class _Stub:
    """A producer's generate/share pair that records what it was asked."""

    def __init__(self, fail_at: int | None = None):
        self.generated, self.versions, self.fail_at = [], [], fail_at

    def generate(self, step, version):
        if step == self.fail_at:
            raise FloatingPointError("non-finite logits")
        self.generated.append(step)
        self.versions.append(version)
        return [Experience(sequences=torch.tensor([step, 1, 2]), prompt_index=torch.tensor(step))]

    def share(self, records, seconds, generated_s):
        return [int(r.sequences[0]) for r in records]


def _producer(stub, **kw):
    return OneStepOffProducer(stub.generate, stub.share, max_steps=kw.get("max_steps", 10),
                              max_staleness=kw.get("max_staleness", 1), samples_per_step=4, rank=0,
                              device=torch.device("cpu"))


def test_a_stale_rollout_is_dropped_counted_and_its_prompts_generated_again():
    stub = _Stub()
    p = _producer(stub, max_staleness=1, max_steps=4)  # the last step: nothing generated in the background
    p.load_state_dict(_state(step=3, version=2), step=3)  # 1 behind: kept (the control)
    assert p.take(3) == [3] and stub.generated == [] and p.settle()["rollout_stale_dropped"] == 0
    p = _producer(stub, max_staleness=1)
    p.load_state_dict(_state(step=3, version=1), step=3)  # 2 behind: dropped, step 3's prompts generated now
    assert p.take(3) == [3] and stub.generated[0] == 3 and stub.versions[0] == 3  # by the resumed policy
    out = p.settle()
    assert out["rollout_stale_dropped"] == 4
    assert p.buffer.step == 4 and p.buffer.version == 3  # the next one, generated meanwhile


def _state(step: int, version: int) -> dict:
    p = _producer(_Stub())
    p.buffer = None
    from rl.rollout.producer import Buffered

    p.buffer = Buffered(step, version, [Experience(sequences=torch.tensor([step, 1, 2]),
                                                   prompt_index=torch.tensor(step))])
    return p.state_dict()


def test_the_buffered_rollout_round_trips_and_a_background_failure_surfaces_in_the_next_take():
    state = _state(step=5, version=4)
    p = _producer(_Stub())
    with pytest.raises(ValueError, match="buffered rollout is step 5's, the checkpoint has 6 steps done"):
        p.load_state_dict(state, step=6)
    p.load_state_dict(state, step=5)
    (rec,) = p.buffer.records
    assert p.buffer.version == 4 and rec.sequences.tolist() == [5, 1, 2] and int(rec.prompt_index) == 5
    p.load_state_dict({"buffered_step": -1, "version": -1, "seconds": 0.0, "records": {"rank0": b""}}, step=5)
    assert p.buffer is None  # saved with nothing buffered

    stub = _Stub(fail_at=2)
    p = _producer(stub)
    p.take(1)  # starts step 2's generation, which fails in the thread
    p.settle()
    with pytest.raises(FloatingPointError):
        p.take(2)


def test_a_background_rollout_failure_is_the_divergence_error_of_the_step_that_takes_it():
    tr = trainer(*SMALL, *OFF, "trainer.max_steps=3")
    generate = tr.producer._generate

    def diverge(step, version):
        if step == 1:
            raise FloatingPointError("non-finite logits at decode step 0")
        return generate(step, version)

    tr.producer._generate = diverge
    tr.step(0)
    with pytest.raises(DivergenceError, match="step 1: non-finite logits in the rollout"):
        tr.step(1)


def test_one_step_off_refuses_an_engine_that_generates_from_the_training_shards():
    """rollout.replica=auto resolves to sharded when the copy does not fit the budget: that engine
    has no weights of its own to generate with while the policy trains (validate cannot know)."""
    trainer(*SMALL, *OFF, "rollout.memory_budget_gb=100")  # the control: the copy fits, one_step_off builds
    with pytest.raises(ValueError, match=r"one_step_off needs the rollout engine's own copy.*"
                                         r"rollout\.replica=auto -> sharded"):
        trainer(*SMALL, *OFF, "rollout.memory_budget_gb=0.000001")


def test_a_checkpoint_holds_the_buffered_rollout_and_one_without_it_generates_it_again(tmp_path):
    """one_step_off, saved after step 0: the loaded trainer holds step 1's buffered records, field
    by field, with their version. A sync run's checkpoint (no buffered rollout) resumed with
    one_step_off generates step 1's prompts in the foreground (staleness 0): nothing skipped."""
    from rl.trainer.checkpoint import load_checkpoint, save_checkpoint

    tr = trainer(*SMALL, *OFF, "trainer.max_steps=3")
    tr.step(0)
    save_checkpoint(tr, tmp_path / "off", 1, tr.cfg, tr.dims)
    saved = tr.producer.buffer
    again = trainer(*SMALL, *OFF, "trainer.max_steps=3")
    assert load_checkpoint(again, tmp_path / "off" / "step_00000001", again.dims) == 1
    got = again.producer.buffer
    assert (got.step, got.version, len(got.records)) == (saved.step, saved.version, len(saved.records)) == (1, 0, 16)
    for a, b in zip(got.records, saved.records):
        assert dict(a.items()).keys() == dict(b.items()).keys()
        assert all(torch.equal(v, getattr(b, k)) for k, v in a.items())

    sync = trainer(*SMALL, "algo.tis_cap=2.0", "eval.every=0", "trainer.max_steps=3")
    sync.step(0)
    save_checkpoint(sync, tmp_path / "sync", 1, sync.cfg, sync.dims)
    off = trainer(*SMALL, *OFF, "trainer.max_steps=3")
    load_checkpoint(off, tmp_path / "sync" / "step_00000001", off.dims)
    assert off.producer.buffer is None
    step1 = off.step(1)
    assert step1["rollout_staleness_max"] == 0.0 and step1["rollout_stale_dropped"] == 0.0


# ------------------------------------------------------------------------------ async
ASYNC = ("rollout.mode=async", "algo.tis_cap=2.0", "eval.every=0")


def test_async_at_staleness_1_trains_as_one_step_off_and_at_2_on_rollouts_two_versions_old():
    """max_staleness=1: rollout j generated with version j - 1, as one_step_off's: the same metrics
    step for step. max_staleness=2 (the control: other metrics from step 2): step 3's samples are
    exactly those a trainer holding version 1 (one step trained, synced) generates for step 3."""
    def run(*extra, steps=4):
        tr = trainer(*SMALL, *extra, "trainer.max_steps=4")
        taken, share = {}, tr.producer._share
        tr.producer._share = lambda records, *a: taken.setdefault(len(taken), records) and share(records, *a)
        return [tr.step(s) for s in range(steps)], taken

    keys = ("loss", "reward_mean", "grad_norm", "entropy", "rollout_logprob_abs_diff")
    off, _ = run(*OFF, "rollout.mode=one_step_off")
    one, _ = run(*ASYNC, "rollout.max_staleness=1")
    two, taken = run(*ASYNC, "rollout.max_staleness=2")
    for a, b in zip(off, one):
        assert {k: b[k] for k in keys} == pytest.approx({k: a[k] for k in keys}, rel=1e-5, abs=1e-7)
    assert [m["rollout_staleness_max"] for m in one] == [0.0, 1.0, 1.0, 1.0]
    assert [m["rollout_staleness_max"] for m in two] == [0.0, 1.0, 2.0, 2.0]  # rollout j: version max(0, j - 2)
    assert two[2]["loss"] != pytest.approx(one[2]["loss"], rel=1e-3)
    assert all(m["rollout_stale_dropped"] == 0 for m in one + two)

    v1 = trainer(*SMALL, "algo.tis_cap=2.0", "eval.every=0", "trainer.max_steps=4")
    v1.step(0)  # version 1 in its engine
    want = v1._records(3, 0, 1)
    assert _tokens(want) == _tokens(taken[3])
    assert all(torch.equal(a.rollout_log_probs, b.rollout_log_probs) for a, b in zip(want, taken[3]))
    v1.step(1)  # the control: version 2 generates step 3's prompts otherwise
    assert not all(torch.equal(a.rollout_log_probs, b.rollout_log_probs) for a, b in zip(v1._records(3, 0, 2), taken[3]))


class _Engine:
    """A rollout engine that records the versions loaded into it (the weight's value)."""

    needs_sync, sync_bucket_bytes = True, None

    def __init__(self):
        self.version, self.loads = 0, []

    def load_weights(self, items):
        self.version = int(dict(items)["weight"].item())
        self.loads.append(self.version)


def _async(engine, seen, *, max_steps=6, max_staleness=2, fail_at=None):
    def generate(step, version):
        if step == fail_at:
            raise FloatingPointError("non-finite logits")
        assert version == engine.version  # the producer names the version the engine holds (raised in take)
        seen.append((step, engine.version))
        return [Experience(sequences=torch.tensor([step, engine.version]), prompt_index=torch.tensor(step))]

    return AsyncProducer(generate, lambda records, *a: [r.sequences.tolist() for r in records], engine,
                         max_steps=max_steps, max_staleness=max_staleness, samples_per_step=4, rank=0,
                         device=torch.device("cpu"))


def _train(p, engine, steps, model):
    """The trainer's side of `steps`: take, settle, then publish the update (version step + 1)."""
    got = []
    for s in steps:
        got.append(p.take(s))
        p.settle()
        model.weight.data.fill_(s + 1)
        p.sync(engine, model)
    return got


def test_async_hands_each_rollout_its_version_through_the_stage_and_a_checkpoint_keeps_the_queue():
    """max_staleness=2 over 6 steps: rollout j is generated with version max(0, j - 2), each
    version loaded once (none past the last that a rollout needs). Saved after 3 steps, the
    checkpoint holds rollouts 3 and 4 (versions 1 and 2: the resumed run could not generate them
    again); the resumed producer trains on them and generates step 5 with version 3, as the
    uninterrupted one did. Resumed with max_staleness=1 (the control), both are dropped and counted."""
    model = torch.nn.Linear(1, 1, bias=False)
    engine, seen = _Engine(), []
    p = _async(engine, seen)
    got = _train(p, engine, range(6), model)
    assert got == [[[j, max(0, j - 2)]] for j in range(6)]
    assert sorted(seen) == [(j, max(0, j - 2)) for j in range(6)] and engine.loads == [1, 2, 3]

    engine, seen = _Engine(), []
    p = _async(engine, seen)
    _train(p, engine, range(3), model)
    state = p.state_dict()
    assert state["buffered_step"] == 3 and [s for s, _ in seen][:5] == [0, 1, 2, 3, 4]
    engine2, seen2 = _Engine(), []
    engine2.version = 3  # the checkpoint's policy, loaded by the trainer
    resumed = _async(engine2, seen2)
    resumed.load_state_dict(state, step=3)
    assert _train(resumed, engine2, range(3, 6), model) == [[[3, 1]], [[4, 2]], [[5, 3]]]
    assert seen2 == [(5, 3)] and engine2.loads == []

    stale = _async(_Engine(), seen3 := [], max_staleness=1)
    stale.engine.version = 3
    stale.load_state_dict(state, step=3)
    first = stale.take(3)
    assert first == [[3, 3]] and stale.settle()["rollout_stale_dropped"] == 8


def test_an_async_rollout_failure_surfaces_in_the_take_that_waits_for_it():
    model = torch.nn.Linear(1, 1, bias=False)
    engine = _Engine()
    p = _async(engine, [], fail_at=2)
    _train(p, engine, range(2), model)
    with pytest.raises(FloatingPointError):
        p.take(2)


def test_an_async_checkpoint_holds_the_queued_rollouts_with_their_versions(tmp_path):
    """Saved after step 0 at max_staleness=2: rollouts 1 and 2 need version 0, which a resumed run
    (version 1) could not generate again, so the save waits for them; the loaded trainer holds
    them, tokens and versions. The held-out evaluation of an async run generates from the policy
    itself (the engine is the thread's, holding an older version)."""
    from rl.trainer.checkpoint import load_checkpoint, save_checkpoint

    run = (*SMALL, *ASYNC, "rollout.max_staleness=2", "trainer.max_steps=3")
    tr = trainer(*run)
    assert tr._eval_engine() is not tr.engine and not tr._eval_engine().needs_sync
    off = trainer(*SMALL, *OFF)
    assert off._eval_engine() is off.engine
    tr.step(0)
    save_checkpoint(tr, tmp_path, 1, tr.cfg, tr.dims)
    queued = sorted(tr.producer.queue)
    assert queued[:2] == [1, 2]
    again = trainer(*run)
    assert load_checkpoint(again, tmp_path / "step_00000001", again.dims) == 1
    assert sorted(again.producer.queue) == queued
    for j in queued:
        a, b = again.producer.queue[j], tr.producer.queue[j]
        assert (a.step, a.version) == (b.step, b.version) and a.version == max(0, j - 2)
        assert _tokens(a.records) == _tokens(b.records)
    assert again.step(1)["rollout_staleness_max"] == 1.0  # rollout 1, version 0, trained by version 1
