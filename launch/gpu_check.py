"""The GPU check: one bare single-GPU machine, <= 6 minutes, two files back (launch/gpu_check.sh).

    launch/gpu_check.sh --out DIR                        # on the GPU machine (how to run it: gpu_check.sh)
    launch/gpu_check.sh --out DIR --device cpu           # the CPU rehearsal (tests/test_gpu_check.py)

Writes `DIR/gpu_check.json` (the summary; also the last stdout line) and `DIR/gpu_check_logs.tar.gz`
(every section's log, figures and run folder, checkpoint weights left out). Sections, each in its own
process with its own time limit (LIMIT_S); a failure or a timeout is recorded in the JSON and the next
section still runs; the exit code is 1 when one failed:

  env      torch / transformers / CUDA / NCCL versions, the device, torch's `varlen_attn` (present, its
           signature, the keywords model/kernels.py calls it with), `torch._grouped_mm` (present, taken
           by the MoE expert GEMMs in bf16 on this device, equal to the per-expert loop within 2 bf16
           eps), the fp32 log-prob head (model/logprobs.py `logits_fp32`: its path here, against fp64
           logits), the torch-2.13-only collectives (runtime/compat.py falls back without them), and the
           modules train.py needs.
  kernels  the pack attention as the model runs it (model/attention.py, model/context_parallel.py:
           torch's varlen kernel on CUDA bf16, per-sequence sdpa on CPU) against masked sdpa over the
           whole pack with an explicit [N_q, N_k] mask, on three layouts: a pack of uneven sequences,
           shared prompts (GRPO groups holding their prompt once: keys != queries, causal bottom-right)
           and CP segments (cp=2 zigzag shards, each rank's queries against the gathered keys; the CP
           layout on the host, as the trainer builds it). Figure: max |out - truth| / max |truth|, truth =
           fp32 masked sdpa on the same (rounded) inputs. Bound: KERNEL_BOUND (bf16: 2 eps, the output's
           own rounding is eps / 2; fp32: 64 eps), the masked sdpa in the compute dtype reported beside it;
           control: the pack's boundaries withheld must break the bound. The CP flash segments of a layout
           that is not on the host (CUDA: on the GPU; CPU: on meta, no op mixing devices). Then the model:
           a tiny Qwen3 and a tiny Qwen3-MoE with the project's MoEBlocks (grouped mm, routing recorded
           and replayed: R3), packed (varlen kernel) vs padded (masked sdpa) log-probs (max and mean
           absolute nats) and gradients, each beside a noise floor (the padded batch under two sdpa
           backends), within NOISE_FACTOR x the floor; control: the pack as one sequence.
  train    train.py on one rank with FSDP2 (NCCL on CUDA, gloo on CPU), bf16 compute over fp32 masters
           on CUDA, activation checkpointing, the tiny MoE, under torch.use_deterministic_algorithms
           (warn_only: an op without a deterministic implementation is listed): 4 steps saving at step
           2, then a second run resumed from that checkpoint; its steps 2-3 equal the first run's within
           RESUME_TOL (RESUME_TOL_NONDETERMINISTIC when an op was listed).
  learn    train.py, the tiny dense model on target_token for LEARN_STEPS steps in bf16 compute: the
           mean reward of the last 5 steps exceeds the first 5's by LEARN_RISE.
  speed    a training step (packed forward, backward, clip, fused AdamW) at SmolLM2-135M's size (random
           init from its config: nothing downloaded), FSDP2 one rank, bf16 compute, activation
           checkpointing: tokens/s, estimated MFU (6 N + attention FLOPs per token, packing/planner.py
           `flop_cost` as bench/roofline.py counts, over the device's bf16 dense peak, PEAK_TFLOPS,
           recompute not counted), peak memory, host syncs per step
           (CUDA's own sync debug mode; on CPU, testing/host_syncs.py's count). Then the rollout side at
           that size: one weight sync into a bf16 copy (seconds, bytes, peak memory) and one generation
           of 64 prompts x 128 new tokens with the transformers engine (tokens/s, peak memory).

The JSON's `not_checked` says what one GPU cannot check (NOT_CHECKED) and where it is checked instead.
On CPU every section runs its CPU path at small sizes (`--size tiny`, the default off CUDA); what needs
CUDA says "skipped: no CUDA". `--drop-torch-2-13-names` deletes torch's 2.13-only names in every process
first (as torch 2.11 on the GPU image), so a CPU rehearsal goes through runtime/compat.py's fallbacks.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import pathlib
import runpy
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
import traceback
import types

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

SECTIONS = ("env", "kernels", "train", "learn", "speed")
# per section; a timeout is a failure. Estimated on one H100 (not yet measured there): env ~10 s, kernels ~20 s,
# train ~70 s (two train.py start-ups), learn ~50 s (20 steps), speed ~70 s (training, generation, sync): ~220 s
LIMIT_S = {"env": 30, "kernels": 60, "train": 120, "learn": 120, "speed": 120}
BUDGET_S = 330  # all sections together (the pip install and the tarball come on top: <= 6 minutes)
# the CPU rehearsal (--device cpu): its 20 RL steps and two resumed runs take minutes on a shared 2-core CPU
# where a GPU takes seconds; every limit and the budget scaled by CPU_SLOWDOWN
CPU_SLOWDOWN = 2
TORCH_2_13_ONLY = ("all_gather_single", "reduce_scatter_single")  # runtime/compat.py's fallbacks replace them
# runtime/compat.py's other fallbacks, by (module, class, name): gone from the GPU image's torch 2.11
TORCH_2_13_ONLY_METHODS = (("torch.distributed.fsdp", "FSDPModule", "reset_iter_state"),)
NO_CUDA = "skipped: no CUDA"
EPS = {torch.float32: torch.finfo(torch.float32).eps, torch.bfloat16: torch.finfo(torch.bfloat16).eps}
KERNEL_BOUND = {torch.float32: 64 * EPS[torch.float32], torch.bfloat16: 2 * EPS[torch.bfloat16]}
# relative; under torch.use_deterministic_algorithms (warn_only) the resumed run repeats the first one's kernels:
# 1e-6 unless an op without a deterministic implementation was reported, then RESUME_TOL_NONDETERMINISTIC
RESUME_TOL = {"cpu": 1e-6, "cuda": 1e-6}
RESUME_TOL_NONDETERMINISTIC = 1e-2  # bf16 and the atomics of those ops' backward
NONDETERMINISTIC = "does not have a deterministic implementation"
NOISE_FACTOR = 4  # model parity bound: NOISE_FACTOR x the noise floor (two sdpa backends) + NOISE_ABS
NOISE_ABS = 64 * torch.finfo(torch.float32).eps  # nats, relative grads: keeps the bound above 0 where the floor is 0
LEARN_STEPS, LEARN_RISE = 20, 0.3  # the learn section: mean reward of the last 5 steps - the first 5's >= LEARN_RISE
# what this check cannot reach on one GPU (the JSON says so; where each is checked instead)
NOT_CHECKED = {
    "nccl_cp_ep": "context and expert parallelism across ranks over NCCL (>= 2 GPUs; gloo on CPU: "
                  "tests/test_context_parallel.py, tests/test_moe.py)",
    "vllm": "rollout.engine=vllm (not on the bare image: requirements-vllm-gpu.txt; CPU: tests/test_vllm_engine.py), "
            "and a dedicated generator's vLLM engine on its own GPU (also >= 2 GPUs; its CUDA_VISIBLE_DEVICES, wiring "
            "only: tests/test_vllm_engine.py)",
    "flash_attn": "flash-attn's varlen kernel (not on the bare image; torch's varlen_attn runs instead)",
    "sharded_replica": "rollout.replica=sharded across ranks (a collective generation; CPU: "
                       "tests/test_sharded_rollout.py)",
    "lora_gpu": "LoRA training and its adapter sync on a GPU (CPU: tests/test_lora.py)",
    "multi_node": "torchrun across nodes (CPU simulation: tests/test_launch.py)",
}
RESUME_KEYS = ("reward_mean", "loss", "grad_norm")
# bf16 dense tensor-core peak (TFLOP/s, no sparsity) by device-name fragment, for the MFU estimate
PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "GH200": 989.0, "B200": 2250.0, "A100": 312.0, "L40S": 362.0,
               "A10G": 125.0, "L4": 121.0}
SMOLLM2_135M = dict(num_hidden_layers=30, hidden_size=576, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                    intermediate_size=1536, vocab_size=49152, tie_word_embeddings=True, rope_theta=100000.0,
                    max_position_embeddings=8192)
PACK_LENS = [5, 200, 37, 120, 9, 64]  # uneven samples
SHARED_UNITS = [(40, (16, 9, 30, 1)), (7, ()), (25, (12, 12))]  # (prompt, responses) per GRPO group; () alone
MODELS = {"dense": "qwen3", "moe": "qwen3_moe"}


def drop_torch_2_13_names() -> None:
    """As torch 2.11: the 2.13-only collectives and methods gone (runtime/compat.py takes the older ones)."""
    import importlib

    import torch.distributed as dist

    for name in TORCH_2_13_ONLY:
        if hasattr(dist, name):
            delattr(dist, name)
    for module, cls, name in TORCH_2_13_ONLY_METHODS:
        owner = getattr(importlib.import_module(module), cls)
        if name in vars(owner):
            delattr(owner, name)


def _device(cuda: bool) -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")


def _rel(ref: torch.Tensor, got: torch.Tensor) -> float:
    ref, got = ref.float(), got.float()
    return float((ref - got).abs().max() / ref.abs().max().clamp_min(1e-30))


# ------------------------------------------------------------------- env
def worker_env(args) -> dict:
    import importlib
    import inspect

    import torch.distributed as dist
    import transformers

    from model import kernels
    from model.moe import grouped_mm_fits

    cuda = args.device == "cuda"
    out = {"python": sys.version.split()[0], "torch": torch.__version__, "transformers": transformers.__version__,
           "cuda_runtime": torch.version.cuda, "torch_2_13_collectives": all(hasattr(dist, n) for n in TORCH_2_13_ONLY)}
    modules = {}
    for name in ("hydra", "omegaconf", "yaml", "tqdm", "psutil", "safetensors", "peft", "vllm", "flash_attn"):
        try:
            modules[name] = getattr(importlib.import_module(name), "__version__", "present")
        except ImportError:
            modules[name] = None
    out["modules"] = modules
    missing = [n for n in ("hydra", "omegaconf", "yaml", "tqdm", "psutil", "safetensors") if modules[n] is None]
    varlen = kernels.varlen_attn
    out["varlen_attn"] = None if varlen is None else {
        "signature": str(inspect.signature(varlen)),
        "causal_keyword": "window_size" if "window_size" in inspect.signature(varlen).parameters else "is_causal"}
    device = _device(cuda)
    out["pack_kernel_auto_bf16"] = kernels.NAMES[kernels.resolve("auto", device, torch.bfloat16)]
    out["grouped_mm"] = _grouped_mm_probe(device, grouped_mm_fits)
    out["fp32_head"] = _fp32_head_probe(device)
    if cuda:
        props = torch.cuda.get_device_properties(device)
        out.update(gpu=props.name, gpus=torch.cuda.device_count(), capability=f"{props.major}.{props.minor}",
                   memory_gib=round(props.total_memory / 2**30, 1), cudnn=torch.backends.cudnn.version(),
                   nccl=str(torch.cuda.nccl.version()))
    else:
        out["gpu"] = NO_CUDA
    ok = not missing and out["grouped_mm"].get("ok", True) and out["fp32_head"]["ok"]
    ok = ok and (not cuda or varlen is not None)
    return {"ok": bool(ok), **({"missing": missing} if missing else {}), **out}


def _grouped_mm_probe(device: torch.device, fits) -> dict:
    """`torch._grouped_mm` on expert GEMMs of the compute dtype vs one matmul per expert."""
    if not hasattr(torch, "_grouped_mm"):
        return {"present": False}
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    gen = torch.Generator().manual_seed(0)
    counts = [5, 0, 17, 42]  # rows per expert (one without any)
    rows = torch.randn(sum(counts), 64, generator=gen).to(device, dtype)
    weight = torch.randn(len(counts), 128, 64, generator=gen).to(device, dtype)  # [E, out, in], as gate_up_proj
    taken = fits(rows, weight)
    out = {"present": True, "taken": taken, "dtype": str(dtype).removeprefix("torch.")}
    if taken:
        offsets = torch.tensor(counts, device=device).cumsum(0).to(torch.int32)
        got = torch._grouped_mm(rows, weight.transpose(-2, -1), offs=offsets)
        loop = torch.cat([r @ w.T for r, w in zip(rows.split(counts), weight)])
        bound = 2 * EPS[dtype]
        out.update(rel_vs_loop=_rel(loop, got), bound=bound, ok=_rel(loop, got) <= bound)
    return out


def _fp32_head_probe(device: torch.device) -> dict:
    """model/logprobs.py `logits_fp32` on bf16 operands at SmolLM2's head size (one 64-row chunk): the
    path it takes on this device (CUDA: one GEMM with out_dtype=float32) against the fp32 product of the
    same values; the bf16-rounded logits beside it."""
    from model.logprobs import fp32_out_gemm, logits_fp32

    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(64, 576, generator=gen).to(device, torch.bfloat16)
    weight = (torch.randn(49152, 576, generator=gen) * 0.2).to(device, torch.bfloat16)
    exact = hidden.double() @ weight.double().T
    got = logits_fp32(hidden, weight)
    rel, rounded = _rel(exact, got), _rel(exact, (hidden @ weight.T).float())
    path = "mm out_dtype=float32" if fp32_out_gemm(device) else "fp32 operands by vocabulary block"
    return {"ok": got.dtype == torch.float32 and rel <= 1e-5, "path": path, "rel_vs_fp64": rel, "bound": 1e-5,
            "bf16_rounded_rel": rounded}


# --------------------------------------------------------------- kernels
def worker_kernels(args) -> dict:
    from model import kernels

    cuda = args.device == "cuda"
    device = _device(cuda)
    dtype = torch.bfloat16 if cuda else torch.float32
    kernel = kernels.select("auto", device, dtype)  # model.attention=auto, as a run's start-up
    out = {"dtype": str(dtype).removeprefix("torch."), "bound": KERNEL_BOUND[dtype], "pack_kernel": kernels.NAMES[kernel]}
    if not cuda:
        out["cuda"] = f"{NO_CUDA} (the CPU path ran: fp32, per-sequence / per-segment sdpa)"
    elif kernel == "sdpa":
        out["error"] = "no varlen kernel on this GPU (torch >= 2.10 has torch.nn.attention.varlen)"
    out["attention"] = _attention_parity(device, dtype)
    out["segments_on_the_layouts_device"] = _segments_device_check(device)
    out["model"] = _model_parity(device, dtype)
    layouts = out["attention"]
    ok = "error" not in out and all(layouts[k]["rel"] <= KERNEL_BOUND[dtype] for k in ("pack", "shared", "cp"))
    ok = ok and out["segments_on_the_layouts_device"]["ok"]
    ok = ok and layouts["pack"]["control_rel"] > KERNEL_BOUND[dtype]
    ok = ok and all(m["ok"] for m in out["model"].values())
    return {"ok": bool(ok), **out}


HEADS, KV_HEADS, HEAD_DIM = 8, 2, 64


def _qkv(n: int, device, dtype, seed: int) -> tuple[torch.Tensor, ...]:
    """q `[1, H, n, D]`, k/v `[1, H_kv, n, D]`, rounded to `dtype` (the truth sees the same inputs); views of
    `[1, n, H, D]` tensors, as a model's projections hand them to the attention."""
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(1, n, h, HEAD_DIM, generator=gen).to(device, dtype).transpose(1, 2)
                 for h in (HEADS, KV_HEADS, KV_HEADS))


