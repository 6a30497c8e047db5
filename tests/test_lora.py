"""LoRA (model/lora.py): the adapted policy is the model with its adapter merged into the weights.

Each forward layout the trainer runs (packed, padded, shared prompts, activation checkpointing)
is compared with a plain model whose weights are W + (alpha / r) B A (`merged_state_dict`):
log-probs and entropy within the suite's fp32 limit (`PARITY_ULPS` eps32 of the values'
magnitude), and the adapters' gradients equal what the chain rule gives from the merged
weight's gradient G (dB = s G A^T, dA = s B^T G). Controls: the unmerged base (and a wrong
scaling) miss by orders of magnitude. Then: the reference is the base with adapters off,
only adapters train, the engine receives adapters only, and the start-up refusals.
"""

from __future__ import annotations

import pytest
import torch

from model.actor import Actor
from model.lora import (DEFAULT_TARGETS, LoraSettings, adapter_bytes, adapters_disabled, apply_lora, check_settings,
                        has_adapters, merged_state_dict, trainable_parameters)
from model.models import build_model
from model.moe import shard_experts
from model.parallelize import apply_activation_checkpointing
from packing.collate import make_experience_batch
from tests.parity_check import assert_control_fails, assert_parity, max_abs
from tests.test_shared_prompt import scored
from testing.records import grpo_records

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
CASES = {"qwen3": DEFAULT_TARGETS, "llama": DEFAULT_TARGETS, "qwen3_moe": ATTENTION}


def lora_model(family: str = "qwen3", rank: int = 4, targets=None, seed: int = 0, alpha: float = 8.0):
    """A tiny model with adapters whose B is perturbed (a trained adapter: B = 0 would be the base)."""
    lm = build_model(family, seed=seed)
    apply_lora(lm, LoraSettings(rank=rank, alpha=alpha, target_modules=list(targets or CASES[family])), seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in lm.named_parameters():
            if ".lora_B." in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    return _experts(lm)


def plain_model(family: str, state: dict | None = None, seed: int = 0):
    lm = build_model(family, seed=seed)
    if state is not None:
        lm.load_state_dict(state)
    return _experts(lm)


def _experts(lm):
    if lm.config.model_type == "qwen3_moe":
        shard_experts(lm, None)  # the training forward's blocks (parallelize does this)
    return lm


def run(actor: Actor, batch) -> dict:
    """Log-probs, entropy and every parameter gradient of a policy-gradient-like loss over them."""
    actor.zero_grad(set_to_none=True)
    mask = batch.action_mask.float()
    lp, ent = actor(batch, return_entropy=True)
    loss = ((-batch.advantages * lp - 0.01 * ent) * mask).sum() / mask.sum()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in actor.named_parameters() if p.grad is not None}
    actor.zero_grad(set_to_none=True)
    return {"log_probs": lp.detach(), "entropy": ent.detach(), "grads": grads}


def chain_rule_grads(lora_lm, merged_grads: dict) -> dict:
    """What the adapters' gradients must be, from the merged model's weight gradients G:
    dB = s G A^T, dA = s B^T G (ΔW = s B A), by adapter parameter name (Actor prefix `model.`)."""
    from peft.tuners.lora import LoraLayer

    out = {}
    for name, m in lora_lm.named_modules():
        if not isinstance(m, LoraLayer):
            continue
        g = merged_grads[f"model.{name}.weight"].double()
        a, b, s = (m.lora_A["default"].weight.detach().double(), m.lora_B["default"].weight.detach().double(),
                       m.scaling["default"])
        out[f"model.{name}.lora_B.default.weight"] = s * g @ a.T
        out[f"model.{name}.lora_A.default.weight"] = s * b.T @ g
    return out


def compare(what: str, lora: dict, lora_batch, merged: dict, merged_batch, records, lora_lm) -> None:
    for key in ("log_probs", "entropy"):
        xs, ys = scored(lora[key], lora_batch, records), scored(merged[key], merged_batch, records)
        assert_parity(f"{what} {key}", max_abs(x - y for x, y in zip(xs, ys)), max_abs(ys))
    want = chain_rule_grads(lora_lm, merged["grads"])
    assert lora["grads"].keys() == want.keys(), "only the adapters get gradients"
    scale = max_abs(want.values())
    assert_parity(f"{what} adapter grads", max_abs(lora["grads"][n].double() - want[n] for n in want), scale)


