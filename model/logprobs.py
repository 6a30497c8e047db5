"""Per-token log-probs and entropy in fp32, chunked over tokens.

The `[N, V]` fp32 logits of a whole microbatch are the largest tensor of an RL step
(N = 16k tokens x V = 152k vocab is ~10 GB). `token_log_probs` computes them `chunk_size`
tokens at a time with a fused autograd function (`_ChunkLogProbs`): forward keeps only
the chunk's inputs and its log-sum-exp; backward recomputes the chunk's logits and writes
the gradient of log p[target] and of the entropy analytically,

    d log p_t / dz = onehot(t) - p          d H / dz = -p * (log p + H)

in place, so at most three `[chunk_size, V]` fp32 temporaries are alive at once (autograd
through log_softmax kept about 5.5: bench/memory.py). The cost is one more
`hidden @ W^T` matmul per chunk in backward (~1/3 more lm-head FLOPs). Without grad
(scoring with the old policy or the reference) nothing is saved.
"""

from __future__ import annotations

import torch


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
    logps, ents = [], []
    for start, end in _chunks(flat_hidden.shape[0], chunk_size):
        h, t = flat_hidden[start:end], flat_targets[start:end]
        logp, ent = _ChunkLogProbs.apply(h, lm_head_weight, t, temperature, return_entropy)
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


def _log_softmax_(hidden, weight, temperature: float, lse=None):
    """The chunk's tempered log-probs `[c, V]` fp32, computed in place on its logits."""
    logits = (hidden @ weight.T).float()
    if temperature != 1.0:
        logits.div_(temperature)
    if lse is None:
        lse = torch.logsumexp(logits, dim=-1, keepdim=True)
    return logits.sub_(lse), lse


class _ChunkLogProbs(torch.autograd.Function):
    """`[c, H]` -> log-probs `[c]` (and entropy `[c]`), fp32; see the module docstring."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature: float, return_entropy: bool):
        logp_all, lse = _log_softmax_(hidden, weight, temperature)
        logp = logp_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        # -sum p log p over the log-probs (not lse - sum p z, which cancels when the entropy is small)
        entropy = -(logp_all.exp() * logp_all).sum(-1) if return_entropy else None
        ctx.save_for_backward(hidden, weight, targets, lse)
        ctx.temperature = temperature
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        hidden, weight, targets, lse = ctx.saved_tensors
        logp_all, _ = _log_softmax_(hidden, weight, ctx.temperature, lse)
        p = logp_all.exp()
        grad = torch.zeros_like(p)  # d loss / d z, z the tempered logits
        if grad_entropy is not None:
            entropy = -(p * logp_all).sum(-1, keepdim=True)
            grad.sub_(logp_all.add_(entropy).mul_(p).mul_(grad_entropy.unsqueeze(-1)))
        if grad_logp is not None:
            grad.sub_(p.mul_(grad_logp.unsqueeze(-1)))
            grad.scatter_add_(-1, targets.unsqueeze(-1), grad_logp.unsqueeze(-1))
        if ctx.temperature != 1.0:
            grad.div_(ctx.temperature)
        grad = grad.to(weight.dtype)
        grad_hidden = grad @ weight if ctx.needs_input_grad[0] else None
        grad_weight = grad.T @ hidden if ctx.needs_input_grad[1] else None
        return grad_hidden, grad_weight, None, None, None
