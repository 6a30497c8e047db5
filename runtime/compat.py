"""What differs between the torch releases the suite runs on (torch 2.11-2.14).

One home for every name a supported release lacks, so the rest of the code calls one
spelling. Each helper looks the newer name up when it is called (not at import), so a
process that lacks it, or a test that removes it, takes the fallback.

    all_gather_single(out, inp, group)          torch >= 2.13; before: all_gather_into_tensor
    reduce_scatter_single(out, inp, op, group)  torch >= 2.13; before: reduce_scatter_tensor
    reset_iter_state(root)                      FSDPModule.reset_iter_state, torch >= 2.13 (2.11 lacks
                                                it); before: the state put back by hand

`SINCE` records the release that brought each name; tests/test_compat.py fails once the oldest
supported torch (`OLDEST_TORCH`, the GPU image's) has them all: the shim is then deleted.

Both pairs take the same tensors: `out` holds world x `inp` rows (gather), `inp` holds
world x `out` rows (reduce-scatter), rank-major on dim 0.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

OLDEST_TORCH = (2, 11)  # the lent GPU image's torch (launch/gpu_check.sh)
SINCE = {"all_gather_single": (2, 13), "reduce_scatter_single": (2, 13), "reset_iter_state": (2, 13)}


def all_gather_single(out: torch.Tensor, inp: torch.Tensor, group: dist.ProcessGroup | None = None) -> None:
    """Every rank's `inp` into `out` (`[world * n, ...]`, rank r's rows at r*n)."""
    gather = getattr(dist, "all_gather_single", None)
    if gather is None:  # torch < 2.13
        dist.all_gather_into_tensor(out, inp, group=group)
    else:
        gather(out, inp, group=group)


def reduce_scatter_single(out: torch.Tensor, inp: torch.Tensor, op=dist.ReduceOp.SUM,
                          group: dist.ProcessGroup | None = None) -> None:
    """`out` = rank r's rows (`inp[r*n:(r+1)*n]`) reduced with `op` over the ranks."""
    scatter = getattr(dist, "reduce_scatter_single", None)
    if scatter is None:  # torch < 2.13
        dist.reduce_scatter_tensor(out, inp, op=op, group=group)
    else:
        scatter(out, inp, op=op, group=group)


def reset_iter_state(root: torch.nn.Module) -> None:
    """FSDP2's per-iteration state put back to idle after an exception aborted a forward of the
    root FSDP module `root` (`FSDPModule.reset_iter_state`, torch >= 2.13; torch 2.11 lacks it).
    The fallback clears what the aborted forward left: every state's training state (IDLE), the
    iteration's forward root, the post-forward order and the modules still to run forward, and
    reshards every parameter group (after the device has finished its work: no collective is
    left in flight)."""
    reset = getattr(type(root), "reset_iter_state", None)
    if reset is not None:
        reset(root)
        return
    from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState

    state = root._get_fsdp_state()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
    for s in state._state_ctx.all_states:
        s._training_state = TrainingState.IDLE
        getattr(s, "_modules_to_run_forward", set()).clear()
        groups = getattr(s, "_fsdp_param_groups", None)
        if groups is None:  # torch 2.11: one group per state
            groups = [g for g in [getattr(s, "_fsdp_param_group", None)] if g is not None]
        for group in groups:
            group._training_state = TrainingState.IDLE
            group.reshard()
    state._state_ctx.iter_forward_root = None
    state._comm_ctx.post_forward_order.clear()
