"""Context parallelism: a CP forward gives one process's numbers, and its layout is balanced.

The reference is stock transformers "sdpa" on the padded batch (attention_mask) in one
process: independent of model/context_parallel.py. The CP runs are one
gloo launch per cp size (cp=2, cp=4), every case inside it (tests/cp_worker.py).
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from cp_worker import CHANGED, LENGTHS, SINGLE, cp_checks, local_slots, records, tiny_qwen3, token_logp, token_mean_loss
from testing.distributed import run_distributed
from tests.parity_check import assert_control_fails, assert_parity
from nemo_automodel.components.distributed.context_parallel.sharder import round_robin_local_indices

from model.attention import packed_attn_kwargs
from model.context_parallel import CP_VARLEN, CPContext, _attend, cp_attention_forward
from runtime.parallel_dims import ParallelDims, build_mesh, init_distributed
from packing.collate import make_experience_batch
from runtime.cp_shard import attention_work, cp_layout, shard, shard_tokens, unshard

def logp_scale(ref) -> float:
    return float(ref["logp"].abs().max())


def grad_scale(ref) -> float:
    return max(float(g.abs().max()) for g in ref["grads"].values())


# ------------------------------------------------------------------ reference
def _reference(lengths, seed=0):
    """One process, stock sdpa, padded batch: log-probs `[B, T-1]` (0 off real slots) and grads."""
    model = tiny_qwen3("sdpa")
    batch = make_experience_batch(records(lengths, seed), packed=False)
    logits = model(input_ids=batch.sequences, attention_mask=batch.attention_mask).logits
    valid = batch.attention_mask[:, 1:]
    logp = token_logp(logits[:, :-1], batch.sequences[:, 1:]).masked_fill(~valid, 0.0)
    token_mean_loss(logp, batch.action_mask).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return {"logp": logp.detach(), "valid": valid, "grads": grads}


@pytest.fixture(scope="module")
def reference():
    return {"main": _reference(LENGTHS), "single": _reference(SINGLE, seed=1)}


def as_padded(pack_logp: torch.Tensor, lengths) -> torch.Tensor:
    """`[1, N]` pack slots -> `[B, T-1]` (each sequence's trailing slot dropped)."""
    rows = [s[:-1] for s in pack_logp[0].split(list(lengths))]
    return torch.stack([F.pad(r, (0, max(lengths) - 1 - r.numel())) for r in rows])


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


@functools.cache
def launch(cp: int) -> list[dict]:
    """One gloo launch of `cp` ranks running every case (cached: process start-up costs seconds)."""
    return run_distributed(cp_checks, cp, timeout=240)


@pytest.fixture(scope="module", params=[2, 4], ids=["cp2", "cp4"])
def cp_run(request):
    return request.param, launch(request.param)


# ------------------------------------------------------------ multi-process
@pytest.mark.slow
def test_cp_log_probs_and_grads_match_one_process(cp_run, reference):
    cp, ranks = cp_run
    ref = reference["main"]
    for r, out in enumerate(ranks):
        assert out["dims"] == {"dp": 1, "cp": cp, "cp_rank": r, "dp_group": None, "cp_group_ranks": list(range(cp))}
        assert out["local_tokens"] == ranks[0]["local_tokens"]
        for case in ("packed", "padded"):  # every rank holds the full restored outputs
            assert torch.equal(out[case]["logp"], ranks[0][case]["logp"])
    packed, padded = ranks[0]["packed"], ranks[0]["padded"]
    assert packed["logp"].shape == (1, sum(LENGTHS)) and padded["logp"].shape == ref["logp"].shape
    diff = (as_padded(packed["logp"], LENGTHS) - ref["logp"])[ref["valid"]].abs().max()
    assert_parity(f"cp={cp} packed log-probs vs one process", diff, logp_scale(ref))
    assert_parity(f"cp={cp} padded log-probs vs one process",
                  (padded["logp"] - ref["logp"])[ref["valid"]].abs().max(), logp_scale(ref))
    assert not padded["logp"][~ref["valid"]].any()  # no slot without a real next token scores
    # exact: no factor of cp
    assert_parity(f"cp={cp} packed grads vs one process", max_diff(packed["grads"], ref["grads"]), grad_scale(ref))
    assert_parity(f"cp={cp} padded grads vs one process", max_diff(padded["grads"], ref["grads"]), grad_scale(ref))


@pytest.mark.slow
def test_shared_prompts_under_cp_equal_the_unshared_pack_of_one_process(cp_run):
    """The shared-prompt forward at cp 2 and 4 (tests/cp_worker.py `shared_prompt_checks`): each
    rank's body runs its zigzag shard of the compressed rows; log-probs and the CP-summed grads
    equal the one-process unshared pack's. Control: the CP mask without the units' segments."""
    from test_shared_prompt import SHARED_ULPS

    cp, ranks = cp_run
    for r, out in enumerate(ranks):
        s = out["shared"]
        assert s["seen"] == [s["local_rows"]] and s["rows"] < s["n"], s
        for key in ("log_probs", "grads"):
            assert_parity(f"cp={cp} rank {r} shared {key} vs one-process unshared", *s[key], k=SHARED_ULPS)
        assert_control_fails(f"cp={cp} rank {r} shared without segments, log-probs",
                             *s["control_no_segments"]["log_probs"], k=SHARED_ULPS)


@pytest.mark.slow
def test_sequences_shorter_than_2cp_and_a_one_sequence_pack(cp_run, reference):
    cp, ranks = cp_run
    assert min(LENGTHS) < 2 * cp
    short = as_padded(ranks[0]["packed"]["logp"], LENGTHS)[:3]  # lengths 1, 2, 3
    ref = reference["main"]
    assert_parity(f"cp={cp} sequences shorter than 2cp", (short - ref["logp"][:3])[ref["valid"][:3]].abs().max(),
                  logp_scale(ref))
    single, ref1 = ranks[0]["single"]["logp"], reference["single"]
    assert_parity(f"cp={cp} one-sequence pack", (as_padded(single, SINGLE) - ref1["logp"]).abs().max(), logp_scale(ref1))


@pytest.mark.slow
def test_changing_one_sequence_leaves_the_others_unchanged(cp_run):
    _, ranks = cp_run
    before = ranks[0]["packed"]["logp"][0].split(LENGTHS)
    after = ranks[0]["changed"]["logp"][0].split(LENGTHS)
    for i, (x, y) in enumerate(zip(before, after)):
        if i == CHANGED:
            assert not torch.equal(x, y)
        else:
            assert torch.equal(x, y), f"sequence {i} changed by {float((x - y).abs().max())}"


@pytest.mark.slow
def test_contiguous_sharding_is_exact_too(cp_run, reference):
    _, ranks = cp_run
    ref = reference["main"]
    got = as_padded(ranks[0]["contiguous"]["logp"], LENGTHS)
    assert_parity("contiguous sharding log-probs vs one process", (got - ref["logp"])[ref["valid"]].abs().max(),
                  logp_scale(ref))


@pytest.mark.slow
def test_wrong_chunk_order_or_no_kv_gather_breaks_parity(cp_run, reference):
    _, ranks = cp_run
    ref = reference["main"]
    for control in ("wrong_order", "no_gather"):
        got = as_padded(ranks[0][control]["logp"], LENGTHS)
        assert_control_fails(control, (got - ref["logp"])[ref["valid"]].abs().max(), logp_scale(ref))


@pytest.mark.slow
def test_a_gather_whose_backward_sums_over_ranks_gives_cp_times_the_grads(cp_run, reference):
    cp, ranks = cp_run
    naive, ref = ranks[0]["naive_restore"], reference["main"]
    assert torch.equal(naive["logp"], ranks[0]["packed"]["logp"])  # same forward
    scaled = {k: v * cp for k, v in ref["grads"].items()}
    assert_parity(f"naive restore grads vs {cp} x one process", max_diff(naive["grads"], scaled), cp * grad_scale(ref))
    assert_control_fails("naive restore grads vs one process", max_diff(naive["grads"], ref["grads"]), grad_scale(ref))


@pytest.mark.slow
def test_process_groups_of_dp2_cp2_ep2():
    for rank, out in enumerate(launch(4)):  # rank = dp_rank * cp + cp_rank
        d, c = divmod(rank, 2)
        assert out["groups_dp2_cp2_ep2"] == {
            "dp": [c, 2 + c],  # same cp coordinate
            "cp": [2 * d, 2 * d + 1],  # consecutive ranks
            "ep": [c, 2 + c],  # ep=2 consecutive dp ranks of the same cp coordinate
            "expert_fsdp": [2 * d, 2 * d + 1],  # dp / ep = 1: the expert shard lives on this rank and its CP peer
            "fsdp": [0, 1, 2, 3],  # dense parameters shard over every rank
        }


# ---------------------------------------------------------------- one process
def test_parallel_dims_reject_sizes_that_do_not_fill_the_world():
    with pytest.raises(ValueError, match="cp=3 does not divide world_size=8"):
        ParallelDims(cp=3, world_size=8)
    with pytest.raises(ValueError, match=r"dp=3 x cp=2 = 6 != world_size=8"):
        ParallelDims(dp=3, cp=2, world_size=8)
    with pytest.raises(ValueError, match="ep=3 does not divide dp=4"):
        ParallelDims(cp=2, ep=3, world_size=8)
    with pytest.raises(ValueError, match="dp=0"):
        ParallelDims(dp=0, world_size=8)
    dims = ParallelDims(cp=2, ep=2, world_size=8)
    assert (dims.dp, dims.cp, dims.ep, dims.edp) == (4, 2, 2, 2)


def test_init_distributed_checks_sizes_before_joining(monkeypatch):
    env = {"WORLD_SIZE": "8", "RANK": "0", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(ValueError, match="cp=3 does not divide world_size=8"):
        init_distributed(cp=3)


def test_one_plain_process_has_size_one_groups(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    dims = init_distributed()
    assert (dims.world_size, dims.dp, dims.cp, dims.rank, dims.dp_rank, dims.cp_rank) == (1, 1, 1, 0, 0, 0)
    assert dims.dp_group is dims.cp_group is dims.ep_group is dims.expert_fsdp_mesh is dims.fsdp_mesh is None
    assert build_mesh(dims) is None


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "padded"])
def test_shard_then_restore_is_the_identity(packed):
    batch = make_experience_batch(records([1, 2, 3, 11, 30, 17, 8]), packed=packed)
    x = torch.randn(*batch.sequences.shape, 3)
    for cp in (1, 2, 3, 4):
        layouts = [cp_layout(batch, cp, r) for r in range(cp)]
        counts = {lay.num_local for lay in layouts}
        assert len(counts) == 1 and counts.pop() * cp == sum(layouts[0].padded_lens)
        assert all(n % (2 * cp) == 0 for n in layouts[0].padded_lens)
        shards = [shard_tokens(x, lay) for lay in layouts]
        assert torch.equal(unshard(torch.cat(shards, dim=1), layouts[0]), x)
        for r, lay in enumerate(layouts):  # the zigzag layout of AutoModel / TE, sequence by sequence
            start, mine = 0, []
            for p in lay.padded_lens:
                mesh = type("Mesh", (), {"size": lambda self: cp, "get_local_rank": lambda self: r})()
                mine.append(start + round_robin_local_indices(mesh, p))
                start += p
            assert torch.equal(lay.local_index, torch.cat(mine))


def test_local_fields_keep_slot_alignment_and_global_positions():
    recs = records([1, 2, 3, 11, 30, 17])
    for packed in (True, False):
        batch = make_experience_batch(recs, packed=packed)
        for cp in (2, 3):
            for r in range(cp):
                local, lay = shard(batch, cp, r)
                targets, valid = local_slots(batch, lay)
                src, real = lay.local_source, lay.local_real
                assert torch.equal(real, local.attention_mask)
                rows = range(batch.sequences.shape[0])
                for b in rows:
                    for i, s in enumerate(src.tolist()):
                        if s < 0:  # CP padding: masked from everything
                            assert not real[b, i] and not local.action_mask[b, i] and not valid[b, i]
                            continue
                        seq = lay.local_seq_id[i]
                        if packed:
                            start = sum(lay.seq_lens[:seq])
                            assert local.position_ids[b, i] == s - start == lay.local_position[i]
                            has_next = s + 1 < start + lay.seq_lens[seq]
                            assert local.action_mask[b, i] == batch.action_mask[b, s]
                        else:
                            has_next = s + 1 < batch.sequences.shape[1] and bool(batch.attention_mask[b, s + 1])
                            slot = batch.action_mask[b, s] if s < batch.action_mask.shape[1] else False  # [B, T-1]
                            assert local.action_mask[b, i] == slot
                        assert valid[b, i] == has_next
                        if has_next:  # slot k scores token k+1, which may live on another rank
                            assert targets[b, i] == batch.sequences[b, s + 1]


def test_zigzag_balances_attention_work_and_contiguous_does_not():
    batch = make_experience_batch(records([1000, 517, 2048, 301, 64]), packed=True)
    for cp in (2, 4):
        zigzag = [attention_work(cp_layout(batch, cp, r)) for r in range(cp)]
        contiguous = [attention_work(cp_layout(batch, cp, r, zigzag=False)) for r in range(cp)]
        assert sum(zigzag) == sum(contiguous) == attention_work(cp_layout(batch, 1, 0))
        assert max(zigzag) / min(zigzag) < 1.02, zigzag
        assert max(contiguous) / min(contiguous) > 2.5, contiguous


def test_ep_suffix_is_more_cp_padding_on_the_last_sequence():
    batch = make_experience_batch(records([5, 9]), packed=True)
    natural = cp_layout(batch, 2, 0).num_local  # (8 + 12) / 2
    layouts = [cp_layout(batch, 2, r, local_tokens=natural + 4) for r in range(2)]
    assert [lay.num_local for lay in layouts] == [natural + 4] * 2
    assert layouts[0].padded_lens == (8, 20)
    assert int(layouts[0].real.sum()) == 14  # the suffix is padding
    with pytest.raises(ValueError, match="local_tokens=11"):
        cp_layout(batch, 2, 0, local_tokens=natural + 1)


def test_flash_segments_select_the_keys_the_mask_allows(monkeypatch):
    """The GPU path of `_attend` on CPU, with a reference flash kernel (bottom-right causal sdpa
    per segment, tests/conftest.py): the same outputs as the mask path on every real token."""
    from conftest import reference_flash_varlen
    from model import kernels

    batch = make_experience_batch(records([1, 3, 11, 30]), packed=True)
    module = torch.nn.Module()
    module.num_key_value_groups = 2
    gen = torch.Generator().manual_seed(0)
    for cp in (2, 3):
        for r in range(cp):
            lay = cp_layout(batch, cp, r)
            s_local, s_full = lay.num_local, lay.num_local * cp
            q = torch.randn(1, 4, s_local, 8, generator=gen)
            k, v = torch.randn(2, 1, 2, s_full, 8, generator=gen)
            want = _attend(module, q, k, v, CPContext(layout=lay, group=None), 0.0, None)[0]  # [S_local, H, D]
            with monkeypatch.context() as mp:  # one process, as if K/V were gathered
                mp.setattr(kernels, "packed_kernel", lambda query: reference_flash_varlen)
                got = _attend(module, q, k, v, CPContext(layout=lay, group=None), 0.0, None)[0]
            real = lay.local_real[0]
            assert_parity(f"cp={cp} rank {r} flash segments vs the mask path",
                          (got[real] - want[real]).abs().max(), want.abs().max())


def per_sequence_causal_attention(q, k, v, lengths) -> torch.Tensor:
    """The attention a pack must get, `[B, S, H, D]`: each sequence of `lengths` its own causal
    sdpa (K/V heads repeated for the query heads), written without model/."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    bounds = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    out = [F.scaled_dot_product_attention(q[:, :, s:e], k[:, :, s:e], v[:, :, s:e], is_causal=True)
           for s, e in zip(bounds, bounds[1:])]
    return torch.cat(out, dim=2).transpose(1, 2)


def test_cp_varlen_without_a_cp_context_is_per_sequence_causal_attention():
    """Layers of a CP model call "cp_varlen"; outside a CP shard (no cp_context) it is the pack's
    attention: each sequence attends causally to itself only. Control: the same pack declared as
    one sequence (boundaries dropped) misses the reference by orders of magnitude."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    assert ALL_ATTENTION_FUNCTIONS[CP_VARLEN] is cp_attention_forward
    module = torch.nn.Module()
    module.num_key_value_groups = 2
    lengths = [4, 1, 7, 3]
    n = sum(lengths)
    gen = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(1, 4, n, 8, generator=gen), *torch.randn(2, 1, 2, n, 8, generator=gen)
    want = per_sequence_causal_attention(q, k, v, lengths)
    got = cp_attention_forward(module, q, k, v, None, **packed_attn_kwargs(lengths))[0]
    assert_parity("cp_varlen without cp_context vs per-sequence causal sdpa", (got - want).abs().max(),
                  want.abs().max())
    leak = cp_attention_forward(module, q, k, v, None, **packed_attn_kwargs([n]))[0]
    assert_control_fails("the pack as one sequence", (leak - want).abs().max(), want.abs().max())


# ------------------------------------------------------------------ shared prompts
SHARED_UNITS = [(5, (3, 6, 1)), (4, ()), (7, (2, 9)), (1, ())]  # (prefix, responses) per unit; alone: ()


def _shared_pack():
    from packing.collate import make_experience_batch as collate
    from packing.experience import Experience

    lens = [p + sum(rs) for p, rs in SHARED_UNITS]
    gen = torch.Generator().manual_seed(3)
    recs = [Experience(sequences=torch.randint(0, 50, (n,), generator=gen)) for n in lens]
    return collate(recs, packed=True)


def test_shared_prompt_segments_mask_exactly_the_shared_attention():
    """`cp_layout` with the units' `Segments`: on the gathered axis, a real query sees exactly the
    keys the shared-prompt attention allows (its unit's prefix causally, its own segment's
    earlier tokens), for every rank at cp 2 and 3; the dense reference is built from the units."""
    from model.context_parallel import attention_mask
    from runtime.cp_shard import Segments

    pack = _shared_pack()
    n = pack.sequences.shape[1]
    expected = torch.zeros(n, n, dtype=torch.bool)
    start = 0
    for p, responses in SHARED_UNITS:
        expected[start:start + p, start:start + p] = torch.ones(p, p, dtype=torch.bool).tril()
        r0 = start + p
        for r in responses:
            expected[r0:r0 + r, start:start + p] = True
            expected[r0:r0 + r, r0:r0 + r] = torch.ones(r, r, dtype=torch.bool).tril()
            r0 += r
        start = r0
    segments = Segments.of_units(SHARED_UNITS)
    for cp in (2, 3):
        for rank in range(cp):
            lay = cp_layout(pack, cp, rank, segments=segments)
            mask = attention_mask(lay)[0, 0]  # [S_local, S_full]
            q_src = lay.local_source
            k_src = lay.source[lay.order.flatten()]
            for i in torch.nonzero(q_src >= 0).squeeze(1).tolist():
                seen = k_src[mask[i] & (k_src >= 0)]
                assert sorted(seen.tolist()) == torch.nonzero(expected[q_src[i]]).squeeze(1).tolist(), (cp, rank, i)
            plain = attention_mask(cp_layout(pack, cp, rank))[0, 0]  # the control: without segments
            assert (plain & ~mask).any()  # ... a response sees its siblings


def test_shared_prompt_flash_segments_select_the_keys_the_mask_allows(monkeypatch):
    from conftest import reference_flash_varlen
    from model import kernels
    from runtime.cp_shard import Segments

    pack = _shared_pack()
    module = torch.nn.Module()
    module.num_key_value_groups = 2
    gen = torch.Generator().manual_seed(0)
    for cp in (2, 3):
        for r in range(cp):
            lay = cp_layout(pack, cp, r, segments=Segments.of_units(SHARED_UNITS))
            s_local, s_full = lay.num_local, lay.num_local * cp
            q = torch.randn(1, 4, s_local, 8, generator=gen)
            k, v = torch.randn(2, 1, 2, s_full, 8, generator=gen)
            want = _attend(module, q, k, v, CPContext(layout=lay, group=None), 0.0, None)[0]
            with monkeypatch.context() as mp:
                mp.setattr(kernels, "packed_kernel", lambda query: reference_flash_varlen)
                got = _attend(module, q, k, v, CPContext(layout=lay, group=None), 0.0, None)[0]
            real = lay.local_real[0]
            assert_parity(f"shared cp={cp} rank {r} flash segments vs the mask path",
                          (got[real] - want[real]).abs().max(), want.abs().max())


def test_flash_segments_are_built_on_the_layouts_device():
    """The layout on another device than the host's index tensors (meta here, CUDA on a GPU): no op
    mixes devices, so CUDA's `index_put_` gets its values on the layout's device (issue 52.5: a
    CPU `arange` into a CUDA layout was refused). The segments equal the host layout's.
    Control: the audit sees the old write, a host `arange` put into a meta tensor."""
    import dataclasses

    from testing.mixed_devices import MixedDevices
    from model.context_parallel import flash_segments
    from runtime.cp_shard import Segments

    for pack, segments in ((make_experience_batch(records([1, 3, 11, 30]), packed=True), None),
                           (_shared_pack(), Segments.of_units(SHARED_UNITS))):
        for r in range(2):
            lay = cp_layout(pack, 2, r, segments=segments)
            on_meta = lay.to("meta")
            if segments is not None:  # read to the host by .tolist(); meta holds no values
                on_meta = dataclasses.replace(on_meta, segment=lay.segment, shared=lay.shared)
            with MixedDevices() as seen:
                got = flash_segments(on_meta, "meta")
            assert seen.ops == [], seen.ops
            want = flash_segments(lay)
            assert [t.device.type for t in (got[0], got[1], got[4])] == ["meta"] * 3
            assert got[2:4] == want[2:4] and got[4].shape == want[4].shape
    gathered_at = torch.empty(6, dtype=torch.long, device="meta")
    with MixedDevices() as seen:
        gathered_at[torch.arange(6, device="meta")] = torch.arange(6)
    assert len(seen.ops) == 1 and "index_put" in seen.ops[0] and "cpu" in seen.ops[0]
