"""Context parallelism in the forward: this rank's view of a batch, and the "cp_varlen" attention.

A forward with cp > 1 runs the decoder on this rank's shard of the token axis. The
forward (model/actor.py) enters context parallelism once, through `shard_forward`:

    view = shard_forward(batch, targets, valid, dims)   # inputs of this rank's shard
    hidden = model.model(**view.inputs).last_hidden_state          # "cp_varlen" attention
    out = token_log_probs(hidden, W, view.targets).masked_fill(~view.valid, 0)
    out = view.restore(out)                             # _restore_full_sequence -> [1, N] / [B, T]

Where every token lives (the zigzag layout), the shard, and the gathers with their gradients
(`gather_tokens` for K/V, `_restore_full_sequence` for the outputs): runtime/cp_shard.py.

Attention. transformers (5.18) forwards unknown kwargs of `Qwen3Model.forward` through
every decoder layer into the attention function's `**kwargs`, so `cp_context` reaches
"cp_varlen" unchanged, once per forward, with no global state. "cp_varlen" all-gathers
keys and values over the CP group (one collective per layer: K and V travel together) and
masks by the layout: a query sees the keys of its own sequence at global positions <= its
own, and never a padding key. Two kernels, one mask semantics:
* CUDA, fp16/bf16, a pack: the varlen kernel of `model.attention` (model/kernels.py) over one
  segment per (sequence, local chunk): chunk j of a sequence is `c` queries against that
  sequence's first `(j+1)*c` gathered keys, causal bottom-right aligned (flash-attn >= 2.1).
  Its index bookkeeping is checked on CPU against the mask.
* otherwise (CPU, fp32, a padded batch): sdpa with an explicit boolean mask
  `[B, 1, S_local, S_full]`, built once per forward.
Without `cp_context` it is exactly the "varlen" attention of model/attention.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import repeat_kv
from transformers.masking_utils import AttentionMaskInterface

from model import kernels
from model.attention import varlen_attention_forward, varlen_mask
from runtime.cp_shard import CPLayout, Segments, _restore_full_sequence, gather_tokens, shard, shard_tokens
from packing.experience import Experience
from packing.layout import cu_seqlens

CP_VARLEN = "cp_varlen"


# ------------------------------------------------------------------ the seam
class ShardedView(NamedTuple):
    """What the forward runs on this CP rank, and how its per-token outputs go back."""

    inputs: dict  # kwargs of model.model(...) for the shard: its rows [B, S_rows]
    weight: torch.Tensor  # [B, S_rows] int64 tokens each row stands for: 0 on CP / right padding and the EP
    #                       suffix (kept out of the experts), k on a prompt row shared by k samples (model/moe.py)
    routed: torch.Tensor | None  # [B, L, K, S_rows] routing replay of the rows, -1 on padding
    targets: torch.Tensor  # [B, S_local] slot target ids
    valid: torch.Tensor  # [B, S_local] bool, True where the slot scores a real token
    restore: Callable[[torch.Tensor], torch.Tensor]  # [B, S_local] -> the full token axis [B, W]
    expand: torch.Tensor | None = None  # [S_local] the row each slot reads (shared prompts); None: rows = slots

    @property
    def synthetic(self) -> torch.Tensor:
        """`[B, S_rows]` bool, True on rows that stand for no token."""
        return self.weight == 0


def shard_forward(experience: Experience, targets: torch.Tensor, valid: torch.Tensor, dims, *,
                  weight: torch.Tensor | None = None, segments: Segments | None = None) -> ShardedView:
    """This CP rank's view of a batch for one forward. `targets`/`valid` are `[B, W]` on the
    batch's token axis (computed on the full batch); outputs come back on that axis.
    `weight [B, W]` (shared prompts: tokens each row stands for; default 1 per real token) and
    `segments` (shared prompts: which rows a row may attend to, see `Segments`)."""
    local, layout = shard(experience, dims.cp, dims.cp_rank, segments=segments)
    group = dims.cp_group
    return ShardedView(
        inputs=cp_model_inputs(local, layout, group),
        weight=local.attention_mask.long() if weight is None else shard_tokens(weight, layout),
        routed=local.routed_experts,
        targets=shard_tokens(targets, layout),
        valid=shard_tokens(valid, layout, fill=False),
        restore=lambda out: _restore_full_sequence(out, layout, group),
    )


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
    """Keyword arguments of `model.model(...)` for this rank's shard (`shard`)."""
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
    if layout.segment is not None:  # shared prompts: own segment, or the sequence's shared prefix
        same = same & ((layout.segment[q].unsqueeze(1) == layout.segment[k].unsqueeze(0))
                       | layout.shared[k].unsqueeze(0))
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
    With shared-prompt segments a chunk is cut where its segment changes: a piece of segment g
    sees its sequence's shared prefix, then g's tokens up to the piece's end (its queries are
    the last keys: bottom-right causal). Built on the layout's device (the trainer's layout
    stays on the host), the result moved to `device`: every index tensor on the layout's device
    (a CUDA `index_put_` refuses a CPU value tensor).
    """
    if not layout.packed:
        raise ValueError("flash_segments: a padded batch uses the masked sdpa path")
    cp, on = layout.cp, layout.seq_id.device
    gathered_at = torch.empty_like(layout.seq_id)
    gathered_at[layout.order.flatten()] = torch.arange(layout.order.numel(), device=on)
    segment = None if layout.segment is None else layout.segment.tolist()
    shared = None if layout.shared is None else layout.shared.tolist()
    lens_q, lens_k, keys = [], [], []
    start = 0
    for p in layout.padded_lens:
        c = p // (2 * cp)
        for j in layout.chunk_pair():
            a, end = start + j * c, start + (j + 1) * c
            if segment is None:
                lens_q.append(c)
                lens_k.append(end - start)
                keys.append(gathered_at[start:end])
                continue
            while a < end:  # one piece per segment the chunk crosses
                g, b = segment[a], a
                while b < end and segment[b] == g:
                    b += 1
                first = a
                while first > start and segment[first - 1] == g:
                    first -= 1
                prefix = 0
                while start + prefix < first and shared[start + prefix]:
                    prefix += 1
                rows = torch.cat([torch.arange(start, start + prefix, device=on), torch.arange(first, b, device=on)])
                lens_q.append(b - a)
                lens_k.append(rows.numel())
                keys.append(gathered_at[rows])
                a = b
        start += p
    return (cu_seqlens(lens_q, device=device), cu_seqlens(lens_k, device=device), max(lens_q), max(lens_k),
            torch.cat(keys).to(device))


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
    kernel = kernels.packed_kernel(query) if ctx.layout.packed else None
    if kernel is not None:
        cu_q, cu_k, max_q, max_k, kv_index = ctx.segments()
        k = key_full[0].transpose(0, 1).index_select(0, kv_index)  # [sum k-segments, H_kv, D]
        v = value_full[0].transpose(0, 1).index_select(0, kv_index)
        out = kernel(query[0].transpose(0, 1), k, v, cu_q, cu_k, max_q, max_k, dropout_p=dropout,
                     softmax_scale=scaling, causal=True)
        return out.unsqueeze(0)
    groups = getattr(module, "num_key_value_groups", 1)
    out = F.scaled_dot_product_attention(query, repeat_kv(key_full, groups), repeat_kv(value_full, groups),
                                         attn_mask=ctx.sdpa_mask(), dropout_p=dropout, scale=scaling)
    return out.transpose(1, 2).contiguous()


AttentionInterface.register(CP_VARLEN, cp_attention_forward)
AttentionMaskInterface.register(CP_VARLEN, varlen_mask)
