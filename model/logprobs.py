"""Per-token log-probs and entropy in fp32, chunked over tokens by a byte budget.

The `[N, V]` fp32 logits of a whole microbatch are the largest tensor of an RL step
(N = 16k tokens x V = 152k vocab is ~10 GB). `token_log_probs` computes them a chunk of
rows at a time with one fused autograd function (`_LogProbHead`). The chunk's rows come
from a byte budget, `chunk_bytes // (V x 4 B)`, so a 152k and a 256 vocabulary reach the
same peak: about one `[rows, V]` fp32 buffer (plus a few MiB of row blocks and the
`[V, H]` weight gradient). Backward writes the gradient of log p[target] and of the
entropy analytically,

    d log p_t / dz = onehot(t) - p          d H / dz = -p * (log p + H)

in place on that buffer. The logits are fp32 whatever the compute dtype (`logits_fp32`),
with no `[V, H]` fp32 copy of the weight. Two regimes, picked by the budget:

* the whole input fits one chunk (`N <= rows`): forward's log-softmax buffer is kept for
  backward and turned into the gradient in place: one `hidden @ W^T` matmul, no recompute;
* more rows than one chunk: forward keeps only the inputs; backward recomputes each
  chunk's logits into one reused buffer (one more `hidden @ W^T` per chunk, ~1/3 more
  lm-head FLOPs) and accumulates the weight gradient with `addmm_`.

Every `[rows, V]` operation runs in place (`log_softmax(out=)`, `exp_`, ...) and the
entropy's `p log p` goes through a small reused row block: on CPU a fresh 400 MB tensor
costs ~0.2 s of page faults alone, more than the in-place softmax over it (bench note in
the Actor's docstring). Without grad (scoring with the old policy or the reference)
nothing is kept. The kept buffer is consumed by backward: the head does not support
`retain_graph` (a second backward raises).

Two more reads of the same chunk buffer serve distillation's exact reverse KL over a teacher's
top-k (`topk_reverse_kl`): `return_topk=k` (scoring, no grad) gives each row's k most likely
ids and their log-probs, and `extra_targets [..., k]` gives each row's log-probs of k given ids,
with their gradient `onehot(id) - p` per id, in the same backward pass as the target's.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

LOGPROB_CHUNK_BYTES = 512 * 2**20  # default budget: [rows, V] fp32 per chunk (rows = budget // (4 V))
_BLOCK_BYTES = 8 * 2**20  # row block of the elementwise passes that need a second [rows, V] tensor


def chunk_rows(vocab_size: int, chunk_bytes: int) -> int:
    """Rows of one `[rows, vocab_size]` fp32 chunk within `chunk_bytes` (at least 2: a
    1-row matmul takes a matrix-vector kernel that rounds differently)."""
    if chunk_bytes < 1:
        raise ValueError(f"logprob chunk_bytes={chunk_bytes}, expected >= 1")
    return max(2, int(chunk_bytes) // (4 * int(vocab_size)))


def token_log_probs(
    hidden: torch.Tensor,
    lm_head_weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    temperature: float = 1.0,
    chunk_bytes: int = LOGPROB_CHUNK_BYTES,
    return_entropy: bool = False,
    return_argmax: bool = False,
    return_topk: int = 0,
    extra_targets: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """log softmax(hidden @ W^T / temperature)[target], fp32, for every token position.

    hidden `[..., S, H]` (any dtype), lm_head_weight `[V, H]`, targets `[..., S]` int ids.
    Returns log-probs `[..., S]` fp32 and, with `return_entropy`, the entropy `[..., S]`
    fp32 of the same tempered distribution. The logits are fp32 whatever the operands' dtype
    (`logits_fp32`: an fp32-output GEMM on CUDA, fp32 operands by vocabulary block elsewhere),
    so bf16 compute does not round them to bf16 (a step of 0.125 for |z| in [16, 32)). Backward
    casts the fp32 gradient of the logits to the weight's dtype for its two matmuls, as autograd
    through a bf16 head does. A chunk holds `chunk_rows(V, chunk_bytes)` rows.
    `return_argmax` (without grad only: a metric of scoring) adds each position's most likely
    id `[..., S]`, as fp32 (exact below 2^24), read from each chunk's buffer: no `[N, V]` tensor.
    `return_topk=k` (without grad only) adds each position's k largest log-probs `[..., S, k]` fp32
    and their ids `[..., S, k]` int64; `extra_targets [..., S, k]` int ids adds their log-probs
    `[..., S, k]` fp32, differentiable. Outputs in that order: log-probs, entropy, argmax, top-k
    log-probs and ids, extra log-probs (each only if asked).
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
    if extra_targets is not None and extra_targets.shape[:-1] != targets.shape:
        raise ValueError(f"token_log_probs: extra_targets has shape {tuple(extra_targets.shape)}, expected "
                         f"[{', '.join(map(str, targets.shape))}, k] (targets' shape and k ids per position)")
    rows = chunk_rows(lm_head_weight.shape[0], chunk_bytes)

    flat_hidden = hidden.reshape(-1, hidden.shape[-1])
    flat_targets = targets.reshape(-1).long()
    flat_extra = extra_targets.reshape(flat_targets.shape[0], -1).long() if extra_targets is not None else None
    chunks = _chunks(flat_hidden.shape[0], rows)
    argmax = top = None
    if torch.is_grad_enabled() and (hidden.requires_grad or lm_head_weight.requires_grad):
        if return_argmax or return_topk:
            raise ValueError("token_log_probs: return_argmax and return_topk are scoring reads; call it without grad")
        log_probs, entropy, extra = _LogProbHead.apply(flat_hidden, lm_head_weight, flat_targets, float(temperature),
                                                       return_entropy, chunks, flat_extra)
    else:  # scoring: nothing kept
        out = _head_forward(flat_hidden, lm_head_weight, flat_targets, float(temperature), return_entropy, chunks,
                            keep=False, argmax=return_argmax, topk=return_topk, extra=flat_extra)
        log_probs, entropy, argmax, top, extra = out.log_probs, out.entropy, out.argmax, out.topk, out.extra
    shape = tuple(targets.shape)
    outs = tuple(o.view(shape) for o in (log_probs, *([entropy] if return_entropy else []),
                                         *([argmax] if return_argmax else [])))
    if return_topk:
        outs += tuple(t.view(*shape, return_topk) for t in top)
    if extra is not None:
        outs += (extra.view(*shape, -1),)
    return outs if len(outs) > 1 else outs[0]


