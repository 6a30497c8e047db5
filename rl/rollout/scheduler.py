"""When a step's rollout is generated, and with which policy version: one scheduler, one number,
`rollout.max_staleness` k (docs/rollouts.md).

    scheduler = RolloutScheduler(source, engine, max_staleness=k, ...)
    rollouts = scheduler.rollouts(step) # the step's rollout stage, one call: the three below, the metadata gathered
      taken = scheduler.take(step)      #   the step's Buffered rollout: this rank's records, their version
      records = scheduler.more(step, r) #   k = 0: dynamic sampling's round r, generated now
      scheduler.rest()                  #   the rollout stage is over (k = 0: the engine sleeps)
    ... plan, collate, score, advantages, train (rl/trainer/trainer.py) ...
    metrics |= scheduler.sync(model)    # the step's update, into the engine or (k >= 2) its stage

k = 0   `take` generates the step's rollout now (`source.records`), with the policy the step
        starts from (and `more` any extra round of dynamic sampling); the engine sleeps from `rest`
        to the sync; nothing runs between steps.
k >= 1  a rollout thread generates rollout after rollout, rollout j with policy version
        max(base, j - k) (base: 0, or the resumed step), into a queue `take` pops from; it starts
        rollout j once step j - k has been taken, so it runs at most k rollouts ahead. At k = 1
        rollout j + 1 is generated while step j trains, with the policy before step j's update,
        and `sync` waits until the thread is idle (no rollout left that needs version j) and
        writes the update straight into the engine. At k >= 2 the thread must go on generating
        (with older versions) while the trainer syncs, so `sync` writes a staged host copy
        (rl/rollout/sync.py `StagedWeights`, one full copy of the model), which the thread loads
        into the engine before the first rollout that needs it; the stage holds one version, so
        `sync` after step v first waits until the engine holds version v.
Either way every rollout gets exactly its version: the samples are a function of (seed, step,
max_staleness), whatever the timing.

Policy version: the number of steps whose update the weights hold. Every sample records it
(`Experience.policy_version`, stamped by the source); a rollout more than k versions behind the
step that takes it (only after a resume that lowered k) is dropped whole, counted as
`rollout_stale_dropped`, and its step generated again with the resumed policy: a step's prompts
are a function of (seed, step), so nothing is skipped or repeated.

The thread runs `source.records` only (generation and rewards on this rank's prompts: no
collective; `rollouts` gathers the metadata on the main thread, so every rank's collectives keep
one order). On CUDA it issues its kernels on its own stream, which waits for the main stream (the
last weight sync) and is synchronized before the records are handed over.

Checkpoint (`state_dict`): the queued rollouts, generated and not yet trained (`pack_rollouts`),
after waiting for those that need a version older than the checkpoint's (a resumed run could not
generate them again): a run killed with a rollout in flight resumes on exactly the uninterrupted
run's samples.
"""

from __future__ import annotations

import atexit
import contextlib
import io
import logging
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Hashable

import torch

from packing.experience import Experience
from runtime.exchange import StandIn, gather_metadata
from rl.choice import Choice
from rl.rollout.samples import sample_rows, turn_counts
from rl.rollout.source import RolloutSource
from rl.rollout.sync import StagedWeights, sync_weights
from rl.tasks.reward import filter_uniform_groups

log = logging.getLogger(__name__)


class RolloutMode(Choice):
    """`rollout.mode`, an alias of `rollout.max_staleness` (`rl.config.max_staleness`)."""

    SYNC = "sync"  # max_staleness=0
    ONE_STEP_OFF = "one_step_off"  # max_staleness=1
    ASYNC = "async"  # the given max_staleness (>= 1; 1 when not given)


@dataclass
class Buffered:
    """A rollout generated and not yet trained: this rank's records of `step`'s prompts, all of
    policy version `version`, the seconds their generation took and (once taken) the seconds
    `take` waited for them."""

    step: int
    version: int
    records: list[Experience]
    seconds: float = 0.0
    waited: float = 0.0


@dataclass
class Rollouts:
    """The step's samples as `RolloutScheduler.rollouts` leaves them: every rank's, as `StandIn`s
    (metadata, in global order, the same list on every rank); the records this rank generated, by
    `StandIn.source[1]` (they stay here until the trainer's `collate` moves each to the ranks that
    run it); dynamic sampling's counts; the seconds the rollout stage took; when the samples were
    generated off the step (by the rollout thread: rollout.max_staleness >= 1), the seconds their
    generation took; this rank's tool / environment counts; and the rows of its first records
    logged (`log_samples`)."""

    samples: list[StandIn]
    records: dict[Hashable, Experience]
    sampling: dict[str, int]
    seconds: float
    generated_s: float | None = None  # None: generated within `seconds`
    counts: dict[str, float] = field(default_factory=dict)  # this rank's tool / environment counts (samples.py)
    rows: list[dict] = field(default_factory=list)  # rl/rollout/samples.py `sample_rows`


