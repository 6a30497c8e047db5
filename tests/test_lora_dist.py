"""LoRA under FSDP2, CP, EP and routing replay: the sharded adapted policy's gradient equals the
chain rule from one process's merged model (W + s B A), and training moves only the adapters.

Each rank builds the same seeded adapted model, parallelizes it (model/parallelize.py: FSDP2 per
decoder layer, frozen base and trainable adapters in one unit; CP attention; EP experts) and
runs one backward of a token-mean policy loss over its plan entry; the adapters' summed
gradients (full tensors) must equal dB = s G A^T, dA = s B^T G from the merged model's weight
gradient G over the whole batch in one process, within the FSDP parity limit of
tests/test_fsdp.py (1e-5 of the largest). Three clipped AdamW steps then equal one process's
LoRA steps, and every base weight is bitwise unchanged. Control: the chain rule from a model
merged with the adapter scaled by 1.1 misses by orders of magnitude.
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import DTensor

from model.actor import Actor
from model.lora import LoraSettings, apply_lora, merged_state_dict, trainable_parameters
from model.models import TINY_MOE, build_model
from runtime.parallel_dims import ParallelDims, init_distributed, local_tensor
from model.parallelize import clip_grad_norm_, full_parameters, parallelize
from packing import make_experience_batch, plan_microbatches
from rl.algos.losses import PolicyLossConfig, aggregate, policy_loss
from testing.distributed import run_distributed
from testing.records import make_records

pytestmark = pytest.mark.slow

LENGTHS = [5, 17, 9, 33, 12, 7, 21, 3, 14, 26, 8, 11]
SMALL = dict(vocab_size=64, hidden_size=32, head_dim=8, intermediate_size=64)
SMALL_MOE = dict(SMALL, moe_intermediate_size=16, num_experts=4)
TARGETS = {"qwen3": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
           "qwen3_moe": ["q_proj", "k_proj", "v_proj", "o_proj"]}
STEPS, CLIP, LR, LIMIT = 3, 0.01, 1e-2, 1e-5


def adapted(name: str, scale_b: float = 1.0):
    lm = build_model(name, seed=0, **(SMALL_MOE if name == "qwen3_moe" else SMALL))
    apply_lora(lm, LoraSettings(rank=4, alpha=8.0, target_modules=TARGETS[name]), seed=0)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for n, p in lm.named_parameters():
            if ".lora_B." in n:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1 * scale_b)
    return lm


def merged(name: str, scale_b: float = 1.0):
    lm = build_model(name, seed=0, **(SMALL_MOE if name == "qwen3_moe" else SMALL))
    lm.load_state_dict(merged_state_dict(adapted(name, scale_b)))
    return lm


def backward(actor, dims, records, packed):
    normalizer = float(sum(r.action_mask.sum() for r in records))
    plan = plan_microbatches([r.sequences.numel() for r in records], 64, dims.dp)
    for mb in plan[dims.dp_rank]:
        batch = make_experience_batch([records[i] for i in mb], packed=packed).to(dims.device)
        loss = aggregate(policy_loss(actor(batch), batch, PolicyLossConfig())[0], batch, "token-mean", normalizer)
        loss.backward()


def full_grads(actor) -> dict[str, torch.Tensor]:
    return {n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).clone()
            for n, p in actor.named_parameters() if p.grad is not None}


def chain_rule(name: str, scale_b: float, records) -> dict[str, torch.Tensor]:
    """The adapters' gradient from one process's merged model (module docstring)."""
    from peft.tuners.lora import LoraLayer

    one = ParallelDims()
    actor = parallelize(Actor(merged(name, scale_b), dims=one), one)
    backward(actor, one, records, packed=True)
    grads = full_grads(actor)
    lm, out = adapted(name, scale_b), {}
    for mod_name, m in lm.named_modules():
        if isinstance(m, LoraLayer):
            g = grads[f"model.{mod_name}.weight"].double()
            a, b, s = (m.lora_A["default"].weight.detach().double(), m.lora_B["default"].weight.detach().double(),
                       m.scaling["default"])
            out[f"model.{mod_name}.lora_B.default.weight"] = s * g @ a.T
            out[f"model.{mod_name}.lora_A.default.weight"] = s * b.T @ g
    return out


def train_adapters(name: str, dims, records, packed: bool) -> tuple[dict, dict, int]:
    """The first backward's adapter grads, then STEPS clipped AdamW steps: (grads, weights, local state bytes)."""
    actor = parallelize(Actor(adapted(name), dims=dims), dims)
    params = trainable_parameters(actor)
    optimizer = torch.optim.AdamW(params, lr=LR, eps=1e-5)
    grads = None
    for _ in range(STEPS):
        backward(actor, dims, records, packed)
        grads = grads or full_grads(actor)
        clip_grad_norm_(params, CLIP, dims)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    state = {id(p) for p in params} == set(map(id, optimizer.state)) and len(optimizer.state) == len(params)
    trained = sum(local_tensor(p).numel() * p.element_size() * 4 for p in params)  # weight, grad, 2 moments
    return grads, dict(full_parameters(actor.model)), trained if state else -1


