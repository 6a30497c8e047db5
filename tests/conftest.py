"""Shared test helpers (keep small and generic)."""

from __future__ import annotations

import pytest
import torch

from packing.experience import Experience


def make_records(lengths, *, vocab=256, seed=0, prompt_len=None, routed=None) -> list[Experience]:
    """Seeded per-sample records of the given lengths.

    `sequences [T]` random ids in [0, vocab); `action_mask [T-1]` True on response slots
    (slot k scores token k+1: the response starts at token `prompt_len`, default a random
    split leaving >= 1 response token); random `action_log_probs` (<= 0) and `advantages`.
    `routed=(layers, topk, num_experts)` adds random `routed_experts [L, K, T]`.
    """
    gen = torch.Generator().manual_seed(seed)
    records = []
    for n in lengths:
        if n < 2:
            raise ValueError(f"make_records: length {n}, expected >= 2 (a prompt token and a response token)")
        p = prompt_len if prompt_len is not None else int(torch.randint(1, n, (1,), generator=gen))
        p = min(max(p, 1), n - 1)
        rec = Experience(
            sequences=torch.randint(0, vocab, (n,), generator=gen),
            action_mask=torch.arange(n - 1) >= p - 1,
            action_log_probs=-torch.rand(n - 1, generator=gen),
            advantages=torch.randn(n - 1, generator=gen),
        )
        if routed is not None:
            layers, topk, experts = routed
            # distinct experts per token: the first `topk` of a random permutation
            order = torch.rand(layers, n, experts, generator=gen).argsort(-1)
            rec.routed_experts = order[..., :topk].permute(0, 2, 1).contiguous()
        records.append(rec)
    return records


# ----------------------------------------------------------- the GPU branch, on CPU
def reference_flash_varlen(q, k, v, cu_q, cu_k, max_q, max_k, *, dropout_p=0.0, softmax_scale=None, causal=True):
    """flash-attn's `flash_attn_varlen_func` contract in plain sdpa: THD `q [Nq, H, D]`,
    `k`/`v [Nk, H_kv, D]`, one segment per `cu_q`/`cu_k` entry, causal aligned bottom-right
    (query i of a segment sees keys j <= i + len_k - len_q). Checks the arguments it is given."""
    import torch.nn.functional as F

    assert causal and dropout_p == 0.0 and cu_q.dtype == cu_k.dtype == torch.int32
    lens_q, lens_k = (cu_q[1:] - cu_q[:-1]).tolist(), (cu_k[1:] - cu_k[:-1]).tolist()
    assert (max_q, max_k) == (max(lens_q), max(lens_k)) and cu_q[-1] == q.shape[0] and cu_k[-1] == k.shape[0]
    out = []
    for s_q, s_k, n_q, n_k in zip(cu_q[:-1].tolist(), cu_k[:-1].tolist(), lens_q, lens_k):
        mask = torch.ones(n_q, n_k, dtype=torch.bool).tril(n_k - n_q)
        seg = F.scaled_dot_product_attention(*(t.transpose(0, 1) for t in (q[s_q:s_q + n_q], k[s_k:s_k + n_k],
                                                                             v[s_k:s_k + n_k])),
                                             attn_mask=mask, scale=softmax_scale, enable_gqa=True)
        out.append(seg.transpose(0, 1))
    return torch.cat(out)


@pytest.fixture
def flash_on_cpu(monkeypatch):
    """Route every pack through the flash-attn branch (model.attention.use_flash), with
    `reference_flash_varlen` as the kernel; yields the list of calls made."""
    from model import attention

    calls = []

    def kernel(*args, **kwargs):
        calls.append(args[3].numel() - 1)  # segments
        return reference_flash_varlen(*args, **kwargs)

    monkeypatch.setattr(attention, "use_flash", lambda query: True)
    monkeypatch.setattr(attention, "flash_attn_varlen_func", kernel)
    yield calls
