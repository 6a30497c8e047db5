"""Parallel sizes, validated once, the rank's device, and every process group the run uses.

    dims = init_distributed(dp=-1, cp=2, ep=2, device="auto")   # torchrun env -> process group -> meshes
    dims.device                                                  # cuda:LOCAL_RANK (NCCL) or cpu (gloo)
    dims.mesh["cp"], dims.cp_group, dims.cp_rank                 # context-parallel peers (same samples)

torchrun starts `world = dp * cp` ranks laid out on a `DeviceMesh` of shape `(dp, cp)`
named ("dp", "cp"): rank = dp_rank * cp + cp_rank, so the CP peers of one DP rank are
consecutive ranks (one node's fast links carry the per-layer K/V gather).

Expert parallelism is carved from the dp dim: `ep` consecutive dp ranks of one cp
coordinate form an EP group (they exchange tokens and each keeps E/ep experts). The
ranks holding the same expert shard are the other dp ranks of that shard (`edp = dp/ep`
of them per cp coordinate) and their CP peers: `edp * cp` ranks. `expert_mesh` has shape
`(ep, edp_cp)`: its "ep" dim is the EP group, its "edp_cp" dim the ranks FSDP shards an
expert shard over. Dense parameters shard over every rank (`fsdp_mesh`, the flattened
(dp, cp)). This class is the one place that decides which group a collective uses:

    dp_group    metric sums over data-parallel ranks (CP peers hold the same values)
    cp_group    K/V gathers and `_restore_full_sequence`
    ep_group    the MoE all-to-all and the EP suffix all-reduce
    fsdp_mesh / expert_fsdp_mesh   FSDP2 sharding of dense / expert parameters
    WORLD       the records gather, the global gradient norm

Dedicated rollout ranks (`parallel.rollout_ranks=R`, docs/rollouts.md): torchrun starts
`world_size + R` processes; the first `world_size = dp * cp` train (every mesh above is
theirs: ranks 0..world_size-1) and the last R only generate (`generates`). Then:

    trainer_group   the trainers' own world-wide collectives (gradient norm, metric maxima,
                    a checkpoint's read): WORLD without generators
    push_group      trainer 0 and the generators: the weight push, the step's destinations
    records_*       where the records gather and exchange run: the DP group and DP ranks,
                    or (with generators) WORLD and global ranks (trainer t is global rank t:
                    DP rank t // cp, CP rank t % cp; a sample for DP rank d goes to each of
                    its cp trainers, as the exchange does for colocated CP peers)

A group property is `None` when its dim has size 1, which means "no collective needed";
never hand `None` to a collective (torch reads it as WORLD). Without a process group (one
plain `python` process) every size is 1, every group and mesh is None.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor


@dataclass
class ParallelDims:
    """`dp * cp == world_size` (the training ranks); `ep` divides `dp`. `dp=-1` is inferred as
    `world_size // cp`. `rollout_ranks` more ranks only generate (ranks world_size.. of the group)."""

    dp: int = -1
    cp: int = 1
    ep: int = 1
    world_size: int = 1
    rollout_ranks: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    # set by build_mesh; a single process keeps None
    mesh: DeviceMesh | None = field(default=None, repr=False, compare=False)
    expert_mesh: DeviceMesh | None = field(default=None, repr=False, compare=False)
    fsdp_mesh: DeviceMesh | None = field(default=None, repr=False, compare=False)
    push_group: dist.ProcessGroup | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        """The one check of the parallel sizes (config validation builds this too): each error
        names the `parallel.*` setting and the sizes."""
        for name in ("cp", "ep", "world_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                key = "world_size" if name == "world_size" else f"parallel.{name}"
                raise ValueError(f"{key}={value!r}: expected an int >= 1")
        if isinstance(self.rollout_ranks, bool) or not isinstance(self.rollout_ranks, int) or self.rollout_ranks < 0:
            raise ValueError(f"parallel.rollout_ranks={self.rollout_ranks!r}: expected an int >= 0")
        # with generators the sizes below fill the training ranks, not torchrun's whole world
        note = (f"; world_size: torchrun's {self.ranks} ranks less parallel.rollout_ranks={self.rollout_ranks}"
                if self.rollout_ranks else "")
        if isinstance(self.dp, bool) or not isinstance(self.dp, int) or (self.dp < 1 and self.dp != -1):
            raise ValueError(f"parallel.dp={self.dp!r}: expected an int >= 1 or -1 (world_size // cp)")
        if self.world_size % self.cp:
            raise ValueError(f"parallel.cp={self.cp} does not divide world_size={self.world_size} (torchrun starts "
                             f"dp x cp ranks){note}")
        if self.dp == -1:
            self.dp = self.world_size // self.cp
        if self.dp * self.cp != self.world_size:
            raise ValueError(f"parallel.dp x parallel.cp must fill the world: dp={self.dp} x cp={self.cp} = "
                             f"{self.dp * self.cp} != world_size={self.world_size} (parallel.dp=-1 fills it){note}")
        if self.dp % self.ep:
            raise ValueError(f"parallel.ep={self.ep} does not divide dp={self.dp} (EP groups are carved from the "
                             f"data-parallel ranks; world_size={self.world_size}, parallel.cp={self.cp}){note}")
        self.device = torch.device(self.device)

    # ------------------------------------------------------------------ ranks
    @property
    def distributed(self) -> bool:
        """True when the ranks run collectives (a process group of world_size > 1)."""
        return self.world_size > 1 and dist.is_initialized()

    @property
    def rank(self) -> int:
        """This process's rank in the job (a trainer's is its training rank: the trainers come first)."""
        return dist.get_rank() if self.joined else 0

    @property
    def ranks(self) -> int:
        """Every process of the job: the trainers and the generators."""
        return self.world_size + self.rollout_ranks

    @property
    def joined(self) -> bool:
        """True when the job's processes run collectives together (start-up, the stop signal)."""
        return self.ranks > 1 and dist.is_initialized()

    @property
    def generates(self) -> bool:
        """This rank is a dedicated generator (parallel.rollout_ranks > 0, one of the last ranks)."""
        return self.rank >= self.world_size

    @property
    def trainer_group(self) -> dist.ProcessGroup | None:
        """The training ranks' group for their world-wide collectives (None: one trainer)."""
        if not self.distributed:
            return None
        return dist.group.WORLD if not self.rollout_ranks else self.fsdp_mesh.get_group()

    @property
    def records_rank(self) -> int:
        """This rank's index in the records gather and exchange (`StandIn.source[0]`)."""
        return self.rank if self.rollout_ranks else self.dp_rank

    @property
    def records_ranks(self) -> int:
        """The ranks of one records exchange: the DP ranks, or every process with generators."""
        return self.ranks if self.rollout_ranks else self.dp

    @property
    def records_cp(self) -> int:
        """The CP peers the records gather checks alike (`gather_metadata`'s cp): cp, or 1 with generators
        (a generator has no CP peers and the trainers hold no records: every CP peer of a DP rank
        receives the generators' records in the exchange, `rl/rollout/dedicated.py` `exchange_records`)."""
        return 1 if self.rollout_ranks else self.cp

    @property
    def records_group(self) -> dist.ProcessGroup | None:
        if self.rollout_ranks:
            return dist.group.WORLD if self.joined else None
        return self.dp_group

    @property
    def dp_rank(self) -> int:
        return self.rank // self.cp

    @property
    def cp_rank(self) -> int:
        return self.rank % self.cp

    @property
    def ep_rank(self) -> int:
        return self.dp_rank % self.ep

    @property
    def edp(self) -> int:
        """dp ranks (of one cp coordinate) holding the same expert shard."""
        return self.dp // self.ep

    # ----------------------------------------------------------------- groups
    @property
    def dp_group(self) -> dist.ProcessGroup | None:
        return self._group(self.mesh, "dp", self.dp)

    @property
    def cp_group(self) -> dist.ProcessGroup | None:
        return self._group(self.mesh, "cp", self.cp)

    @property
    def ep_group(self) -> dist.ProcessGroup | None:
        return self._group(self.expert_mesh, "ep", self.ep)

    @property
    def expert_fsdp_mesh(self) -> DeviceMesh | None:
        """The 1-D mesh of the `edp * cp` ranks holding this rank's expert shard."""
        return None if self.expert_mesh is None else self.expert_mesh["edp_cp"]

    def _group(self, mesh: DeviceMesh | None, name: str, size: int) -> dist.ProcessGroup | None:
        if size == 1:
            return None
        if mesh is None:
            raise RuntimeError(
                f"ParallelDims: the {name} group (size {size}) needs build_mesh(dims) first "
                f"(or init_distributed(...), which builds it)"
            )
        return mesh.get_group(name)


