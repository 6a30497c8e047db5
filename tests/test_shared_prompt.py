"""Shared-prompt forward: a pack runs each repeated prompt once and scores like the whole pack.

A GRPO group's samples share their prompt tokens; with `share_prompts` the body runs each
distinct prompt once, then every member's response attending to it (model/actor.py
`_shared_prompt_view`, model/attention.py `SharedPrompts`). Log-probs, entropy, values and
parameter gradients equal the unshared pack's and the padded batch's within `SHARED_ULPS`
(fp32 eps relative to the values' magnitude, on every kernel set: run as a program, this
module prints the figures of one kernel set, and the slow test launches it per kernel set);
a wrong mask or wrong positions miss by far more. Everything it does not apply to falls back.

    ATEN_CPU_CAPABILITY=avx2 python tests/test_shared_prompt.py --threads 1,2
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root, when run as a program

from tests.parity_check import (CONTROL_MARGIN, EPS32, PARITY_ULPS, assert_control_fails,  # noqa: E402
                                  assert_parity, max_abs, ulps)

from model import actor as actor_module  # noqa: E402
from model.actor import Actor, Critic, _forward_slots, _shared_prompt_view, _slot_targets  # noqa: E402
from model.models import DENSE, build_model  # noqa: E402
from model.moe import shard_experts  # noqa: E402
from runtime.parallel_dims import ParallelDims  # noqa: E402
from packing.collate import make_experience_batch  # noqa: E402
from packing.experience import Experience  # noqa: E402
from packing.prompts import layout_of_units  # noqa: E402
from testing.records import GROUPS, grpo_records  # noqa: E402

# The suite's fp32 tolerance (tests/parity_check.py, 16 eps32 relative): sharing sums a prompt's
# gradient over its members before the matmuls instead of inside them, yet the worst measured over
# {default, avx2, avx512} x {1, 2} threads and the five families (AVX512 machine, torch 2.13) is
# 4.3 eps (entropy; grads <= 3.9 eps of the largest gradient), as packed vs padded.
SHARED_ULPS = PARITY_ULPS
FAMILIES = DENSE  # every dense family (model/families.py)


@contextlib.contextmanager
def body_tokens(model):
    """Within the context, the tokens the body (`model.model`) sees, one entry per forward."""
    seen: list[int] = []
    handle = model.model.register_forward_pre_hook(
        lambda module, args, kwargs: seen.append(kwargs["input_ids"].shape[1]), with_kwargs=True)
    try:
        yield seen
    finally:
        handle.remove()


def scored(values: torch.Tensor, batch: Experience, records) -> list[torch.Tensor]:
    """Per sample, the values on its action slots."""
    if batch.is_packed:
        starts = batch.cu_seqlens.tolist()
        rows = [values[0, s:e - 1] for s, e in zip(starts[:-1], starts[1:])]
    else:
        rows = [values[i, :r.sequences.numel() - 1] for i, r in enumerate(records)]
    return [row[r.action_mask] for row, r in zip(rows, records)]


def diff(a, batch_a, b, batch_b, records) -> tuple[float, float]:
    xs, ys = scored(a, batch_a, records), scored(b, batch_b, records)
    return max_abs(x - y for x, y in zip(xs, ys)), max_abs(xs)


def run(module, batch: Experience) -> dict:
    """Log-probs and entropy (Actor) or values (Critic), and the parameter gradients of a loss over them."""
    module.zero_grad(set_to_none=True)
    mask = batch.action_mask.float()
    if isinstance(module, Actor):
        lp, ent = module(batch, return_entropy=True)
        out = {"log_probs": lp, "entropy": ent}
        loss = ((-batch.advantages * lp - 0.01 * ent) * mask).sum() / mask.sum()
    else:
        out = {"values": module(batch)}
        loss = ((out["values"] - batch.advantages) ** 2 * mask).sum() / mask.sum()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}
    module.zero_grad(set_to_none=True)
    return {**{k: v.detach() for k, v in out.items()}, "grads": grads}


def figures(a: dict, batch_a, b: dict, batch_b, records) -> dict:
    """Each output's max difference in eps32 relative to `a`'s magnitude (grads: to max |grad|)."""
    out = {k: ulps(*diff(a[k], batch_a, b[k], batch_b, records)) for k in a if k != "grads"}
    assert a["grads"].keys() == b["grads"].keys()
    out["grads"] = ulps(max_abs(a["grads"][n] - b["grads"][n] for n in a["grads"]), max_abs(a["grads"].values()))
    return out


def shared_parity(family: str) -> dict:
    """Shared-prompt pack vs the unshared pack and vs padded, actor and critic, in eps32 units."""
    records = grpo_records()
    pack, padded = make_experience_batch(records, packed=True), make_experience_batch(records, packed=False)
    lm = build_model(family, seed=0)
    out = {}
    rows_32 = 32 * 4 * lm.config.vocab_size  # 32-row log-prob chunks
    for name, shared, plain in (("actor", Actor(lm, chunk_bytes=rows_32, share_prompts=True), Actor(lm, chunk_bytes=rows_32)),
                                ("critic", Critic(lm, share_prompts=True), Critic(lm))):
        with body_tokens(lm) as seen:
            s = run(shared, pack)
        assert seen == [pack.shared_prompts.keep.numel()], "the shared forward did not run"
        u, p = run(plain, pack), run(plain, padded)
        for key, value in figures(u, pack, s, pack, records).items():
            out[f"{name}_{key}_vs_pack"] = value
        for key, value in figures(p, padded, s, pack, records).items():
            out[f"{name}_{key}_vs_padded"] = value
    return out


# ----------------------------------------------------------------- fixtures
@pytest.fixture(scope="module", params=FAMILIES)
def lm(request):
    return build_model(request.param, seed=0)


@pytest.fixture(scope="module")
def records():
    return grpo_records()


@pytest.fixture(scope="module")
def pack(records):
    return make_experience_batch(records, packed=True)


# ------------------------------------------------------------------- parity
@pytest.mark.parametrize("family", FAMILIES)
def test_shared_prompt_scores_and_grads_match_the_whole_pack_and_padded(family):
    for key, value in shared_parity(family).items():
        print(f"{family} {key}: {value:.2f} eps32 (limit {SHARED_ULPS})")
        assert value <= SHARED_ULPS, f"{family} {key}: {value:.2f} eps32, limit {SHARED_ULPS}"


@pytest.mark.parametrize("wrong", ["previous-response-visible", "positions-restart"])
def test_a_wrong_mask_or_wrong_positions_miss_by_far(lm, records, pack, wrong, monkeypatch):
    """Controls: responses that also see the first member's response, or whose positions
    restart at 0, miss the unshared pack's hidden states by orders of magnitude more than the
    tolerance (the right layout: within it). Hidden states, not log-probs: a tiny random
    model's near-uniform log-probs (~log 256) hide a RoPE shift of a few tokens (~3.6e3 eps)."""
    def hidden(share: bool) -> torch.Tensor:
        with torch.no_grad():
            return _forward_slots(lm, pack, ParallelDims(), replay=False, share_prompts=share)[0]

    plain = hidden(False)
    assert_parity("hidden states, shared vs unshared", (hidden(True) - plain).abs().max(), plain.abs().max(),
                  k=SHARED_ULPS)
    view = actor_module._shared_prompt_view

    def wrong_view(*args):
        shared = view(*args)
        layout = shared.inputs["shared_prompts"]
        if wrong == "previous-response-visible":  # the first response joins the "prompt" its siblings attend to
            units = [(p + rs[0], rs[1:]) if len(rs) > 1 else (p, rs) for p, rs in layout.units]
            shared.inputs["shared_prompts"] = layout_of_units(units, layout.keep, layout.expand)
        else:
            pos = torch.cat([torch.arange(p) if not rs else torch.cat([torch.arange(p), *map(torch.arange, rs)])
                             for p, rs in layout.units]).unsqueeze(0)
            shared.inputs["position_ids"] = pos
        return shared

    monkeypatch.setattr(actor_module, "_shared_prompt_view", wrong_view)
    assert_control_fails(f"shared prompts with {wrong}", (hidden(True) - plain).abs().max(), plain.abs().max(),
                         k=SHARED_ULPS)


