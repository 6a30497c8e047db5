"""Per-token log-probs and entropy in fp32, chunked over tokens.

The `[N, V]` fp32 logits of a whole microbatch are the largest tensor of an RL step
(N = 16k tokens x V = 152k vocab is ~10 GB). `token_log_probs` computes them `chunk_size`
tokens at a time and, when a gradient is needed, wraps each chunk in
`torch.utils.checkpoint`, so autograd keeps only the chunk's inputs (a view of `hidden`)
and recomputes its logits in backward.

Memory trade-off: peak extra memory is one chunk's `[chunk_size, V]` fp32 logits (plus
their softmax in backward) instead of `[N, V]`, for one more `hidden @ W^T` matmul per
chunk in backward (~1/3 more lm-head FLOPs). Without grad (scoring with the old policy
or the reference) nothing is recomputed.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint


def token_log_probs(
    hidden: torch.Tensor,
    lm_head_weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    temperature: float = 1.0,
    chunk_size: int = 1024,
    return_entropy: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """log softmax(hidden @ W^T / temperature)[target], fp32, for every token position.

    hidden `[..., S, H]` (any dtype), lm_head_weight `[V, H]`, targets `[..., S]` int ids.
    Returns log-probs `[..., S]` fp32 and, with `return_entropy`, the entropy `[..., S]`
    fp32 of the same tempered distribution. The lm-head matmul runs in the weight's dtype
    and its output is upcast before the softmax.
    """
    if hidden.shape[:-1] != targets.shape:
        raise ValueError(
            f"token_log_probs: hidden has shape {tuple(hidden.shape)}, targets {tuple(targets.shape)}; "
            f"expected targets of shape {tuple(hidden.shape[:-1])} (hidden without its last axis)"
        )
    if lm_head_weight.dim() != 2 or lm_head_weight.shape[1] != hidden.shape[-1]:
        raise ValueError(
            f"token_log_probs: lm_head_weight has shape {tuple(lm_head_weight.shape)}, "
            f"expected [V, {hidden.shape[-1]}] (hidden size of hidden {tuple(hidden.shape)})"
        )
    if temperature <= 0:
        raise ValueError(f"token_log_probs: temperature={temperature}, expected > 0")
    if chunk_size < 1:
        raise ValueError(f"token_log_probs: chunk_size={chunk_size}, expected >= 1")

    flat_hidden = hidden.reshape(-1, hidden.shape[-1])
    flat_targets = targets.reshape(-1).long()
    recompute = torch.is_grad_enabled() and (hidden.requires_grad or lm_head_weight.requires_grad)
    logps, ents = [], []
    for start, end in _chunks(flat_hidden.shape[0], chunk_size):
        h, t = flat_hidden[start:end], flat_targets[start:end]
        if recompute:
            logp, ent = checkpoint(_chunk, h, lm_head_weight, t, temperature, return_entropy, use_reentrant=False)
        else:
            logp, ent = _chunk(h, lm_head_weight, t, temperature, return_entropy)
        logps.append(logp)
        ents.append(ent)

    log_probs = torch.cat(logps).view(targets.shape)
    if not return_entropy:
        return log_probs
    return log_probs, torch.cat(ents).view(targets.shape)


def _chunks(m: int, chunk_size: int) -> list[tuple[int, int]]:
    """`[start, end)` row ranges of `chunk_size`; a 1-row tail joins the chunk before it,
    because a 1-row matmul takes a matrix-vector kernel that rounds differently, and the
    same token would then score differently in a padded batch and in a pack."""
    bounds = [*range(0, m, chunk_size), m]
    if chunk_size > 1 and len(bounds) > 2 and bounds[-1] - bounds[-2] == 1:
        del bounds[-2]
    return list(zip(bounds[:-1], bounds[1:]))


def _chunk(hidden, weight, targets, temperature: float, return_entropy: bool):
    """`[c, H]` -> log-probs `[c]` (and entropy `[c]`), fp32."""
    logits = (hidden @ weight.T).float()
    if temperature != 1.0:
        logits = logits / temperature
    logp_all = logits - torch.logsumexp(logits, dim=-1, keepdim=True)
    logp = logp_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    if not return_entropy:
        return logp, None
    # -sum p log p over the log-probs (not lse - sum p z, which cancels when the entropy is small)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy
