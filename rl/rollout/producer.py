"""Where a step's rollout comes from: `rollout.mode` (the trainer's `rollout` stage asks its producer).

    producer = make_producer(cfg, dims, engine, sample=..., generate=..., share=...)
    rollouts = producer.take(step)           # the step's Rollouts (rl/trainer/trainer.py)
    ... plan, collate, score, advantages, train ...
    metrics |= producer.settle()             # sync, one_step_off: the engine is idle from here on
    metrics |= producer.sync(engine, policy) # the step's update: into the engine, or (async) its stage

    sync          `take` generates the step's rollout now, with the policy the step starts from
                  (`sample`: the trainer's own rollout, dynamic sampling included); nothing is
                  kept between steps; `settle` returns no metric. The default.
    one_step_off  `take(k)` returns the rollout generated while step k-1 trained, and starts step
                  k+1's in a background thread with the engine's weights as they are, i.e. the
                  policy before step k's update; `settle` (after the train stage) waits for it,
                  so the weight sync never writes weights a generation is reading. Step k thus
                  trains on samples of policy version k-1 (staleness 1); the run's first step
                  (and a resumed step with no buffered rollout) generates in the foreground
                  (staleness 0). Nothing is generated for a step past `trainer.max_steps`.
    async         a rollout thread generates rollout after rollout, rollout j with policy version
                  max(base, j - rollout.max_staleness) (base: 0, or the resumed step), into a
                  queue `take` pops from; the trainer never waits for a generation to end before
                  its sync: `sync` writes the update into a staged host copy (rl/rollout/sync.py
                  `StagedWeights`), which the thread loads into the engine before the first
                  rollout that needs it. At max_staleness=1 it trains on exactly one_step_off's
                  samples (tested: equal metrics); at k > 1 generation may run k - 1 steps ahead of
                  the step that waits for it, which absorbs a slow rollout (a long answer) instead
                  of stalling the trainer. The stage holds one version, so the trainer's sync after
                  step v waits (`rollout_publish_wait_s`) until the engine holds version v (the
                  rollout that needs it has begun), and every rollout gets exactly its version:
                  the samples are a function of (seed, step, max_staleness), whatever the timing.

Policy version: the number of steps whose update the weights hold (the engine holds version k
during step k, until the sync after it). Every sample records the version that generated it
(`Experience.policy_version`, stamped by `generate`; the trainer's metrics stage reports
`rollout_staleness_mean/max`, step minus version, over every rank's samples, in every mode);
all samples of one rollout share it. A rollout whose version is more than
`rollout.max_staleness` behind the step that takes it is dropped whole (its sample count
reported as `rollout_stale_dropped`) and the step's prompts generated again (one_step_off: in
the foreground; async: by the thread, with the resumed policy): the prompts of a step are a
function of (seed, step) (rl/trainer/trainer.py), so a drop never skips or repeats a prompt.
With max_staleness >= 1 (what `validate` allows) a drop only happens after a resume that
lowered the setting.

What runs in the thread: `generate(step, version)` only (the engine's `generate` and the
rewards, on this rank's prompts: no collective; async also copies the stage into the engine);
the all-gather of the samples' metadata (`share`) runs on the main thread in `take`, so the
collectives of every rank keep one order. On CUDA the thread issues its kernels on its own
stream, which first waits for the main stream (the last weight sync) and is synchronized before
the records are handed over, so generation kernels run beside the training kernels on the
device. On CPU the two threads' ops run at the same time (torch releases the GIL inside ops)
but share the cores: the measured overlap is of wall-clock intervals, not of free compute.

Checkpoint (`state_dict`, saved by rl/trainer/checkpoint.py): the buffered rollouts, i.e. the
samples generated and not yet trained: `buffered_step` (the prompt cursor: the step whose
prompts the first holds, -1 for none), the first's `version`, their generation seconds, and
this rank's records (`records.rank<r>`, torch.save bytes of each rollout's step, version and
records). async first waits for the rollouts that need a policy older than the checkpoint's
(a resumed run could not generate them again). A resumed run trains on exactly those samples,
so at one process it continues with the uninterrupted run's metrics.

The producers' metrics (one_step_off and async; sync has none): `rollout_stale_dropped`;
one_step_off, for the background generation started during the step (absent on the last step):
`rollout_generate_s`, `rollout_overlap` (the fraction of it that ran while the step's
collate..train stages ran) and `rollout_wait_s` (how long `settle` waited for it: the
generation not hidden); async: `rollout_wait_s` (how long `take` waited for the step's
rollout), `rollout_generate_s` (its generation), `rollout_queue` (rollouts ready beyond it),
`rollout_overlap` (the fraction of the thread's generation during the step that ran while it
trained) and `rollout_publish_wait_s`.
"""

