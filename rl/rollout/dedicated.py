"""Dedicated rollout ranks (`parallel.rollout_ranks=R`, docs/rollouts.md): of the job's ranks the
first `dims.world_size` train and the last R only generate. The pieces, trainer side and generator
side of each collective:

    WeightPush          the trainers' "engine": `sync_weights(push, model)` gathers the full tensors
                        bucket by bucket over the trainers (rl/rollout/sync.py, as a colocated sync)
                        and trainer 0 broadcasts each distinct one over `dims.push_group`; LoRA: the
                        first push (version 0) the full model, every later one the adapters only
    received_weights    a generator's side of a push: `(name, tensor)` in the same order, received
                        into fresh buffers (names, shapes and dtypes from the model built on meta,
                        with the policy's adapters under LoRA)
    RemoteRollouts      the trainers' scheduler: the rollout stage is the metadata gather alone (the
                        records come from the generators in the exchange, rl/trainer/trainer.py),
                        and with dynamic sampling each extra round's gather, decided from the gathered
                        metadata as the generators decide it (rl/rollout/scheduler.py `sample_rounds`);
                        `sync` is the push, then the generators' figures
    share_episodes      what trainer 0 logs of the step (rl/rollout/samples.py), as colocated rank 0
                        logs it: the tool / environment counts summed over the generators (the colocated
                        ranks' sum) and generator 0's rows (its first trainer.log_samples records, the
                        ones colocated rank 0 generates), gathered to trainer 0 over the push group
    share_destinations  the ranks each sample goes to: the trainers plan (DP ranks: each is its cp
                        trainers, `trainer_ranks`: every CP peer receives the sample from the generator,
                        as colocated CP ranks do), trainer 0 sends the plan's destinations to the
                        generators (they take part in the exchange as senders)
    Generator           a generator's step: its `RolloutScheduler` (the thread as colocated; its
                        `sync` receives the push, at max_staleness >= 1 into a stage the thread loads
                        between rollouts), the metadata gather, the exchange, the push, the figures;
                        its part of a checkpoint (`state_dict`: the queued rollouts) and its resume

A generator's engine is the one rollout.engine names (rl/trainer/build.py `build_generator`): the
project's over a compute copy, or vLLM's, an engine of the generator's own (rl/rollout/build.py
`vllm_engine(alone=True)`: vLLM's one-rank layout, its engine core a process of its own, on cuda
seeing only the generator's GPU; an MoE's routes recorded and LoRA's adapters taken as adapter
versions, as colocated). Either takes a push through its own `load_weights`, as a colocated sync;
at k >= 1 the push fills the stage and the rollout thread loads it before the first rollout that
needs it, so loading and generating run one after the other on that thread: no request is in
flight while weights load. This is where vLLM runs at k >= 1 (colocated, rl/config/checks.py refuses it).

Every rank runs the per-step collectives in one order: gather (world) -> [dynamic sampling: one
gather (world) per extra round, as many on every rank: whether a round follows is read from the
rounds gathered so far] -> [episodes (push group): with a multi-turn task or trainer.log_samples > 0]
-> destinations (push group) ->
exchange (world) -> push (push group) -> figures (push group) -> [checkpoint (world)] -> stop signal
(world, train.py), and on resume: the checkpoint's choice and load (world) -> push (push group, the
checkpoint's policy: the end of `Trainer.load_state_dict`, the start of `Generator.load_state_dict`)
-> the load's agreement (world). A step's held-out evaluation (eval.every, before the gather; train.py's
after the last step, once the generators are done) runs on the trainers alone, with the policy itself
(rl/rollout/build.py `evaluation_engine`): its collectives (the FSDP gathers, the decoding lockstep,
the DP sum) are over the trainers' groups, none over the world or the push group, so the generators
keep generating meanwhile and wait for it in the gather; nothing of it touches their rollouts (greedy:
no random numbers). A generator's rollout thread runs no collective. Rollout j uses
exactly version max(base, j - k) of the weights (base: 0, or the resumed checkpoint's steps), a
broadcast copies bits, and generator g rolls out the prompts a colocated DP rank g of R would (each of
its CP peers alike): with the colocated run's trainers (dp = R, any cp: T = R x cp) the records are
that run's (tests/test_dedicated.py). The trainers run FSDP2/CP/EP over their mesh as colocated ranks
do; each sample reaches every CP peer of its DP rank in the one exchange (`trainer_ranks`). An MoE's
records carry the routes the generator's engine recorded (`routed_experts`, as a colocated engine's)
to the trainers, which replay them; the push sends the experts gathered over EP as a colocated sync
does. Dynamic sampling (`algo.dynamic_sampling`, k = 0 as colocated): a generator generates round r
of step j from its slice of round r's prompts with the policy the step starts from (`more`), as
colocated rank g does, so every round's records and the samples kept are the colocated run's.

Checkpoints (rl/trainer/checkpoint.py): one DCP save over every rank; a generator's part is its
scheduler's queue (`RolloutScheduler.state_dict`, taken once the rollouts that need a version older
than the checkpoint's are generated) and its RNG state, in its own file, which the metadata names, so
the checkpoint is published only with every generator's part. A run killed anywhere (a generator or a
trainer) resumes on the uninterrupted run's records (tests/test_dedicated_resume.py).
"""

