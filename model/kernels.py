"""Which varlen kernel a pack's attention runs on: `model.attention=auto|torch|flash|sdpa`.

    torch  torch's own `torch.nn.attention.varlen.varlen_attn` (torch >= 2.10: FA2 kernels
           inside libtorch, CUDA, fp16/bf16; nothing to install)
    flash  flash-attn's `flash_attn_varlen_func` (the optional GPU extra, requirements-gpu.txt)
    sdpa   one causal sdpa call per sequence (model/attention.py `_per_sequence_sdpa`): the
           CPU path, and any device's fallback
    auto   on CUDA with an fp16/bf16 compute dtype: torch if this torch has it, else flash if
           installed, else sdpa; on CPU (or in fp32): sdpa, the only kernel CPUs have

`resolve` is the start-up check (`rl.config.validate`): a named kernel this machine lacks
(torch or flash on CPU, in fp32, flash not installed, a torch before 2.10) is an error naming
`model.attention`, never a silent fallback. `select` fixes the choice for the process and
logs it; `packed_kernel(query)` is the one dispatch the "varlen" and "cp_varlen" attentions
ask per call. A kernel runs fp16/bf16 CUDA queries only: an fp32 pack (a CPU run, an fp32
copy of the model) takes the sdpa path whatever was chosen.

Both kernels are called with flash-attn's contract: THD `q [Nq, H, D]`, `k`/`v [Nk, H_kv, D]`,
`cu_q`/`cu_k` int32 `[n + 1]`, causal aligned bottom-right when a segment has more keys than
queries (the context-parallel and shared-prompt segments). `torch_varlen` adapts that call to
whichever `varlen_attn` signature this torch has (its keywords changed between releases:
`is_causal=True` in 2.10, `window_size=(-1, 0)` later; `scale` and `enable_gqa` are used when
present, else the query is rescaled and K/V heads repeated).
"""

from __future__ import annotations

import functools
import inspect
import logging
from typing import Callable

import torch

log = logging.getLogger(__name__)

KERNELS = ("auto", "torch", "flash", "sdpa")
HALF = (torch.float16, torch.bfloat16)

try:  # torch >= 2.10
    from torch.nn.attention.varlen import varlen_attn
except ImportError:  # pragma: no cover - depends on the torch release
    varlen_attn = None

try:  # optional GPU extra (requirements-gpu.txt); never needed by the tests
    from flash_attn import flash_attn_varlen_func
except ImportError:  # pragma: no cover - depends on the machine
    flash_attn_varlen_func = None

NAMES = {"torch": "torch.nn.attention.varlen.varlen_attn", "flash": "flash_attn.flash_attn_varlen_func",
         "sdpa": "per-sequence sdpa"}


def resolve(choice: str, device: torch.device | str, dtype: torch.dtype) -> str:
    """The kernel `model.attention=choice` means on `device` with compute `dtype`:
    "torch", "flash" or "sdpa". A named kernel that cannot run here raises, naming the field."""
    choice = str(getattr(choice, "value", choice))
    if choice not in KERNELS:
        raise ValueError(f"model.attention={choice!r}: expected one of {', '.join(KERNELS)}")
    device = torch.device(device)
    runs = device.type == "cuda" and dtype in HALF
    if choice == "sdpa":
        return "sdpa"
    if choice == "auto":
        if not runs:
            return "sdpa"
        return "torch" if varlen_attn is not None else "flash" if flash_attn_varlen_func is not None else "sdpa"
    missing = {"torch": varlen_attn is None and f"torch {torch.__version__} has no torch.nn.attention.varlen "
                                               f"(torch >= 2.10)",
               "flash": flash_attn_varlen_func is None and "flash_attn is not installed (requirements-gpu.txt)"}[choice]
    if missing:
        raise ValueError(f"model.attention={choice}: {missing}; use model.attention=auto or sdpa")
    if not runs:
        raise ValueError(f"model.attention={choice}: {NAMES[choice]} runs fp16/bf16 on CUDA only; this run computes "
                         f"in {str(dtype).removeprefix('torch.')} on {device.type} (model.param_dtype / model.dtype, "
                         f"trainer.device); use model.attention=auto or sdpa")
    return choice


_selected: str | None = None  # None: not selected (library use): auto, resolved per call


def select(choice: str, device: torch.device | str, dtype: torch.dtype) -> str:
    """Fix the process's pack kernel (`resolve`), log it, return it."""
    global _selected
    _selected = resolve(choice, device, dtype)
    why = "" if str(getattr(choice, "value", choice)) == _selected else f" (model.attention={choice})"
    log.info("packed attention kernel: %s%s on %s, %s", NAMES[_selected], why, torch.device(device).type,
             str(dtype).removeprefix("torch."))
    return _selected


def packed_kernel(query: torch.Tensor) -> Callable | None:
    """The varlen kernel for this pack's `query` (flash-attn's calling convention), or None for
    the per-sequence sdpa path: fp32 and CPU queries always take sdpa."""
    if not query.is_cuda or query.dtype not in HALF:
        return None
    kernel = _selected or resolve("auto", query.device, query.dtype)
    return {"torch": torch_varlen, "flash": flash_attn_varlen_func}.get(kernel)


@functools.lru_cache(maxsize=8)
def _parameters(fn: Callable) -> frozenset[str]:
    return frozenset(inspect.signature(fn).parameters)


def torch_varlen(q, k, v, cu_q, cu_k, max_q, max_k, *, dropout_p=0.0, softmax_scale=None, causal=True):
    """torch's `varlen_attn` behind flash-attn's call (see the module docstring): `[Nq, H, D]`."""
    if dropout_p or not causal:
        raise ValueError(f"torch varlen attention: dropout_p={dropout_p}, causal={causal}; the packed path is "
                         f"causal without attention dropout")
    params = _parameters(varlen_attn)
    kwargs = {}
    if "window_size" in params:
        kwargs["window_size"] = (-1, 0)
    else:  # torch 2.10
        kwargs["is_causal"] = True
    if softmax_scale is not None:
        if "scale" in params:
            kwargs["scale"] = softmax_scale
        else:
            q = q * (softmax_scale * q.shape[-1] ** 0.5)  # the kernel applies 1 / sqrt(D)
    if q.shape[1] != k.shape[1]:
        if "enable_gqa" in params:
            kwargs["enable_gqa"] = True
        else:
            groups = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    return varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, **kwargs)
