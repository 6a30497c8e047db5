"""Counting the host syncs a piece of code would make on a GPU, from a CPU run.

    with count_host_syncs() as syncs:
        engine.generate(...)
    syncs["scalar"], syncs["shape"], syncs["to_host"], syncs.total()

On a GPU the host queues kernels ahead of the device; each of the operations below makes it
wait until the device has caught up (a stall of the whole queue). On CPU they cost nothing,
so they are counted, not timed: a count is the number of syncs the same code makes with
all its tensors on the accelerator. Values kept as Python ints/lists on the host are free
and invisible here; that is the point (keep host-known values on the host).

Kinds:
- "scalar": a tensor read as a Python number: `.item()`, `int/float/bool(t)`, `if t:`
  (aten._local_scalar_dense), `torch.equal`;
- "shape": an op whose output shape depends on the values (the device computes it, the
  host must read it to allocate): nonzero, masked_select, unique, boolean-mask indexing
  and assignment, repeat_interleave without `output_size`;
- "to_host": a copy to host memory: `.cpu()`, `.tolist()`, `.numpy()`, `.to("cpu")` (counted
  at the call: on CPU these are no-ops that the dispatcher never sees; `.to(device)` with a
  `torch.device` is not counted: on a CPU run the code's device is the host).
"""

from __future__ import annotations

import collections
import contextlib
import os
import sys
from typing import Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten
_SCALAR = {aten._local_scalar_dense.default, aten.equal.default}
_SHAPE = {aten.nonzero.default, aten.masked_select.default, aten._unique.default, aten._unique2.default,
          aten.unique_dim.default, aten.unique_consecutive.default, aten.repeat_interleave.Tensor}
_BOOL_INDEXED = {aten.index.Tensor, aten.index_put.default, aten.index_put_.default, aten._index_put_impl_.default}
_TO_HOST = ("cpu", "tolist", "numpy", "to")


_TORCH = os.path.dirname(torch.__file__)


def _caller() -> str:
    """`file:line` of the innermost frame outside torch and this module (who asked for the sync)."""
    frame = sys._getframe(2)
    while frame is not None and (frame.f_code.co_filename.startswith(_TORCH) or frame.f_code.co_filename == __file__):
        frame = frame.f_back
    return f"{os.path.relpath(frame.f_code.co_filename)}:{frame.f_lineno}" if frame is not None else "?"


class HostSyncs(collections.Counter):
    """Counts by kind ("scalar", "shape", "to_host"); `where[kind]`: "op @ file:line" of each, in order."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.where: dict[str, list[str]] = collections.defaultdict(list)

    def add(self, kind: str, name: str) -> None:
        self[kind] += 1
        self.where[kind].append(f"{name} @ {_caller()}")


class _Mode(TorchDispatchMode):
    def __init__(self, syncs: HostSyncs) -> None:
        super().__init__()
        self.syncs = syncs

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _SCALAR:
            self.syncs.add("scalar", str(func))
        elif func in _SHAPE and not (func is aten.repeat_interleave.Tensor and kwargs.get("output_size") is not None):
            self.syncs.add("shape", str(func))
        elif func in _BOOL_INDEXED and any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8)
                                           for i in (args[1] if len(args) > 1 else ()) if i is not None):
            self.syncs.add("shape", f"{func} (boolean mask)")
        return func(*args, **kwargs)


def _to_host(args, kwargs) -> bool:
    """Whether `Tensor.to(*args, **kwargs)` names the host as a string ("cpu"): a `torch.device`
    is taken for the code's device variable, which on a CPU run is the host too (not counted)."""
    device = kwargs.get("device", args[0] if args else None)
    return isinstance(device, str) and torch.device(device).type == "cpu"


@contextlib.contextmanager
def count_host_syncs() -> Iterator[HostSyncs]:
    """Count, by kind, the host syncs of the code run inside (module docstring); not re-entrant."""
    syncs = HostSyncs()
    saved = {name: torch.Tensor.__dict__.get(name) for name in _TO_HOST}
    originals = {name: getattr(torch.Tensor, name) for name in _TO_HOST}

    def wrap(name):
        original = originals[name]

        def counted(self, *args, **kwargs):
            if name != "to" or _to_host(args, kwargs):
                syncs.add("to_host", f"Tensor.{name}")
            return original(self, *args, **kwargs)
        return counted

    for name in _TO_HOST:
        setattr(torch.Tensor, name, wrap(name))
    try:
        with _Mode(syncs):
            yield syncs
    finally:
        for name, value in saved.items():
            if value is None:
                delattr(torch.Tensor, name)
            else:
                setattr(torch.Tensor, name, value)