def lora_layout_checks(rank: int, world_size: int, name: str, ep: int, cp: int, packed: bool) -> dict:
    dims = init_distributed(dp=-1, cp=cp, ep=ep)
    moe = dict(TINY_MOE, **SMALL_MOE)
    routed = (moe["num_hidden_layers"], moe["num_experts_per_tok"], moe["num_experts"]) if name == "qwen3_moe" else None
    records = make_records(LENGTHS, vocab=SMALL["vocab_size"], seed=3, routed=routed)  # replayed routing (R3)
    grads, weights, state_bytes = train_adapters(name, dims, records, packed)
    one_grads, one_weights, _ = train_adapters(name, ParallelDims(device=dims.device), records, True)
    want, control = chain_rule(name, 1.0, records), chain_rule(name, 1.1, records)
    scale = max(float(v.abs().max()) for v in want.values())
    initial = dict(full_parameters(adapted(name) if name != "qwen3_moe" else _moe_blocks(adapted(name))))
    base = [k for k in initial if ".lora_" not in k]
    wscale = max(float(v.abs().max()) for k, v in one_weights.items() if ".lora_" in k)
    return {
        "grad_keys_match": grads.keys() == want.keys(),
        "grad_diff": max(float((grads[k].double() - v).abs().max()) for k, v in want.items()) / scale,
        "control_diff": max(float((grads[k].double() - v).abs().max()) for k, v in control.items()) / scale,
        "weight_diff": max(float((weights[k] - v).abs().max()) for k, v in one_weights.items()
                           if ".lora_" in k) / wscale,
        "adapters_moved": max(float((weights[k] - initial[k]).abs().max()) for k in initial if ".lora_" in k),
        "base_unchanged": all(torch.equal(weights[k], initial[k]) for k in base),
        "optimizer_state_bytes": state_bytes,
    }


def _moe_blocks(lm):
    from model.moe import shard_experts

    shard_experts(lm, None)  # the state-dict names of the parallelized model
    return lm


CASES = {  # world, name, ep, cp, packed
    "dense-fsdp2": (2, "qwen3", 1, 1, True),
    "dense-fsdp4-padded": (4, "qwen3", 1, 1, False),
    "dense-dp2-cp2": (4, "qwen3", 1, 2, True),
    "moe-dp4-ep2-replay": (4, "qwen3_moe", 2, 1, True),
}


@pytest.mark.parametrize("case", list(CASES))
def test_sharded_lora_equals_merged_model(case):
    world, *args = CASES[case]
    for rank, r in enumerate(run_distributed(lora_layout_checks, world, *args, timeout=400)):
        print(f"{case} rank {rank}: adapter grads vs chain rule {r['grad_diff']:.2e}, control {r['control_diff']:.2e}, "
              f"weights after {STEPS} steps vs one process {r['weight_diff']:.2e} (relative to the largest)")
        assert r["grad_keys_match"] and r["optimizer_state_bytes"] > 0  # adapters only get grads and AdamW state
        assert r["grad_diff"] <= LIMIT
        assert r["control_diff"] >= 1000 * LIMIT
        assert r["weight_diff"] <= LIMIT and r["adapters_moved"] > 1e-4
        assert r["base_unchanged"]
