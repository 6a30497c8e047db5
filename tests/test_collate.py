"""The collate: records -> padded [B, T] or THD pack [1, N], and back."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from nemo_automodel.components.datasets.utils import pack_features_for_thd, packed_sequence_thd_collater
from nemo_automodel.components.distributed.thd_utils import process_input_for_thd

from packing import Experience, Kind, make_experience_batch

ACTION_FIELDS = Experience.names(Kind.ACTION)
L, K = 3, 2  # MoE layers, top-k


def record(length: int, gen: torch.Generator, *, routed: bool = False, vocab: int = 1000) -> Experience:
    """A prompt + response sample with every action field filled."""
    prompt = int(torch.randint(0, length, (1,), generator=gen))
    action_mask = torch.arange(length - 1) >= max(prompt - 1, 0)
    fields = {name: torch.randn(length - 1, generator=gen) for name in ACTION_FIELDS if name != "action_mask"}
    return Experience(
        sequences=torch.randint(0, vocab, (length,), generator=gen),
        action_mask=action_mask,
        routed_experts=torch.randint(0, 8, (L, K, length), generator=gen) if routed else None,
        rewards=torch.randn((), generator=gen),
        response_length=action_mask.sum(),
        total_length=torch.tensor(length),
        **fields,
    )


def records(lengths, seed=0, **kw):
    gen = torch.Generator().manual_seed(seed)
    return [record(n, gen, **kw) for n in lengths]


lengths_st = st.lists(st.integers(1, 512), min_size=1, max_size=64)


@settings(max_examples=30, deadline=None)
@given(lengths=lengths_st, seed=st.integers(0, 2**16))
def test_pack_is_automodel_thd_pack(lengths, seed):
    items = records(lengths, seed)
    pack = make_experience_batch(items, packed=True)

    ref = packed_sequence_thd_collater(
        [pack_features_for_thd([{"input_ids": item.sequences.tolist()} for item in items])]
    )
    for ours, theirs in [(pack.sequences, ref["input_ids"]), (pack.position_ids, ref["position_ids"])]:
        assert ours.dtype == theirs.dtype and torch.equal(ours, theirs)  # byte-identical
    assert pack.packed_seq_lens == ref["seq_lens"][0].tolist() == lengths

    thd = process_input_for_thd(ref)
    assert pack.cu_seqlens.dtype == thd["cu_seqlens"].dtype
    assert torch.equal(pack.cu_seqlens, thd["cu_seqlens"])
    assert pack.max_seqlen == int(thd["max_seqlen"])


@settings(max_examples=30, deadline=None)
@given(lengths=lengths_st, seed=st.integers(0, 2**16))
def test_every_scored_target_agrees_across_layouts(lengths, seed):
    items = records(lengths, seed)
    padded = make_experience_batch(items, packed=False)
    pack = make_experience_batch(items, packed=True)
    start = 0
    for i, n in enumerate(lengths):
        slots = torch.arange(n - 1)
        scored = slots[padded.action_mask[i, : n - 1]]
        # slot k scores token k+1 in both layouts
        assert torch.equal(pack.sequences[0, start + scored + 1], padded.sequences[i, scored + 1])
        assert torch.equal(pack.action_mask[0, start : start + n - 1], padded.action_mask[i, : n - 1])
        assert not pack.action_mask[0, start + n - 1]  # the trailing slot is never scored
        start += n
    assert pack.action_mask.shape == pack.sequences.shape == (1, sum(lengths))
    assert padded.action_mask.shape == (len(lengths), max(lengths) - 1)


def test_control_pack_without_trailing_slot_misaligns_targets():
    """The property above is not vacuous: concatenating [T_i - 1] fields without the
    trailing slot shifts every later sequence's slots off their target tokens."""
    items = records([4, 6, 5], seed=1)
    pack = make_experience_batch(items, packed=True)
    naive_mask = torch.cat([item.action_mask for item in items])  # [sum(T_i - 1)], no trailing slot
    naive_targets = pack.sequences[0, 1 : naive_mask.numel() + 1][naive_mask]
    padded = make_experience_batch(items, packed=False)
    true_targets = padded.sequences[:, 1:][padded.action_mask]
    assert naive_targets.numel() == true_targets.numel()
    assert not torch.equal(naive_targets, true_targets)
    fixed_targets = pack.sequences[0, 1:][pack.action_mask[0, :-1]]
    assert torch.equal(fixed_targets, true_targets)