def _masked(q, k, v, allowed: torch.Tensor) -> torch.Tensor:
    """sdpa over the whole row with `allowed [N_q, N_k]`: `[1, N_q, H, D]`."""
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=allowed, enable_gqa=True)
    return out.transpose(1, 2)


def _pack_mask(lens: list[int], device) -> torch.Tensor:
    """Same sequence, key position <= query position: built from the lengths alone."""
    seq = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))
    pos = torch.cat([torch.arange(n) for n in lens])
    return ((seq[:, None] == seq[None, :]) & (pos[None, :] <= pos[:, None])).to(device)


def _shared_mask(units, device) -> torch.Tensor:
    """A prompt row sees its prompt causally; a response row its prompt and its own response causally."""
    unit, seg, pos = [], [], []
    for u, (prompt, responses) in enumerate(units):
        for g, (start, n) in enumerate([(0, prompt)] + [(prompt, r) for r in responses]):
            unit += [u] * n
            seg += [g] * n
            pos += range(start, start + n)
    unit, seg, pos = torch.tensor(unit), torch.tensor(seg), torch.tensor(pos)
    same = (unit[:, None] == unit[None, :]) & ((seg[None, :] == 0) | (seg[:, None] == seg[None, :]))
    return (same & (pos[None, :] <= pos[:, None])).to(device)