def topk_reverse_kl(student: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
    """Per position, the exact reverse KL(q_s || q_t) = sum_v q_s(v) (log q_s(v) - log q_t(v))
    between the student's and the teacher's distributions renormalized over the same k ids:
    `student`, `teacher` `[..., k]` log-probs of those ids (`token_log_probs`' `extra_targets`
    and `return_topk`). With k = the vocabulary it is the full reverse KL. Differentiable in
    `student`, by the closed form `q_s (log q_s - log q_t - KL)` on the k ids (their probabilities
    sum to 1, so the softmax term of the logits cancels): where the two agree on the k ids the
    term and its gradient are exactly 0 (counted by the caller, never clamped)."""
    return _TopKReverseKL.apply(student, teacher)


class _TopKReverseKL(torch.autograd.Function):
    @staticmethod
    def forward(ctx, student, teacher):
        ls, lt = torch.log_softmax(student.float(), dim=-1), torch.log_softmax(teacher.float(), dim=-1)
        q, diff = ls.exp(), ls - lt
        kl = (q * diff).sum(-1)
        ctx.save_for_backward(q, diff, kl)
        return kl

    @staticmethod
    def backward(ctx, grad):
        q, diff, kl = ctx.saved_tensors
        return grad.unsqueeze(-1) * q * (diff - kl.unsqueeze(-1)), None


def _chunks(m: int, chunk_size: int) -> list[tuple[int, int]]:
    """`[start, end)` row ranges of `chunk_size`; a 1-row tail joins the chunk before it,
    because a 1-row matmul takes a matrix-vector kernel that rounds differently, and the
    same token would then score differently in a padded batch and in a pack."""
    bounds = [*range(0, m, chunk_size), m]
    if chunk_size > 1 and len(bounds) > 2 and bounds[-1] - bounds[-2] == 1:
        del bounds[-2]
    return list(zip(bounds[:-1], bounds[1:]))


def fp32_out_gemm(device: torch.device) -> bool:
    """Whether `torch.mm(a, b, out_dtype=torch.float32)` runs on `device` for bf16/fp16
    operands (CUDA, torch >= 2.10; CPU has no such kernel in torch 2.13)."""
    return device.type == "cuda"


def logits_fp32(hidden: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """`hidden [c, H] @ weight[V, H]^T` as fp32 logits `[c, V]` (written into `out` if given),
    never rounded to a 16-bit dtype: the product of bf16 operands is exact in fp32, so the
    logits are those of the fp32 GEMM on the same values. Three paths, none holding a second
    `[V, H]` or `[c, V]` tensor:

    * fp32 operands: one `torch.mm(out=)`;
    * 16-bit operands where `fp32_out_gemm` (CUDA): one GEMM with an fp32 output
      (`torch.mm(..., out_dtype=torch.float32)`), the tensor-core bf16 kernel with its fp32
      accumulator written out unrounded;
    * otherwise (CPU, mixed dtypes): fp32 operands a block of vocabulary rows at a time,
      `hidden.float() @ weight[block].float()^T` into `out[:, block]`: besides `out`, the
      chunk's `[c, H]` fp32 hidden and one `[block, H]` fp32 weight block of <= 8 MiB.
    """
    c, v = hidden.shape[0], weight.shape[0]
    if out is None:
        out = torch.empty(c, v, dtype=torch.float32, device=hidden.device)
    if hidden.dtype == torch.float32 and weight.dtype == torch.float32:
        return torch.mm(hidden, weight.T, out=out)
    sixteen = hidden.dtype == weight.dtype and hidden.dtype in (torch.bfloat16, torch.float16)
    if sixteen and fp32_out_gemm(hidden.device):
        return torch.mm(hidden, weight.T, out_dtype=torch.float32, out=out)
    h = hidden.float()
    step = max(1, _BLOCK_BYTES // (4 * weight.shape[1]))
    for v0 in range(0, v, step):
        torch.mm(h, weight[v0:v0 + step].float().T, out=out[:, v0:v0 + step])
    return out


def _log_softmax_into(buf: torch.Tensor | None, hidden, weight, temperature: float) -> torch.Tensor:
    """The chunk's tempered log-probs `[c, V]` fp32, written in place into `buf` (a reused
    buffer of at least c rows; None allocates one); the logits are fp32 (`logits_fp32`)."""
    c, v = hidden.shape[0], weight.shape[0]
    if buf is None or buf.shape[0] < c:
        buf = torch.empty(c, v, dtype=torch.float32, device=hidden.device)
    out = logits_fp32(hidden, weight, out=buf[:c])
    if temperature != 1.0:
        out.div_(temperature)
    return torch.log_softmax(out, dim=-1, out=out)  # row-wise: reads a row before writing it


def _entropy(logp: torch.Tensor) -> torch.Tensor:
    """-sum p log p per row of `logp [c, V]` (not lse - sum p z, which cancels when the
    entropy is small), through one reused row block instead of a second `[c, V]` tensor."""
    c, v = logp.shape
    step = max(1, _BLOCK_BYTES // (4 * v))
    block = torch.empty(min(step, c), v, dtype=logp.dtype, device=logp.device)
    out = torch.empty(c, dtype=logp.dtype, device=logp.device)
    for s in range(0, c, step):
        lp = logp[s:s + step]
        p = torch.exp(lp, out=block[:lp.shape[0]])
        torch.sum(p.mul_(lp), dim=-1, out=out[s:s + step])
    return out.neg_()


class _HeadOut(NamedTuple):
    """What `_head_forward` reads off each chunk's log-softmax; None where not asked."""

    log_probs: torch.Tensor  # [N] fp32, of the targets
    entropy: torch.Tensor | None  # [N] fp32
    kept: torch.Tensor | None  # `keep` (a single chunk): its [N, V] log-softmax, for backward
    argmax: torch.Tensor | None  # [N], each row's most likely id as fp32
    topk: tuple[torch.Tensor, torch.Tensor] | None  # each row's k largest log-probs [N, k] fp32 and their ids
    extra: torch.Tensor | None  # [N, k] fp32, the log-probs of the `extra` ids


def _head_forward(hidden, weight, targets, temperature: float, return_entropy: bool, chunks, *, keep: bool,
                  argmax: bool = False, topk: int = 0, extra: torch.Tensor | None = None) -> _HeadOut:
    """The targets' log-probs (and what else is asked: `_HeadOut`) chunk by chunk through one reused
    buffer; `extra`: `[N, k]` ids whose log-probs are read too."""
    n = hidden.shape[0]
    logps = torch.empty(n, dtype=torch.float32, device=hidden.device)
    ents = torch.empty(n, dtype=torch.float32, device=hidden.device) if return_entropy else None
    top = torch.empty(n, dtype=torch.float32, device=hidden.device) if argmax else None
    best = ((torch.empty(n, topk, dtype=torch.float32, device=hidden.device),
             torch.empty(n, topk, dtype=torch.long, device=hidden.device)) if topk else None)
    gathered = torch.empty(extra.shape, dtype=torch.float32, device=hidden.device) if extra is not None else None
    buf = None
    for start, end in chunks:
        logp_all = _log_softmax_into(buf, hidden[start:end], weight, temperature)
        buf = logp_all if buf is None else buf
        torch.gather(logp_all, -1, targets[start:end].unsqueeze(-1), out=logps[start:end].unsqueeze(-1))
        if return_entropy:
            ents[start:end] = _entropy(logp_all)
        if argmax:
            top[start:end] = logp_all.argmax(-1)
        if topk:
            torch.topk(logp_all, topk, dim=-1, out=(best[0][start:end], best[1][start:end]))
        if extra is not None:
            torch.gather(logp_all, -1, extra[start:end], out=gathered[start:end])
    return _HeadOut(logps, ents, buf if keep else None, top, best, gathered)


class _LogProbHead(torch.autograd.Function):
    """`[N, H]` -> log-probs `[N]` (and entropy `[N]`), fp32; see the module docstring."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature: float, return_entropy: bool, chunks, extra=None):
        keep = len(chunks) == 1
        out = _head_forward(hidden, weight, targets, temperature, return_entropy, chunks, keep=keep, extra=extra)
        ctx.set_materialize_grads(False)  # an unused entropy (a logged metric) costs no backward work
        ctx.save_for_backward(hidden, weight, targets, extra)
        ctx.kept = out.kept  # not a saved tensor: backward turns it into the gradient in place
        ctx.entropy = out.entropy.detach() if out.entropy is not None else None
        ctx.temperature, ctx.chunks = temperature, chunks
        return out.log_probs, out.entropy, out.extra

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy, grad_extra):
        hidden, weight, targets, extra = ctx.saved_tensors
        if grad_logp is None and grad_entropy is None and grad_extra is None:
            return None, None, None, None, None, None, None
        if ctx.chunks is None:
            raise RuntimeError("token_log_probs: backward ran twice through the log-prob head; its buffers are "
                               "consumed by the first backward (retain_graph is not supported)")
        kept, chunks, temperature = ctx.kept, ctx.chunks, ctx.temperature
        ctx.kept = ctx.chunks = None
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_hidden = torch.empty_like(hidden) if need_h else None
        grad_weight = None
        buf = kept
        for start, end in chunks:
            h = hidden[start:end]
            logp_all = kept[: end - start] if kept is not None else _log_softmax_into(buf, h, weight, temperature)
            buf = logp_all if buf is None else buf
            g_lp = grad_logp[start:end] if grad_logp is not None else None
            g_h = grad_entropy[start:end] if grad_entropy is not None else None
            ent = ctx.entropy[start:end] if g_h is not None else None
            g_x = (extra[start:end], grad_extra[start:end]) if grad_extra is not None else None
            grad = _grad_logits_(logp_all, targets[start:end], g_lp, g_h, ent, g_x)  # in place on logp_all
            if temperature != 1.0:
                grad.div_(temperature)
            grad = grad if weight.dtype == torch.float32 else grad.to(weight.dtype)
            if need_h:
                if grad_hidden.dtype == grad.dtype:
                    torch.mm(grad, weight, out=grad_hidden[start:end])
                else:
                    grad_hidden[start:end] = grad @ weight
            if need_w:
                if grad_weight is None:
                    grad_weight = grad.T @ h.to(grad.dtype)
                else:
                    grad_weight.addmm_(grad.T, h.to(grad.dtype))
        ctx.entropy = None
        return grad_hidden, grad_weight, None, None, None, None, None


def _grad_logits_(logp: torch.Tensor, targets, g_lp, g_h, entropy, g_x=None) -> torch.Tensor:
    """d loss / d z for one chunk, written over `logp [c, V]` in place:
    `-p * (a + g_h * (log p + H)) + onehot(t) * g_lp + sum_j onehot(id_j) * g_x_j` with
    a = g_lp + sum_j g_x_j (absent terms are 0; `g_x`: the extra targets' ids `[c, k]` and
    their gradients `[c, k]`)."""
    a = g_lp
    if g_x is not None:  # the extra ids' softmax term joins the target's
        a = g_x[1].sum(-1) if a is None else a + g_x[1].sum(-1)
    if g_h is None:  # the common case: one pass, no temporary
        grad = logp.exp_().mul_(-a.unsqueeze(-1))
    else:
        c, v = logp.shape
        coef = a if a is not None else torch.zeros_like(g_h)
        step = max(1, _BLOCK_BYTES // (4 * v))
        block = torch.empty(min(step, c), v, dtype=logp.dtype, device=logp.device)
        for s in range(0, c, step):
            lp = logp[s:s + step]
            p = torch.exp(lp, out=block[:lp.shape[0]])
            gh, e, a_ = g_h[s:s + step, None], entropy[s:s + step, None], coef[s:s + step, None]
            lp.add_(e).mul_(gh).add_(a_).mul_(p).neg_()
        grad = logp
    if g_lp is not None:
        grad.scatter_add_(-1, targets.unsqueeze(-1), g_lp.unsqueeze(-1))
    if g_x is not None:
        grad.scatter_add_(-1, g_x[0], g_x[1].to(grad.dtype))
    return grad
