"""The MoE block's result depends on the experts' outputs only, never on the order the
(token, slot) pairs arrive in (model/moe.py `combine`, `_Dispatch`): a top-8 block is bitwise
the same, forward and backward, with its experts permuted (which reorders every expert group
and changes the split sizes). Control: adding the pairs onto their tokens in arrival order
(`index_add`, the former combine) is not."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from tests.parity_check import assert_parity
from torch import nn

from model import moe
from model.moe import ExpertParallelExperts, combine

E, K, H, I, S = 16, 8, 64, 32, 53


def index_add_combine(rows, pairs, tokens, k):
    """The former combine: each row added onto its token in arrival order."""
    return rows.new_zeros(tokens, rows.shape[-1]).index_add(0, pairs // k, rows)


class FusedExperts(nn.Module):
    def __init__(self, gate_up: torch.Tensor, down: torch.Tensor) -> None:
        super().__init__()
        self.gate_up_proj, self.down_proj, self.act_fn = nn.Parameter(gate_up), nn.Parameter(down), F.silu


def inputs(dtype):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(S, H, generator=gen).to(dtype)
    ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(S)])  # [S, K] distinct experts
    weights = torch.softmax(torch.randn(S, K, generator=gen), -1).to(dtype)
    keep = torch.rand(S, generator=gen) > 0.1  # a few synthetic rows
    gate_up, down = torch.randn(E, 2 * I, H, generator=gen) * 0.1, torch.randn(E, H, I, generator=gen) * 0.1
    grad = torch.randn(S, H, generator=gen).to(dtype)
    return x, ids, weights, keep, gate_up.to(dtype), down.to(dtype), grad


def run(dtype, perm: torch.Tensor):
    """Output, and gradients of x, gate weights and (in the original expert order) the expert
    weights, with expert e stored and routed as expert perm[e]."""
    x, ids, weights, keep, gate_up, down, grad = inputs(dtype)
    inv = torch.argsort(perm)
    experts = ExpertParallelExperts(FusedExperts(gate_up[inv], down[inv]), E, None)
    x.requires_grad_(True)
    weights.requires_grad_(True)
    out = experts(x, perm[ids], weights, keep)
    out.backward(grad)
    return {"out": out.detach(), "x": x.grad, "weights": weights.grad,
            "gate_up": experts.gate_up_proj.grad[perm], "down": experts.down_proj.grad[perm]}


PERMS = [torch.arange(E), torch.arange(E).flip(0), torch.randperm(E, generator=torch.Generator().manual_seed(5))]


@pytest.mark.parametrize("grouped", [True, False], ids=["grouped_mm", "per-expert"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_top8_moe_is_bitwise_the_same_under_permuted_expert_order(dtype, grouped, monkeypatch):
    if not grouped:
        monkeypatch.setattr(moe, "grouped_mm_fits", lambda *a: False)
    elif not moe.grouped_mm_fits(torch.zeros(1, H, dtype=dtype), torch.zeros(E, 2 * I, H, dtype=dtype)):
        pytest.skip("torch._grouped_mm does not take these shapes on this torch")
    base = run(dtype, PERMS[0])
    for perm in PERMS[1:]:
        other = run(dtype, perm)
        for key in base:
            assert torch.equal(other[key], base[key]), (key, perm.tolist())
    assert torch.equal(base["out"][~inputs(dtype)[3]], torch.zeros(int((~inputs(dtype)[3]).sum()), H, dtype=dtype))


def test_the_index_add_combine_depends_on_expert_order(monkeypatch):
    """The control, on the same block: the former combine gives different bits when the experts
    are permuted, in fp32 (and its result is still right to fp32 precision). In bf16 this CPU's
    index_add accumulates in fp32 before rounding, so the order rarely shows there; on CUDA a
    bf16 index_add is atomics on bf16, each add rounded, in whatever order the threads land."""
    monkeypatch.setattr(moe, "combine", index_add_combine)
    base, other = run(torch.float32, PERMS[0]), run(torch.float32, PERMS[2])
    diff, scale = (base["out"] - other["out"]).abs().max(), base["out"].abs().max()
    print(f"index_add combine, experts permuted (fp32): max|a-b| {float(diff):.3g} of max|a| {float(scale):.3g}")
    assert not torch.equal(base["out"], other["out"])
    assert not torch.equal(base["x"], other["x"])  # the autograd of x[pairs // k] adds in arrival order too
    assert_parity("index_add combine, experts permuted", diff, scale)  # rounding order, not a wrong result


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_combine_sums_each_tokens_slots_whatever_the_arrival_order(dtype):
    gen = torch.Generator().manual_seed(1)
    tokens, k = 41, 8
    pairs = torch.randperm(tokens * k, generator=gen)[: tokens * k - 9]  # 9 pairs never dispatched
    rows = torch.randn(len(pairs), H, generator=gen).to(dtype)
    want = combine(rows, pairs, tokens, k)
    exact = torch.zeros(tokens * k, H, dtype=torch.float64).index_copy(0, pairs, rows.double()).view(tokens, k, H).sum(1)
    ulps = float((want.double() - exact).abs().max() / (torch.finfo(dtype).eps * exact.abs().max()))
    print(f"combine ({dtype}) vs the float64 sum: {ulps:.2f} eps of its dtype relative to max|sum|")
    assert ulps <= 1.0  # one rounding of an fp32-accumulated sum (bf16), a few fp32 adds (fp32)
    added = set()
    for seed in range(4):
        order = torch.randperm(len(pairs), generator=torch.Generator().manual_seed(seed))
        assert torch.equal(combine(rows[order], pairs[order], tokens, k), want)
        added.add(index_add_combine(rows[order], pairs[order], tokens, k).view(torch.int16).numpy().tobytes())
    if dtype == torch.float32:  # control: arrival order changes the index_add sums' bits (see above for bf16)
        assert len(added) > 1


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_grouped_mm_experts_equal_the_per_expert_gemms(dtype, monkeypatch):
    """`torch._grouped_mm` (where this torch takes the shapes) vs one pair of GEMMs per expert:
    output and every gradient, within fp32-ulps of the values (bitwise on this machine so far)."""
    if not moe.grouped_mm_fits(torch.zeros(1, H, dtype=dtype), torch.zeros(E, 2 * I, H, dtype=dtype)):
        pytest.skip("torch._grouped_mm does not take these shapes on this torch")
    grouped = run(dtype, PERMS[2])
    monkeypatch.setattr(moe, "grouped_mm_fits", lambda *a: False)
    loop = run(dtype, PERMS[2])
    k = 16 if dtype == torch.float32 else 16 * 2 ** 16  # eps32 units: a bf16 ulp is 2^16 of them
    for key in grouped:
        a, b = grouped[key].float(), loop[key].float()
        assert_parity(f"grouped_mm vs per-expert GEMMs ({dtype}): {key} (bitwise {torch.equal(a, b)})",
                      (a - b).abs().max(), b.abs().max(), k=k)