def _attention_parity(device, dtype) -> dict:
    from model.attention import packed_attn_kwargs, varlen_attention_forward
    from model.context_parallel import CPContext, _attend
    from runtime.cp_shard import cp_layout, shard_tokens, unshard
    from packing.experience import Experience
    from packing.prompts import layout_of_units

    module = types.SimpleNamespace(is_causal=True, num_key_value_groups=HEADS // KV_HEADS)
    out = {}

    def figures(name, got, q, k, v, allowed):
        truth = _masked(q.float(), k.float(), v.float(), allowed)
        out[name] = {"rel": _rel(truth, got), "masked_sdpa_rel": _rel(truth, _masked(q, k, v, allowed)),
                     "tokens": q.shape[2]}
        return truth

    n = sum(PACK_LENS)
    q, k, v = _qkv(n, device, dtype, seed=1)
    got = varlen_attention_forward(module, q, k, v, None, **packed_attn_kwargs(PACK_LENS, device=device))[0]
    truth = figures("pack", got, q, k, v, _pack_mask(PACK_LENS, device))
    whole = varlen_attention_forward(module, q, k, v, None, **packed_attn_kwargs([n], device=device))[0]
    out["pack"]["control_rel"] = _rel(truth, whole)  # the boundaries withheld: one causal sequence

    layout = layout_of_units(SHARED_UNITS).to(device)
    rows = sum(p + sum(r) for p, r in SHARED_UNITS)
    qs, ks, vs = _qkv(rows, device, dtype, seed=2)
    got = varlen_attention_forward(module, qs, ks, vs, None, shared_prompts=layout)[0]
    figures("shared", got, qs, ks, vs, _shared_mask(SHARED_UNITS, device))

    cp = 2  # each CP rank's queries against the keys every rank holds (gathered in rank order), on one device
    pack = Experience(sequences=torch.zeros(1, n, dtype=torch.long), packed_seq_lens=list(PACK_LENS))
    layouts = [cp_layout(pack, cp, r) for r in range(cp)]
    key_full, value_full = (torch.cat([shard_tokens(t, lay, dim=2) for lay in layouts], dim=2) for t in (k, v))
    local = [_attend(module, shard_tokens(q, lay, dim=2), key_full, value_full,
                     CPContext(lay, None, device), 0.0, None) for lay in layouts]  # the host layout, as trained
    got = unshard(torch.cat(local, dim=1), layouts[0], dim=1)
    figures("cp", got, q, k, v, _pack_mask(PACK_LENS, device))
    out["cp"]["cp"] = cp
    return out


def _segments_device_check(device: torch.device) -> dict:
    """The CP flash segments of a layout that is not on the host (issue 52.5: a CUDA layout got a host
    `arange` through index_put_, which CUDA refuses), plain and shared-prompt, CP rank 0 and 1. CUDA: the
    layout on the GPU, its segments equal the host layout's. CPU: the layout on meta, no op mixing
    devices (testing/mixed_devices.py), the same segment lengths."""
    import dataclasses as dc

    from model.context_parallel import flash_segments
    from runtime.cp_shard import Segments, cp_layout
    from packing.experience import Experience

    cases = {"pack": (PACK_LENS, None), "shared": ([p + sum(r) for p, r in SHARED_UNITS],
                                                   Segments.of_units(SHARED_UNITS))}
    out, ok = {}, True
    for name, (lens, segments) in cases.items():
        pack = Experience(sequences=torch.zeros(1, sum(lens), dtype=torch.long), packed_seq_lens=list(lens))
        for rank in range(2):
            lay = cp_layout(pack, 2, rank, segments=segments)
            want = flash_segments(lay, device)
            if device.type == "cuda":
                got, mixed = flash_segments(lay.to(device), device), []
                same = all(torch.equal(a, b) for a, b in zip((got[0], got[1], got[4]), (want[0], want[1], want[4])))
            else:
                from testing.mixed_devices import MixedDevices

                meta = lay.to("meta")
                if segments is not None:  # read to the host by .tolist(): meta holds no values
                    meta = dc.replace(meta, segment=lay.segment, shared=lay.shared)
                with MixedDevices() as seen:
                    got = flash_segments(meta, "meta")
                mixed = seen.ops
                same = got[2:4] == want[2:4] and got[4].shape == want[4].shape and got[4].device.type == "meta"
            out[f"{name}_rank{rank}"] = {"same": bool(same), "mixed_device_ops": mixed}
            ok = ok and same and not mixed
    return {"ok": bool(ok), "layout_device": "cuda" if device.type == "cuda" else "meta", **out}


def _records(vocab: int, lengths=PACK_LENS, seed: int = 0):
    from packing.experience import Experience

    gen = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        prompt = int(torch.randint(1, n, (1,), generator=gen))  # >= 1 response token
        out.append(Experience(sequences=torch.randint(0, vocab, (n,), generator=gen),
                              action_mask=torch.arange(n - 1) >= prompt - 1))
    return out


def _model_parity(device, dtype) -> dict:
    """Packed (the varlen kernel) vs padded (masked sdpa) log-probs and gradients of the tiny Qwen3 and
    of the tiny Qwen3-MoE with the project's `MoEBlock`s (`shard_experts`: the expert GEMMs through
    `torch._grouped_mm` where it fits, counted), its routing recorded on the padded forward and
    replayed in both (R3), so a router near-tie cannot flip an expert between layouts. Figures: the
    log-probs' max and mean absolute difference in nats over the action tokens, the gradients' max
    absolute difference relative to the largest gradient, each beside its noise floor: the padded
    batch under two sdpa backends (the default and the math one). Bound: NOISE_FACTOR x the floor +
    NOISE_ABS. Control: the pack run as one sequence must break the log-prob bound."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from model.actor import Actor
    from model.models import build_model
    from model.moe import moe_blocks, record_routing, shard_experts
    from runtime.parallel_dims import ParallelDims
    from packing.collate import make_experience_batch
    from packing.experience import Experience

    out = {}
    for kind, name in MODELS.items():
        # initializer_range 0.2: peaked next-token distributions, like a trained model's
        model = build_model(name, seed=0, dtype=dtype, initializer_range=0.2).to(device)
        if kind == "moe":
            shard_experts(model, None)  # the training forward's blocks, every expert local (as one rank runs)
        blocks = len(moe_blocks(model, strict=False))
        actor = Actor(model, chunk_bytes=128 * 4 * model.config.vocab_size, dims=ParallelDims(device=device)).eval()
        records = _records(model.config.vocab_size)
        if blocks:
            padded = make_experience_batch(records, packed=False).to(device)
            with torch.no_grad(), record_routing(model) as rec:
                actor(padded)
            routed = rec.routed_experts.cpu()
            records = [dataclasses.replace(r, routed_experts=routed[b, ..., : r.sequences.numel()])
                       for b, r in enumerate(records)]
        padded = make_experience_batch(records, packed=False).to(device)
        pack = make_experience_batch(records, packed=True).to(device)
        with _count_grouped_mm() as grouped:
            ref, ref_grads = _logp_and_grads(actor, padded)
            got, got_grads = _logp_and_grads(actor, pack)
        with sdpa_kernel([SDPBackend.MATH]):
            floor, floor_grads = _logp_and_grads(actor, padded)
        with torch.no_grad():
            whole = Experience(sequences=pack.sequences, attention_mask=torch.ones_like(pack.sequences, dtype=torch.bool),
                               routed_experts=pack.routed_experts)
            control = torch.nn.functional.pad(actor(whole), (0, 1))[pack.action_mask].float().cpu()
        fig = {"max_nats": float((got - ref).abs().max()), "mean_nats": float((got - ref).abs().mean()),
               "noise_max_nats": float((floor - ref).abs().max()), "noise_mean_nats": float((floor - ref).abs().mean()),
               "control_max_nats": float((control - ref).abs().max()), "tokens": ref.numel(),
               "grad_rel": _grads_rel(ref_grads, got_grads), "noise_grad_rel": _grads_rel(ref_grads, floor_grads)}
        fig.update(bound_max_nats=NOISE_FACTOR * fig["noise_max_nats"] + NOISE_ABS,
                   bound_mean_nats=NOISE_FACTOR * fig["noise_mean_nats"] + NOISE_ABS,
                   bound_grad_rel=NOISE_FACTOR * fig["noise_grad_rel"] + NOISE_ABS)
        fig["ok"] = bool(fig["max_nats"] <= fig["bound_max_nats"] and fig["mean_nats"] <= fig["bound_mean_nats"]
                         and fig["grad_rel"] <= fig["bound_grad_rel"]
                         and fig["control_max_nats"] > fig["bound_max_nats"])
        if kind == "moe":
            fig.update(moe_blocks=blocks, grouped_mm_calls=grouped[0], routing="recorded on the padded batch, "
                       "replayed in both (R3)")
            fig["ok"] = fig["ok"] and blocks > 0
        out[kind] = fig
    return out


def _logp_and_grads(actor, batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The action tokens' log-probs (fp32, host) and every parameter's gradient of their sum."""
    actor.zero_grad(set_to_none=True)
    logp = actor(batch)[batch.action_mask]
    logp.sum().backward()
    grads = {n: p.grad.detach().float().cpu() for n, p in actor.named_parameters() if p.grad is not None}
    actor.zero_grad(set_to_none=True)
    return logp.detach().float().cpu(), grads


def _grads_rel(ref: dict[str, torch.Tensor], got: dict[str, torch.Tensor]) -> float:
    """max |got - ref| over every gradient, relative to the largest |ref|."""
    if ref.keys() != got.keys():
        raise ValueError(f"gradients of different parameters: {sorted(ref.keys() ^ got.keys())[:4]}")
    scale = max(float(g.abs().max()) for g in ref.values())
    return max(float((got[n] - g).abs().max()) for n, g in ref.items()) / max(scale, 1e-30)


class _count_grouped_mm:
    """`with _count_grouped_mm() as calls:` counts `torch._grouped_mm` calls (calls[0])."""

    def __enter__(self) -> list[int]:
        self.calls, self.original = [0], getattr(torch, "_grouped_mm", None)
        if self.original is not None:
            def counted(*args, **kwargs):
                self.calls[0] += 1
                return self.original(*args, **kwargs)
            torch._grouped_mm = counted
        return self.calls

    def __exit__(self, *exc) -> None:
        if self.original is not None:
            torch._grouped_mm = self.original


# ----------------------------------------------------------------- speed
def worker_speed(args) -> dict:
    import math

    from model.actor import Actor
    from model.models import build_model
    from runtime.parallel_dims import init_distributed
    from model.parallelize import clip_grad_norm_, parallelize
    from packing.collate import make_experience_batch
    from packing.flops import flop_cost
    from rl.trainer.trainer import adamw_options

    cuda, full = args.device == "cuda", args.size == "full"
    dims = init_distributed(device=args.device, one_rank_group=True)  # FSDP2 over one rank, as train.py
    device = dims.device
    overrides = SMOLLM2_135M if full else dict(SMOLLM2_135M, num_hidden_layers=2, hidden_size=64,
                                                num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                                intermediate_size=128, vocab_size=512)
    lengths = ([384, 512, 640, 448, 576, 320, 704, 512] * 2) if full else [24, 40, 16, 32]
    warmup, timed = (3, 5) if full else (1, 2)
    model = build_model("llama", seed=0, dtype=torch.float32, initializer_range=0.02, **overrides)
    config = model.config
    actor = parallelize(Actor(model, dims=dims), dims, param_dtype=torch.bfloat16 if cuda else None,
                        activation_checkpointing=True)
    optimizer = torch.optim.AdamW(actor.parameters(), lr=1e-5, **adamw_options(device))
    batch = make_experience_batch(_records(config.vocab_size, lengths, seed=3), packed=True).to(device)
    scored = batch.action_mask.sum()

    def step():
        logp = actor(batch)
        (-(logp * batch.action_mask).sum() / scored).backward()
        clip_grad_norm_(actor.parameters(), 1.0, dims)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for _ in range(warmup):
        step()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    for _ in range(timed):
        step()
    if cuda:
        torch.cuda.synchronize()
    seconds = (time.perf_counter() - start) / timed
    syncs, where = _host_syncs(step, cuda)
    tokens = sum(lengths)
    cost = flop_cost(config)  # every token scored (no actions_only): the head on each
    flops = sum(cost(n) for n in lengths)
    out = {"model": "SmolLM2-135M config, random init" if full else "llama, tiny (CPU sizes)",
           "params": sum(p.numel() for p in model.parameters()), "tokens_per_step": tokens, "sequences": len(lengths),
           "step_s": seconds, "tokens_per_s": tokens / seconds, "flops_per_step": flops,
           "host_syncs_per_step": syncs, "host_syncs_where": where,
           "compute_dtype": "bfloat16" if cuda else "float32", "activation_checkpointing": True}
    if cuda:
        name = torch.cuda.get_device_name(device)
        peak = next((v for k, v in PEAK_TFLOPS.items() if k in name), None)
        out.update(peak_memory_gib=torch.cuda.max_memory_allocated(device) / 2**30, peak_tflops=peak,
                   mfu=None if peak is None else flops / seconds / (peak * 1e12))
    else:
        out.update(peak_memory_gib=NO_CUDA, mfu=NO_CUDA)
    out["weight_sync"], out["generation"] = _sync_and_generate(actor, overrides, device, full)
    ok = math.isfinite(seconds) and seconds > 0 and out["generation"]["tokens"] == out["generation"]["expected_tokens"]
    return {"ok": ok, **out}


def _peak_gib(device: torch.device) -> float | str:
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else NO_CUDA


def _reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)


