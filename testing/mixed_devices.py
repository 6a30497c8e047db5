"""Ops that mix devices, seen on CPU: on CUDA an op whose tensor arguments sit on two devices
raises (an index_put_ of host values into a CUDA tensor, issue 52.5); on CPU and meta it runs.
`with MixedDevices() as seen: ...` then `seen.ops` lists every such op (0-dim CPU scalars, which
CUDA takes, and the copies between devices aside). Used by tests/test_context_parallel.py and by
launch/gpu_check.py's CPU rehearsal (no pytest here: the check imports it on CPU)."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

MOVES = ("aten.copy_.default", "aten._to_copy.default")


class MixedDevices(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        devices = {t.device for t in tree_leaves((args, kwargs or {}))
                   if isinstance(t, torch.Tensor) and not (t.dim() == 0 and t.device.type == "cpu")}
        if len(devices) > 1 and str(func) not in MOVES:
            self.ops.append(f"{func} on {sorted(str(d) for d in devices)}")
        return func(*args, **(kwargs or {}))
