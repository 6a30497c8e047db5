"""Will it fit? Per-GPU memory of one policy-training step for Qwen2.5-7B, Qwen3-8B,
Qwen3-30B-A3B and Qwen3-235B-A22B on 8 and 64 GPUs of 80 GB, for a few dp x cp x ep layouts
and pack sizes; then the rollout's memory per GPU in each rollout mode (rollout.replica) for
Qwen2.5-7B, Qwen3-8B and Qwen3-30B-A3B on 8 GPUs, and the mode the start-up plan chooses; then
the memory per placement (colocated, and parallel.rollout_ranks' trainers and generators:
`placement_plan`) for SmolLM2-135M and Qwen3-8B on 8 GPUs.

Parameter counts are exact: each model is built on the meta device from its real config
(below; no weights, nothing downloaded) and its parameters are counted, dense apart from
expert (the fused `mlp.experts.gate_up_proj` / `down_proj`, `model.moe.is_expert_param`).
The rest is a stated model of memory, not a measurement:

Precision policy (FSDP2 as model/parallelize.py applies it, at scale):
    sharded fp32 parameters (master copy)             4 B / param
    sharded fp32 gradients (reduce-scatter in fp32)   4 B / param
    AdamW exp_avg + exp_avg_sq, fp32, sharded         8 B / param
    -> state = 16 B x (dense / (dp*cp) + experts / ep / ((dp/ep)*cp)) = 16 B x params / world
  Dense parameters shard over the dp*cp ranks; experts are first split over the EP group
  (E/ep per rank), then each shard over the (dp/ep)*cp ranks holding it. The per-rank state
  is therefore params/world whatever ep is; ep sets the size of the unsharded transients.
  Compute runs on bf16 copies gathered just in time (MixedPrecisionPolicy(param_dtype=bf16,
  reduce_dtype=fp32)):
    root unit (embeddings, final norm, lm head): gathered for the whole forward+backward:
        bf16 params + bf16 grads = 4 B x root params
    decoder layers: two in flight (current + prefetched), each its dense params + its
        experts / ep: bf16 params + bf16 grads + fp32 grads for the reduce-scatter = 2 x 8 B x layer params

Activations, one microbatch of T = max_tokens tokens, T/cp per rank, bf16 (2 B), with
activation checkpointing per decoder layer (trainer.activation_checkpointing):
    checkpointed layer inputs       L x H x 2 B per token
    one layer recomputed in backward, its activations and their gradients (x 2):
        attention  (3H + 4q + 4kv) x 2 B + 4 B x heads (softmax statistics)
                   q = heads x head_dim, kv = kv_heads x head_dim; with cp > 1 plus the
                   gathered K/V of the full sequence (2 kv x 2 B per token of T)
        dense MLP  (4I) x 2 B
        MoE MLP    k x (2H + 4I_moe) x 2 B x skew + 8 B x E (fp32 router logits, probabilities)
                   (k routed copies per token; skew = 1: balanced routing)
    lm head: one chunk of model.logprob_chunk_size tokens: 12 B x chunk x V (fp32 logits,
        log-softmax, their gradient; model/logprobs.py recomputes chunk by chunk)
A layout fits when state + transients + activations <= GPU memory - reserve (CUDA context,
NCCL buffers, allocator fragmentation). Not counted: the rollout engine's copy of the policy
(an unsharded bf16 copy, 2 B x params, is shown as `rollout` and as a second verdict: a lower
bound, the HF engine builds its copy in model.dtype; the rollout table below counts it so),
a reference model (kl_coef > 0: 2 B x params / world more), a critic (PPO: the state again),
the KV cache of generation (in the rollout table).

Rollout (second table), per GPU, at the rollout (the training state stays resident: fp32
parameters + AdamW moments = 12 B/param/world; gradients are freed by zero_grad) and over the
whole step (peak of rollout and training):
    keep     the HF engine's unsharded copy, built in model.dtype (the fp32 master: 4 B x params)
             and resident through training too; its KV cache and compute in fp32
    sharded  generation with the FSDP2 policy (rl/rollout/engine.py PolicyRolloutEngine): the root
             (embeddings, norm, lm head) gathered in bf16 for the whole rollout + two decoder
             layers in bf16 (the one computing, the next being gathered; experts: this EP rank's
             E/ep); KV cache in bf16; no copy. `received a decode step`: what each rank receives
             to run one decode step this way (every layer's dense rows from the other ranks, its
             experts from the rest of its expert-data-parallel group), a communication cost paid
             per generated token
    vllm     an external colocated engine (sleep mode: nothing of it resident during training):
             bf16 weights / TP + bf16 KV cache / TP; the smallest TP of 1, 2, 4, 8 that fits
    KV cache: rollout_rows x rollout_len tokens x 2 (K, V) x layers x kv_heads x head_dim x dtype;
    sampling buffers: rows x vocab x 16 B (fp32 logits, fp32 log-softmax, fp64 CDF).
`chosen` is what `rollout.replica=auto` decides at start-up (rl/rollout/replica.py `choose`, the
same function): keep when copy + training state to come (gradients + AdamW, 12 B/param/world)
<= 90% of the free memory after the shards are placed (GPU - reserve - 4 B/param/world), else
sharded. `keep_fits` / `sharded_fits` check each mode against the fuller model above.

    python bench/memory_plan.py [--gpu-gib 80] [--reserve-gib 8] [--rollout-rows 32] [--rollout-len 2048]

Prints the table, then one JSON line: which layouts fit (bench/results/memory_plan.json).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import emit  # noqa: E402  (puts the repo on sys.path)

import torch  # noqa: E402
from transformers import (LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config,  # noqa: E402
                          Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM)

from model.moe import is_expert_param  # noqa: E402
from rl.rollout.replica import RESERVE, choose  # noqa: E402

GIB = 2**30
BF16, FP32 = 2, 4
STATE_BYTES = FP32 + FP32 + 2 * FP32  # master params, grads, AdamW moments
LOGPROB_CHUNK = 1024  # ModelConfig.logprob_chunk_size

# The models' config.json on the Hugging Face hub (Qwen/Qwen2.5-7B, Qwen/Qwen3-8B, Qwen/Qwen3-30B-A3B,
# Qwen/Qwen3-235B-A22B; Qwen2.5-7B's published 7.61B is 7,615,616,512 exactly); the same numbers appear in Megatron launch scripts for these models
# (e.g. THUDM/slime/scripts/models/qwen3-*.sh). `published` is the total parameter count
# (Qwen3-8B: the hub's safetensors total; the MoE models: keras-hub's presets, whose converter
# asserts equality with transformers' num_parameters()); the meta count must equal it.
_COMMON = dict(vocab_size=151936, head_dim=128, tie_word_embeddings=False, max_position_embeddings=40960,
               rope_theta=1_000_000.0, rms_norm_eps=1e-6)
_MOE = dict(num_experts=128, num_experts_per_tok=8, decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True)
MODELS = {
    # HuggingFaceTB/SmolLM2-135M(-Instruct): 134,515,008 (tests/test_real_model.py loads it: 134.5M), the lm head tied
    "SmolLM2-135M": (LlamaConfig, LlamaForCausalLM, 134_515_008, dict(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
        num_key_value_heads=3, head_dim=64, tie_word_embeddings=True, max_position_embeddings=8192,
        rope_theta=100000.0, rms_norm_eps=1e-5)),
    "Qwen2.5-7B": (Qwen2Config, Qwen2ForCausalLM, 7_615_616_512, dict(
        vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
        num_attention_heads=28, num_key_value_heads=4, tie_word_embeddings=False, max_position_embeddings=131072,
        rope_theta=1_000_000.0, rms_norm_eps=1e-6)),
    "Qwen3-8B": (Qwen3Config, Qwen3ForCausalLM, 8_190_735_360, dict(
        _COMMON, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
        num_attention_heads=32, num_key_value_heads=8)),
    "Qwen3-30B-A3B": (Qwen3MoeConfig, Qwen3MoeForCausalLM, 30_532_122_624, dict(
        _COMMON, **_MOE, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
        num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4)),
    "Qwen3-235B-A22B": (Qwen3MoeConfig, Qwen3MoeForCausalLM, 235_093_634_560, dict(
        _COMMON, **_MOE, hidden_size=4096, intermediate_size=12288, moe_intermediate_size=1536,
        num_hidden_layers=94, num_attention_heads=64, num_key_value_heads=4)),
}

# (model, GPUs, dp, cp, ep): world = dp * cp, ep divides dp and the expert count
LAYOUTS = [
    ("Qwen2.5-7B", 8, 8, 1, 1), ("Qwen2.5-7B", 8, 4, 2, 1),
    ("Qwen3-8B", 8, 8, 1, 1), ("Qwen3-8B", 8, 4, 2, 1), ("Qwen3-8B", 64, 64, 1, 1), ("Qwen3-8B", 64, 32, 2, 1),
    ("Qwen3-30B-A3B", 8, 8, 1, 1), ("Qwen3-30B-A3B", 8, 8, 1, 8), ("Qwen3-30B-A3B", 8, 4, 2, 4),
    ("Qwen3-30B-A3B", 64, 64, 1, 8), ("Qwen3-30B-A3B", 64, 32, 2, 8),
    ("Qwen3-235B-A22B", 8, 8, 1, 8), ("Qwen3-235B-A22B", 64, 64, 1, 8), ("Qwen3-235B-A22B", 64, 64, 1, 64),
    ("Qwen3-235B-A22B", 64, 32, 2, 32), ("Qwen3-235B-A22B", 64, 16, 4, 16),
]
MAX_TOKENS = (8192, 32768)


@dataclass(frozen=True)
class Counts:
    """Parameter counts of one model, from its meta-device build."""

    total: int
    experts: int
    layer_dense: int  # one decoder layer (all layers are alike in these models)
    layer_experts: int
    root: int  # embeddings, final norm, lm head
    config: object

    @property
    def active(self) -> int:  # per token: dense + k of E experts
        c = self.config
        return self.total - self.experts + self.experts * getattr(c, "num_experts_per_tok", 0) // max(getattr(c, "num_experts", 1), 1)


def count(name: str) -> Counts:
    config_cls, model_cls, published, fields = MODELS[name]
    config = config_cls(**fields)
    with torch.device("meta"):
        lm = model_cls(config)
    params = dict(lm.named_parameters())  # tied weights would appear once
    total = sum(p.numel() for p in params.values())
    if total != published:
        raise AssertionError(f"{name}: the meta model has {total:,} parameters, the published count is {published:,}")
    layers = lm.model.layers
    per_layer = [(sum(p.numel() for n, p in layer.named_parameters() if not is_expert_param(n)),
                  sum(p.numel() for n, p in layer.named_parameters() if is_expert_param(n))) for layer in layers]
    if len(set(per_layer)) != 1:
        raise AssertionError(f"{name}: decoder layers differ in size {sorted(set(per_layer))}; the plan assumes alike layers")
    layer_dense, layer_experts = per_layer[0]
    return Counts(total=total, experts=sum(p.numel() for n, p in params.items() if is_expert_param(n)),
                  layer_dense=layer_dense, layer_experts=layer_experts,
                  root=total - len(layers) * (layer_dense + layer_experts), config=config)


def head_dim(c) -> int:
    return getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads  # Qwen2 has no field


def activation_bytes(c, tokens: int, cp: int, skew: float = 1.0) -> float:
    """Peak activation bytes of one rank for a microbatch of `tokens` tokens (see the module docstring)."""
    H, L, V = c.hidden_size, c.num_hidden_layers, c.vocab_size
    q, kv = c.num_attention_heads * head_dim(c), c.num_key_value_heads * head_dim(c)
    local = tokens / cp
    attention = (3 * H + 4 * q + 4 * kv) * BF16 + FP32 * c.num_attention_heads
    if getattr(c, "num_experts", 0):
        mlp = c.num_experts_per_tok * (2 * H + 4 * c.moe_intermediate_size) * BF16 * skew + 2 * FP32 * c.num_experts
    else:
        mlp = 4 * c.intermediate_size * BF16
    gathered_kv = (2 * kv * BF16 * tokens) if cp > 1 else 0.0  # the full sequence's K/V on every CP rank
    checkpoints = L * H * BF16 * local
    one_layer = 2 * ((attention + mlp) * local + gathered_kv)  # activations + their gradients
    head = 12 * LOGPROB_CHUNK * V
    return checkpoints + one_layer + head


def transient_bytes(c: Counts, ep: int = 1) -> float:
    """Root and two gathered decoder layers (this EP rank's experts): the module docstring's transients."""
    return 4 * c.root + 2 * 8 * (c.layer_dense + c.layer_experts / ep)


def plan(counts: dict[str, Counts], gpu_gib: float, reserve_gib: float, skew: float) -> list[dict]:
    rows = []
    for name, gpus, dp, cp, ep in LAYOUTS:
        c = counts[name]
        if dp * cp != gpus or dp % ep or (c.experts == 0 and ep > 1):
            raise ValueError(f"layout {name} gpus={gpus} dp={dp} cp={cp} ep={ep}: need dp*cp == gpus, ep | dp, ep=1 for dense")
        dense, experts = c.total - c.experts, c.experts
        per_rank = dense / (dp * cp) + experts / ep / ((dp // ep) * cp)  # == total / gpus
        transient = transient_bytes(c, ep)
        for tokens in MAX_TOKENS:
            act = activation_bytes(c.config, tokens, cp, skew)
            parts = {"params": FP32 * per_rank, "grads": FP32 * per_rank, "adam": 2 * FP32 * per_rank,
                     "transient": transient, "activations": act}
            total = sum(parts.values())
            rollout = BF16 * c.total
            budget = (gpu_gib - reserve_gib) * GIB
            rows.append({"model": name, "gpus": gpus, "dp": dp, "cp": cp, "ep": ep, "max_tokens": tokens,
                         **{k: v / GIB for k, v in parts.items()}, "total": total / GIB, "rollout": rollout / GIB,
                         "fits": total <= budget, "fits_with_rollout": total + rollout <= budget})
    return rows


# (model, GPUs, dp, cp, ep) of the rollout table: 8 GPUs, each model's layout whose training fits
# (Qwen3-30B-A3B needs ep=8: at ep=1 a gathered layer holds all 128 experts and training alone is over)
ROLLOUT_LAYOUTS = [("Qwen2.5-7B", 8, 8, 1, 1), ("Qwen3-8B", 8, 8, 1, 1), ("Qwen3-30B-A3B", 8, 8, 1, 8)]
ROLLOUT_TRAIN_TOKENS = 8192  # the training row each rollout row stands beside
TP_SIZES = (1, 2, 4, 8)


def kv_bytes_per_token(c, dtype_bytes: int) -> int:
    return 2 * c.num_hidden_layers * c.num_key_value_heads * head_dim(c) * dtype_bytes


def sampling_bytes(c, rows: int) -> int:
    """Sampling buffers: fp32 logits, fp32 log-softmax, fp64 CDF over the vocabulary, a row each."""
    return rows * c.vocab_size * (FP32 + FP32 + 8)


def rollout_plan(counts: dict[str, Counts], train_rows: list[dict], gpu_gib: float, reserve_gib: float,
                 rows: int, length: int) -> list[dict]:
    """Per-GPU rollout memory of each mode and the start-up choice (module docstring)."""
    budget = (gpu_gib - reserve_gib) * GIB
    out = []
    for name, gpus, dp, cp, ep in ROLLOUT_LAYOUTS:
        c, P = counts[name], counts[name].total
        train = next(r for r in train_rows if (r["model"], r["gpus"], r["dp"], r["cp"], r["ep"], r["max_tokens"])
                     == (name, gpus, dp, cp, ep, ROLLOUT_TRAIN_TOKENS))["total"] * GIB
        shards = FP32 * P / gpus
        resident = 3 * shards  # fp32 parameters + AdamW moments; gradients freed after the step
        tokens = rows * length
        sampling = sampling_bytes(c.config, rows)
        replica = FP32 * P
        keep_rollout = resident + replica + tokens * kv_bytes_per_token(c.config, FP32) + sampling
        keep = max(keep_rollout, train + replica)
        gathered = BF16 * c.root + 2 * BF16 * (c.layer_dense + c.layer_experts / ep)
        # what a decode step of the sharded engine receives per rank: every layer's dense rows from
        # the other ranks, its experts from the other ranks of its expert-data-parallel group
        edp = gpus // ep
        per_step = BF16 * c.config.num_hidden_layers * (c.layer_dense * (gpus - 1) / gpus
                                                        + c.layer_experts / ep * (edp - 1) / edp)
        sharded_rollout = resident + gathered + tokens * kv_bytes_per_token(c.config, BF16) + sampling
        sharded = max(sharded_rollout, train)
        vllm = {tp: resident + (BF16 * P + tokens * kv_bytes_per_token(c.config, BF16)) / tp + sampling
                for tp in TP_SIZES}
        tp_min = next((tp for tp in TP_SIZES if max(vllm[tp], train) <= budget), None)
        # what rollout.replica=auto decides at start-up: the free memory it sees once the shards are placed
        free = budget - shards
        plan = choose("auto", engine="hf", replica_bytes=int(replica), state_bytes=int(3 * shards),
                      budget_bytes=int(free * (1 - RESERVE)), budget_source="bench")
        out.append({"model": name, "gpus": gpus, "dp": dp, "cp": cp, "ep": ep, "params": P,
                    "train_peak": train / GIB, "resident": resident / GIB, "kv_tokens": tokens,
                    "keep_copy": replica / GIB, "keep_rollout": keep_rollout / GIB, "keep_peak": keep / GIB,
                    "sharded_gathered": gathered / GIB, "sharded_step_received": per_step / GIB,
                    "sharded_rollout": sharded_rollout / GIB,
                    "sharded_peak": sharded / GIB, "vllm_tp": tp_min,
                    "vllm_rollout": (vllm[tp_min] if tp_min else vllm[TP_SIZES[-1]]) / GIB,
                    "keep_fits": keep <= budget, "sharded_fits": sharded <= budget, "chosen": plan.mode,
                    "chosen_rollout": (keep_rollout if plan.mode == "keep" else sharded_rollout) / GIB})
    return out


# Placements (issue 54, docs/rollouts.md "Memory per placement"): (model, N GPUs, R of them dedicated generators)
PLACEMENTS = [("SmolLM2-135M", 8, 4), ("Qwen3-8B", 8, 4), ("Qwen3-8B", 8, 2)]


def placement_plan(counts: dict[str, Counts], gpu_gib: float, reserve_gib: float, rows: int, length: int,
                   tokens: int = ROLLOUT_TRAIN_TOKENS) -> list[dict]:
    """Per-GPU memory of a dense model on N GPUs, colocated against dedicated rollout ranks
    (R generators, T = N - R trainers; `rows` x `length` tokens of KV cache a colocated GPU holds):

        colocated  each GPU: training state 16 B x P / N (fp32 masters, gradients, AdamW moments) +
                   transients + activations (`plan`), and the rollout copy (rl/rollout/build.py: in
                   the compute dtype, bf16: 2 B x P) with its KV cache and sampling buffers: peak =
                   max(resident 12 B x P / N + copy + KV + sampling, training + copy)
        trainer    16 B x P / T + transients + activations + one sync bucket of full fp32 tensors
                   (the push's gather, rl/rollout/sync.py); no copy, no KV cache
        generator  the copy in the compute dtype (2 B x P) + the KV cache and sampling buffers of
                   N / R colocated GPUs' rows (it rolls out their prompts) + one received tensor in
                   fp32 (the largest); no optimizer state, no gradients, no activations. At
                   max_staleness >= 1 the next version waits in host memory (4 B x P, the stage)."""
    from rl.rollout.sync import DEFAULT_BUCKET_BYTES

    budget = (gpu_gib - reserve_gib) * GIB
    out = []
    for name, n, r in PLACEMENTS:
        c, P, t = counts[name], counts[name].total, n - r
        cfg = c.config
        transient = transient_bytes(c)
        act = activation_bytes(cfg, tokens, 1)
        largest = FP32 * cfg.vocab_size * cfg.hidden_size  # the embedding (and an untied head)
        kv, sampling = rows * length * kv_bytes_per_token(cfg, BF16), sampling_bytes(cfg, rows)
        copy = BF16 * P
        colocated = max(3 * FP32 * P / n + copy + kv + sampling, STATE_BYTES * P / n + transient + act + copy)
        bucket = max(min(DEFAULT_BUCKET_BYTES, FP32 * P / t), largest)
        trainer = STATE_BYTES * P / t + transient + act + bucket
        generator = copy + (n / r) * (kv + sampling) + largest
        out.append({"model": name, "gpus": n, "rollout_ranks": r, "params": P, "colocated": colocated / GIB,
                    "trainer": trainer / GIB, "trainer_state": STATE_BYTES * P / t / GIB, "generator": generator / GIB,
                    "generator_kv": (n / r) * kv / GIB, "generator_copy": copy / GIB,
                    "generator_host_stage": FP32 * P / GIB, "colocated_fits": colocated <= budget,
                    "trainer_fits": trainer <= budget, "generator_fits": generator <= budget})
    return out


def placement_table(rows: list[dict]) -> str:
    head = ["model", "GPUs", "R", "colocated", "trainer", "(state)", "generator", "(copy)", "(KV x N/R)",
            "host stage (k>=1)", "fits: colocated", "trainer", "generator"]
    keys = ["model", "gpus", "rollout_ranks", "colocated", "trainer", "trainer_state", "generator", "generator_copy",
            "generator_kv", "generator_host_stage", "colocated_fits", "trainer_fits", "generator_fits"]
    return _format(head, keys, rows)


def rollout_table(rows: list[dict]) -> str:
    head = ["model", "GPUs", "train peak", "resident", "keep: copy", "rollout", "peak", "fits",
            "sharded: gathered", "received a decode step", "rollout", "peak", "fits", "vllm TP", "rollout", "chosen",
            "chosen rollout"]
    keys = ["model", "gpus", "train_peak", "resident", "keep_copy", "keep_rollout", "keep_peak", "keep_fits",
            "sharded_gathered", "sharded_step_received", "sharded_rollout", "sharded_peak", "sharded_fits", "vllm_tp", "vllm_rollout",
            "chosen", "chosen_rollout"]
    return _format(head, keys, rows)


def layout_id(r: dict) -> str:
    return f"{r['model']}@{r['gpus']}:dp{r['dp']}xcp{r['cp']}xep{r['ep']},T{r['max_tokens'] // 1024}k"


def table(rows: list[dict]) -> str:
    cols = ["model", "gpus", "dp", "cp", "ep", "max_tokens", "params", "grads", "adam", "transient",
            "activations", "total", "fits", "rollout", "fits_with_rollout"]
    head = ["model", "GPUs", "dp", "cp", "ep", "tokens", "params", "grads", "adam", "transient",
            "activ.", "total GiB", "fits", "+rollout", "fits w/ rollout"]
    return _format(head, cols, rows)


def _format(head: list[str], keys: list[str], rows: list[dict]) -> str:
    def cell(v) -> str:
        if isinstance(v, bool):
            return "yes" if v else "no"
        return "-" if v is None else f"{v:.1f}" if isinstance(v, float) else str(v)

    cells = [[cell(r[k]) for k in keys] for r in rows]
    widths = [max(len(h), *(len(row[i]) for row in cells)) for i, h in enumerate(head)]
    fmt = lambda row: "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths)))  # noqa: E731
    return "\n".join([fmt(head), fmt(["-" * w for w in widths]), *map(fmt, cells)])


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description="Per-GPU memory plan (see the module docstring for the model).")
    p.add_argument("--gpu-gib", type=float, default=80.0, help="memory of one GPU, GiB")
    p.add_argument("--reserve-gib", type=float, default=8.0, help="CUDA context, NCCL buffers, fragmentation")
    p.add_argument("--routing-skew", type=float, default=1.0, help="busiest rank's routed tokens over the mean")
    p.add_argument("--rollout-rows", type=int, default=32, help="samples generated together per GPU")
    p.add_argument("--rollout-len", type=int, default=2048, help="prompt + response tokens of each")
    args = p.parse_args(argv)

    counts = {name: count(name) for name in MODELS}
    for name, c in counts.items():
        print(f"{name}: {c.total:,} parameters (= published), {c.experts:,} expert, {c.total - c.experts:,} dense, "
              f"{c.active:,} active per token; one layer {c.layer_dense:,} dense + {c.layer_experts:,} expert; "
              f"root {c.root:,}")
    rows = plan(counts, args.gpu_gib, args.reserve_gib, args.routing_skew)
    print(f"\nGiB per GPU; fits: total <= {args.gpu_gib:g} - {args.reserve_gib:g} reserve GiB "
          f"(state 16 B/param sharded, bf16 compute, activation checkpointing per layer)")
    print(table(rows))
    rollout = rollout_plan(counts, rows, args.gpu_gib, args.reserve_gib, args.rollout_rows, args.rollout_len)
    print(f"\nRollout, GiB per GPU ({args.rollout_rows} x {args.rollout_len} tokens of KV cache per GPU; training "
          f"beside it: T{ROLLOUT_TRAIN_TOKENS // 1024}k; fits: <= {args.gpu_gib:g} - {args.reserve_gib:g} GiB at "
          f"the step's peak; chosen: rollout.replica=auto at start-up)")
    print(rollout_table(rollout))
    placements = placement_plan(counts, args.gpu_gib, args.reserve_gib, args.rollout_rows, args.rollout_len)
    print(f"\nPlacements, GiB per GPU ({args.rollout_rows} x {args.rollout_len} tokens of KV cache per colocated "
          f"GPU, a generator N/R times that; training T{ROLLOUT_TRAIN_TOKENS // 1024}k; bf16 compute; host stage: "
          "host memory of a generator at max_staleness >= 1)")
    print(placement_table(placements))
    summary = {
        "gpu_gib": args.gpu_gib, "reserve_gib": args.reserve_gib,
        "params": {name: c.total for name, c in counts.items()},
        "fits": [layout_id(r) for r in rows if r["fits"]],
        "does_not_fit": [layout_id(r) for r in rows if not r["fits"]],
        "fits_with_rollout_copy": [layout_id(r) for r in rows if r["fits_with_rollout"]],
        "rollout_chosen": {r["model"]: r["chosen"] for r in rollout},
        "rollout_gib_chosen": {r["model"]: round(r["chosen_rollout"], 1) for r in rollout},
        "rollout_gib_keep": {r["model"]: round(r["keep_rollout"], 1) for r in rollout},
        "rollout_gib_sharded": {r["model"]: round(r["sharded_rollout"], 1) for r in rollout},
        "sharded_received_gib_per_decode_step": {r["model"]: round(r["sharded_step_received"], 1) for r in rollout},
        "placements_gib": {f"{r['model']}@{r['gpus']}:R{r['rollout_ranks']}": {
            k: round(r[k], 2) for k in ("colocated", "trainer", "generator")} for r in placements},
    }
    return emit("memory_plan", summary, {"rows": rows, "rollout": rollout, "placements": placements})


if __name__ == "__main__":
    main()