def _sync_and_generate(actor, overrides: dict, device: torch.device, full: bool) -> tuple[dict, dict]:
    """The rollout side at the same size: a compute-dtype copy (bf16 on CUDA, as `rollout.replica=keep`)
    gets the trained weights (`sync_weights`, in the default buckets: seconds, bytes, peak memory; the
    second sync timed), then generates 64 prompts x 128 new tokens (CPU: 8 x 16) with the transformers
    engine, no stop token (tokens/s, peak memory; a small generation first warms the kernels up)."""
    from model.models import build_model
    from rl.rollout.engine import HFRolloutEngine
    from rl.rollout.sync import sync_weights

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    engine = HFRolloutEngine(build_model("llama", seed=1, dtype=dtype, **overrides).to(device))
    sync_weights(engine, actor.model)
    _reset_peak(device)
    t0 = time.perf_counter()
    sync_weights(engine, actor.model)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    sync = {"seconds": time.perf_counter() - t0, "bytes": int(engine.loaded_bytes),
            "peak_memory_gib": _peak_gib(device), "replica_dtype": str(dtype).removeprefix("torch.")}
    prompts_n, prompt_len, new = (64, 32, 128) if full else (8, 8, 16)
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, overrides["vocab_size"], (prompt_len,), generator=gen) for _ in range(prompts_n)]
    engine.generate(prompts[:2], prompt_indices=[0, 1], max_new_tokens=4, temperature=1.0, seed=0)  # warm-up
    _reset_peak(device)
    t0 = time.perf_counter()
    records = engine.generate(prompts, prompt_indices=list(range(prompts_n)), max_new_tokens=new, temperature=1.0,
                              seed=0)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - t0
    tokens = sum(int(r.action_mask.sum()) for r in records)
    generation = {"prompts": prompts_n, "prompt_tokens": prompt_len, "new_tokens": new, "tokens": tokens,
                  "expected_tokens": prompts_n * new, "seconds": seconds, "tokens_per_s": tokens / seconds,
                  "peak_memory_gib": _peak_gib(device), "engine": "transformers (rl/rollout/engine.py)"}
    return sync, generation