def build_mesh(dims: ParallelDims) -> DeviceMesh | None:
    """The `(dp, cp)` DeviceMesh named ("dp", "cp"), stored on `dims` with the expert and FSDP meshes.

    Needs an initialised process group of `dims.world_size` ranks (None is returned, and
    nothing is built, for a single process without one).
    """
    if not dist.is_initialized():
        if dims.world_size != 1:
            raise RuntimeError(
                f"build_mesh: world_size={dims.world_size} but no process group is initialised "
                "(launch with torchrun and call init_distributed)"
            )
        return None
    if dist.get_world_size() != dims.ranks:
        raise ValueError(
            f"build_mesh: the process group has {dist.get_world_size()} ranks, ParallelDims has "
            f"world_size={dims.world_size} (dp={dims.dp} x cp={dims.cp}) + parallel.rollout_ranks={dims.rollout_ranks}"
        )
    kind = dims.device.type
    if dims.rollout_ranks:  # the trainers' meshes over ranks 0..world_size-1: every rank builds them (new_group)
        dims.mesh = DeviceMesh(kind, torch.arange(dims.world_size).view(dims.dp, dims.cp), mesh_dim_names=("dp", "cp"))
        dims.push_group = dist.new_group([0, *range(dims.world_size, dims.ranks)])
    else:
        dims.mesh = init_device_mesh(kind, (dims.dp, dims.cp), mesh_dim_names=("dp", "cp"))
    dims.fsdp_mesh = DeviceMesh(kind, torch.arange(dims.world_size), mesh_dim_names=("dp_cp",))
    # rank = (edp_rank * ep + ep_rank) * cp + cp_rank; row ep_rank of (ep, edp_cp) holds one expert shard
    ranks = torch.arange(dims.world_size).view(dims.edp, dims.ep, dims.cp).permute(1, 0, 2).reshape(dims.ep, -1)
    dims.expert_mesh = DeviceMesh(kind, ranks, mesh_dim_names=("ep", "edp_cp"))
    return dims.mesh


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of `t`: a DTensor's local shard, any other tensor itself."""
    return t.to_local() if isinstance(t, DTensor) else t


