"""Where a decode step of the transformers engine goes, against its floors (issue 57).

SmolLM2-135M's shape (the `make model` weights if present, else a random init of its config:
the shapes are what counts), the job's 47-token prompts in groups of 8, no stop token; at 8
and 32 rows. Per round every arm runs once, the arms of both row counts in turn (a shared
machine's drift falls on all of them alike); each figure is the median over `--repeats`
rounds, `_min` the best:

    decode{R}_ms            wall ms a decode step sampled at temperature 1 (bench/roofline.py
                            `engine_phases`: a generation of 17 tokens less one of 1, over 16)
    decode{R}_greedy_ms     the same, greedy (temperature 0: argmax, no inverse-CDF draw)
    decode{R}_gemm_ms       the step's matmuls alone: R rows by every matmul weight of the model
                            (the head last), in the forward's order, so each weight comes from
                            memory as in a step; `_bf16`: the same with bf16 copies of the weights
    decode{R}_host_ms       a step of the same engine on a model of the same depth, heads and ops
                            but 72 wide with a 512-word vocabulary: what a step costs besides
                            its arithmetic (Python, dispatch, the layers' small ops, the loop)
    decode{R}_floor_bandwidth_ms  the step's bytes (bench/roofline.py `decode_cost`: every matmul
                            weight once, each row's cached keys and values at the mean context)
                            over the measured copy bandwidth
    decode{R}_floor_gemm_ms the step's FLOPs over the best fp32 FLOP/s of a matmul sweep at R
                            rows by the model's weight shapes (`gemm_peak`), weights hot in cache
    decode{R}_over_floor    decode{R}_ms over decode{R}_floor_bandwidth_ms
    decode{R}_share_<what>  the step's profiled self-CPU op time (torch.profiler, the same
                            difference of two generations) by what runs it: `gemm` (aten::mm, the
                            body's matmuls), `head` (aten::mm by the LM head's weight: its output
                            is a row of vocab logits), `attention` (sdpa), `sampling` (the engine's
                            log-softmax, exp, cumsum, searchsorted, argmax), `allocation` (empty
                            tensors), `other` (the layers' element-wise ops, the cache, the
                            engine's bookkeeping). Python's own time is in none: see `_host_ms`

    .venv/bin/python bench/decode.py --threads 1   # one thread (a loaded machine: OpenMP waits)
    .venv/bin/python bench/decode.py --threads 2 --repeats 5

Last line: one JSON object (nothing written); state the load it was measured at.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine, provenance  # noqa: E402
from prefix import MODELS  # noqa: E402
from roofline import bandwidth, decode_cost, engine_phases, gemm_peak, job_prompts, model_shapes  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

MODEL_DIR = Path(__file__).resolve().parents[1] / ".cache/models/SmolLM2-135M-Instruct"
PROMPT, NEW = 47, 16
NARROW = dict(hidden_size=72, head_dim=8, intermediate_size=64, vocab_size=512)  # the host arm's model: same depth and heads
HEAD = "aten::mm (head)"  # the LM head's matmul, told from the body's by its output's width (the vocabulary)
SHARES = {"gemm": ("aten::mm", "aten::addmm"), "head": (HEAD,), "attention": ("aten::_scaled_dot_product_flash_attention_for_cpu",),
          "sampling": ("aten::_log_softmax", "aten::exp", "aten::cumsum_", "aten::searchsorted", "aten::argmax"),
          "allocation": ("aten::empty", "aten::empty_strided")}


def self_cpu(engine, rows: int, new: int) -> dict[str, float]:
    """Self-CPU seconds per op name of one generation of `new` tokens (the head's matmul as `HEAD`)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        prompts, index = job_prompts(engine.vocab_size, rows, PROMPT)
        engine.generate(prompts, prompt_indices=index, max_new_tokens=new, temperature=1.0, seed=0)
    out: dict[str, float] = {}
    for e in prof.key_averages(group_by_input_shape=True):
        head = e.key == "aten::mm" and any(s and s[-1] == engine.vocab_size for s in e.input_shapes)
        key = HEAD if head else e.key
        out[key] = out.get(key, 0.0) + e.self_cpu_time_total / 1e6
    return out


def matmuls(model) -> list[torch.Tensor]:
    """Every matmul weight `[N, K]` of a decode step in the forward's order: the body's, then the head."""
    body = [m.weight for m in model.model.modules() if isinstance(m, torch.nn.Linear)]
    return body + [model.get_output_embeddings().weight]


def replay(weights: list[torch.Tensor], rows: int) -> float:
    """Seconds of `rows` rows by every weight in `weights`, in order (F.linear, as the model runs them)."""
    inputs = {w.shape[1]: torch.randn(rows, w.shape[1]).to(w.dtype) for w in weights}
    t = time.perf_counter()
    for w in weights:
        F.linear(inputs[w.shape[1]], w)
    return time.perf_counter() - t


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--repeats", type=int, default=3, help="rounds of every arm")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from model.models import build_model
    from rl.rollout.engine import HFRolloutEngine

    pretrained = (MODEL_DIR / "config.json").exists()
    family, shape = MODELS["smollm2-135m"]  # bench/prefix.py's SmolLM2-135M shape
    model = build_model(None, pretrained_path=str(MODEL_DIR)) if pretrained else build_model(family, seed=0, **shape)
    engine = HFRolloutEngine(model)
    narrow = HFRolloutEngine(build_model(family, seed=0, **(shape | NARROW)))
    fp32 = matmuls(model)
    bf16 = [w.bfloat16() for w in fp32]
    load = [os.getloadavg()[0]]
    bw = bandwidth()
    out: dict = {"model": "SmolLM2-135M-Instruct" if pretrained else "SmolLM2-135M config, random init",
                 "bandwidth_gb_per_s": round(bw / 1e9, 2)}
    arms = {"": lambda e, r: engine_phases(e, r, PROMPT, NEW, 1)[1],
            "_greedy": lambda e, r: engine_phases(e, r, PROMPT, NEW, 1, temperature=0.0)[1],
            "_gemm": lambda e, r: replay(fp32, r), "_gemm_bf16": lambda e, r: replay(bf16, r),
            "_host": lambda e, r: engine_phases(narrow, r, PROMPT, NEW, 1)[1]}
    seconds: dict[str, list[float]] = {}
    for _ in range(args.repeats):
        for rows in (8, 32):
            for arm, fn in arms.items():
                seconds.setdefault(f"decode{rows}{arm}", []).append(fn(engine, rows))
        load.append(os.getloadavg()[0])
    for key, values in seconds.items():
        out |= {f"{key}_ms": round(statistics.median(values) * 1e3, 2), f"{key}_min_ms": round(min(values) * 1e3, 2)}
    for rows in (8, 32):
        flops, nbytes = decode_cost(model.config, rows, PROMPT + NEW / 2)
        peak = gemm_peak(torch.float32, model_shapes(model.config, [rows]))["flops_per_s"]
        out |= {f"decode{rows}_floor_bandwidth_ms": round(nbytes / bw * 1e3, 2),
                f"decode{rows}_floor_gemm_ms": round(flops / peak * 1e3, 2),
                f"decode{rows}_over_floor": round(out[f"decode{rows}_ms"] / (nbytes / bw * 1e3), 2)}
        short, long = self_cpu(engine, rows, 1), self_cpu(engine, rows, NEW + 1)
        per_op = {k: (v - short.get(k, 0.0)) / NEW for k, v in long.items()}
        total = sum(per_op.values())
        shares = {what: sum(per_op.get(op, 0.0) for op in ops) / total for what, ops in SHARES.items()}
        shares["other"] = 1 - sum(shares.values())
        out |= {f"decode{rows}_share_{what}": round(v, 3) for what, v in shares.items()}
        top = sorted(per_op.items(), key=lambda kv: -kv[1])[:8]
        print(f"{rows} rows: {out[f'decode{rows}_ms']:.1f} ms a step; self-CPU a step: "
              + ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in top), flush=True)
        load.append(os.getloadavg()[0])
    out["loadavg_1m_max"] = round(max(load), 2)
    line = out | machine() | provenance()
    print(json.dumps(line), flush=True)
    return line


if __name__ == "__main__":
    main()