@pytest.mark.parametrize("family", list(CASES))
def test_lora_forward_equals_merged_model(family):
    """Packed, padded and shared-prompt forwards (and backward) of the adapted model equal the
    merged model's padded forward; controls: the unmerged base, and the adapter scaled twice."""
    records = grpo_records(vocab=256)
    pack, padded = make_experience_batch(records, packed=True), make_experience_batch(records, packed=False)
    lm = lora_model(family)
    merged = plain_model(family, merged_state_dict(lm))
    want = run(Actor(merged), padded)
    for what, share, batch in (("packed", False, pack), ("padded", False, padded), ("shared prompts", True, pack)):
        compare(f"{family} {what}", run(Actor(lm, share_prompts=share), batch), batch, want, padded, records, lm)

    base = run(Actor(plain_model(family)), padded)
    xs, ys = scored(base["log_probs"], padded, records), scored(want["log_probs"], padded, records)
    assert_control_fails(f"{family} unmerged base", max_abs(x - y for x, y in zip(xs, ys)), max_abs(ys))
    doubled = merged_state_dict(lm)
    for k, v in plain_model(family).state_dict().items():  # W + 2 s B A
        doubled[k] = 2 * doubled[k] - v
    twice = run(Actor(plain_model(family, doubled)), padded)
    xs = scored(twice["log_probs"], padded, records)
    assert_control_fails(f"{family} adapter scaled twice", max_abs(x - y for x, y in zip(xs, ys)), max_abs(ys))


def test_activation_checkpointing_equals_merged_model():
    """Per-layer recompute around the adapted layers: the same numbers as the merged model."""
    records = grpo_records(vocab=256)
    pack, padded = make_experience_batch(records, packed=True), make_experience_batch(records, packed=False)
    lm = lora_model("qwen3")
    want = run(Actor(plain_model("qwen3", merged_state_dict(lm))), padded)
    apply_activation_checkpointing(lm)
    for what, share in (("checkpointed packed", False), ("checkpointed shared prompts", True)):
        compare(what, run(Actor(lm, share_prompts=share), pack), pack, want, padded, records, lm)


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe"])
def test_reference_is_the_base_with_adapters_disabled(family):
    """`adapters_disabled` scores like the model before the adapters were injected (the
    reference, no copy built), and puts them back: the adapted scores and trainability return."""
    records = grpo_records(vocab=256)
    pack = make_experience_batch(records, packed=True)
    lm = lora_model(family)
    actor = Actor(lm, share_prompts=True)
    with torch.no_grad():
        adapted = actor(pack)
        with adapters_disabled(lm):
            off = actor(pack)
        again = actor(pack)
        base = Actor(plain_model(family), share_prompts=True)(pack)
    assert_parity(f"{family} adapters disabled vs base", max_abs([off - base]), max_abs([base]))
    assert torch.equal(again, adapted)
    assert_control_fails(f"{family} adapters enabled vs base", max_abs([adapted - base]), max_abs([base]))
    assert [n for n, p in lm.named_parameters() if p.requires_grad] == [n for n, _ in lm.named_parameters()
                                                                        if ".lora_" in n]


def test_only_adapters_train():
    """The optimizer's parameters are the adapters: 2 per adapted linear, none of the base; a
    trainable base weight is refused. Without adapters every parameter trains."""
    lm = lora_model("qwen3", rank=4)
    actor = Actor(lm)
    params = trainable_parameters(actor)
    names = {id(p): n for n, p in actor.named_parameters()}
    assert all(".lora_A." in names[id(p)] or ".lora_B." in names[id(p)] for p in params)
    assert len(params) == 2 * 7 * lm.config.num_hidden_layers
    frac = sum(p.numel() for p in params) / sum(p.numel() for p in actor.parameters())
    print(f"trainable fraction of the tiny model at rank 4: {frac:.4f}")
    assert frac < 0.5
    lm.model.norm.weight.requires_grad_(True)
    with pytest.raises(RuntimeError, match="non-adapter parameters require grad"):
        trainable_parameters(actor)
    plain = Actor(build_model("qwen3"))
    assert len(trainable_parameters(plain)) == len(list(plain.parameters())) and not has_adapters(plain)