def _host_syncs(step, cuda: bool) -> tuple[int, dict[str, int]]:
    """Host syncs of one step: CUDA's own count (one warning per synchronizing call), or on CPU
    testing/host_syncs.py's count of the calls that would sync on a GPU."""
    if cuda:
        import warnings

        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                step()
            finally:
                torch.cuda.set_sync_debug_mode(0)
        found = [f"{w.filename}:{w.lineno}" for w in caught if "synchroniz" in str(w.message)]
        return len(found), dict(collections.Counter(found).most_common(20))
    from testing.host_syncs import count_host_syncs

    with count_host_syncs() as syncs:
        step()
    return syncs.total(), dict(collections.Counter(w for kind in syncs.where.values() for w in kind).most_common(20))


# ----------------------------------------------------------------- train
def worker_train_py(args) -> dict:
    """train.py in this process (so `--drop-torch-2-13-names` holds in it), its overrides after `--`;
    with `--deterministic` under `torch.use_deterministic_algorithms(True, warn_only=True)` (cuBLAS's
    deterministic workspace set first): an op without a deterministic implementation warns in the log."""
    if args.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
    sys.argv = [str(ROOT / "train.py"), *args.rest]
    runpy.run_path(str(ROOT / "train.py"), run_name="__main__")
    return {}


