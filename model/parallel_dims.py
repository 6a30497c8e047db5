"""Parallel sizes, validated once, and the process groups they name.

    dims = init_distributed(dp=-1, cp=2, ep=2)   # torchrun env -> process group -> mesh
    dims.cp_group, dims.cp_rank                   # context-parallel peers (same samples)

torchrun starts `world = dp * cp` ranks laid out on a `DeviceMesh` of shape `(dp, cp)`
named ("dp", "cp"): rank = dp_rank * cp + cp_rank, so the CP peers of one DP rank are
consecutive ranks (one node's fast links carry the per-layer K/V gather). The expert
groups are carved from the dp dim: `ep` consecutive dp ranks of the same cp coordinate
form an EP group (they exchange tokens); the dp ranks of one cp coordinate holding the
same expert shard form its expert-data-parallel (EDP) group (size `dp / ep`). With cp > 1
the CP peers of those ranks hold the same shard and saw other tokens: an expert shard's
grads are summed over the EDP group and over the CP group (model/parallelize.py).

A group property is `None` when its dim has size 1, which means "no collective needed";
never hand `None` to a collective (torch reads it as WORLD). Without a process group (one
plain `python` process) every size is 1 and every group is None.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh


@dataclass
class ParallelDims:
    """`dp * cp == world_size`; `ep` divides `dp`. `dp=-1` is inferred as `world_size // cp`."""

    dp: int = -1
    cp: int = 1
    ep: int = 1
    world_size: int = 1
    # set by build_mesh; a single process keeps None
    mesh: DeviceMesh | None = field(default=None, repr=False, compare=False)
    expert_mesh: DeviceMesh | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in ("cp", "ep", "world_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"ParallelDims: {name}={value!r}, expected an int >= 1")
        if isinstance(self.dp, bool) or not isinstance(self.dp, int) or (self.dp < 1 and self.dp != -1):
            raise ValueError(f"ParallelDims: dp={self.dp!r}, expected an int >= 1 or -1 (infer world_size // cp)")
        if self.world_size % self.cp:
            raise ValueError(f"ParallelDims: cp={self.cp} does not divide world_size={self.world_size}")
        if self.dp == -1:
            self.dp = self.world_size // self.cp
        if self.dp * self.cp != self.world_size:
            raise ValueError(
                f"ParallelDims: dp={self.dp} x cp={self.cp} = {self.dp * self.cp} != world_size={self.world_size}"
            )
        if self.dp % self.ep:
            raise ValueError(
                f"ParallelDims: ep={self.ep} does not divide dp={self.dp} (EP groups are carved from the dp dim; "
                f"world_size={self.world_size}, cp={self.cp})"
            )

    # ------------------------------------------------------------------ ranks
    @property
    def rank(self) -> int:
        return dist.get_rank() if dist.is_initialized() else 0

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
        """Size of the expert-data-parallel group: the dp ranks (of one cp coordinate) holding
        the same expert shard. Their CP peers hold it too: sum expert grads over both groups."""
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
    def edp_group(self) -> dist.ProcessGroup | None:
        return self._group(self.expert_mesh, "edp", self.edp)

    def _group(self, mesh: DeviceMesh | None, name: str, size: int) -> dist.ProcessGroup | None:
        if size == 1:
            return None
        if mesh is None:
            raise RuntimeError(
                f"ParallelDims: the {name} group (size {size}) needs build_mesh(dims, device_type) first "
                f"(or init_distributed(...), which builds it)"
            )
        return mesh.get_group(name)


def build_mesh(dims: ParallelDims, device_type: str = "cpu") -> DeviceMesh | None:
    """The `(dp, cp)` DeviceMesh named ("dp", "cp"), stored on `dims` with the expert groups.

    Needs an initialised process group of `dims.world_size` ranks (None is returned, and
    nothing is built, for a single process without one). The expert mesh `(cp, edp, ep)`
    holds the same ranks regrouped: an "ep" group is ep consecutive dp ranks of one cp
    coordinate, an "edp" group the dp ranks of one cp coordinate holding the same shard.
    """
    if not dist.is_initialized():
        if dims.world_size != 1:
            raise RuntimeError(
                f"build_mesh: world_size={dims.world_size} but no process group is initialised "
                "(launch with torchrun and call init_distributed)"
            )
        return None
    if dist.get_world_size() != dims.world_size:
        raise ValueError(
            f"build_mesh: the process group has {dist.get_world_size()} ranks, ParallelDims has "
            f"world_size={dims.world_size} (dp={dims.dp} x cp={dims.cp})"
        )
    dims.mesh = init_device_mesh(device_type, (dims.dp, dims.cp), mesh_dim_names=("dp", "cp"))
    # the expert groups live inside each cp coordinate: rank = (edp_rank * ep + ep_rank) * cp + cp_rank
    ranks = torch.arange(dims.world_size).view(dims.edp, dims.ep, dims.cp).permute(2, 0, 1)
    dims.expert_mesh = DeviceMesh(device_type, ranks, mesh_dim_names=("cp", "edp", "ep"))
    return dims.mesh


def init_distributed(dp: int = -1, cp: int = 1, ep: int = 1, *, timeout_s: float = 600.0) -> ParallelDims:
    """Read torchrun's env (RANK, WORLD_SIZE, LOCAL_RANK), join the process group, build the mesh.

    NCCL when CUDA is available (each rank on cuda:LOCAL_RANK), gloo otherwise. A process
    group that already exists (a test launcher) is used as is. One process without
    WORLD_SIZE>1 in its env initialises nothing: every group is None.
    """
    if not dist.is_initialized():
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world == 1:
            return ParallelDims(dp=dp, cp=cp, ep=ep, world_size=1)
        for var in ("RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
            if var not in os.environ:
                raise RuntimeError(f"init_distributed: WORLD_SIZE={world} but {var} is not set (launch with torchrun)")
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        ParallelDims(dp=dp, cp=cp, ep=ep, world_size=world)  # fail on bad sizes before joining anyone
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
    dims = ParallelDims(dp=dp, cp=cp, ep=ep, world_size=dist.get_world_size())
    build_mesh(dims, "cuda" if dist.get_backend() == "nccl" else "cpu")
    return dims

