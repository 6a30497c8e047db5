"""Attention backends for the THD pack: explicit boundaries, never guessed.

`packed_attn_kwargs` is the one builder of the boundary description a pack hands to the
model (`cu_seq_lens_q/k`, `max_length_q/k`: the names transformers' flash-attention
integration also reads). The "varlen" attention registered here enforces exactly those
boundaries:

* CUDA, fp16/bf16: the kernel `model.attention` chose (model/kernels.py: torch's own
  `varlen_attn` by default, flash-attn's `flash_attn_varlen_func` if asked or if torch lacks one).
* otherwise (CPU, fp32, or `model.attention=sdpa`): one causal sdpa call per sequence,
  `S_i x S_i` (`_per_sequence_sdpa`).
  Chosen by bench/results/attention.json (torch 2.13, fp32, AVX512 kernel set, the default on this
  machine; 1 thread, process CPU time), forward+backward with 6 heads / 2 KV heads / dim 64:

      pack                          per-sequence  held keys  K/V repeated  one [N, N] mask
      32 seqs, N=4780, S_max=512        136 ms      357 ms       198 ms        1946 ms
      8 seqs, N=8288, S_max=1771        503 ms     1183 ms       528 ms           -

  "held keys" is the former default: every sequence's keys zero-extended to the pack's
  longest length, to reproduce the padded batch's rounding on one kernel set. It was 2.4-2.6x
  slower and kept K/V at `S_max` for every sequence alive for backward: +73 MiB on
  the long-tail microbatch of bench/results/memory.json (8 sequences, S_max=482, 6 layers), memory that
  grows with the longest sequence, not with the tokens. sdpa's `enable_gqa` beats repeating
  K/V per head. FlexAttention with a document mask has no CPU backward in torch 2.13.
  Parity with the padded batch is a few fp32 ulps of the values, not bit-exactness (which
  kernel set rounds alike differs by machine anyway): worst 4.3 eps32 relative over
  log-probs, entropy and grads, dense and MoE, under the default, AVX2 and AVX512 kernel
  sets with 1 and 2 threads (tests/test_portable_parity.py, tolerance in tests/parity_check.py).
* no `cu_seq_lens_q` (a padded batch, or generation with a cache): sdpa with the mask the
  model built (`_masked_sdpa`: on CPU with `enable_gqa` instead of transformers' per-head
  copy of K/V, which the rollout engine paid for the whole cache at every decode step).

A shared-prompt pack (`shared_prompts=`, packing/prompts.py `SharedPrompts`, built by the
collate when a GRPO group's samples share their prompt tokens) holds each shared prompt once,
then the responses that share it. Its boundary description cuts the pack into segments (a
prompt, a response, an unshared sequence, an EP suffix): segment i's queries are its own
slots, its keys are gathered by `kv_index` (a response's keys: its prompt's slots, then its
own), causal aligned bottom-right. That is flash-attn's varlen contract with `cu_seqlens_k != cu_seqlens_q`, so
on GPU it is one varlen kernel call (model/kernels.py) on the gathered K/V; on CPU one sdpa call
per segment (measured per layer, SmolLM2's 9/3 heads of dim 64, 4 prompts of 45 tokens x 8
responses of 16, fwd+bwd, 2 threads: 36.6 ms today's pack, 16.7 ms per segment, 105.8 ms
one masked `[L_g, L_g]` sdpa per group, which also grows with (group size)^2).

A pack's `position_ids` only feed RoPE; a library that infers boundaries from them
(transformers' sdpa/eager with `attention_mask=None`) is exactly what this module avoids:
see transformers #39814 for a context-parallel shard with no position 0.
"""

from __future__ import annotations

import itertools
from typing import Sequence

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from model import kernels
from packing.layout import cu_seqlens
from packing.prompts import SharedPrompts

VARLEN = "varlen"