class RolloutScheduler:
    def __init__(self, source: RolloutSource, engine, *, max_staleness: int, max_steps: int,
                 samples_per_step: int, rank: int, device: torch.device, staged: bool = False,
                 write=sync_weights) -> None:
        """`staged`: a stage at k = 1 too (a dedicated generator receives the next version while it
        generates with the current one); `write(target, model)` writes an update into the engine
        or the stage (`sync_weights`: gathered from the policy; a generator: received)."""
        if max_staleness and not engine.needs_sync:
            replica = f"{engine.replica.setting} -> {engine.replica.mode}" if engine.replica else "sharded"
            raise ValueError(f"rollout.max_staleness={max_staleness} needs the rollout engine's own copy of the "
                             f"weights, but rollout.replica={replica}"
                             " generates with the training policy's shards (every forward a collective, the weights "
                             "changing while they train): set rollout.replica=keep (or a rollout.memory_budget_gb "
                             "the copy fits in)")
        self.source, self.engine, self.k = source, engine, max_staleness
        self.max_steps, self.samples_per_step, self.rank = max_steps, samples_per_step, rank
        self.write = write
        self.stage = (StagedWeights(engine.sync_bucket_bytes, pin=device.type == "cuda")
                      if self.k >= 2 or (staged and self.k) else None)
        self.queue: dict[int, Buffered] = {}  # generated, not yet taken, by step
        self._cv = threading.Condition()
        self._base = 0  # the version the run (or its resume) starts from: no rollout gets an older one
        self._next = 0  # the next rollout the thread generates
        self._taken = -1  # the last step taken: rollout j starts once step j - k is
        self._published = self._loaded = 0  # the newest version synced (into the stage or engine), and in the engine
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._closed = False  # `close`: the thread stops after its current rollout
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" and self.k else None
        self._busy: list[tuple[float, float]] = []  # the thread's generation intervals
        self._busy_since: float | None = None  # the start of the generation running now
        self._idle = 0.0  # seconds the thread waited to start a rollout since the last sync
        self.thread_wait_s = 0.0  # of those, up to the last sync (a dedicated generator reports it)
        self._dropped = 0  # samples of loaded rollouts older than the bound (counted in the next take)
        self._metrics: dict[str, float] = {}
        self._step_start = self._train_start = 0.0

    def version_of(self, step: int) -> int:
        """The policy version rollout `step` is generated with."""
        return max(self._base, step - self.k)

    # ------------------------------------------------------------------ the step
    def rollouts(self, step: int, *, log_samples: int = 0) -> Rollouts:
        """The step's rollout stage: `take`, every rank's samples gathered as metadata (a collective,
        on the main thread). With dynamic sampling (k = 0 only, `sample_rounds`), groups whose rewards
        are all equal are dropped and rounds generated (`more`) until the step holds `task.prompts_per_step`
        groups (at most `algo.max_sampling_rounds`); then `rest`. `log_samples` = N: the rows of this
        rank's first N records (rl/rollout/samples.py)."""
        cfg, dims, task = self.source.cfg, self.source.dims, self.source.task
        t0 = time.perf_counter()
        taken = self.take(step)
        samples, records = share_records(taken.records, 0, dims)
        samples, sampling = sample_rounds(samples, records, lambda round_: self.more(step, round_), cfg.algo,
                                          cfg.task.prompts_per_step, dims)
        # this rank's records of the step (by their places in it): rank 0's come first
        places = [j for j, s in enumerate(samples) if s.source[0] == dims.records_rank]
        mine = [records[samples[j].source[1]] for j in places]
        rows = sample_rows(mine[:log_samples], task, step=step, places=places[:log_samples]) if log_samples else []
        rollouts = Rollouts(samples, records, sampling, time.perf_counter() - t0,
                            taken.seconds if self.k else None, turn_counts(mine, task), rows)
        self.rest()
        return rollouts

    def take(self, step: int) -> Buffered:
        """The step's rollout: generated now (k = 0), or the thread's (started on the first take)."""
        t0 = self._step_start = time.perf_counter()
        if not self.k:
            records = self.source.records(step, 0, step)  # the engine holds version `step`
            seconds = time.perf_counter() - t0
            return Buffered(step, step, records, seconds, waited=seconds)
        if self._thread is None:
            self._start(step)
        with self._cv:
            self._taken = step
            self._cv.notify_all()
            self._cv.wait_for(lambda: step in self.queue or self._error is not None or self._closed)
            if step not in self.queue:  # the thread failed before it: raised in this step's rollout stage
                error, self._error = self._error, None
                raise error or RuntimeError(f"step {step}'s rollout asked of a closed RolloutScheduler")
            taken, ready = self.queue.pop(step), len(self.queue)
            dropped, self._dropped = self._dropped, 0
        self._train_start = time.perf_counter()
        taken.waited = self._train_start - t0
        self._metrics = {"rollout_stale_dropped": float(dropped), "rollout_wait_s": taken.waited,
                         "rollout_generate_s": taken.seconds, "rollout_queue": float(ready)}
        return taken

    def more(self, step: int, round_: int) -> list[Experience]:
        """Dynamic sampling's extra round `round_` of `step`, generated now with the policy the step
        starts from (k = 0 only: rl.config.validate refuses dynamic sampling beside a rollout thread)."""
        if self.k:
            raise RuntimeError(f"RolloutScheduler.more: extra rollout rounds need max_staleness=0, got {self.k}")
        return self.source.records(step, round_, step)

    def rest(self) -> None:
        """The step's rollout is complete. k = 0: nothing generates until the sync, so the engine
        sleeps (its memory free for training; the sync refills it); k >= 1: the thread goes on."""
        if not self.k:
            self.engine.sleep()

    def sync(self, model) -> dict[str, float]:
        """The step's update (version v + 1) into the engine, once no rollout needs version v there
        (k = 1: the thread is idle; k >= 2: into the stage, once the engine holds v); the step's
        metrics, `rollout_publish_wait_s` the seconds waited."""
        if not self.k:
            self.write(self.engine, model)
            return {}
        now = time.perf_counter()
        with self._cv:
            busy = self._busy + ([(self._busy_since, now)] if self._busy_since is not None else [])
            self._busy, self.thread_wait_s, self._idle = [], self._idle, 0.0
            v = self._published
            self._cv.wait_for(lambda: self._done_with(v) or self._error is not None or self._closed)
        waited = time.perf_counter() - now
        self.write(self.stage or self.engine, model)  # the full tensors gathered bucket by bucket
        with self._cv:
            self._published = v + 1
            self._loaded = self._loaded if self.stage else v + 1
            self._cv.notify_all()
        during = sum(max(0.0, min(b, now) - max(a, self._step_start)) for a, b in busy)
        hidden = sum(max(0.0, min(b, now) - max(a, self._train_start)) for a, b in busy)
        return {**self._metrics, "rollout_publish_wait_s": waited,
                **({"rollout_overlap": hidden / during} if during > 0 else {})}

    def _done_with(self, v: int) -> bool:
        """No rollout will read version v from what `sync` writes next (under the lock)."""
        if self._thread is None or self._next >= self.max_steps:
            return True
        if self.stage is not None:  # the rollout that needs v has loaded it, or none does
            return self._loaded >= v or v + self.k >= self.max_steps
        return self.version_of(self._next) > v  # the engine: none in flight, the next needs a newer one

    # --------------------------------------------------------------- the thread
    def _start(self, step: int) -> None:
        self._next = max(self._next, step)
        main = torch.cuda.current_stream(self._stream.device) if self._stream is not None else None
        self._thread = threading.Thread(target=self._loop, args=(main,), name="rollout", daemon=True)
        self._thread.start()
        # a run left before its last step: no thread inside a torch op at exit (a weak reference: a
        # scheduler whose thread has ended is not kept alive for it)
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
            while self._next < self.max_steps:
                with self._cv:  # the rollout's step - k taken and its version published, or closed
                    t0 = time.perf_counter()
                    self._cv.wait_for(lambda: self._closed or (self._next - self.k <= self._taken and
                                                               self._published >= self.version_of(self._next)))
                    self._idle += time.perf_counter() - t0
                    if self._closed:
                        return
                    self._busy_since = time.perf_counter()
                self._run(self._next, main)
        except BaseException as e:  # noqa: BLE001 - re-raised by the take that waits for this rollout
            with self._cv:
                self._error = e
                self._cv.notify_all()

    def _run(self, step: int, main) -> None:
        """Generate rollout `step` with its version, loading it from the stage first (k >= 2)."""
        version, t0 = self.version_of(step), self._busy_since
        with torch.cuda.stream(self._stream) if self._stream is not None else contextlib.nullcontext():
            if self._stream is not None:
                self._stream.wait_stream(main)  # the weights the last sync wrote
            if self.stage is not None and self._loaded < version:
                self.engine.load_weights(self.stage.items())
                with self._cv:
                    self._loaded = version
                    self._cv.notify_all()
            records = self.source.records(step, 0, version)
        if self._stream is not None:
            self._stream.synchronize()  # the records are complete before the main thread reads them
        t1 = time.perf_counter()
        with self._cv:
            self.queue[step] = Buffered(step, version, records, seconds=t1 - t0)
            self._busy.append((t0, t1))
            self._busy_since = None
            self._next = step + 1
            self._cv.notify_all()

    # ------------------------------------------------------------- checkpoint
    def state_dict(self) -> dict[str, Any]:
        """The queue (none with k = 0). Taken after the step's sync, it first waits for the rollouts
        that need a version older than the one just published (they could not be generated again
        after a resume), so the resumed run gets every rollout with the version the uninterrupted
        one gave it."""
        if not self.k:
            return {}
        with self._cv:
            until = min(self._published + self.k, self.max_steps)
            self._cv.wait_for(lambda: self._next >= until or self._error is not None or self._thread is None
                              or self._closed)
            rollouts = [self.queue[j] for j in sorted(self.queue)]
        return pack_rollouts(rollouts, self.rank)

    def load_state_dict(self, state: dict[str, Any] | None, step: int) -> None:
        """Put back a loaded `state_dict` before the first take: the engine holds version `step`
        (the checkpoint's policy); the rollouts older than k are dropped (their steps generated
        again, with version `step`) and counted in the next take."""
        if self._thread is not None:
            raise RuntimeError("RolloutScheduler.load_state_dict after the rollout thread started")
        rollouts = unpack_rollouts(state, self.rank, step) if self.k else []
        kept = [b for b in rollouts if b.step - b.version <= self.k]
        # a rollout is kept only if every one before it is (the thread generates in step order)
        kept = [b for i, b in enumerate(kept) if b.step == step + i]
        self._dropped = self.samples_per_step * (len(rollouts) - len(kept))
        if self._dropped:
            log.info("rollout.max_staleness=%d: %d of the checkpoint's buffered rollouts dropped, their prompts "
                     "generated again", self.k, len(rollouts) - len(kept))
        self.queue = {b.step: b for b in kept}
        self._base = self._published = self._loaded = step
        self._next, self._taken = step + len(kept), step - 1