def test_the_flash_branch_builds_the_same_attention(lm, records, pack, flash_on_cpu):
    """The GPU branch (one varlen call on K/V gathered by `kv_index`, cu_seqlens_q != cu_seqlens_k,
    causal bottom-right) run on CPU with conftest's reference kernel: the CPU path's numbers."""
    with torch.no_grad():
        flash = Actor(lm, share_prompts=True)(pack)
    segments = sum(1 + len(rs) for _, rs in pack.shared_prompts.units)
    assert flash_on_cpu == [segments] * lm.config.num_hidden_layers
    flash_on_cpu.clear()
    with torch.no_grad(), pytest.MonkeyPatch.context() as mp:
        from model import kernels

        mp.setattr(kernels, "packed_kernel", lambda query: None)
        cpu = Actor(lm, share_prompts=True)(pack)
        plain = Actor(lm)(pack)
    assert flash_on_cpu == []
    assert_parity("log-probs through the flash branch vs the CPU path", (flash - cpu).abs().max(), cpu.abs().max())
    assert_parity("log-probs through the flash branch vs unshared", (flash - plain).abs().max(), plain.abs().max(),
                  k=SHARED_ULPS)


# ------------------------------------------------------------------- layout
def test_the_compressed_pack_holds_each_distinct_prompt_once_and_every_response(records, pack):
    layout = pack.shared_prompts
    units, keep, expand = layout.units, layout.keep, layout.expand
    distinct = {p: None for p, _ in GROUPS}  # every test prompt length is distinct
    # a group shares its prompt but the last token, which opens each member's response segment
    responses = sum(sum(r + 1 for r in rs) for _, rs in GROUPS if len(rs) > 1)
    alone = sum(p + sum(rs) for p, rs in GROUPS if len(rs) == 1)
    assert keep.numel() == sum(p - 1 for p, rs in GROUPS if len(rs) > 1) + responses + alone
    assert keep.numel() < pack.sequences.numel() == sum(len(rs) * p + sum(rs) for p, rs in GROUPS)
    assert sorted(p + 1 for p, rs in units if rs) == sorted(p for p, rs in GROUPS if len(rs) > 1)
    assert len(distinct) == 4
    # every compressed row scores one target: the token after it is the same in every slot that reads it
    nxt = torch.roll(pack.sequences[0], -1)
    assert torch.equal(nxt[keep][expand][pack.action_mask[0]], nxt[pack.action_mask[0]])
    assert [(p, rs) for p, rs in units if not rs] == [(9 + 6, ())]  # the sample alone is one causal sequence
    # every pack slot reads a compressed slot holding its token at its position
    assert torch.equal(pack.sequences[0, keep][expand], pack.sequences[0])
    assert torch.equal(pack.position_ids[0, keep][expand], pack.position_ids[0])
    assert expand.numel() == pack.sequences.numel() and int(expand.max()) == keep.numel() - 1