from __future__ import annotations

import time
import weakref
from typing import Iterator

import torch
import torch.distributed as dist

from runtime.exchange import exchange
from rl.rollout.samples import turn_counts
from rl.rollout.scheduler import RolloutScheduler, Rollouts, sample_rounds, share_records
from rl.rollout.sync import sync_weights

# what each generator reports after a push (the largest over the generators reaches trainer 0)
FIGURES = ("generator_generate_s", "generator_wait_s")


class WeightPush:
    """The trainers' side of the weight push, an engine to `sync_weights` (rl/rollout/sync.py):
    every trainer gathers the buckets, trainer 0 broadcasts each distinct tensor (a tied one once)
    over the push group; `loaded_bytes` is what one push sends. The generators hold the base once
    the first push (version 0) is in (`holds_base`): a LoRA policy's later pushes send the adapters
    only, as a colocated sync (a generator's `receive`, rl/trainer/build.py, expects the same)."""

    needs_sync = True
    replica = None

    def __init__(self, dims, sync_bucket_bytes: int | None) -> None:
        self.dims, self.sync_bucket_bytes = dims, sync_bucket_bytes
        self.on_progress = None
        self.loaded_bytes = 0
        self.holds_base = False

    def sleep(self) -> None:
        """Nothing held to free: the trainers have no engine."""

    @torch.no_grad()
    def load_weights(self, weights) -> None:
        # a tied weight is one tensor under several names, wherever they fall in the stream: sent at its first
        # name, as `received_weights` groups them (`tensor_order`); held weakly (a bucket goes before the next)
        sent, seen = 0, weakref.WeakValueDictionary()
        for _, tensor in weights.items() if isinstance(weights, dict) else weights:
            if seen.get(id(tensor)) is tensor:
                continue
            seen[id(tensor)] = tensor
            if self.dims.rank == 0:
                dist.broadcast(tensor.contiguous(), src=0, group=self.dims.push_group)
            sent += tensor.numel() * tensor.element_size()
        self.loaded_bytes, self.holds_base = sent, True


@torch.no_grad()
def received_weights(order: list[tuple[list[str], tuple[int, ...], torch.dtype]], dims,
                     device: torch.device) -> Iterator[tuple[str, torch.Tensor]]:
    """A generator's side of one push: `(name, tensor)` for every state-dict entry in `order` (the
    policy's `tensor_order`, rl/rollout/sync.py: its names, shapes and master dtypes), each distinct
    tensor received once from trainer 0 over the push group, in the order the trainers' buckets send them."""
    for names, shape, dtype in order:
        buf = torch.empty(shape, dtype=dtype, device=device)
        dist.broadcast(buf, src=0, group=dims.push_group)
        for name in names:
            yield name, buf