def train_overrides(device: str) -> list[str]:
    """One rank, FSDP2 (model.param_dtype asks for its one-rank group), activation checkpointing, the tiny
    MoE, a small job; bf16 compute over fp32 masters on CUDA, fp32 on CPU."""
    compute = "bfloat16" if device == "cuda" else "float32"
    return [f"trainer.device={device}", "model=moe_tiny", "model.dtype=float32", f"model.param_dtype={compute}",
            "trainer.activation_checkpointing=true", "task.prompts_per_step=4", "task.samples_per_prompt=4",
            "trainer.max_steps=4", "checkpoint.every=2", "trainer.progress=false", "trainer.plot=false"]


def read_metrics(run_dir: pathlib.Path) -> list[dict]:
    path = pathlib.Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist (did the run write its metrics there?)")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def compare_resume(first: list[dict], resumed: list[dict], start: int, tol: float) -> dict:
    """The resumed run's rows equal the first run's from step `start` on, per RESUME_KEYS, within `tol`
    relative to the first run's magnitude."""
    want = first[start:]
    if len(first) < start + 1 or len(resumed) != len(want):
        raise ValueError(f"train: the first run logged {len(first)} steps, the resumed one {len(resumed)}; expected "
                         f"{start} + {len(want)} and {len(want)}")
    worst = {key: max(abs(float(a[key]) - float(b[key])) / max(abs(float(a[key])), 1e-12) for a, b in zip(want, resumed))
             for key in RESUME_KEYS}
    return {"ok": max(worst.values()) <= tol, "resume_tolerance": tol, "resume_rel": worst}