def test_the_layout_is_built_once_by_the_collate_and_travels_with_the_batch(records, pack, monkeypatch):
    """The pack carries its layout (None for a padded batch); `.to` moves every index tensor; the
    forward reads it and never rebuilds it (the builder, patched to raise, is not called)."""
    from packing import prompts

    assert make_experience_batch(records, packed=False).shared_prompts is None
    moved = pack.to("meta")
    layout = moved.shared_prompts
    assert all(t.device.type == "meta" for t in (layout.keep, layout.expand, layout.multiplicity,
                                                 layout.cu_seq_lens_q, layout.cu_seq_lens_k, layout.kv_index))
    assert layout.units == pack.shared_prompts.units and pack.shared_prompts.keep.device.type == "cpu"
    monkeypatch.setattr(prompts, "shared_prompts", lambda *a: pytest.fail("the forward rebuilt the layout"))
    lm = build_model("qwen3", seed=0)
    with torch.no_grad(), body_tokens(lm) as seen:
        Actor(lm, share_prompts=True)(pack)
    assert seen == [pack.shared_prompts.keep.numel()]
    # a layout of another pack is refused by name and shape
    other = make_experience_batch(records[:-1], packed=True)
    stale = dataclasses.replace(pack, shared_prompts=other.shared_prompts)
    with pytest.raises(ValueError, match=r"shared_prompts.expand has shape \(\d+,\), expected \[\d+\]"):
        Actor(lm, share_prompts=True)(stale)