def test_checkpoint_state_is_adapters_only_with_tied_embeddings():
    """A tied-embedding model (SmolLM2's layout): the checkpoint's weights are the adapters and
    nothing else. Control: DCP's ignore_frozen_params alone keeps the tied lm_head.weight (a
    frozen base tensor the size of the embedding, which made every SmolLM2 LoRA checkpoint 6x
    too big and the export refuse it)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    from runtime.parallel_dims import ParallelDims
    from rl.trainer.state import sharded_state

    lm = build_model("llama", seed=0, tie_word_embeddings=True)
    apply_lora(lm, LoraSettings(rank=4, alpha=8, target_modules=ATTENTION))
    assert lm.lm_head.weight is lm.model.embed_tokens.weight
    actor = Actor(lm)
    optimizer = torch.optim.AdamW(trainable_parameters(actor))
    state = sharded_state(actor, optimizer, ParallelDims())
    adapters = {n for n, _ in actor.named_parameters() if ".lora_" in n}
    assert set(state["weights"]) == adapters and set(state["optimizer"]["state"]) <= adapters
    kept, _ = get_state_dict(actor, optimizer, options=StateDictOptions(ignore_frozen_params=True))
    assert set(kept) - adapters == {"model.lm_head.weight"}  # the control


def test_start_up_refusals_name_the_field():
    ok = LoraSettings(rank=8)
    check_settings(ok, moe=False, engine="hf")
    check_settings(LoraSettings(rank=8, target_modules=ATTENTION), moe=True, engine="hf")
    check_settings(ok, moe=False, engine="vllm")  # vLLM takes adapters (enable_lora) up to its largest rank
    with pytest.raises(ValueError, match=r"model.lora.rank=1024 with rollout.engine=vllm"):
        check_settings(LoraSettings(rank=1024), moe=False, engine="vllm")
    with pytest.raises(ValueError, match=r"model.lora.target_modules=.*MLP projections.*MoE"):
        check_settings(ok, moe=True, engine="hf")
    with pytest.raises(ValueError, match=r"model.lora.target_modules=.*router"):
        check_settings(LoraSettings(rank=8, target_modules=["q_proj", "gate"]), moe=True, engine="hf")
    with pytest.raises(ValueError, match=r"model.lora.rank=-1"):
        check_settings(LoraSettings(rank=-1), moe=False, engine="hf")
    check_settings(LoraSettings(rank=0), moe=True, engine="vllm")  # off: nothing to refuse


def test_engine_receives_adapters_only():
    """The HF engine's copy gets the base once (build), then each sync sends the adapters
    only: `loaded_bytes` is their size, the copy's adapters equal the policy's, and the copy
    scores like the merged model. Control: an engine without adapters receives every weight."""
    from model.loading import materialize
    from rl.rollout.engine import HFRolloutEngine
    from rl.rollout.sync import full_tensor_bytes, sync_weights

    lm = lora_model("qwen3", rank=4)
    settings = LoraSettings(rank=4, alpha=8.0, target_modules=DEFAULT_TARGETS)
    engine = HFRolloutEngine(materialize(apply_lora(build_model("qwen3", device="meta"), settings), "cpu"))
    full = sum(full_tensor_bytes(lm).values())
    sync_weights(engine, lm)  # the build's sync: everything
    assert engine.holds_base and engine.loaded_bytes == full
    engine.sleep()  # the base is kept (LoRA): nothing released
    with torch.no_grad():
        for name, p in lm.named_parameters():
            if ".lora_A." in name:
                p.mul_(1.5)
    sync_weights(engine, lm)
    assert engine.loaded_bytes == adapter_bytes(lm) < full
    own = engine.model.state_dict()
    assert all(torch.equal(own[k], v) for k, v in lm.state_dict().items())
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))
    merged = plain_model("qwen3", merged_state_dict(lm))
    with torch.no_grad():
        got, want = engine.model(ids).logits, merged(ids).logits
    assert_parity("engine copy vs merged logits", max_abs([got - want]), max_abs([want]))

    plain = build_model("qwen3")
    control = HFRolloutEngine(materialize(build_model("qwen3", device="meta"), "cpu"))
    sync_weights(control, plain)
    sync_weights(control, plain)
    assert not control.holds_base and control.loaded_bytes == sum(full_tensor_bytes(plain).values())


def test_sync_bytes_at_rank_16_on_smollm2_shape():
    """Adapters at rank 16 on every projection of a SmolLM2-135M-shaped model (meta: shapes
    only) are <= 5% of a full sync's bytes."""
    shape = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                 num_key_value_heads=3, head_dim=64, vocab_size=49152, tie_word_embeddings=True)
    lm = apply_lora(build_model("llama", device="meta", **shape), LoraSettings(rank=16))
    from rl.rollout.sync import full_tensor_bytes

    full, adapters = sum(full_tensor_bytes(lm).values()) - adapter_bytes(lm), adapter_bytes(lm)
    print(f"rank 16 adapters: {adapters / 2**20:.2f} MiB = {adapters / full:.4f} of a full sync "
          f"({full / 2**20:.1f} MiB, fp32)")
    assert adapters / full <= 0.05
    # training state per rank at 4 FSDP ranks, fp32: full fine-tuning holds weights, grads and two AdamW
    # moments of every parameter (16 bytes each); LoRA those of the adapters, beside the frozen base's weights
    # (`full` and `adapters` are fp32 weight bytes: weights + grads + moments are 4 x those, over 4 ranks)
    full_ft, trainable = 4 * full / 4, 4 * adapters / 4
    with_base = trainable + full / 4
    print(f"per-rank training state at 4 ranks: full fine-tuning {full_ft / 2**20:.1f} MiB, LoRA adapters "
          f"{trainable / 2**20:.1f} MiB ({trainable / full_ft:.3f}), with the frozen fp32 base shard "
          f"{with_base / 2**20:.1f} MiB ({with_base / full_ft:.3f})")
    assert trainable / full_ft <= 0.1


