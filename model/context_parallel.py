"""Context-parallel attention and the one un-sharding gather.

A forward with cp > 1 runs the decoder on this rank's shard of the token axis
(`packing.cp.shard`) and hands the shard's metadata to the attention in a forward kwarg:

    local, layout = shard(batch, cp, cp_rank)                 # packing/cp.py
    hidden = model.model(**cp_model_inputs(local, layout, cp_group)).last_hidden_state
    targets, valid = local_slots(batch, layout)                # slot targets from the full batch
    log_probs = token_log_probs(hidden, W, targets).masked_fill(~valid, 0)    # [B, S_local]
    log_probs = _restore_full_sequence(log_probs, layout, cp_group)           # [1, N] / [B, T]

transformers (5.18) forwards unknown kwargs of `Qwen3Model.forward` through every decoder
layer into the attention function's `**kwargs`, so `cp_context` reaches "cp_varlen"
unchanged, once per forward, with no global state.

"cp_varlen" (registered here) all-gathers keys and values over the CP group (one
collective per layer: K and V travel together) and masks by the layout: a query sees the
keys of its own sequence (`seq_id` of the CP-padded pack) at global positions <= its own,
and never a padding key. Boundaries come from the layout, never from position_ids
(transformers #39814). Two kernels, one mask semantics:
* CUDA, fp16/bf16, flash-attn importable, a pack: `flash_attn_varlen_func` over one
  segment per (sequence, local chunk): chunk j of a sequence is `c` queries against that
  sequence's first `(j+1)*c` gathered keys, causal bottom-right aligned (flash-attn >= 2.1),
  so a query at position p sees keys 0..p. Not run by the tests (no CUDA here); its index
  bookkeeping is checked on CPU against the mask.
* otherwise (CPU, fp32, a padded batch): sdpa with an explicit boolean mask
  `[B, 1, S_local, S_full]`, built once per forward. Memory is S_local x S_full per head
  for the scores: fine on CPU and for moderate packs on GPU; flash is the GPU path.
Without `cp_context` it is exactly the "varlen" attention of model/attention.py.

Gradients. The K/V gather's backward sums, over ranks, the gradients every rank's queries
send to this rank's keys (reduce-scatter): exact. `_restore_full_sequence`'s gather is
different: every CP rank computes the same loss on the full gathered axis, so summing
their gradients (what all_gather's backward does) would be cp times too large; its
backward returns only this rank's slice of the incoming gradient. Each rank then holds
the parameter gradient of its own tokens' contribution, and the trainer's SUM over the CP
group (with the DP reduction) is the gradient of one process, exactly
(tests/test_context_parallel.py proves both, and the cp-times error of the naive gather).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import repeat_kv
from transformers.masking_utils import AttentionMaskInterface

from model.attention import flash_attn_varlen_func, varlen_attention_forward, varlen_mask
from packing.cp import CPLayout, unshard

CP_VARLEN = "cp_varlen"


# -------------------------------------------------------------------- context
@dataclass(eq=False)
class CPContext:
    """What "cp_varlen" needs for one forward: the group, the layout, and what is built from it
    once per forward (not per layer): the sdpa mask or the flash segments, whichever runs."""

    layout: CPLayout
    group: dist.ProcessGroup | None
    device: torch.device | str | None = None
    mask: torch.Tensor | None = None  # [B, 1, S_local, S_full] bool, True = may attend; built on first use
    _segments: tuple | None = field(default=None, repr=False)

    def sdpa_mask(self) -> torch.Tensor:
        if self.mask is None:
            self.mask = attention_mask(self.layout.to(self.device) if self.device is not None else self.layout)
        return self.mask

    def segments(self) -> tuple[torch.Tensor, torch.Tensor, int, int, torch.Tensor]:
        """flash varlen description of a pack: (cu_q, cu_k, max_q, max_k, kv_index)."""
        if self._segments is None:
            self._segments = flash_segments(self.layout, self.device)
        return self._segments


def cp_context(layout: CPLayout, group: dist.ProcessGroup | None, device: torch.device | str | None = None
               ) -> CPContext:
    """The forward kwarg value for "cp_varlen": `model.model(..., cp_context=cp_context(...))`."""
    size = 1 if group is None else dist.get_world_size(group)
    rank = 0 if group is None else dist.get_rank(group)
    if size != layout.cp or rank != layout.rank:
        raise ValueError(f"cp_context: the layout is for CP rank {layout.rank} of {layout.cp}, "
                         f"the group is rank {rank} of {size}")
    return CPContext(layout=layout, group=group, device=device)


def cp_model_inputs(local, layout: CPLayout, group: dist.ProcessGroup | None) -> dict:
    """Keyword arguments of `model.model(...)` for this rank's shard (`packing.cp.shard`)."""
    ids = local.sequences
    return {"input_ids": ids, "position_ids": local.position_ids, "attention_mask": None,
            "use_cache": False, "cp_context": cp_context(layout, group, ids.device)}


