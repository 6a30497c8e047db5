"""Actor/critic forward: a pack gives the padded batch's numbers, and its boundaries are enforced."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from conftest import make_records
from tests.parity_check import assert_control_fails, assert_parity
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from model.actor import Actor, Critic, _forward_slots, _local_view, _slot_targets
from model.attention import packed_attn_kwargs, varlen_attention_forward
from model.logprobs import LOGPROB_CHUNK_BYTES, chunk_rows, token_log_probs
from model.models import TINY, TINY_MOE, build_model
from packing.collate import make_experience_batch
from runtime.parallel_dims import ParallelDims
from packing.experience import Experience

LENGTHS = [5, 61, 17, 40, 2, 9]  # uneven, with a 1-slot sample


@pytest.fixture(scope="module", params=["qwen3", "qwen3_moe"])
def name(request):
    return request.param


@pytest.fixture(scope="module")
def lm(name):
    return build_model(name, seed=0)


@pytest.fixture(scope="module")
def dense():
    return build_model("qwen3", seed=0)


@pytest.fixture(scope="module")
def records():
    return make_records(LENGTHS, seed=1)


@pytest.fixture(scope="module")
def padded(records):
    return make_experience_batch(records, packed=False)


@pytest.fixture(scope="module")
def pack(records):
    return make_experience_batch(records, packed=True)


# ---------------------------------------------------------------- helpers
def per_sample(values: torch.Tensor, batch: Experience) -> list[torch.Tensor]:
    """Action-axis outputs -> one `[T_i - 1]` tensor per sample (the trailing slot dropped)."""
    return [r.action_log_probs for r in dataclasses.replace(batch, action_log_probs=values).split()]


def scored_diff(a, batch_a, b, batch_b, records) -> float:
    return max(
        (x - y)[r.action_mask].abs().max().item()
        for x, y, r in zip(per_sample(a, batch_a), per_sample(b, batch_b), records)
    )


def token_mean(per_token: torch.Tensor, batch: Experience) -> torch.Tensor:
    mask = batch.action_mask.float()
    return (per_token * mask).sum() / mask.sum()


def grads_of(module: torch.nn.Module, loss: torch.Tensor) -> dict[str, torch.Tensor]:
    module.zero_grad(set_to_none=True)
    loss.backward()
    out = {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}
    module.zero_grad(set_to_none=True)
    return out


def rel_grad_diff(g_a: dict, g_b: dict) -> float:
    assert g_a.keys() == g_b.keys()
    scale = max(g.abs().max().item() for g in g_a.values())
    return max((g_a[n] - g_b[n]).abs().max().item() for n in g_a) / scale


def trailing_slots(pack: Experience) -> torch.Tensor:
    return pack.cu_seqlens[1:].long() - 1


# ---------------------------------------------------------------- parity
def test_packed_log_probs_entropy_and_grads_match_padded(lm, records, padded, pack):
    actor = Actor(lm, chunk_bytes=32 * 4 * lm.config.vocab_size)  # 32-row chunks
    lp_pad, ent_pad = actor(padded, return_entropy=True)
    lp_pack, ent_pack = actor(pack, return_entropy=True)
    assert lp_pad.shape == padded.action_mask.shape and lp_pack.shape == pack.action_mask.shape
    # a few fp32 ulps of the values (~5.5), on every kernel set: tests/parity_check.py
    assert_parity("log-probs packed vs padded", scored_diff(lp_pad, padded, lp_pack, pack, records), lp_pad.abs().max())
    assert_parity("entropy packed vs padded", scored_diff(ent_pad, padded, ent_pack, pack, records), ent_pad.abs().max())

    loss = lambda lp, ent, b: token_mean(-b.advantages * lp - 0.01 * ent, b)  # noqa: E731
    g_pad = grads_of(actor, loss(lp_pad, ent_pad, padded))
    g_pack = grads_of(actor, loss(lp_pack, ent_pack, pack))
    assert_parity("grads packed vs padded (relative to max |grad|)", rel_grad_diff(g_pad, g_pack), 1.0)


@pytest.mark.parametrize("layout", ["padded", "pack"])
def test_actions_only_scores_the_action_slots_alike_and_zeroes_the_rest(lm, layout, request):
    """The trainer's Actor runs the lm head on the action slots only: the same numbers and
    gradients on those slots as scoring every slot, exactly 0 with no gradient elsewhere."""
    batch = request.getfixturevalue(layout)
    full, only = Actor(lm), Actor(lm, actions_only=True)
    lp_full, ent_full = full(batch, return_entropy=True)
    lp_only, ent_only = only(batch, return_entropy=True)
    act = batch.action_mask
    assert lp_only.shape == act.shape and not lp_only[~act].any() and not ent_only[~act].any()
    assert_parity("log-probs actions only vs all", (lp_full - lp_only)[act].abs().max(), lp_full[act].abs().max())
    assert_parity("entropy actions only vs all", (ent_full - ent_only)[act].abs().max(), ent_full[act].abs().max())
    loss = lambda lp, ent: token_mean(-batch.advantages * lp - 0.01 * ent, batch)  # noqa: E731
    g_full, g_only = grads_of(full, loss(lp_full, ent_full)), grads_of(only, loss(lp_only, ent_only))
    assert_parity("grads actions only vs all", rel_grad_diff(g_full, g_only), 1.0)
    none = dataclasses.replace(batch, action_mask=torch.zeros_like(act))  # no action slot: every slot scored
    assert torch.equal(only(none).detach(), lp_full.detach())


def test_packed_critic_values_and_grads_match_padded(lm, records, padded, pack):
    critic = Critic(lm, seed=0)
    v_pad, v_pack = critic(padded), critic(pack)
    assert v_pad.shape == padded.action_mask.shape and v_pack.shape == pack.action_mask.shape
    assert v_pad.dtype == torch.float32
    assert_parity("values packed vs padded", scored_diff(v_pad, padded, v_pack, pack, records), v_pad.abs().max())
    g_pad = grads_of(critic, token_mean((v_pad - 1.0) ** 2, padded))
    g_pack = grads_of(critic, token_mean((v_pack - 1.0) ** 2, pack))
    assert_parity("critic grads packed vs padded (relative to max |grad|)", rel_grad_diff(g_pad, g_pack), 1.0)


def test_withheld_boundaries_differ_from_padded(lm, records, padded, pack):
    """Control: the pack fed as ONE sequence (positions 0..N-1, no cu_seqlens) leaks across samples."""
    actor = Actor(lm)
    with torch.no_grad():
        lp_pad = actor(padded)
        one_row = Experience(sequences=pack.sequences, attention_mask=torch.ones_like(pack.sequences, dtype=torch.bool))
        lp_leak = F.pad(actor(one_row), (0, 1))  # [1, N-1] -> the pack's [1, N] slots
    assert_control_fails("withheld boundaries", scored_diff(lp_pad, padded, lp_leak, pack, records), lp_pad.abs().max())


# ----------------------------------------------------------- boundaries
def test_changing_one_sequence_leaves_the_others_bit_identical(lm, records, pack):
    actor, critic = Actor(lm), Critic(lm, seed=0)
    changed = list(records)
    j = 1
    gen = torch.Generator().manual_seed(7)
    new_ids = torch.randint(0, TINY["vocab_size"], records[j].sequences.shape, generator=gen)
    changed[j] = dataclasses.replace(records[j], sequences=new_ids)
    other = make_experience_batch(changed, packed=True)
    with torch.no_grad():
        before = [per_sample(t, pack) for t in (*actor(pack, return_entropy=True), critic(pack))]
        after = [per_sample(t, other) for t in (*actor(other, return_entropy=True), critic(other))]
    for out_before, out_after in zip(before, after):
        assert not torch.equal(out_before[j], out_after[j])
        for i in range(len(records)):
            if i != j:
                assert torch.equal(out_before[i], out_after[i]), f"sample {i} changed when sample {j} did"


def reference_log_probs(model, ids, position_ids, seg_lens) -> torch.Tensor:
    """Known-correct `[1, N]` log-probs: stock sdpa with an explicit block-diagonal causal 4D mask."""
    seg = torch.repeat_interleave(torch.arange(len(seg_lens)), torch.tensor(seg_lens))
    n = ids.shape[1]
    mask = (seg[:, None] == seg[None, :]) & torch.ones(n, n, dtype=torch.bool).tril()
    hidden = model.model(input_ids=ids, position_ids=position_ids, attention_mask=mask[None, None]).last_hidden_state
    logits = model.lm_head(hidden).float()
    lp = logits.log_softmax(-1).gather(-1, ids.roll(-1, 1).unsqueeze(-1)).squeeze(-1)
    ends = torch.tensor(seg_lens).cumsum(0) - 1
    lp[0, ends] = 0.0
    return lp


@pytest.mark.parametrize("positions", ["restarting", "continuous"])
def test_cu_seqlens_is_authoritative_not_position_ids(dense, positions):
    a, b = 23, 30
    ids = torch.randint(0, TINY["vocab_size"], (1, a + b), generator=torch.Generator().manual_seed(3))
    pos = torch.cat([torch.arange(a), torch.arange(b)]) if positions == "restarting" else torch.arange(a + b)
    pos = pos.unsqueeze(0)
    actor = Actor(dense)
    with torch.no_grad():
        for declared, other in (([a, b], [a + b]), ([a + b], [a, b])):
            out = actor(Experience(sequences=ids, position_ids=pos, packed_seq_lens=declared))
            follows = reference_log_probs(dense, ids, pos, declared)
            ignores = reference_log_probs(dense, ids, pos, other)
            what = f"declared {declared} with {positions} positions"
            assert_parity(f"{what} vs block-diagonal sdpa", (out - follows).abs().max(), follows.abs().max())
            assert_control_fails(f"{what} vs the other boundaries", (out - ignores).abs().max(), follows.abs().max())


def test_trailing_slot_of_each_sequence_is_exactly_zero_without_grad(lm, pack, padded):
    actor, critic = Actor(lm), Critic(lm, seed=0)
    lp, ent = actor(pack, return_entropy=True)
    values = critic(pack)
    ends = trailing_slots(pack)
    for t in (lp, ent, values):
        assert torch.equal(t[0, ends], torch.zeros(len(ends)))
    grads = grads_of(actor, lp[0, ends].sum() + ent[0, ends].sum())
    assert all(torch.count_nonzero(g) == 0 for g in grads.values())
    # padded: every slot whose next token is padding is 0 too
    lp_pad = actor(padded).detach()
    assert torch.equal(lp_pad[~padded.attention_mask[:, 1:]], torch.zeros(int((~padded.attention_mask[:, 1:]).sum())))


def test_the_flash_branch_is_wired_like_the_cpu_path(lm, pack, flash_on_cpu):
    """The GPU branch of the "varlen" attention (THD transposes, cu_seq_lens, max lengths, GQA),
    run on CPU with a reference kernel: the same log-probs as the per-sequence sdpa path."""
    with torch.no_grad():
        flash = Actor(lm)(pack)
    # called in every layer, with one segment per packed sequence
    assert flash_on_cpu == [len(pack.packed_seq_lens)] * lm.config.num_hidden_layers
    flash_on_cpu.clear()
    from model import kernels

    with torch.no_grad(), pytest.MonkeyPatch.context() as mp:
        mp.setattr(kernels, "packed_kernel", lambda query: None)
        cpu = Actor(lm)(pack)
    assert flash_on_cpu == []
    assert_parity("log-probs through the flash branch vs the CPU path", (flash - cpu).abs().max(), cpu.abs().max())


def test_ep_suffix_is_invisible_to_real_tokens_and_trimmed(dense, pack):
    with torch.no_grad():
        plain, _ = _forward_slots(dense, pack, ParallelDims(), replay=False)
        suffixed, view = _forward_slots(dense, pack, ParallelDims(), replay=False, pad=7)
    n, last = pack.sequences.shape[1], pack.packed_seq_lens[-1]
    assert plain.shape == (1, n, dense.config.hidden_size) and suffixed.shape == (1, n + 7, dense.config.hidden_size)
    assert view.restore(suffixed[..., 0]).shape == (1, n)  # the suffix is cut off
    assert_parity("hidden states with vs without a 7-token EP suffix", (suffixed[:, :n] - plain).abs().max(),
                  plain.abs().max())
    inputs = view.inputs
    assert inputs["position_ids"][0, n:].tolist() == list(range(last, last + 7))  # continue the last sequence
    assert inputs["cu_seq_lens_q"][-1] == n + 7 and inputs["input_ids"].shape == (1, n + 7)
    assert view.synthetic.tolist() == [[False] * n + [True] * 7]
    assert not view.valid[0, n - 1:].any()  # the suffix scores nothing


def test_ep_suffix_on_a_padded_batch_is_refused(dense, padded):
    with pytest.raises(NotImplementedError, match="pack"):
        _local_view(padded, *_slot_targets(padded), None, pad=3)


# ------------------------------------------------------------- log-probs
@pytest.mark.parametrize("entropy_grad", [True, False], ids=["entropy-loss", "entropy-logged"])
@pytest.mark.parametrize("chunk_bytes", [7 * 4 * 40, LOGPROB_CHUNK_BYTES], ids=["chunks-recompute", "one-chunk-kept"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_log_probs_and_grads_equal_full_log_softmax(temperature, chunk_bytes, entropy_grad):
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(1, 50, 16, generator=gen, requires_grad=True)
    weight = torch.randn(40, 16, generator=gen, requires_grad=True)
    targets = torch.randint(0, 40, (1, 50), generator=gen)
    w = torch.randn(1, 50, generator=gen)
    e = torch.randn(1, 50, generator=gen) if entropy_grad else torch.zeros(1, 50)

    lp, ent = token_log_probs(hidden, weight, targets, temperature=temperature, chunk_bytes=chunk_bytes,
                              return_entropy=True)
    g = torch.autograd.grad((lp * w).sum() + ((ent * e).sum() if entropy_grad else 0), (hidden, weight))

    logp_all = (hidden @ weight.T / temperature).log_softmax(-1)
    ref_lp = logp_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    ref_ent = -(logp_all.exp() * logp_all).sum(-1)
    ref_g = torch.autograd.grad((ref_lp * w).sum() + (ref_ent * e).sum(), (hidden, weight))

    torch.testing.assert_close(lp, ref_lp, rtol=1e-6, atol=1e-6)  # |log p| ~ 20 here: a few ulps
    torch.testing.assert_close(ent, ref_ent, rtol=1e-6, atol=1e-6)
    for got, ref in zip(g, ref_g):
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    assert lp.dtype == ent.dtype == torch.float32


def test_chunked_log_probs_keep_no_logits_for_backward():
    """Only the inputs are saved for backward (each chunk's logits are recomputed), never [N, V]."""
    n, h, v = 200, 12, 300  # a chunk's logits (16 x 300) outsize every input
    hidden = torch.randn(1, n, h, requires_grad=True)
    weight = torch.randn(v, h, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
        lp, ent = token_log_probs(hidden, weight, torch.randint(0, v, (1, n)), chunk_bytes=16 * 4 * v,
                                  return_entropy=True)
    assert max(saved) <= max(n * h, v * h) < 16 * v
    (lp.sum() + ent.sum()).backward()
    assert hidden.grad is not None and weight.grad is not None


def test_one_chunk_keeps_its_log_softmax_and_refuses_a_second_backward():
    """Within the byte budget the chunk's log-softmax is kept for backward (no recompute)
    and consumed there: retain_graph is refused rather than computed from a spent buffer."""
    hidden = torch.randn(1, 20, 8, requires_grad=True)
    weight = torch.randn(30, 8, requires_grad=True)
    lp = token_log_probs(hidden, weight, torch.randint(0, 30, (1, 20)))
    lp.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="retain_graph is not supported"):
        lp.sum().backward()


def test_chunk_rows_follow_the_byte_budget():
    """rows = bytes // (4 V): a 152k and a 256 vocabulary fill the same [rows, V] fp32 bytes."""
    budget = 64 * 2**20
    for vocab in (151_936, 49_152, 256):
        rows = chunk_rows(vocab, budget)
        assert rows * vocab * 4 <= budget < (rows + 1) * vocab * 4
    assert chunk_rows(10**9, 1) == 2  # never a 1-row matmul
    with pytest.raises(ValueError, match="chunk_bytes=0"):
        chunk_rows(256, 0)


def test_log_probs_without_grad_match_with_grad():
    hidden, weight = torch.randn(1, 33, 8), torch.randn(30, 8)
    targets = torch.randint(0, 30, (1, 33))
    for chunk_bytes in (LOGPROB_CHUNK_BYTES, 5 * 4 * 30):  # one chunk; 5-row chunks
        with torch.no_grad():
            a = token_log_probs(hidden, weight, targets, chunk_bytes=chunk_bytes, return_entropy=True)
        b = token_log_probs(hidden.requires_grad_(), weight, targets, chunk_bytes=chunk_bytes, return_entropy=True)
        hidden.requires_grad_(False)
        assert all(torch.equal(x, y.detach()) for x, y in zip(a, b))


def test_actor_divides_logits_by_temperature(dense, padded):
    with torch.no_grad():
        logits = dense(input_ids=padded.sequences, attention_mask=padded.attention_mask).logits[:, :-1].float()
        lp = Actor(dense, temperature=0.5)(padded)
        lp1 = Actor(dense, temperature=1.0)(padded)
    valid = padded.attention_mask[:, 1:]
    ref = (logits / 0.5).log_softmax(-1).gather(-1, padded.sequences[:, 1:].unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(lp[valid], ref[valid], rtol=0, atol=1e-5)
    assert (lp - lp1)[valid].abs().max() > 1e-3


# ------------------------------------------------------------- bad input
def test_pack_without_position_ids_is_rejected(dense, pack):
    with pytest.raises(ValueError, match=r"position_ids None, expected \[1, 134\]"):
        Actor(dense)(dataclasses.replace(pack, position_ids=None))


def test_pack_without_packed_seq_lens_is_rejected(dense, pack):
    with pytest.raises(ValueError, match=r"sequences \(1, 134\) has position_ids but packed_seq_lens None"):
        Actor(dense)(dataclasses.replace(pack, packed_seq_lens=None))


def test_pack_whose_lengths_do_not_sum_to_n_is_rejected(dense, pack):
    lens = pack.packed_seq_lens[:-1] + [pack.packed_seq_lens[-1] + 1]
    expected = r"packed_seq_lens .* \(sum 135\) does not describe sequences of shape \(1, 134\)"
    with pytest.raises(ValueError, match=expected):
        Actor(dense)(dataclasses.replace(pack, packed_seq_lens=lens))


def test_batch_longer_than_max_position_embeddings_is_rejected():
    short = build_model("qwen3", max_position_embeddings=32, num_hidden_layers=1)
    too_long = make_experience_batch(make_records([12, 40]), packed=False)
    with pytest.raises(ValueError, match="sequence length 40 exceeds the model's max_position_embeddings=32"):
        Actor(short)(too_long)
    with pytest.raises(ValueError, match="sequence length 40 exceeds"):
        Critic(short)(make_experience_batch(make_records([12, 40]), packed=True))


@pytest.mark.parametrize("bad_id", [TINY["vocab_size"], -1])
def test_token_ids_outside_the_vocab_are_rejected(dense, pack, bad_id):
    ids = pack.sequences.clone()
    ids[0, 3] = bad_id
    with pytest.raises(ValueError, match=rf"token ids in \[.*\], expected ids in \[0, {TINY['vocab_size']}\)"):
        Actor(dense)(dataclasses.replace(pack, sequences=ids))


def test_a_record_is_rejected(dense, records):
    with pytest.raises(ValueError, match=r"sequences has shape \(5,\), expected a batch"):
        Actor(dense)(records[0])


def test_action_mask_of_another_layout_is_rejected(dense, pack, padded):
    with pytest.raises(ValueError, match=r"action_mask has shape \[6, 60\], expected \[1, 134\]"):
        Actor(dense)(dataclasses.replace(pack, action_mask=padded.action_mask))


# ----------------------------------------------------------- attention
def test_packed_attn_kwargs_values_and_trailing_pad():
    kw = packed_attn_kwargs([3, 1, 4])
    assert kw["cu_seq_lens_q"].dtype == kw["cu_seq_lens_k"].dtype == torch.int32
    assert kw["cu_seq_lens_q"].tolist() == kw["cu_seq_lens_k"].tolist() == [0, 3, 4, 8]
    assert kw["max_length_q"] == kw["max_length_k"] == 4
    assert isinstance(kw["max_length_q"], int)
    grown = packed_attn_kwargs([3, 1, 4], trailing_pad=5)
    assert grown["cu_seq_lens_q"].tolist() == [0, 3, 4, 13] and grown["max_length_k"] == 9
    assert packed_attn_kwargs([2], device="cpu")["cu_seq_lens_q"].device.type == "cpu"
    for bad, match in (([], "empty"), ([3, 0], "<= 0")):
        with pytest.raises(ValueError, match=match):
            packed_attn_kwargs(bad)
    with pytest.raises(ValueError, match="trailing_pad=-1"):
        packed_attn_kwargs([3], trailing_pad=-1)


def test_padded_batch_runs_stock_sdpa(dense, padded):
    stock = build_model("qwen3", seed=0, attn_implementation="sdpa")
    with torch.no_grad():
        assert torch.equal(Actor(dense)(padded), Actor(stock)(padded))


def test_decoding_with_a_cache_runs_stock_sdpa(dense):
    stock = build_model("qwen3", seed=0, attn_implementation="sdpa")
    ids = torch.randint(1, TINY["vocab_size"], (2, 7), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # left-padded prompt, as in rollout
    args = dict(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert torch.equal(dense.generate(**args), stock.generate(**args))


def test_varlen_refuses_sliding_window_and_non_causal_attention(pack):
    sliding = build_model("qwen3", num_hidden_layers=1, use_sliding_window=True, sliding_window=8, max_window_layers=0)
    with pytest.raises(ValueError, match="sliding-window"):
        Actor(sliding)(pack)
    module = torch.nn.Module()
    module.is_causal = False
    q = torch.zeros(1, 2, 4, 8)
    with pytest.raises(ValueError, match="is_causal is False"):
        varlen_attention_forward(module, q, q, q, None, **packed_attn_kwargs([4]))


# -------------------------------------------------------------- models
def config_gaps(config, definition: dict) -> dict:
    """`{field: (built, defined)}` for every field of `definition` that `config` does not hold."""
    return {k: (getattr(config, k, None), v) for k, v in definition.items() if getattr(config, k, None) != v}


def attention_of(model):
    """The function transformers dispatches every attention layer of `model` to."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return ALL_ATTENTION_FUNCTIONS.get(model.config._attn_implementation)


def test_build_model_defaults_are_the_tiny_definition_seeded_and_leave_the_global_rng_alone():
    state = torch.random.get_rng_state()
    a, b = build_model("qwen3_moe", seed=0), build_model("qwen3_moe", seed=0)
    assert torch.equal(torch.random.get_rng_state(), state)
    Qwen3MoeForCausalLM(Qwen3MoeConfig(**TINY_MOE))  # control: a plain init draws from the global RNG
    assert not torch.equal(torch.random.get_rng_state(), state)
    c = build_model("qwen3_moe", seed=1)

    # the config holds every field of the one tiny definition (model/models.py TINY, TINY_MOE), and the
    # model stays small enough for a test run to build it dozens of times
    assert config_gaps(a.config, TINY_MOE) == {} and config_gaps(build_model("qwen3").config, TINY) == {}
    assert sum(p.numel() for p in a.parameters()) < 10**6
    # control: the same check names the field of a model built off the definition
    assert config_gaps(build_model("qwen3_moe", num_experts=4).config, TINY_MOE) == {"num_experts": (4, 8)}
    assert all(type(layer.mlp).__name__ == "Qwen3MoeSparseMoeBlock" for layer in a.model.layers)
    # attention goes through the pack-aware "varlen" of model/attention.py unless asked otherwise
    assert attention_of(a) is varlen_attention_forward
    assert attention_of(build_model("qwen3_moe", attn_implementation="sdpa")) is not varlen_attention_forward

    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not all(torch.equal(sa[k], sc[k]) for k in sa)
    assert build_model("qwen3", dtype=torch.bfloat16).model.embed_tokens.weight.dtype == torch.bfloat16


def test_build_model_rejects_unknown_names_and_config_keys():
    with pytest.raises(ValueError, match="num_hiden_layers"):
        build_model("qwen3", num_hiden_layers=3)
    with pytest.raises(ValueError, match=r"model.name='gpt2': unsupported model family; supported: dense \['llama'"):
        build_model("gpt2")


def test_build_model_loads_a_local_checkpoint(tmp_path, dense):
    dense.save_pretrained(tmp_path)
    loaded = build_model("qwen3", pretrained_path=str(tmp_path))
    assert attention_of(loaded) is varlen_attention_forward
    ref = dense.state_dict()
    assert all(torch.equal(v, ref[k]) for k, v in loaded.state_dict().items())
    with pytest.raises(ValueError, match="model.name='qwen3_moe' but the checkpoint .* is a 'qwen3' model"):
        build_model("qwen3_moe", pretrained_path=str(tmp_path))