def nondeterministic_ops(log_text: str) -> list[str]:
    """The ops torch reported without a deterministic implementation (warn_only), once each."""
    return sorted({line.strip()[:200] for line in log_text.splitlines() if NONDETERMINISTIC in line})


def section_train(c: Check) -> dict:
    first, resumed = c.work / "train_first", c.work / "train_resumed"
    base = train_overrides(c.device)
    c.python("train", ["--worker", "train_py", "--deterministic", "--", *base, f"hydra.run.dir={first}"])
    saved = first / "checkpoints" / "step_00000002"
    c.python("train", ["--worker", "train_py", "--deterministic", "--", *base, f"hydra.run.dir={resumed}",
                       f"resume={saved}"])
    log = (first / "train.log").read_text(errors="replace") if (first / "train.log").exists() else ""
    kernel = next((line.split("packed attention kernel: ", 1)[1] for line in log.splitlines()
                   if "packed attention kernel: " in line), None)
    rows = read_metrics(first)
    ops = nondeterministic_ops((c.work / "train.log").read_text(errors="replace"))
    tol = RESUME_TOL[c.device] if not ops else RESUME_TOL_NONDETERMINISTIC
    out = {"steps": len(rows), "backend": "nccl" if c.device == "cuda" else "gloo", "attention": kernel,
           "overrides": base, "reward_mean": [r["reward_mean"] for r in rows],
           "deterministic_algorithms": "torch.use_deterministic_algorithms(True, warn_only=True)",
           "nondeterministic_ops": ops, **compare_resume(rows, read_metrics(resumed), 2, tol)}
    if c.device == "cpu":
        out["cuda"] = f"{NO_CUDA} (the CPU path ran: gloo, fp32 compute)"
    return out


# ----------------------------------------------------------------- learn
def learn_overrides(device: str, size: str) -> list[str]:
    """The tiny dense model on target_token for LEARN_STEPS steps, bf16 compute over fp32 masters (FSDP2's
    mixed precision, its one-rank group); the run's batch (16 prompts x 8 samples) on the GPU, 4 x 8 at
    the tiny size (CPU)."""
    batch = ["task.prompts_per_step=4", "task.samples_per_prompt=8"] if size == "tiny" else []
    return [f"trainer.device={device}", "model=dense_tiny", "task=target_token", "model.dtype=float32",
            "model.param_dtype=bfloat16", f"trainer.max_steps={LEARN_STEPS}", "checkpoint.final=false",
            "trainer.progress=false", "trainer.plot=false", *batch]


def reward_rise(rewards: list[float], n: int = 5) -> float:
    """Mean reward of the last `n` steps minus the first `n`'s."""
    if len(rewards) < 2 * n:
        raise ValueError(f"learn: {len(rewards)} steps logged, expected >= {2 * n}")
    return sum(rewards[-n:]) / n - sum(rewards[:n]) / n


def section_learn(c: Check) -> dict:
    run = c.work / "learn"
    base = learn_overrides(c.device, c.size)
    c.python("learn", ["--worker", "train_py", "--", *base, f"hydra.run.dir={run}"])
    rewards = [r["reward_mean"] for r in read_metrics(run)]
    rise = reward_rise(rewards)
    return {"ok": len(rewards) == LEARN_STEPS and rise >= LEARN_RISE, "steps": len(rewards), "reward_rise": rise,
            "bound": LEARN_RISE, "reward_mean": rewards, "compute_dtype": "bfloat16", "overrides": base}


# ---------------------------------------------------------- orchestration
class SectionFailed(RuntimeError):
    pass