from __future__ import annotations

import atexit
import contextlib
import io
import logging
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any, Callable

import torch

from packing.experience import Experience
from rl.choice import Choice
from rl.rollout.sync import StagedWeights, sync_weights

log = logging.getLogger(__name__)


class RolloutMode(Choice):
    """`rollout.mode`: when a step's rollout is generated, and with which policy version."""

    SYNC = "sync"  # at the step's start, with the policy the step starts from
    ONE_STEP_OFF = "one_step_off"  # during the previous step's training, with the policy one update older
    ASYNC = "async"  # continuously, up to rollout.max_staleness steps ahead, through a staged copy of the weights


@dataclass
class Buffered:
    """A rollout generated and not yet trained: this rank's records of `step`'s prompts, all of
    policy version `version`."""

    step: int
    version: int
    records: list[Experience]
    seconds: float = 0.0  # the generation's


class SyncProducer:
    """`rollout.mode=sync`: the step's rollout, generated when the step asks for it."""

    generates_during_training = False  # the engine is idle from `take` to the sync: the trainer sleeps it

    def __init__(self, sample: Callable[[int], Any]) -> None:
        self._sample = sample

    def take(self, step: int):
        return self._sample(step)

    def settle(self) -> dict[str, float]:
        return {}

    def sync(self, engine, model) -> dict[str, float]:
        """The step's update into the engine (idle: nothing generates between steps)."""
        sync_weights(engine, model)
        return {}

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any] | None, step: int) -> None:
        pass