def share_episodes(rollouts: Rollouts, task, log_samples: int, dims) -> Rollouts:
    """The step's tool / environment counts and logged rows (rl/rollout/samples.py) moved to trainer 0,
    in place on `rollouts`: each generator sends its counts (`turn_counts` over its records) and generator 0
    its rows (`sample_rows` of its first `log_samples` records, with their places: colocated rank 0's rows),
    gathered over the push group. Trainer 0 keeps the counts' sum over the generators (the colocated DP
    ranks' sum) and generator 0's rows; the other trainers zero counts under the same keys (the trainers'
    metrics sum them over the DP ranks). A single-turn task with nothing logged: no counts, no collective."""
    keys = turn_counts([], task)  # the same keys on every rank; none for a single-turn task
    if not keys and not log_samples:
        return rollouts
    if dims.rank not in (0, *range(dims.world_size, dims.ranks)):
        rollouts.counts = keys
        return rollouts
    got = [None] * (dims.rollout_ranks + 1) if dims.rank == 0 else None
    dist.gather_object((rollouts.counts, rollouts.rows), got, dst=0, group=dims.push_group)
    if dims.rank == 0:  # got[0]: trainer 0's own (nothing), got[1 + g]: generator g's
        rollouts.counts = {k: sum(counts[k] for counts, _ in got[1:]) for k in keys}
        rollouts.rows = got[1][1]
    return rollouts


def share_destinations(destinations: list[list[int]] | None, samples: int, dims) -> list[list[int]]:
    """The trainer ranks each of the step's `samples` goes to (`destinations`, on every trainer: the
    plan's, `trainer_ranks`) sent by trainer 0 to the generators over the push group, as a
    [samples, trainers] mask. Other trainers return theirs untouched."""
    if dims.rank not in (0, *range(dims.world_size, dims.ranks)):
        return destinations
    mask = torch.zeros(samples, dims.world_size, dtype=torch.uint8, device=dims.device)
    if dims.rank == 0:
        for j, ranks in enumerate(destinations):
            mask[j, ranks] = 1
    dist.broadcast(mask, src=0, group=dims.push_group)
    if dims.rank == 0:
        return destinations
    return [torch.nonzero(row).flatten().tolist() for row in mask.cpu()]


def trainer_ranks(destinations: list[list[int]], cp: int) -> list[list[int]]:
    """The plan's DP ranks per sample as trainer ranks: DP rank d's cp trainers d * cp .. d * cp + cp - 1
    (the mesh's rank = dp_rank * cp + cp_rank), so every CP peer receives the sample straight from its
    generator, as each colocated CP rank receives it from its CP coordinate's sender (runtime/exchange.py):
    one collective, no second hop over the CP group."""
    return [[d * cp + c for d in ranks for c in range(cp)] for ranks in destinations]


def exchange_records(rollouts: Rollouts, destinations: list[list[int]] | None, dims) -> list:
    """The step's exchange over the records ranks (`dims.records_*`), to the trainers' plan `destinations`
    (DP ranks; a generator passes None: it gets them from trainer 0 as trainer ranks, `share_destinations`);
    this rank's records."""
    if dims.rollout_ranks:
        if destinations is not None:
            destinations = trainer_ranks(destinations, dims.cp)
        destinations = share_destinations(destinations, len(rollouts.samples), dims)
    return exchange(rollouts.records, rollouts.samples, destinations, dp_rank=dims.records_rank,
                    dp=dims.records_ranks, group=dims.records_group, device=dims.device)


def generator_figures(values: list[float], dims) -> dict[str, float]:
    """Each generator's `FIGURES` (trainer 0: zeros), their maxima on trainer 0 (push group MAX)."""
    t = torch.tensor(values, dtype=torch.float64, device=dims.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=dims.push_group)
    return dict(zip(FIGURES, t.tolist()))