def sample_rounds(samples: list[StandIn], records: dict[Hashable, Experience], more, algo, want: int,
                  dims) -> tuple[list[StandIn], dict[str, int]]:
    """Dynamic sampling (`algo.dynamic_sampling`; otherwise `samples` as they are, no counts) on the
    step's gathered first round `samples`: the groups whose rewards are all equal are dropped and
    round after round is generated (`more(round_)`: this rank's records of it), gathered
    (`share_records`, its records added to `records`) and filtered alike, until `want` groups are
    kept or `algo.max_sampling_rounds` rounds ran; the step's samples (the first `want` groups kept,
    by prompt index) and the counts. Every decision reads the gathered metadata only, the same list
    on every rank, so every rank joins the same gathers: a dedicated trainer, which generates
    nothing (`more` gives no records), as many as the generators (rl/rollout/dedicated.py)."""
    if not algo.dynamic_sampling:
        return samples, {}
    kept, dropped = filter_uniform_groups(samples)
    rounds = 1
    while len({int(r.prompt_index) for r in kept}) < want and rounds < algo.max_sampling_rounds:
        generated, local = share_records(more(rounds), rounds, dims)
        records |= local
        extra, lost = filter_uniform_groups(generated)
        kept, dropped, rounds = kept + extra, dropped + lost, rounds + 1
    first = set(sorted({int(r.prompt_index) for r in kept})[:want])
    sampling = {"sampling_rounds": rounds, "dropped_groups": len(dropped), "kept_groups": len(first)}
    # every group uniform in every round: train on the first round (advantages 0)
    return [r for r in kept if int(r.prompt_index) in first] or samples, sampling


def share_records(records: list[Experience], round_: int, dims) -> tuple[list[StandIn], dict[Hashable, Experience]]:
    """Every rank: the round's samples, rank by rank, as metadata (CP peers checked alike; a
    collective over the records ranks: the DP ranks, or every rank with dedicated generators,
    `dims.records_*`), and this rank's records by key."""
    samples = gather_metadata(records, round_, dp_rank=dims.records_rank, dp=dims.records_ranks, cp=dims.records_cp,
                              device=dims.device)
    return samples, {(round_, i): rec for i, rec in enumerate(records)}


def _close(ref) -> None:
    if (scheduler := ref()) is not None:
        scheduler.close()


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