class OneStepOffProducer:
    """`rollout.mode=one_step_off` (see the module docstring).

    `generate(step, version) -> [Experience]`: this rank's records of the step's prompts, each
    stamped with the policy version the engine holds (thread-safe: no collective);
    `share(records, seconds, generated_s) -> Rollouts`: every rank's samples as metadata (a
    collective, main thread only), with the seconds the step waited for them and the seconds
    their generation took."""

    generates_during_training = True  # step+1 is generated on the engine while the step trains: no sleep

    def __init__(self, generate: Callable[[int, int], list[Experience]], share: Callable[..., Any],
                 *, max_steps: int, max_staleness: int, samples_per_step: int, rank: int,
                 device: torch.device) -> None:
        self._generate, self._share = generate, share
        self.max_steps, self.max_staleness = max_steps, max_staleness
        self.samples_per_step, self.rank = samples_per_step, rank
        self.buffer: Buffered | None = None
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._times: tuple[float, float] | None = None  # the background generation's start and end
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._taken: dict[str, float] = {}

    # ------------------------------------------------------------------ the step
    def take(self, step: int):
        """The step's Rollouts: the buffered rollout if it is `step`'s and fresh enough, else
        generated now; then step+1's generation starts in the background."""
        t0 = time.perf_counter()
        self._join()  # nothing is in flight after `settle`; a caller that skipped it waits here
        buffered, self.buffer = self.buffer, None
        if self._error is not None:  # the background generation failed: raise it in this step's rollout stage
            error, self._error = self._error, None
            raise error
        dropped = 0
        if buffered is not None and buffered.step != step:
            log.warning("rollout.mode=one_step_off: the buffered rollout is step %d's, step %d asked: generating "
                        "step %d's prompts now", buffered.step, step, step)
            buffered = None
        if buffered is not None and step - buffered.version > self.max_staleness:
            log.info("rollout.max_staleness=%d: step %d's buffered rollout is of policy version %d (%d behind): "
                     "dropped, its prompts generated again", self.max_staleness, step, buffered.version,
                     step - buffered.version)
            dropped, buffered = self.samples_per_step, None
        if buffered is None:  # in the foreground: the engine holds version `step`
            g0 = time.perf_counter()
            buffered = Buffered(step, step, self._generate(step, step))
            buffered.seconds = time.perf_counter() - g0
        rollouts = self._share(buffered.records, time.perf_counter() - t0, buffered.seconds)
        self._taken = {"rollout_stale_dropped": float(dropped)}
        if step + 1 < self.max_steps:
            self._start(step + 1, version=step)
        self._train_start = time.perf_counter()
        return rollouts

    def settle(self) -> dict[str, float]:
        """Wait for the background generation (the engine is then free for the weight sync);
        the step's staleness and overlap metrics."""
        t0 = time.perf_counter()
        running = self._thread is not None
        self._join()
        out = dict(self._taken)
        if running and self._times is not None:
            g0, g1 = self._times
            busy = max(g1 - g0, 1e-9)
            out.update(rollout_generate_s=g1 - g0, rollout_wait_s=time.perf_counter() - t0,
                       rollout_overlap=max(0.0, min(g1, t0) - max(g0, self._train_start)) / busy)
        return out

    def sync(self, engine, model) -> dict[str, float]:
        """The step's update into the engine, idle since `settle`."""
        sync_weights(engine, model)
        return {}

    # --------------------------------------------------------------- the thread
    def _start(self, step: int, *, version: int) -> None:
        main = torch.cuda.current_stream(self._stream.device) if self._stream is not None else None
        self._times = None
        self._thread = threading.Thread(target=self._run, args=(step, version, main), name=f"rollout-{step}",
                                        daemon=True)
        self._thread.start()

    def _run(self, step: int, version: int, main) -> None:
        try:
            t0 = time.perf_counter()
            if self._stream is None:
                records = self._generate(step, version)
            else:
                torch.cuda.set_device(self._stream.device)  # the current device is per thread
                self._stream.wait_stream(main)  # the weights of the last sync are written
                with torch.cuda.stream(self._stream):
                    records = self._generate(step, version)
                self._stream.synchronize()  # the records are complete before the main thread reads them
            self._times = (t0, time.perf_counter())
            self.buffer = Buffered(step, version, records, seconds=self._times[1] - t0)
        except BaseException as e:  # noqa: BLE001 - re-raised by the next `take`, in its rollout stage
            self._error = e

    def _join(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    # ------------------------------------------------------------- checkpoint
    def state_dict(self) -> dict[str, Any]:
        """The buffered rollout (see the module docstring); a placeholder when there is none
        (the same keys either way: `dcp.load` fills this dict in place)."""
        self._join()
        return pack_rollouts([self.buffer] if self.buffer is not None else [], self.rank)

    def load_state_dict(self, state: dict[str, Any] | None, step: int) -> None:
        """Put back a loaded `state_dict` (None or no records: nothing buffered, `step`'s
        rollout is generated when it is taken). An async run's checkpoint may hold rollouts of
        later steps too: only `step`'s is kept."""
        self._join()
        self.buffer = None
        rollouts = unpack_rollouts(state, self.rank, step)
        if len(rollouts) > 1:
            log.info("checkpoint: %d buffered rollouts of later steps (rollout.mode=async) let go: one_step_off "
                     "generates them again", len(rollouts) - 1)
        self.buffer = rollouts[0] if rollouts else None


class AsyncProducer:
    """`rollout.mode=async` (see the module docstring): one rollout thread that generates step
    after step, rollout j with policy version max(base, j - max_staleness), while the trainer
    trains; the weight sync writes a staged host copy (rl/rollout/sync.py `StagedWeights`) that
    the thread loads into the engine between two rollouts, so the trainer never waits for a
    generation to finish before its sync, and the thread never waits for a step it does not need.

    The hand-over, under one condition variable: the thread starts rollout j once the staged
    version is >= its version (loading it first when the engine holds an older one); the
    trainer publishes version v + 1 once the engine holds v (the rollout that needs v has
    started) or no rollout needs v any more. The stage holds one version, so every rollout gets
    exactly its version: the samples are a function of (seed, step, max_staleness), as sync's and
    one_step_off's are, whatever the timing."""

    generates_during_training = True

    def __init__(self, generate: Callable[[int, int], list[Experience]], share: Callable[..., Any], engine,
                 *, max_steps: int, max_staleness: int, samples_per_step: int, rank: int,
                 device: torch.device) -> None:
        self._generate, self._share, self.engine = generate, share, engine
        self.max_steps, self.max_staleness = max_steps, max_staleness
        self.samples_per_step, self.rank = samples_per_step, rank
        self.stage = StagedWeights(engine.sync_bucket_bytes, pin=device.type == "cuda")
        self.queue: dict[int, Buffered] = {}  # generated, not yet taken, by step
        self._cv = threading.Condition()
        self._base = 0  # the version the run (or its resume) starts from: no rollout gets an older one
        self._next = 0  # the next step the thread generates
        self._staged = self._loaded = 0  # the version in the stage, and in the engine
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._busy: list[tuple[float, float]] = []  # the thread's generation intervals
        self._dropped = 0  # samples of loaded rollouts older than the bound (counted in the next take)
        self._busy_since: float | None = None  # the start of the generation running now
        self._closed = False  # `close`: the thread stops after its current rollout
        self._taken: dict[str, float] = {}
        self._step_start = self._train_start = 0.0

    def version_of(self, step: int) -> int:
        """The policy version rollout `step` is generated with."""
        return max(self._base, step - self.max_staleness)

    # ------------------------------------------------------------------ the step
    def take(self, step: int):
        """The step's Rollouts: its rollout from the queue (waiting for the thread if it is not
        done yet); the thread starts on the first take."""
        t0 = self._step_start = time.perf_counter()
        if self._thread is None:
            self._start(step)
        with self._cv:
            self._cv.wait_for(lambda: step in self.queue or self._error is not None or self._closed)
            if step not in self.queue:  # the thread failed before it: raised in this step's rollout stage
                error, self._error = self._error, None
                raise error or RuntimeError(f"rollout.mode=async: step {step}'s rollout asked of a closed producer")
            buffered, ready = self.queue.pop(step), len(self.queue)
            dropped, self._dropped = self._dropped, 0
        waited = time.perf_counter() - t0
        rollouts = self._share(buffered.records, waited, buffered.seconds)
        self._taken = {"rollout_stale_dropped": float(dropped), "rollout_wait_s": waited,
                       "rollout_generate_s": buffered.seconds, "rollout_queue": float(ready)}
        self._train_start = time.perf_counter()
        return rollouts

    def settle(self) -> dict[str, float]:
        """Nothing to wait for (the thread goes on); the step's metrics: `rollout_overlap` is the
        fraction of the thread's generation during the step that ran while it trained."""
        now = time.perf_counter()
        with self._cv:
            busy = list(self._busy) + ([(self._busy_since, now)] if self._busy_since is not None else [])
            self._busy = []
        during = sum(max(0.0, min(b, now) - max(a, self._step_start)) for a, b in busy)
        hidden = sum(max(0.0, min(b, now) - max(a, self._train_start)) for a, b in busy)
        return {**self._taken, **({"rollout_overlap": hidden / during} if during > 0 else {})}

    def sync(self, engine, model) -> dict[str, float]:
        """Publish the step's update (version v + 1) into the stage once the thread no longer
        needs version v there; the seconds waited for that are `rollout_publish_wait_s`."""
        t0 = time.perf_counter()
        with self._cv:
            v = self._staged
            self._cv.wait_for(lambda: self._loaded >= v or v + self.max_staleness >= self.max_steps
                              or self._error is not None or self._thread is None or self._closed)
        waited = time.perf_counter() - t0
        sync_weights(self.stage, model)  # the full tensors gathered bucket by bucket, copied into the stage
        with self._cv:
            self._staged = v + 1
            self._cv.notify_all()
        return {"rollout_publish_wait_s": waited}

    # --------------------------------------------------------------- the thread
    def _start(self, step: int) -> None:
        self._next = max(self._next, step)
        main = torch.cuda.current_stream(self._stream.device) if self._stream is not None else None
        self._thread = threading.Thread(target=self._loop, args=(main,), name="rollout", daemon=True)
        self._thread.start()
        # a run left before its last step: no thread inside a torch op at exit (a weak reference: a
        # producer whose thread has ended is not kept alive for it)
        atexit.register(_close, weakref.ref(self))

    def close(self) -> None:
        """Stop the thread after the rollout it is generating (the queue stays as it is)."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()

    def _loop(self, main) -> None:
        try:
            if self._stream is not None:
                torch.cuda.set_device(self._stream.device)  # the current device is per thread
                self._stream.wait_stream(main)
            while self._next < self.max_steps:
                with self._cv:  # the rollout's version published (`sync`), or the producer closed
                    self._cv.wait_for(lambda: self._staged >= self.version_of(self._next) or self._closed)
                    if self._closed:
                        return
                self._run(self._next)
        except BaseException as e:  # noqa: BLE001 - re-raised by the take that waits for this rollout
            with self._cv:
                self._error = e
                self._cv.notify_all()

    def _run(self, step: int) -> None:
        """Generate rollout `step` with its version (`version_of`, in the stage), loading it first."""
        version = self.version_of(step)
        t0 = time.perf_counter()
        with self._cv:
            load = self._loaded < version
            self._busy_since = t0
        with torch.cuda.stream(self._stream) if self._stream is not None else _nothing():
            if load:
                self.engine.load_weights(self.stage.items())
                with self._cv:
                    self._loaded = version
                    self._cv.notify_all()
            records = self._generate(step, version)
        if self._stream is not None:
            self._stream.synchronize()  # the records are complete before the main thread reads them
        t1 = time.perf_counter()
        with self._cv:
            self.queue[step] = Buffered(step, version, records, seconds=t1 - t0)
            self._busy.append((t0, t1))
            self._busy_since = None
            self._next = step + 1
            self._cv.notify_all()

    def _drain(self, until: int) -> None:
        """Wait until every rollout before `until` is generated (or the thread failed)."""
        with self._cv:
            self._cv.wait_for(lambda: self._next >= until or self._error is not None or self._thread is None
                              or self._closed)

    # ------------------------------------------------------------- checkpoint
    def state_dict(self) -> dict[str, Any]:
        """The queue: every rollout generated and not yet trained. Taken after the step's sync, it
        first waits for the rollouts that need a version older than the one just published (they
        could not be generated again after a resume), so the resumed run gets every rollout with
        the version the uninterrupted one gave it."""
        taken = min(self.queue) if self.queue else self._next
        if self._thread is not None:
            self._drain(min(self._staged + self.max_staleness, self.max_steps))
        with self._cv:
            rollouts = [self.queue[j] for j in sorted(self.queue)]
        log.debug("async checkpoint: %d rollouts buffered from step %d", len(rollouts), taken)
        return pack_rollouts(rollouts, self.rank)

    def load_state_dict(self, state: dict[str, Any] | None, step: int) -> None:
        """Put back a loaded `state_dict` before the first take: the engine holds version `step`
        (the checkpoint's policy), the rollouts older than `max_staleness` are dropped (their
        steps generated again, with version `step`) and counted in the next take."""
        if self._thread is not None:
            raise RuntimeError("AsyncProducer.load_state_dict after the rollout thread started")
        rollouts = unpack_rollouts(state, self.rank, step)
        kept = [b for b in rollouts if b.step - b.version <= self.max_staleness]
        # a rollout is kept only if every one before it is (the thread generates in step order)
        kept = [b for i, b in enumerate(kept) if b.step == step + i]
        self._dropped = self.samples_per_step * (len(rollouts) - len(kept))
        if self._dropped:
            log.info("rollout.max_staleness=%d: %d of the checkpoint's buffered rollouts dropped, their prompts "
                     "generated again", self.max_staleness, len(rollouts) - len(kept))
        self.queue = {b.step: b for b in kept}
        self._base = self._staged = self._loaded = step
        self._next = step + len(kept)


def _close(ref) -> None:
    if (producer := ref()) is not None:
        producer.close()


@contextlib.contextmanager
def _nothing():
    yield


def pack_rollouts(rollouts: list[Buffered], rank: int) -> dict[str, Any]:
    """Buffered rollouts as checkpoint state (the same keys with none: `dcp.load` fills a
    placeholder in place): the first one's step (-1 for none: the prompt cursor is the
    checkpoint's step) and version, their seconds, and this rank's records
    (`records.rank<r>`, torch.save bytes of every rollout's step, version, seconds and fields)."""
    blob = b""
    if rollouts:
        out = io.BytesIO()
        torch.save([{"step": b.step, "version": b.version, "seconds": b.seconds,
                     "records": [dict(rec.items()) for rec in b.records]} for b in rollouts], out)
        blob = out.getvalue()
    first = rollouts[0] if rollouts else None
    return {"buffered_step": first.step if first else -1, "version": first.version if first else -1,
            "seconds": sum(b.seconds for b in rollouts), "records": {f"rank{rank}": blob}}


def unpack_rollouts(state: dict[str, Any] | None, rank: int, step: int) -> list[Buffered]:
    """`pack_rollouts`'s rollouts back (none for None or no records), the first checked to be
    `step`'s (the checkpoint's steps done)."""
    blob = (state or {}).get("records", {}).get(f"rank{rank}", b"")
    if not state or int(state["buffered_step"]) < 0 or not blob:
        return []
    if int(state["buffered_step"]) != step:
        raise ValueError(f"checkpoint: the buffered rollout is step {state['buffered_step']}'s, the checkpoint "
                         f"has {step} steps done (expected step {step}'s)")
    return [Buffered(int(b["step"]), int(b["version"]), [Experience(**fields) for fields in b["records"]],
                     seconds=float(b["seconds"])) for b in torch.load(io.BytesIO(blob), weights_only=True)]


def make_producer(cfg, dims, engine, *, sample: Callable[[int], Any],
                  generate: Callable[[int, int], list[Experience]], share: Callable[..., Any]):
    """The producer `rollout.mode` names (the mode's config checks are `validate`'s; what only
    the built engine tells is checked here)."""
    r = cfg.rollout
    mode = RolloutMode(r.mode)
    if mode is RolloutMode.SYNC:
        return SyncProducer(sample)
    if not engine.needs_sync:
        raise ValueError(f"rollout.mode={mode.value} needs the rollout engine's own copy of the weights, but "
                         f"rollout.replica={_replica_label(engine)} generates with the training policy's shards "
                         "(every forward a collective, the weights changing while they train): set "
                         "rollout.replica=keep (or a rollout.memory_budget_gb the copy fits in)")
    kwargs = dict(max_steps=cfg.trainer.max_steps, max_staleness=r.max_staleness, rank=dims.rank, device=dims.device,
                  samples_per_step=cfg.task.prompts_per_step * cfg.task.samples_per_prompt)
    if mode is RolloutMode.ASYNC:
        return AsyncProducer(generate, share, engine, **kwargs)
    return OneStepOffProducer(generate, share, **kwargs)


def _replica_label(engine) -> str:
    """`rollout.replica` as the start-up memory plan resolved it (rl/rollout/replica.py)."""
    replica = getattr(engine, "replica", None)
    return f"{replica.setting} -> {replica.mode}" if replica is not None else "sharded"