def packed_attn_kwargs(
    seq_lens: Sequence[int], *, device: torch.device | str | None = None, trailing_pad: int = 0
) -> dict:
    """Boundary kwargs of a pack of sequences with lengths `seq_lens`.

    Returns `cu_seq_lens_q`, `cu_seq_lens_k` (int32 `[n + 1]`, cumulative lengths starting
    at 0), `max_length_q`, `max_length_k` (python ints) and `packed_seq_lens` (a tuple of
    python ints: the host copy the CPU kernel splits by, so no layer reads lengths back from
    the device). `trailing_pad` grows the last sequence: expert parallelism folds its
    synthetic suffix into the last sequence so the real tokens (which come earlier, and
    attend causally) never see it.
    """
    lens = [int(n) for n in seq_lens]
    if not lens:
        raise ValueError("packed_attn_kwargs: seq_lens is empty; a pack holds at least one sequence")
    if any(n <= 0 for n in lens):
        raise ValueError(
            f"packed_attn_kwargs: seq_lens {lens} has a length <= 0; every packed sequence needs >= 1 token"
        )
    if trailing_pad < 0:
        raise ValueError(f"packed_attn_kwargs: trailing_pad={trailing_pad}, expected >= 0")
    lens[-1] += int(trailing_pad)
    cu = cu_seqlens(lens, device=device)
    longest = max(lens)
    return {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": longest, "max_length_k": longest,
            "packed_seq_lens": tuple(lens)}


def varlen_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    cu_seq_lens_q: torch.Tensor | None = None,
    cu_seq_lens_k: torch.Tensor | None = None,
    max_length_q: int | None = None,
    max_length_k: int | None = None,
    shared_prompts: SharedPrompts | None = None,
    packed_seq_lens: Sequence[int] | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers attention interface: q `[B, H, S, D]`, k/v `[B, H_kv, S, D]` -> `[B, S, H, D]`.

    Lengths come from the host (`max_length_k`, `packed_seq_lens`, the layout's): no layer
    reads them back from the device."""
    if not getattr(module, "is_causal", True):
        raise ValueError(f"varlen attention is causal only; {type(module).__name__}.is_causal is False")
    if shared_prompts is not None:
        longest = shared_prompts.max_length_k
    elif max_length_k is not None:
        longest = max_length_k
    else:
        longest = _longest(key, cu_seq_lens_q)
    if sliding_window is not None and sliding_window < longest:
        # a window at least as long as every sequence masks nothing (Mistral's 4096 on short samples)
        raise ValueError(
            f"varlen attention does not implement sliding-window attention ({type(module).__name__} has "
            f"sliding_window={sliding_window}); build the model with use_sliding_window=False or use 'sdpa'"
        )
    if shared_prompts is not None:
        if cu_seq_lens_q is not None:
            raise ValueError("varlen attention got both cu_seq_lens_q and shared_prompts; a shared-prompt pack "
                             "is described by shared_prompts alone")
        return _shared_prompt_attention(query, key, value, attention_mask, shared_prompts, dropout, scaling), None
    if cu_seq_lens_q is None:
        # a padded batch (or decoding with a cache): the model built the mask, sdpa applies it
        return _masked_sdpa(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)

    cu_k = cu_seq_lens_q if cu_seq_lens_k is None else cu_seq_lens_k
    _check_pack(query, key, attention_mask, cu_seq_lens_q, cu_k)
    return _packed_attention(module, query, key, value, cu_seq_lens_q, cu_k, max_length_q, max_length_k,
                             packed_seq_lens, dropout, scaling), None


def _packed_attention(module, query, key, value, cu_q: torch.Tensor, cu_k: torch.Tensor, max_length_q: int | None,
                      max_length_k: int | None, packed_seq_lens: Sequence[int] | None, dropout,
                      scaling) -> torch.Tensor:
    """A THD pack `[1, H, N, D]` -> `[1, N, H, D]`: the device's varlen kernel where there is one
    (model/kernels.py), else sdpa per sequence over the pack's host boundaries."""
    kernel = kernels.packed_kernel(query)
    if kernel is not None:
        longest_q = max_length_q if max_length_q is not None else int((cu_q[1:] - cu_q[:-1]).max())
        longest_k = max_length_k if max_length_k is not None else int((cu_k[1:] - cu_k[:-1]).max())
        out = kernel(  # THD in [N, H, D], THD out; GQA handled by the kernel
            query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1),
            cu_q, cu_k, longest_q, longest_k, dropout_p=dropout, softmax_scale=scaling, causal=True,
        )
        return out.unsqueeze(0)
    if packed_seq_lens is not None:  # the host copy: no device read per layer
        bounds = [0, *itertools.accumulate(int(n) for n in packed_seq_lens)]
        if bounds[-1] != query.shape[2] or len(bounds) != cu_q.shape[0]:
            raise ValueError(f"packed_seq_lens {list(packed_seq_lens)} (sum {bounds[-1]}, {len(bounds) - 1} sequences) "
                             f"does not describe the pack: query shape {tuple(query.shape)}, cu_seq_lens_q shape "
                             f"{tuple(cu_q.shape)}")
    else:  # a caller that passed device boundaries only (reads them back once per layer)
        bounds = cu_q.tolist()
        if bounds != cu_k.tolist() or bounds[0] != 0 or bounds[-1] != query.shape[2]:
            raise ValueError(
                f"cu_seq_lens_q {bounds} / cu_seq_lens_k {cu_k.tolist()} must be equal, start at 0 and end at the "
                f"pack length {query.shape[2]} (query shape {tuple(query.shape)})"
            )
    return _per_sequence_sdpa(module, query, key, value, bounds, dropout, scaling)


