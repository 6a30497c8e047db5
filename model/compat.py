"""What differs between the torch releases the suite runs on (torch 2.11-2.14).

One home for every name a supported release lacks, so the rest of the code calls one
spelling. Each helper looks the newer name up when it is called (not at import), so a
process that lacks it, or a test that removes it, takes the fallback.

    all_gather_single(out, inp, group)          torch >= 2.13; before: all_gather_into_tensor
    reduce_scatter_single(out, inp, op, group)  torch >= 2.13; before: reduce_scatter_tensor

Both pairs take the same tensors: `out` holds world x `inp` rows (gather), `inp` holds
world x `out` rows (reduce-scatter), rank-major on dim 0.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


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
