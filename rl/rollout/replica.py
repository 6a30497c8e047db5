"""Where the rollout's weights live: a start-up memory plan (`rollout.replica`).

    keep     the HF engine holds an unsharded copy of the policy (in the compute dtype) and gets
             the new weights after every update (rl/rollout/sync.py, bucket by bucket); the
             copy's storage is released for the training step (`HFRolloutEngine.sleep`: the
             sync rewrites all of it), so it adds to the rollout and the sync, not to training
    sharded  the HF engine generates with the training policy itself (`PolicyRolloutEngine`):
             no copy, no sync; FSDP2 gathers each layer for its forward and frees it after.
             Token-identical to `keep` (same seeds), dense and MoE, with cp and ep (tested
             up to dp2 x cp2 x ep2); generation then computes in `model.param_dtype` if set
    auto     keep if the copy fits beside the training state, else sharded
    (rollout.engine=vllm is an external engine with its own copy: `external`)

Why auto keeps a copy whenever it fits: generation from the shards all-gathers every layer
for every forward (the prompt's and each new token's), so its communication grows with the
answer's length, while a copy costs one gather per update (the sync). Measured side by side
(bench/rank_memory.py --arms default sharded: a 178M Qwen3 in bf16, one step of
task=target_token, 16 new tokens, 2 shared CPU cores at load ~7): the rollout took 7.4 s with
the copy and 37.5 s sharded on 4 ranks (10.1 s and 29.5 s on 2), for a per-rank peak of
1.282 GB against 1.273 GB (1.692 / 1.691 on 2): the copy lives from the sync to the end of
the rollout, and the step's peak is the training, where it is released.

The plan counts, per rank: the copy (every full tensor of the policy, `full_tensor_bytes`),
the training state still to come at start-up (gradients and the two AdamW moments: 3 x
this rank's shard bytes of the policy's trainable parameters, with LoRA its adapters only,
and of a whole policy's for the critic when the algorithm has one), the distillation teacher
(rl/algos/distill.py: this rank's shard bytes, by `algo.teacher.placement`: `sharded` shards are
resident from before the plan, so already out of the budget it measures, and counted as 0 to
come; `offload` shards are on the host when the plan measures and come back onto the device
for each score stage, counted to come when the copy is awake then, i.e. with
`rollout.max_staleness` >= 1 (the rollout thread generates with it through the step; at 0 the
copy sleeps before the score stage and the teacher is back on the host before the sync refills
it)), and the budget: `rollout.memory_budget_gb` when set, else the device's free memory now (cuda:
`torch.cuda.mem_get_info`; cpu: psutil's available memory shared by the ranks of this host)
less a reserve of `RESERVE` of it (activations, the KV cache, the allocator). The copy fits
when copy + state to come <= budget. Every rank takes the same decision: the budget is the
least and the state to come the largest over the ranks (an all-reduce), since generation
from the shards is a collective and ranks that chose differently would hang. The decision
and its figures are logged at start-up (rank 0) and kept as `engine.replica`.

bench/memory_plan.py applies the same rule to the at-scale models.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from torch import nn

from runtime.parallel_dims import local_tensor
from rl.algos.distill import TeacherPlacement
from rl.choice import Choice

GIB = 2**30
RESERVE = 0.10  # of the measured free memory: activations, KV cache, fragmentation


class RolloutEngineName(Choice):
    """`rollout.engine`: what generates the rollouts."""

    HF = "hf"  # HFRolloutEngine: an embedded transformers copy of the policy (rl/rollout/engine.py)
    VLLM = "vllm"  # VLLMRolloutEngine (rl/rollout/vllm_engine.py): needs `make install-vllm`


class ReplicaMode(Choice):
    """`rollout.replica`: where generation gets its weights (rl/rollout/replica.py)."""

    AUTO = "auto"  # keep if the unsharded copy fits (the start-up memory plan), else sharded
    KEEP = "keep"  # an unsharded copy in the HF engine, synced after every update
    SHARDED = "sharded"  # generate with the FSDP2-sharded training policy itself (no copy, no sync)


@dataclass(frozen=True)
class ReplicaChoice:
    """The decision and the figures behind it (bytes per rank)."""

    setting: str  # rollout.replica as configured
    mode: str  # keep | sharded | external
    replica_bytes: int
    state_bytes: int  # training state still to come (gradients, AdamW moments)
    budget_bytes: int
    budget_source: str
    teacher_placement: TeacherPlacement | None = None  # algo.teacher.placement; None without a teacher
    teacher_bytes: int = 0  # this rank's shard bytes of the teacher
    teacher_to_come: int = 0  # of those, what comes onto the device beside the copy (module docstring)

    @property
    def fits(self) -> bool:
        return self.replica_bytes + self.state_bytes + self.teacher_to_come <= self.budget_bytes

    def describe(self) -> str:
        verdict = "fits" if self.fits else "does not fit"
        teacher = ""
        if self.teacher_placement is not None:
            resident = self.teacher_placement is TeacherPlacement.SHARDED
            where = ("resident on the device, out of the budget" if resident else
                     "on the host between steps, on the device for the score stage")
            teacher = (f" + the teacher to come {self.teacher_to_come / GIB:.3f} GiB (algo.teacher.placement="
                       f"{self.teacher_placement}: {self.teacher_bytes / GIB:.3f} GiB of shards, {where})")
        return (f"rollout.replica={self.setting} -> {self.mode}: an unsharded copy needs "
                f"{self.replica_bytes / GIB:.3f} GiB + training state to come {self.state_bytes / GIB:.3f} GiB "
                f"(gradients and AdamW moments of the trainable parameters){teacher} "
                f"per rank against a budget of {self.budget_bytes / GIB:.3f} GiB ({self.budget_source}): {verdict}")


def choose(setting: ReplicaMode | str, *, engine: str, replica_bytes: int, state_bytes: int, budget_bytes: int,
           budget_source: str, sharded_unsupported: str | None = None,
           teacher: tuple[TeacherPlacement | None, int, int] = (None, 0, 0)) -> ReplicaChoice:
    """The plan for `rollout.replica=setting` with `rollout.engine=engine`; a ValueError
    naming the setting and the sizes when it cannot be followed. `sharded_unsupported`:
    why generation from the sharded policy cannot serve this run (None: it can). `teacher`:
    (placement, shard bytes, bytes to come) of a distillation teacher."""
    setting = ReplicaMode(setting)
    plan = ReplicaChoice(setting.value, "", int(replica_bytes), int(state_bytes), int(budget_bytes), budget_source,
                         teacher[0], int(teacher[1]), int(teacher[2]))
    with_teacher = f" + the teacher to come {plan.teacher_to_come / GIB:.3f} GiB" if plan.teacher_to_come else ""
    sizes = (f"it needs {plan.replica_bytes / GIB:.3f} GiB ({plan.replica_bytes} bytes) + the training state to "
             f"come {plan.state_bytes / GIB:.3f} GiB{with_teacher} per rank, over the budget of "
             f"{plan.budget_bytes / GIB:.3f} GiB ({budget_source})")
    if engine != RolloutEngineName.HF:
        if setting is ReplicaMode.SHARDED:
            raise ValueError(f"rollout.replica=sharded: {sharded_unsupported or f'rollout.engine={engine}'}")
        mode = "external"
    elif setting is ReplicaMode.SHARDED:
        if sharded_unsupported:
            raise ValueError(f"rollout.replica=sharded: {sharded_unsupported}; use rollout.replica=keep")
        mode = "sharded"
    elif plan.fits:
        mode = "keep"
    elif setting is ReplicaMode.KEEP:
        raise ValueError(f"rollout.replica=keep: the unsharded rollout copy does not fit: {sizes}; use "
                         f"rollout.replica=sharded (or auto)")
    elif sharded_unsupported:
        raise ValueError(f"rollout.replica=auto: the unsharded rollout copy does not fit ({sizes}) and generation "
                         f"from the sharded policy cannot serve this run: {sharded_unsupported}")
    else:
        mode = "sharded"
    return ReplicaChoice(**{**plan.__dict__, "mode": mode})


def device_budget(device: torch.device, *, budget_gb: float | None, local_ranks: int) -> tuple[int, str]:
    """Bytes this rank may still use, and where the figure comes from (module docstring)."""
    if budget_gb is not None:
        return int(budget_gb * GIB), f"rollout.memory_budget_gb={budget_gb:g}"
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return int(free * (1 - RESERVE)), f"free memory of {device} (torch.cuda.mem_get_info) less {RESERVE:.0%}"
    import psutil

    available = psutil.virtual_memory().available
    return (int(available / max(local_ranks, 1) * (1 - RESERVE)),
            f"available host memory / {local_ranks} local ranks (psutil) less {RESERVE:.0%}")


def local_shard_bytes(module: nn.Module, trainable: bool = False) -> int:
    """Bytes of this rank's share of `module`'s parameters (a DTensor's local shard); `trainable`:
    of those that train only (LoRA: the adapters)."""
    return sum(local_tensor(p).numel() * p.element_size() for p in module.parameters()
               if p.requires_grad or not trainable)


def choose_replica(cfg, dims, actor: nn.Module, teacher: nn.Module | None = None, *,
                   max_staleness: int = 0) -> ReplicaChoice:
    """`choose` for the run: `actor` is the parallelized policy (its `.model` the causal LM),
    `teacher` the distillation teacher (None: no teacher), `max_staleness` the run's
    `rollout.max_staleness` as resolved (rl/config/checks.py `max_staleness`)."""
    from rl.rollout.sync import full_tensor_bytes

    r = cfg.rollout
    # the copy is built in the compute dtype (rl/rollout/build.py): bf16 on CUDA is half the fp32 masters' bytes
    copy, master = (torch.finfo(getattr(torch, d.value)).bits for d in (cfg.model.param_dtype or cfg.model.dtype,
                                                                         cfg.model.dtype))
    replica = sum(full_tensor_bytes(actor.model).values()) * copy // master
    # grads + AdamW moments of what trains (LoRA: the adapters); a critic trains all of about the policy's size
    state = 3 * (local_shard_bytes(actor, trainable=True) + (local_shard_bytes(actor) if cfg.algo.uses_critic else 0))
    placement, shards, to_come = None, 0, 0
    if teacher is not None:  # its shards, resident (sharded) or back for each score stage (offload): module docstring
        placement, shards = TeacherPlacement(cfg.algo.teacher.placement), local_shard_bytes(teacher)
        to_come = shards if placement is TeacherPlacement.OFFLOAD and max_staleness >= 1 else 0
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", dims.world_size if dims.device.type == "cpu" else 1))
    budget, source = device_budget(dims.device, budget_gb=r.memory_budget_gb, local_ranks=local_ranks)
    if dims.distributed:  # one plan for every rank (sharded generation is a collective): the tightest rank's figures
        figures = torch.tensor([budget, -state, -shards, -to_come], dtype=torch.int64, device=dims.device)
        torch.distributed.all_reduce(figures, op=torch.distributed.ReduceOp.MIN)
        budget, state, shards, to_come = int(figures[0]), -int(figures[1]), -int(figures[2]), -int(figures[3])
        source = f"the least over {dims.world_size} ranks of: {source}"
    return choose(r.replica, engine=str(r.engine), replica_bytes=replica, state_bytes=state, budget_bytes=budget,
                  budget_source=source, sharded_unsupported=sharded_unsupported(cfg),
                  teacher=(placement, shards, to_come))


def sharded_unsupported(cfg) -> str | None:
    """Why `rollout.replica=sharded` cannot serve this run, from the config alone (None: it
    can). Generation from the sharded policy is proven token-identical to the replica's for
    dense and MoE policies with cp and ep up to 2 (tests/test_sharded_rollout.py); it needs
    the transformers engine."""
    engine = str(cfg.rollout.engine)
    if engine != RolloutEngineName.HF:
        return f"rollout.engine={engine} generates with its own copy of the weights; sharded needs rollout.engine=hf"
    return None


def check_sharded(cfg) -> None:
    """`validate`'s check of `rollout.replica=sharded` (before any model is built)."""
    reason = sharded_unsupported(cfg)
    if reason:
        raise ValueError(f"rollout.replica=sharded: {reason}")
