"""Shared test helpers (keep small and generic)."""

from __future__ import annotations

import pytest
import torch

from testing.records import make_records  # noqa: F401  (tests import it from here too)


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
    """Route every pack through the varlen-kernel branch (model/kernels.py `packed_kernel`), with
    `reference_flash_varlen` as the kernel; yields the list of calls made."""
    from model import kernels

    calls = []

    def kernel(*args, **kwargs):
        calls.append(args[3].numel() - 1)  # segments
        return reference_flash_varlen(*args, **kwargs)

    monkeypatch.setattr(kernels, "packed_kernel", lambda query: kernel)
    yield calls