def _masked_sdpa(module, query, key, value, attention_mask, *, dropout=0.0, scaling=None, is_causal=None,
                 **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' sdpa with the model's mask, GQA kept in the kernel on CPU.

    With a mask, transformers repeats K/V per query head (`repeat_kv`: a copy of the whole
    cache per layer and decode step) except on XPU/MPS; torch's CPU kernels take
    `enable_gqa` with a mask. Anything else (CUDA, no GQA, a position bias) goes to
    transformers' own `sdpa_attention_forward`.
    """
    groups = getattr(module, "num_key_value_groups", 1)
    if groups == 1 or query.device.type != "cpu" or kwargs.get("position_bias") is not None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    causal = query.shape[2] > 1 and attention_mask is None and causal
    if causal and key.shape[2] > query.shape[2]:  # as transformers: is_causal aligns top-left
        key, value = key[:, :, : query.shape[2]], value[:, :, : query.shape[2]]
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, dropout_p=dropout,
                                         scale=scaling, is_causal=causal, enable_gqa=True)
    return out.transpose(1, 2).contiguous(), None


def _longest(key: torch.Tensor, cu_seqlens: torch.Tensor | None) -> int:
    """The longest sequence of the batch: a pack's longest segment, else the key length."""
    if cu_seqlens is None:
        return key.shape[2]
    return int((cu_seqlens[1:] - cu_seqlens[:-1]).max())


def _per_sequence_sdpa(module, query, key, value, bounds: list[int], dropout, scaling) -> torch.Tensor:
    """One causal sdpa call per sequence of the pack: `[1, H, N, D]` -> `[1, N, H, D]`.

    Sequence i's queries `[S_i]` attend to its own keys `[S_i]` (`is_causal`): `S_i x S_i`
    scores, nothing held at the pack's longest length. GQA stays in the kernel
    (`enable_gqa`), so K/V are never repeated per query head.
    """
    gqa = query.shape[1] != key.shape[1]
    lens = [e - s for s, e in zip(bounds[:-1], bounds[1:])]
    # `split`, not one slice per sequence: a slice's backward zero-fills and adds a whole
    # [1, H, N, D] gradient per sequence (O(num_seqs x N) per layer: 32 sequences of ~62
    # tokens spent 3x the attention itself on it); split's backward is one cat
    outs = [
        F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True, scale=scaling, enable_gqa=gqa)
        for q, k, v in zip(query.split(lens, dim=2), key.split(lens, dim=2), value.split(lens, dim=2))
    ]
    return torch.cat(outs, dim=2).transpose(1, 2).contiguous()