def test_groups_come_from_the_tokens_not_prompt_index():
    """Equal prompt tokens under different `prompt_index`: shared. The same `prompt_index` on
    different tokens: not shared. A sample with no action slot is alone."""
    prompt, other = torch.arange(10, 16), torch.arange(20, 26)

    def record(tokens, response, index, acting=True):
        t = tokens.numel() + response
        return Experience(sequences=torch.cat([tokens, torch.arange(100, 100 + response)]),
                          action_mask=(torch.arange(t - 1) >= tokens.numel() - 1) & acting,
                          prompt_index=torch.tensor(index))

    pack = make_experience_batch([record(prompt, 3, 0), record(other, 2, 0), record(prompt, 4, 7),
                                  record(prompt, 5, 0, acting=False)], packed=True)
    assert pack.shared_prompts.units == ((5, (4, 5)), (8, ()), (11, ()))


def test_a_pack_without_a_repeated_prompt_runs_the_whole_pack(lm):
    records = grpo_records([(5, [4]), (4, [3]), (6, [2])], seed=5, hole=False)
    pack = make_experience_batch(records, packed=True)
    assert pack.shared_prompts is None
    with torch.no_grad(), body_tokens(lm) as seen:
        shared, plain = Actor(lm, share_prompts=True)(pack), Actor(lm)(pack)
    assert seen == [pack.sequences.numel()] * 2 and torch.equal(shared, plain)  # today's path, exactly


@pytest.mark.parametrize("case", ["padded", "cp2", "ep-suffix", "sdpa", "moe", "no-action-mask", "off"])
def test_sharing_falls_back_where_it_does_not_apply(case, records, pack):
    """Padded, an attention that ignores the layout (sdpa; "varlen" under cp > 1, where the shard
    needs "cp_varlen"), no action_mask (no layout):
    `_shared_prompt_view` declines and the forward runs as before. It applies to MoE blocks and an EP
    suffix (tests/test_shared_moe.py; ep2 in tests/test_moe.py's launch), and (the control) to the plain case."""
    model = build_model("qwen3_moe" if case == "moe" else "qwen3", seed=0)
    if case == "moe":
        shard_experts(model, None)
    batch, dims, pad = pack, ParallelDims(), None
    if case == "padded":
        batch = make_experience_batch(records, packed=False)
    elif case == "cp2":
        dims = ParallelDims(cp=2, world_size=2)
    elif case == "ep-suffix":
        pad = 3
    elif case == "sdpa":
        model.config._attn_implementation = "sdpa"
    elif case == "no-action-mask":
        batch = Experience(sequences=pack.sequences, position_ids=pack.position_ids,
                           packed_seq_lens=pack.packed_seq_lens)
    targets, valid = _slot_targets(batch)
    applies = _shared_prompt_view(model, batch, targets, valid, dims, pad)
    assert (applies is not None) == (case in ("off", "moe", "ep-suffix"))


