"""Where a step's rollout comes from: `rollout.mode` (the trainer's `rollout` stage asks its producer).

    producer = make_producer(cfg, dims, engine, sample=..., generate=..., share=...)
    rollouts = producer.take(step)     # the step's Rollouts (rl/trainer/trainer.py)
    ... plan, collate, score, advantages, train ...
    metrics |= producer.settle()       # before the weight sync: the engine is idle from here on
    sync_weights(engine, policy)

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

Policy version: the number of steps whose update the weights hold (the engine holds version k
during step k, until the sync after it). Every sample of a rollout has the version its rollout
was generated with; a rollout whose version is more than `rollout.max_staleness` behind the
step that takes it is dropped whole (its sample count reported as `rollout_stale_dropped`) and
the step's prompts generated again in the foreground: the prompts of a step are a function of
(seed, step) (rl/trainer/trainer.py), so a drop never skips or repeats a prompt. With
one_step_off and max_staleness >= 1 (what `validate` allows) a drop only happens after a
resume that changed the setting.

What runs in the thread: `generate(step)` only (the engine's `generate` and the rewards, on
this rank's prompts: no collective); the all-gather of the samples' metadata (`share`) runs
on the main thread in `take`, so the collectives of every rank keep one order. On CUDA the
thread issues its kernels on its own stream, which first waits for the main stream (the last
weight sync) and is synchronized before the records are handed over, so generation kernels
run beside the training kernels on the device. On CPU the two threads' ops run at the same
time (torch releases the GIL inside ops) but share the cores: the measured overlap is of
wall-clock intervals, not of free compute.

Checkpoint (`state_dict`, saved by rl/trainer/checkpoint.py): the buffered rollout, i.e. the
samples generated and not yet trained: `buffered_step` (the prompt cursor: the step whose
prompts it holds, -1 for none; the next rollout generated is that step + 1), `version`, the
seconds its generation took, and this rank's records (`records.rank<r>`, torch.save bytes). A resumed run trains on exactly
those samples, so at one process it continues with the uninterrupted run's metrics.

Metrics (one_step_off only; sync's metrics are unchanged): `rollout_staleness_mean` /
`rollout_staleness_max` over the step's samples, `rollout_stale_dropped`, and for the
background generation started during the step (absent on the last step) `rollout_generate_s`,
`rollout_overlap` (the fraction of it that ran while the step's collate..train stages ran)
and `rollout_wait_s` (how long `settle` waited for it: the generation not hidden).
"""

from __future__ import annotations

import io
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

from packing.experience import Experience
from rl.choice import Choice

log = logging.getLogger(__name__)


class RolloutMode(Choice):
    """`rollout.mode`: when a step's rollout is generated, and with which policy version."""

    SYNC = "sync"  # at the step's start, with the policy the step starts from
    ONE_STEP_OFF = "one_step_off"  # during the previous step's training, with the policy one update older
    # several steps ahead, continuously: not implemented (validate refuses it). With the one colocated
    # engine the weight sync needs the engine idle, so a deeper queue gives one_step_off's steady-state
    # step with more staleness; what async buys (continuous batching across steps) needs rollout ranks
    ASYNC = "async"


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

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any] | None, step: int) -> None:
        pass


class OneStepOffProducer:
    """`rollout.mode=one_step_off` (see the module docstring).

    `generate(step) -> [Experience]`: this rank's records of the step's prompts (thread-safe:
    no collective); `share(records, seconds, generated_s) -> Rollouts`: every rank's samples
    as metadata (a collective, main thread only), with the seconds the step waited for them
    and the seconds their generation took."""

    generates_during_training = True  # step+1 is generated on the engine while the step trains: no sleep

    def __init__(self, generate: Callable[[int], list[Experience]], share: Callable[..., Any],
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
            buffered = Buffered(step, step, self._generate(step))
            buffered.seconds = time.perf_counter() - g0
        rollouts = self._share(buffered.records, time.perf_counter() - t0, buffered.seconds)
        staleness = float(step - buffered.version)
        self._taken = {"rollout_staleness_mean": staleness, "rollout_staleness_max": staleness,
                       "rollout_stale_dropped": float(dropped)}
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
                records = self._generate(step)
            else:
                torch.cuda.set_device(self._stream.device)  # the current device is per thread
                self._stream.wait_stream(main)  # the weights of the last sync are written
                with torch.cuda.stream(self._stream):
                    records = self._generate(step)
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
        b = self.buffer
        blob = b""
        if b is not None:
            out = io.BytesIO()
            torch.save([dict(rec.items()) for rec in b.records], out)
            blob = out.getvalue()
        return {"buffered_step": b.step if b is not None else -1, "version": b.version if b is not None else -1,
                "seconds": b.seconds if b is not None else 0.0, "records": {f"rank{self.rank}": blob}}

    def load_state_dict(self, state: dict[str, Any] | None, step: int) -> None:
        """Put back a loaded `state_dict` (None or no records: nothing buffered, `step`'s
        rollout is generated when it is taken)."""
        self._join()
        self.buffer = None
        blob = (state or {}).get("records", {}).get(f"rank{self.rank}", b"")
        if not state or int(state["buffered_step"]) < 0 or not blob:
            return
        if int(state["buffered_step"]) != step:
            raise ValueError(f"checkpoint: the buffered rollout is step {state['buffered_step']}'s, the checkpoint "
                             f"has {step} steps done (expected step {step}'s)")
        records = [Experience(**fields) for fields in torch.load(io.BytesIO(blob), weights_only=True)]
        self.buffer = Buffered(step, int(state["version"]), records, seconds=float(state.get("seconds", 0.0)))


def make_producer(cfg, dims, engine, *, sample: Callable[[int], Any], generate: Callable[[int], list[Experience]],
                  share: Callable[..., Any]):
    """The producer `rollout.mode` names (the mode's config checks are `validate`'s; what only
    the built engine tells is checked here)."""
    r = cfg.rollout
    mode = RolloutMode(r.mode)
    if mode is RolloutMode.SYNC:
        return SyncProducer(sample)
    if mode is not RolloutMode.ONE_STEP_OFF:
        raise ValueError(f"rollout.mode={mode.value}: not implemented (expected sync or one_step_off)")
    if not engine.needs_sync:
        raise ValueError("rollout.mode=one_step_off needs the rollout engine's own copy of the weights, but "
                         f"rollout.replica={_replica_label(engine)} generates with the training policy's shards "
                         "(every forward a collective, the weights changing while they train): set "
                         "rollout.replica=keep (or a rollout.memory_budget_gb the copy fits in)")
    return OneStepOffProducer(generate, share, max_steps=cfg.trainer.max_steps, max_staleness=r.max_staleness,
                              samples_per_step=cfg.task.prompts_per_step * cfg.task.samples_per_prompt,
                              rank=dims.rank, device=dims.device)


def _replica_label(engine) -> str:
    """`rollout.replica` as the start-up memory plan resolved it (rl/rollout/replica.py)."""
    replica = getattr(engine, "replica", None)
    return f"{replica.setting} -> {replica.mode}" if replica is not None else "sharded"