class RemoteRollouts:
    """The trainers' `RolloutScheduler`: the rollout stage (`rollouts`) is the metadata gather alone
    (a trainer holds no records: they come in the exchange), and with dynamic sampling each extra
    round's gather, which the generators' schedulers decide from the same gathered metadata
    (`sample_rounds`), then the step's counts and logged rows (`share_episodes`); its seconds the
    trainers' wait for the generators; `sync` pushes the update and returns (trainer 0) the generators' figures."""

    k = 0  # nothing generated on this rank (the stage's seconds are the wait)
    source = None

    def __init__(self, push: WeightPush, dims, cfg, task) -> None:
        self.push, self.dims, self.cfg, self.task = push, dims, cfg, task

    def rollouts(self, step: int, *, log_samples: int = 0) -> Rollouts:
        t0 = time.perf_counter()
        samples, _ = share_records([], 0, self.dims)
        samples, sampling = sample_rounds(samples, {}, lambda round_: [], self.cfg.algo,
                                          self.cfg.task.prompts_per_step, self.dims)
        rollouts = share_episodes(Rollouts(samples, {}, sampling, 0.0), self.task, self.cfg.trainer.log_samples,
                                  self.dims)
        rollouts.seconds = time.perf_counter() - t0
        return rollouts

    def sync(self, model) -> dict[str, float]:
        """The push (the trainer's `weight_sync_s` times it), then on trainer 0 the generators' figures."""
        sync_weights(self.push, model)
        return generator_figures([0.0] * len(FIGURES), self.dims) if self.dims.rank == 0 else {}

    def state_dict(self) -> dict:
        """Nothing: the queued rollouts are the generators' part of a checkpoint (`Generator.state_dict`)."""
        return {}

    def load_state_dict(self, state, step: int) -> None:
        """Nothing to put back (the trainer's load then pushes the checkpoint's policy: `Generator.load_state_dict`)."""


class Generator:
    """A generator rank's steps (train.py runs `step` for each, then the stop signal): see the
    module docstring. `scheduler` is a `RolloutScheduler` over this rank's engine and its slice of
    the prompts, whose `sync` receives the push (`received_weights`)."""

    def __init__(self, scheduler: RolloutScheduler, dims) -> None:
        self.scheduler, self.dims = scheduler, dims

    def step(self, step: int) -> None:
        dims, source = self.dims, self.scheduler.source
        n = source.cfg.trainer.log_samples  # generator 0 logs its first n records, as colocated rank 0
        # take, the metadata gather (k = 0: the engine sleeps after), the counts and rows to trainer 0
        rollouts = self.scheduler.rollouts(step, log_samples=n if dims.rank == dims.world_size else 0)
        share_episodes(rollouts, source.task, n, dims)
        exchange_records(rollouts, None, dims)  # the plan's destinations from trainer 0, the records sent
        t0 = time.perf_counter()
        self.scheduler.sync(None)  # the step's update, received (k >= 1: into the stage)
        # waited for weights: k = 0 the push itself (the trainers train meanwhile), k >= 1 the thread's idle time
        waited = self.scheduler.thread_wait_s if self.scheduler.k else time.perf_counter() - t0
        generator_figures([rollouts.seconds if rollouts.generated_s is None else rollouts.generated_s, waited], dims)

    def state_dict(self) -> dict:
        """The generator's part of a checkpoint (rl/trainer/checkpoint.py, beside the trainers'): its
        scheduler's queued rollouts (max_staleness >= 1), `rollout` as a colocated rank saves it."""
        produced = self.scheduler.state_dict()
        return {"rollout": produced} if produced else {}

    def load_state_dict(self, state: dict) -> None:
        """The checkpoint's policy received into the engine (the trainers push it at the end of their
        load, `Trainer.load_state_dict`), then the queued rollouts put back before the first take."""
        self.scheduler.write(self.scheduler.engine, None)
        self.scheduler.load_state_dict(state.get("rollout"), int(state.get("step", 0)))

    def close(self) -> None:
        """The rollout thread stopped, then the engine (vLLM's: its engine-core process)."""
        self.scheduler.close()
        if hasattr(self.scheduler.engine, "close"):
            self.scheduler.engine.close()