@settings(max_examples=30, deadline=None)
@given(lengths=lengths_st, seed=st.integers(0, 2**16))
def test_masked_token_mean_is_layout_invariant(lengths, seed):
    items = records(lengths, seed)
    padded = make_experience_batch(items, packed=False)
    pack = make_experience_batch(items, packed=True)
    for name in ACTION_FIELDS:
        if name == "action_mask":
            continue

        def token_mean(b):
            mask = b.action_mask.double()
            return (getattr(b, name).double() * mask).sum() / mask.sum().clamp(min=1)

        a, b = token_mean(padded), token_mean(pack)
        assert abs(a - b) <= 1e-6 * max(abs(a), 1e-12) + 1e-12, name


def test_padded_layout_and_pad_values():
    items = records([5, 2, 7], routed=True)
    b = make_experience_batch(items, packed=False, pad_token_id=9)
    assert b.sequences.shape == (3, 7) and b.attention_mask.dtype == torch.bool
    assert b.attention_mask.sum(-1).tolist() == [5, 2, 7]
    assert b.sequences[1, 2:].eq(9).all()
    assert b.advantages.shape == (3, 6) and b.advantages[1, 1:].eq(0).all()
    assert not b.action_mask[1, 1:].any()
    assert b.routed_experts.shape == (3, L, K, 7) and b.routed_experts[1, ..., 2:].eq(-1).all()
    assert b.rewards.shape == (3,)


@pytest.mark.parametrize("packed", [False, True])
def test_records_round_trip_through_a_batch(packed):
    items = records([1, 4, 9, 2, 16], seed=3, routed=True)
    back = make_experience_batch(items, packed=packed).split()
    assert len(back) == len(items)
    for ours, theirs in zip(back, items):
        assert dict(ours.items()).keys() == dict(theirs.items()).keys()
        for name, value in theirs.items():
            assert torch.equal(getattr(ours, name), value), name


def test_routed_experts_pack_and_live_routing_fill():
    items = records([3, 4, 2], routed=True)
    items[1].routed_experts = None  # no record: must become a -1 block (keep live routing)
    pack = make_experience_batch(items, packed=True)
    assert pack.routed_experts.shape == (1, L, K, 9)
    assert torch.equal(pack.routed_experts[0, ..., :3], items[0].routed_experts)
    assert pack.routed_experts[0, ..., 3:7].eq(-1).all()
    assert torch.equal(pack.routed_experts[0, ..., 7:], items[2].routed_experts)


def test_to_device_moves_every_tensor():
    b = make_experience_batch(records([3, 4], routed=True), packed=True).to("meta")
    assert all(v.device.type == "meta" for _, v in b.items() if isinstance(v, torch.Tensor))
    assert b.packed_seq_lens == [3, 4]


# ------------------------------------------------------------------ bad input

def test_empty_items():
    with pytest.raises(ValueError, match="items is empty"):
        make_experience_batch([])


def test_zero_length_sample():
    items = records([3, 4])
    items[1] = Experience(sequences=torch.zeros(0, dtype=torch.long))
    with pytest.raises(ValueError, match=r"item 1: field 'sequences' has shape \(0,\)"):
        make_experience_batch(items)


def test_action_field_of_wrong_length():
    items = records([3, 5])
    items[1].advantages = torch.zeros(5)
    with pytest.raises(ValueError, match=r"item 1: action field 'advantages' has shape \(5,\), expected \(4,\)"):
        make_experience_batch(items, packed=True)