# ---------------------------------------------------------- GPU index layout
def test_segments_keys_and_cu_seqlens_equal_the_dense_mask():
    """`layout_of_units` on CPU: the (query segment, gathered keys, bottom-right causal)
    description of flash-attn's varlen call allows exactly the dense reference mask: a prompt
    token sees its prompt causally; a response token its prompt and its own earlier tokens."""
    units = [(4, [2, 3, 1]), (5, []), (3, [2])]
    layout = layout_of_units(units)
    assert layout.cu_seq_lens_q.tolist() == [0, 4, 6, 9, 10, 15, 18, 20]
    assert layout.cu_seq_lens_k.tolist() == [0, 4, 10, 17, 22, 27, 30, 35]
    assert layout.cu_seq_lens_q.dtype == layout.cu_seq_lens_k.dtype == torch.int32
    assert (layout.max_length_q, layout.max_length_k) == (5, 7)
    n = 20
    allowed = torch.zeros(n, n, dtype=torch.bool)
    cq, ck, kv = layout.cu_seq_lens_q.tolist(), layout.cu_seq_lens_k.tolist(), layout.kv_index.tolist()
    for sq, eq, sk, ek in zip(cq[:-1], cq[1:], ck[:-1], ck[1:]):
        for j in range(eq - sq):  # bottom-right: query j sees keys < j + 1 + len_k - len_q
            allowed[sq + j, kv[sk:sk + j + 1 + (ek - sk) - (eq - sq)]] = True
    expected = torch.zeros(n, n, dtype=torch.bool)
    start = 0
    for p, responses in units:  # from the definition, independently of the builder
        expected[start:start + p, start:start + p] = torch.ones(p, p, dtype=torch.bool).tril()
        r0 = start + p
        for r in responses:
            expected[r0:r0 + r, start:start + p] = True
            expected[r0:r0 + r, r0:r0 + r] = torch.ones(r, r, dtype=torch.bool).tril()
            r0 += r
        start = r0
    assert torch.equal(allowed, expected)


# ------------------------------------------------------------------ trainer
@pytest.mark.slow
def test_the_trainer_shares_prompts_and_trains_alike():
    """One GRPO step of the tiny dense model with `model.share_prompts` true and false: the
    same metrics within the tolerance, and the body saw fewer tokens with sharing on only.
    An entropy bonus puts the log-probs into the loss (at step 0 the ratio is exactly 1)."""
    from testing.inprocess import SMALL, trainer

    results = {}
    for share in (True, False):
        tr = trainer("model=dense_tiny", *SMALL, "algo.entropy_coef=0.01", f"model.share_prompts={str(share).lower()}")
        assert tr.actor.share_prompts is share
        with body_tokens(tr.actor.model) as seen:
            results[share] = (tr.step(0), seen)
    (on, seen_on), (off, seen_off) = results[True], results[False]
    assert seen_on and seen_off and len(seen_on) == len(seen_off)
    assert all(a < b for a, b in zip(seen_on, seen_off)), (seen_on, seen_off)  # the control: off runs every token
    for key in ("loss", "grad_norm", "entropy"):
        assert_parity(f"trainer {key} shared vs unshared", abs(on[key] - off[key]), abs(off[key]), k=SHARED_ULPS)


@pytest.mark.slow
@pytest.mark.parametrize("cap", ["default", "avx2", "avx512"])
def test_the_tolerance_holds_on_every_kernel_set(cap):
    flags = Path("/proc/cpuinfo").read_text().split() if Path("/proc/cpuinfo").exists() else []
    if cap != "default" and {"avx2": "avx2", "avx512": "avx512f"}[cap] not in flags:
        pytest.skip(f"this CPU has no {cap}")
    proc = subprocess.run([sys.executable, __file__, "--threads", "1,2"],
                          env={**os.environ, "ATEN_CPU_CAPABILITY": cap}, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    worst = max(v for per_thread in result["threads"].values() for fam in per_thread.values() for v in fam.values())
    print(f"{result['capability']}: worst {worst:.2f} eps32 (limit {SHARED_ULPS}, control margin {CONTROL_MARGIN})")
    assert worst <= SHARED_ULPS


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", default=None, help="comma-separated thread counts")
    args = parser.parse_args()
    runs = {}
    for threads in [int(t) for t in args.threads.split(",")] if args.threads else [torch.get_num_threads()]:
        torch.set_num_threads(threads)
        runs[str(torch.get_num_threads())] = {family: shared_parity(family) for family in FAMILIES}
    print(json.dumps({"capability": torch.backends.cpu.get_cpu_capability(), "eps32": EPS32, "threads": runs}))


if __name__ == "__main__":
    main()