def _shared_prompt_attention(query, key, value, attention_mask, layout: SharedPrompts, dropout,
                             scaling) -> torch.Tensor:
    """Attention of a shared-prompt pack: `[1, H, N_c, D]` -> `[1, N_c, H, D]`.

    K/V are gathered once by `layout.kv_index` (`[sum len_k]` rows: each response's copy of its
    prompt's keys; the gather's backward sums a shared prompt's key gradients). GPU: one
    varlen kernel call (causal is bottom-right there when `len_q != len_k`). Otherwise one
    sdpa per segment, as `_per_sequence_sdpa`, with the bottom-right mask of `layout.mask`.
    """
    n = sum(layout.lens_q)
    if query.shape[0] != 1 or key.shape[2] != query.shape[2] or query.shape[2] != n or attention_mask is not None:
        mask_shape = None if attention_mask is None else tuple(attention_mask.shape)
        raise ValueError(
            f"shared-prompt attention: query {tuple(query.shape)}, key {tuple(key.shape)}, attention_mask "
            f"{mask_shape}; expected one packed row of the layout's {n} slots, keys like queries, no mask"
        )
    kernel = kernels.packed_kernel(query)
    if kernel is not None:
        k, v = (t[0].transpose(0, 1).index_select(0, layout.kv_index) for t in (key, value))  # [sum len_k, H_kv, D]
        out = kernel(
            query[0].transpose(0, 1), k, v, layout.cu_seq_lens_q, layout.cu_seq_lens_k, layout.max_length_q,
            layout.max_length_k, dropout_p=dropout, softmax_scale=scaling, causal=True,
        )
        return out.unsqueeze(0)
    gqa = query.shape[1] != key.shape[1]
    k, v = (t.index_select(2, layout.kv_index) for t in (key, value))  # [1, H_kv, sum len_k, D]
    outs = [
        F.scaled_dot_product_attention(q_i, k_i, v_i, attn_mask=mask, dropout_p=dropout, is_causal=mask is None,
                                       scale=scaling, enable_gqa=gqa)
        for q_i, k_i, v_i, mask in zip(
            query.split(layout.lens_q, dim=2), k.split(layout.lens_k, dim=2), v.split(layout.lens_k, dim=2),
            (layout.mask(a, b, query.device) for a, b in zip(layout.lens_q, layout.lens_k)),
        )
    ]
    return torch.cat(outs, dim=2).transpose(1, 2).contiguous()


def _check_pack(query, key, attention_mask, cu_q, cu_k) -> None:
    """Shape checks of a pack (no device sync: they run in every layer)."""
    b, _, n, _ = query.shape
    if b != 1:
        raise ValueError(
            f"varlen attention takes one packed row: query has batch {b} (shape {tuple(query.shape)}), expected 1"
        )
    if attention_mask is not None:
        raise ValueError(
            f"varlen attention got cu_seq_lens_q and an attention_mask of shape {tuple(attention_mask.shape)}; "
            "a pack passes attention_mask=None (its boundaries are cu_seq_lens_q/k)"
        )
    if key.shape[2] != n:
        raise ValueError(
            f"varlen attention is self-attention over one pack without a cache: key length {key.shape[2]} "
            f"(key shape {tuple(key.shape)}), expected the query length {n}"
        )
    if cu_q.dim() != 1 or cu_q.shape != cu_k.shape or cu_q.numel() < 2:
        raise ValueError(
            f"cu_seq_lens_q has shape {tuple(cu_q.shape)}, cu_seq_lens_k {tuple(cu_k.shape)}: "
            "expected equal 1-d [num_seqs + 1] tensors"
        )


def varlen_mask(
    *, attention_mask: torch.Tensor | None = None, q_length: int, kv_length: int, q_offset=0, kv_offset=0, **kwargs
):
    """Mask builder paired with "varlen": no `[N, N]` mask for a pack, sdpa's mask otherwise.

    Without a 2D padding mask and without a cache offset the input is a pack (boundaries in
    cu_seq_lens_q/k) or one causal sequence: nothing to build, so nothing is guessed from
    position_ids. Everything else (a padded batch, decoding) gets exactly sdpa's mask.
    """
    no_offset = not isinstance(q_offset, torch.Tensor) and q_offset == 0 and kv_offset == 0
    if attention_mask is None and no_offset and q_length == kv_length:
        return None
    return sdpa_mask(attention_mask=attention_mask, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
                     kv_offset=kv_offset, **kwargs)


AttentionInterface.register(VARLEN, varlen_attention_forward)
AttentionMaskInterface.register(VARLEN, varlen_mask)