@dataclasses.dataclass
class Check:
    device: str
    work: pathlib.Path
    deadline: float
    drop_names: bool = False
    size: str = "tiny"  # full: SmolLM2-135M's size and the run's batch (the GPU); tiny: CPU sizes

    def run(self, name: str, cmd: list[str], limit: float) -> None:
        """Run `cmd` from the repo root, its output in work/<name>.log; raise SectionFailed on failure."""
        log = self.work / f"{name}.log"
        left = self.deadline - time.monotonic()
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
                   PYTHONUNBUFFERED="1")
        if self.device == "cpu":
            env["CUDA_VISIBLE_DEVICES"] = ""
        with log.open("a") as f:
            f.write(f"$ {' '.join(cmd)}\n")
            f.flush()
            # a session of its own: on timeout the whole tree is killed
            proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
            try:
                rc = proc.wait(timeout=max(1.0, min(limit, left)))
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                rc = f"timeout after {min(limit, left):.0f} s"
        if rc != 0:
            tail = log.read_text(errors="replace").splitlines()[-12:]
            raise SectionFailed(f"exit {rc} (log {log.name}): " + " | ".join(tail))

    def python(self, name: str, args: list[str]) -> None:
        """This script with `args` in a child process, under the section's time limit."""
        drop = ["--drop-torch-2-13-names"] if self.drop_names else []
        limit = LIMIT_S[name] * (CPU_SLOWDOWN if self.device == "cpu" else 1)
        self.run(name, [sys.executable, str(pathlib.Path(__file__).resolve()), "--device", self.device,
                        "--size", self.size, *drop, *args], limit)

    def worker(self, name: str) -> dict:
        out = self.work / f"{name}.json"
        self.python(name, ["--worker", name, "--result", str(out)])
        return json.loads(out.read_text())


WORKERS = {"env": worker_env, "kernels": worker_kernels, "speed": worker_speed, "train_py": worker_train_py}


def assemble(results: dict[str, dict], env: dict, seconds: float) -> dict:
    """The summary: what ran where, every section's figures, what failed."""
    failed = [n for n, r in results.items() if r.get("ok") is not True]
    return {"ok": not failed, "failed": failed, "seconds": round(seconds, 1), **env, **results}


def write_outputs(out: pathlib.Path, work: pathlib.Path, report: dict) -> list[pathlib.Path]:
    """`out/gpu_check.json` and `out/gpu_check_logs.tar.gz` (the work folder, checkpoints left out)."""
    out.mkdir(parents=True, exist_ok=True)
    summary, logs = out / "gpu_check.json", out / "gpu_check_logs.tar.gz"
    summary.write_text(json.dumps(report, indent=1) + "\n")
    with tarfile.open(logs, "w:gz") as tar:
        tar.add(work, arcname="gpu_check",
                filter=lambda info: None if "/checkpoints/" in info.name + "/" else info)
    return [summary, logs]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto", help="auto: cuda if visible")
    p.add_argument("--out", type=pathlib.Path, default=os.environ.get("OUT"),
                   help="folder for gpu_check.json and gpu_check_logs.tar.gz (default $OUT)")
    p.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated subset of {SECTIONS}")
    p.add_argument("--work", type=pathlib.Path, default=None, help="folder for logs and run folders (default: a temp)")
    p.add_argument("--budget", type=float, default=None,
                   help=f"seconds for all sections together (default {BUDGET_S}; on cpu x {CPU_SLOWDOWN})")
    p.add_argument("--drop-torch-2-13-names", action="store_true",
                   help=f"delete torch.distributed.{{{','.join(TORCH_2_13_ONLY)}}} in every process (as torch 2.11)")
    p.add_argument("--size", choices=("auto", "full", "tiny"), default="auto",
                   help="full: SmolLM2-135M's size and the run's batch; tiny: CPU sizes (auto: full on cuda)")
    p.add_argument("--worker", choices=sorted(WORKERS), help=argparse.SUPPRESS)  # a section's process body
    p.add_argument("--deterministic", action="store_true", help=argparse.SUPPRESS)  # train_py
    p.add_argument("--result", type=pathlib.Path, help=argparse.SUPPRESS)
    p.add_argument("rest", nargs="*", help=argparse.SUPPRESS)  # train.py's overrides (after --)
    args = p.parse_args(argv)
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.size == "auto":
        args.size = "full" if args.device == "cuda" else "tiny"
    if args.budget is None:
        args.budget = BUDGET_S * (CPU_SLOWDOWN if args.device == "cpu" else 1)
    if args.drop_torch_2_13_names:
        drop_torch_2_13_names()

    if args.worker:
        if args.device == "cuda" and not torch.cuda.is_available():
            raise SystemExit("--device cuda: torch.cuda.is_available() is False")
        result = WORKERS[args.worker](args)
        if args.result is not None:
            args.result.write_text(json.dumps(result))
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        return 0

    if args.out is None:
        p.error("--out: no output folder (and $OUT is not set)")
    names = [s for s in args.sections.split(",") if s]
    unknown = sorted(set(names) - set(SECTIONS))
    if unknown:
        p.error(f"--sections: unknown {unknown}, expected a subset of {list(SECTIONS)}")
    start = time.monotonic()
    work = args.work or pathlib.Path(tempfile.mkdtemp(prefix="gpu_check_"))
    work.mkdir(parents=True, exist_ok=True)
    check = Check(args.device, work, start + args.budget, args.drop_torch_2_13_names, args.size)
    results = {}
    for name in names:
        t0 = time.monotonic()
        if time.monotonic() >= check.deadline:  # not run is not passed
            results[name] = {"ok": False, "error": f"not run: out of time (budget {args.budget:.0f} s)"}
            continue
        print(f"gpu_check: {name} ...", file=sys.stderr, flush=True)
        try:
            section = globals().get(f"section_{name}")
            results[name] = section(check) if section is not None else check.worker(name)
        except Exception as e:  # a failed section is a figure too; the next one still runs
            results[name] = {"ok": False, "error": f"{type(e).__name__}: {e}"[:2000]}
            (work / f"{name}.error").write_text(traceback.format_exc())
        results[name]["seconds"] = round(time.monotonic() - t0, 1)
        print(f"gpu_check: {name} ok={results[name].get('ok')} ({results[name]['seconds']} s)", file=sys.stderr,
              flush=True)
    env = {"device": args.device, "size": args.size, "torch_2_13_names_dropped": args.drop_torch_2_13_names,
           "work": str(work), "not_checked": NOT_CHECKED}
    report = assemble(results, env, time.monotonic() - start)
    write_outputs(args.out, work, report)
    print(json.dumps(report), flush=True)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