def resolve_device(choice: str = "auto") -> torch.device:
    """`trainer.device`: auto (CUDA when present, else CPU), cpu, or cuda (an error without CUDA)."""
    if choice not in ("auto", "cpu", "cuda"):
        raise ValueError(f"trainer.device={choice!r}, expected one of auto, cpu, cuda")
    if choice == "cuda" and not torch.cuda.is_available():
        raise ValueError("trainer.device=cuda but CUDA is not available on this machine (use trainer.device=auto or cpu)")
    if choice == "cpu" or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))


def use_tf32(device: torch.device) -> None:
    """On CUDA, fp32 matmuls take TF32 tensor cores (10-bit mantissa products, fp32 sums), so
    whatever runs in fp32 (an fp32 run, fp32 parts beside bf16 compute) runs at tensor-core
    speed. `set_float32_matmul_precision` sets torch's legacy and newer TF32 flags alike
    (setting one by hand and reading the other is an error in recent torch). CPU: unchanged."""
    if device.type == "cuda":
        torch.set_float32_matmul_precision("high")


def init_distributed(dp: int = -1, cp: int = 1, ep: int = 1, *, device: str = "auto", rollout_ranks: int = 0,
                     timeout_s: float = 600.0, one_rank_group: bool = False) -> ParallelDims:
    """Read torchrun's env (RANK, WORLD_SIZE, LOCAL_RANK), join the process group, build the meshes.

    NCCL on CUDA (each rank on cuda:LOCAL_RANK), gloo on CPU. A process group that already
    exists (a test launcher) is used as is. One process without WORLD_SIZE>1 in its env
    initialises nothing: every group is None; unless `one_rank_group`, which gives it a
    process group of one rank (an in-memory store) and its meshes, so FSDP2 wraps the model
    as it does at any world size (`model.param_dtype`: its mixed precision in one process).
    """
    where = resolve_device(device)
    if where.type == "cuda":
        torch.cuda.set_device(where)
    use_tf32(where)
    if not dist.is_initialized():
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world == 1 and not one_rank_group:
            return ParallelDims(dp=dp, cp=cp, ep=ep, world_size=1, device=where)
        backend = "nccl" if where.type == "cuda" else "gloo"
        if world == 1:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1,
                                    timeout=datetime.timedelta(seconds=timeout_s))
        else:
            for var in ("RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
                if var not in os.environ:
                    raise RuntimeError(f"init_distributed: WORLD_SIZE={world} but {var} is not set "
                                       f"(launch with torchrun)")
            # fail on bad sizes before joining anyone
            ParallelDims(dp=dp, cp=cp, ep=ep, world_size=world - rollout_ranks, rollout_ranks=rollout_ranks)
            dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
    dims = ParallelDims(dp=dp, cp=cp, ep=ep, world_size=dist.get_world_size() - rollout_ranks,
                        rollout_ranks=rollout_ranks, device=where)
    build_mesh(dims)
    return dims


def decided_on_rank0(dims: ParallelDims, decide):
    """`decide()` run on rank 0 alone, its (picklable) result returned on every rank; an
    exception it raises on rank 0 is raised on every rank. What a start-up decision reads from
    local state (free memory, a folder listing, a file) is read once, so every rank takes the
    same branch before a collective (one rank picking another plan would hang the group)."""
    if not dims.joined:
        return decide()
    box: list = [None]
    if dims.rank == 0:
        try:
            box[0] = (True, decide())
        except Exception as error:  # noqa: BLE001 - raised below, on every rank
            box[0] = (False, error)
    dist.broadcast_object_list(box, src=0)
    ok, value = box[0]
    if not ok:
        raise value
    return value


def gathered(dims: ParallelDims, value) -> list:
    """Every rank's `value` (picklable), in rank order, on every rank (a one-item list alone)."""
    if not dims.joined:
        return [value]
    out: list = [None] * dims.ranks
    dist.all_gather_object(out, value)
    return out