def attention_mask(layout: CPLayout) -> torch.Tensor:
    """`[B, 1, S_local, S_full]` bool: local query i may see gathered key j.

    Same sequence, key position <= query position, key real. A query also sees itself,
    so a padding query never has an empty row (its output is discarded; an empty row
    would be NaN and leak into the next layer through 0 * NaN).
    """
    q = layout.local_index
    k = layout.order.flatten()
    same = layout.seq_id[q].unsqueeze(1) == layout.seq_id[k].unsqueeze(0)
    causal = layout.position[k].unsqueeze(0) <= layout.position[q].unsqueeze(1)
    allowed = (same & causal).unsqueeze(0) & layout.real[:, k].unsqueeze(1)
    self_key = torch.zeros_like(same)
    self_key[:, layout.rank * layout.num_local:(layout.rank + 1) * layout.num_local] = torch.eye(
        layout.num_local, dtype=torch.bool, device=same.device)
    return (allowed | self_key).unsqueeze(1)


def flash_segments(layout: CPLayout, device=None):
    """One flash varlen segment per (sequence, local chunk) of a pack.

    Queries keep their local order (chunk by chunk); the keys of a segment are its
    sequence's prefix up to the chunk's end, picked from the gathered axis by `kv_index`.
    """
    if not layout.packed:
        raise ValueError("flash_segments: a padded batch uses the masked sdpa path")
    cp = layout.cp
    gathered_at = torch.empty_like(layout.seq_id)
    gathered_at[layout.order.flatten()] = torch.arange(layout.order.numel())
    lens_q, lens_k, keys = [], [], []
    start = 0
    for p in layout.padded_lens:
        c = p // (2 * cp)
        for j in layout.chunk_pair():
            lens_q.append(c)
            lens_k.append((j + 1) * c)
            keys.append(gathered_at[start:start + (j + 1) * c])
        start += p
    cu = lambda lens: F.pad(torch.tensor(lens).cumsum(0), (1, 0)).to(device=device, dtype=torch.int32)  # noqa: E731
    return cu(lens_q), cu(lens_k), max(lens_q), max(lens_k), torch.cat(keys).to(device)