def test_trainer_builds_no_reference_and_steps_adapters_only():
    """A LoRA run with a KL term builds no reference copy (the policy with adapters off is the
    reference: the bytes a copy would take are saved) and its optimizer holds exactly the adapters."""
    from testing.inprocess import SMALL, trainer

    args = (*SMALL, "model=dense_tiny", "algo.kl_coef=0.05", "trainer.max_steps=1")
    full, lora = trainer(*args), trainer(*args, "model.lora.rank=4")
    saved = sum(p.numel() * p.element_size() for p in full.reference.parameters())
    print(f"reference copy not built: {saved} bytes saved (the tiny model; SmolLM2-135M fp32: its 513 MiB)")
    assert callable(lora.reference) and not isinstance(lora.reference, torch.nn.Module) and saved > 0  # no copy
    held = {id(p) for g in lora.optimizer.param_groups for p in g["params"]}
    adapters = {id(p) for n, p in lora.actor.named_parameters() if ".lora_" in n}
    assert held == adapters and len(adapters) == 2 * 7 * lora.actor.model.config.num_hidden_layers
    metrics = lora.step(0)
    assert metrics["kl"] >= 0 and set(map(id, lora.optimizer.state)) == adapters  # AdamW state: adapters only
    assert 0 < metrics["weight_sync_bytes"] < 0.5 * full.step(0)["weight_sync_bytes"]


def test_the_memory_plan_counts_the_adapters_training_state_under_lora():
    """The start-up memory plan (rl/rollout/replica.py) counts gradients and AdamW moments of what
    trains: the adapters under LoRA (it counted the whole policy's, as for full fine-tuning)."""
    from testing.inprocess import SMALL, trainer

    args = (*SMALL, "model=dense_tiny", "trainer.max_steps=1")
    full, lora = trainer(*args), trainer(*args, "model.lora.rank=4")
    adapters = sum(p.numel() * p.element_size() for n, p in lora.actor.named_parameters() if ".lora_" in n)
    everything = sum(p.numel() * p.element_size() for p in full.actor.parameters())
    assert lora.engine.replica.state_bytes == 3 * adapters < 0.5 * 3 * everything
    assert full.engine.replica.state_bytes == 3 * everything  # the control: full fine-tuning trains every weight
    assert "(gradients and AdamW moments of the trainable parameters)" in lora.engine.replica.describe()