def test_routed_experts_wrong_token_axis_and_layers():
    items = records([3, 5], routed=True)
    items[0].routed_experts = torch.zeros(L, K, 4, dtype=torch.long)
    with pytest.raises(ValueError, match=r"item 0: field 'routed_experts' has shape \(3, 2, 4\), expected \[L, K, 3\]"):
        make_experience_batch(items)
    items = records([3, 5], routed=True)
    items[1].routed_experts = torch.zeros(L + 1, K, 5, dtype=torch.long)
    with pytest.raises(ValueError, match=r"item 1: field 'routed_experts' has \[L, K\] = \[4, 2\], expected \[3, 2\]"):
        make_experience_batch(items, packed=True)


def test_field_with_different_dtype():
    items = records([3, 5])
    items[1].advantages = items[1].advantages.double()
    with pytest.raises(ValueError, match="item 1: field 'advantages' has dtype torch.float64, but item 0 has torch.float32"):
        make_experience_batch(items)


def test_field_missing_on_some_items():
    items = records([3, 5])
    items[1].values = None
    with pytest.raises(ValueError, match="field 'values' is present on item 0 but missing"):
        make_experience_batch(items, packed=True)


def test_media_cannot_be_packed():
    items = records([3, 5])
    items[1].pixel_values = torch.zeros(4, 12)
    with pytest.raises(ValueError, match=r"item 1: media field 'pixel_values' \(\(4, 12\)\) cannot be packed"):
        make_experience_batch(items, packed=True)
    items[0].pixel_values = torch.zeros(2, 12)
    padded = make_experience_batch(items, packed=False)  # the padded layout carries media per sample
    assert [p.shape for p in padded.pixel_values] == [(2, 12), (4, 12)]


# -------------------------------------------------------------- split: collate's inverse
def test_split_unpads_a_padded_batch_on_every_axis():
    items = records([6, 2, 9], routed=True)
    back = make_experience_batch(items, packed=False).split()
    assert [r.sequences.numel() for r in back] == [6, 2, 9]
    for stored, original in zip(back, items):
        assert stored.attention_mask is None
        assert stored.advantages.shape == (original.sequences.numel() - 1,)
        assert torch.equal(stored.routed_experts, original.routed_experts)  # routing unpadded too


def test_non_blocking_copies_to_cuda_start_from_pinned_memory(monkeypatch):
    """The trainer moves each collated batch with `to(device, non_blocking=True)`: to CUDA every
    host tensor (the shared-prompt layout's too) is pinned first, since a non-blocking copy from
    pageable memory is synchronous. This CPU-only torch can neither pin nor reach CUDA, so both
    calls are recorded instead of run. Controls: a blocking copy and a copy to the CPU pin nothing."""
    from testing.records import grpo_records

    batch = make_experience_batch(grpo_records(), packed=True)
    assert batch.shared_prompts is not None
    pinned, copies = [], []
    real_to = torch.Tensor.to

    def to(self, *args, non_blocking=False, **kwargs):
        if args and str(args[0]).startswith("cuda"):
            copies.append(non_blocking)
            return self
        return real_to(self, *args, non_blocking=non_blocking, **kwargs)

    monkeypatch.setattr(torch.Tensor, "to", to)
    monkeypatch.setattr(torch.Tensor, "is_pinned", lambda self: False)
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: pinned.append(self) or self)
    batch.to("cuda", non_blocking=True)
    assert len(copies) > 10 and all(copies) and len(pinned) == len(copies)
    shared = {id(getattr(batch.shared_prompts, name)) for name in ("keep", "expand")}
    assert shared <= {id(t) for t in pinned}
    pinned.clear(), copies.clear()
    batch.to("cuda")  # control: blocking
    assert copies and not any(copies) and not pinned
    batch.to("cpu", non_blocking=True)  # control: no device copy
    assert not pinned