# ------------------------------------------------------------------ attention
def cp_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    cp_context: CPContext | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers attention interface: q `[B, H, S_local, D]`, k/v `[B, H_kv, S_local, D]` -> `[B, S_local, H, D]`."""
    if cp_context is None:
        return varlen_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                        scaling=scaling, sliding_window=sliding_window, **kwargs)
    if not getattr(module, "is_causal", True):
        raise ValueError(f"cp_varlen attention is causal only; {type(module).__name__}.is_causal is False")
    if sliding_window is not None:
        raise ValueError(f"cp_varlen attention does not implement sliding-window attention "
                         f"({type(module).__name__} has sliding_window={sliding_window})")
    if attention_mask is not None:
        raise ValueError(f"cp_varlen got cp_context and an attention_mask of shape {tuple(attention_mask.shape)}; "
                         "a CP shard passes attention_mask=None (its mask comes from the layout)")
    ctx, layout = cp_context, cp_context.layout
    b, _, s, _ = query.shape
    if s != layout.num_local or b != layout.real.shape[0] or key.shape[2] != s:
        raise ValueError(f"cp_varlen: query {tuple(query.shape)} / key {tuple(key.shape)}, expected "
                         f"[{layout.real.shape[0]}, heads, {layout.num_local}, head_dim] (the layout's shard)")
    kv = gather_tokens(torch.cat([key, value], dim=-1), ctx.group, dim=2)  # [B, H_kv, S_full, Dk + Dv]
    key_full, value_full = kv.split([key.shape[-1], value.shape[-1]], dim=-1)
    return _attend(module, query, key_full, value_full, ctx, dropout, scaling), None


def _attend(module, query, key_full, value_full, ctx: CPContext, dropout, scaling) -> torch.Tensor:
    """Local queries against the gathered keys: `[B, S_local, H, D]`."""
    use_flash = (query.is_cuda and flash_attn_varlen_func is not None and ctx.layout.packed
                 and query.dtype in (torch.float16, torch.bfloat16))
    if use_flash:
        cu_q, cu_k, max_q, max_k, kv_index = ctx.segments()
        k = key_full[0].transpose(0, 1).index_select(0, kv_index)  # [sum k-segments, H_kv, D]
        v = value_full[0].transpose(0, 1).index_select(0, kv_index)
        out = flash_attn_varlen_func(query[0].transpose(0, 1), k, v, cu_q, cu_k, max_q, max_k,
                                     dropout_p=dropout, softmax_scale=scaling, causal=True)
        return out.unsqueeze(0)
    groups = getattr(module, "num_key_value_groups", 1)
    out = F.scaled_dot_product_attention(query, repeat_kv(key_full, groups), repeat_kv(value_full, groups),
                                         attn_mask=ctx.sdpa_mask(), dropout_p=dropout, scale=scaling)
    return out.transpose(1, 2).contiguous()


# -------------------------------------------------------------------- gathers
def _all_gather(x: torch.Tensor, group, dim: int) -> torch.Tensor:
    size = dist.get_world_size(group)
    moved = x.movedim(dim, 0).contiguous()
    out = moved.new_empty((size * moved.shape[0], *moved.shape[1:]))
    dist.all_gather_single(out, moved, group=group)
    return out.movedim(0, dim)


class _GatherSum(torch.autograd.Function):
    """all_gather on `dim`; backward: reduce-scatter (each rank gets the SUM of every rank's
    gradient for its slice). Right when every rank's loss uses the gathered tensor
    differently (K/V: each rank's queries read other ranks' keys)."""

    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return _all_gather(x, group, dim)

    @staticmethod
    def backward(ctx, grad):
        moved = grad.movedim(ctx.dim, 0).contiguous()
        out = moved.new_empty((moved.shape[0] // dist.get_world_size(ctx.group), *moved.shape[1:]))
        dist.reduce_scatter_single(out, moved, op=dist.ReduceOp.SUM, group=ctx.group)
        return out.movedim(0, ctx.dim), None, None


class _GatherSlice(torch.autograd.Function):
    """all_gather on `dim`; backward: this rank's slice of the incoming gradient, no
    communication. Right when every rank computes the same loss on the gathered tensor."""

    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.rank, ctx.size, ctx.dim = dist.get_rank(group), x.shape[dim], dim
        return _all_gather(x, group, dim)

    @staticmethod
    def backward(ctx, grad):
        return grad.narrow(ctx.dim, ctx.rank * ctx.size, ctx.size), None, None


def gather_tokens(x: torch.Tensor, group: dist.ProcessGroup | None, dim: int) -> torch.Tensor:
    """Differentiable all_gather of `x` on `dim` in rank order, gradients summed back (K/V)."""
    if group is None or dist.get_world_size(group) == 1:
        return x
    return _GatherSum.apply(x, group, dim)


def _restore_full_sequence(local: torch.Tensor, layout: CPLayout, cp_group: dist.ProcessGroup | None) -> torch.Tensor:
    """Per-token outputs of this rank's shard `[B, S_local, ...]` -> the full token axis `[B, W, ...]`.

    W is N for a pack (`[1, N]`, the original flat order, CP padding trimmed) and T for a
    padded batch (`[B, T]`; its action axis is `[:, :-1]`). The only un-sharding step.
    Every rank gets the full tensor; backward returns this rank's slice of the gradient
    (see the module docstring), so a loss computed identically on every CP rank followed by
    a SUM of the parameter gradients over the CP group equals the one-process gradient.
    """
    if local.shape[1] != layout.num_local:
        raise ValueError(f"_restore_full_sequence: local tensor of shape {tuple(local.shape)}, expected "
                         f"[B, {layout.num_local}, ...] (this rank's shard)")
    size = 1 if cp_group is None else dist.get_world_size(cp_group)
    if size != layout.cp:
        raise ValueError(f"_restore_full_sequence: the layout has cp={layout.cp}, the CP group has {size} ranks")
    gathered = local if size == 1 else _GatherSlice.apply(local, cp_group, 1)
    return unshard(gathered, layout)


AttentionInterface.register(CP_VARLEN, cp_attention_forward)
AttentionMaskInterface.register(CP_VARLEN, varlen_mask)
