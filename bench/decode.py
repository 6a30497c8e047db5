"""Where a decode step of the transformers engine goes, against the bandwidth floor (issue 57).

SmolLM2-135M's shape (the `make model` weights if present, else a random init of its config:
the shapes are what counts), the job's 47-token prompts in groups of 8, temperature 1, no stop
token; at 8 and 32 rows:

    decode{R}_ms            wall ms a decode step (bench/roofline.py `engine_phases`: a generation
                            of 17 tokens less one of 1, over 16; median of --repeats pairs)
    decode{R}_share_<what>  the step's profiled self-CPU time (torch.profiler, the same difference
                            of two generations) by what runs it: `gemm` (aten::mm, the body's
                            matmuls), `head` (aten::mm by the LM head's weight [vocab, hidden]:
                            its output is a row of vocab logits), `attention` (sdpa), `sampling` (the engine's
                            log-softmax, exp, cumsum, searchsorted), `other` (the layers'
                            element-wise ops, the cache, the engine's bookkeeping)
    floor_ms                the weights' bytes over the measured copy bandwidth (bench/roofline.py)

    .venv/bin/python bench/decode.py             # 3 pairs a row count (~1 min idle)
    .venv/bin/python bench/decode.py --threads 1 # one thread (a loaded machine: OpenMP waits)

Last line: one JSON object (nothing written); state the load it was measured at.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine, provenance  # noqa: E402
from prefix import MODELS  # noqa: E402
from roofline import bandwidth, engine_phases, job_prompts, matmul_weights  # noqa: E402

import torch  # noqa: E402

MODEL_DIR = Path(__file__).resolve().parents[1] / ".cache/models/SmolLM2-135M-Instruct"
PROMPT, NEW = 47, 16
HEAD = "aten::mm (head)"  # the LM head's matmul, told from the body's by its output's width (the vocabulary)
SHARES = {"gemm": ("aten::mm", "aten::addmm"), "head": (HEAD,), "attention": ("aten::_scaled_dot_product_flash_attention_for_cpu",),
          "sampling": ("aten::_log_softmax", "aten::exp", "aten::cumsum_", "aten::searchsorted")}


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


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from model.models import build_model
    from rl.rollout.engine import HFRolloutEngine

    pretrained = (MODEL_DIR / "config.json").exists()
    family, shape = MODELS["smollm2-135m"]  # bench/prefix.py's SmolLM2-135M shape
    model = build_model(None, pretrained_path=str(MODEL_DIR)) if pretrained else build_model(family, seed=0, **shape)
    engine = HFRolloutEngine(model)
    load = [os.getloadavg()[0]]
    bw = bandwidth()
    out: dict = {"model": "SmolLM2-135M-Instruct" if pretrained else "SmolLM2-135M config, random init",
                 "bandwidth_gb_per_s": round(bw / 1e9, 2),
                 "floor_ms": round(sum(matmul_weights(model.config)) * next(model.parameters()).element_size() / bw * 1e3, 2)}
    for rows in (8, 32):
        _, step_s = engine_phases(engine, rows, PROMPT, NEW, args.repeats)
        short, long = self_cpu(engine, rows, 1), self_cpu(engine, rows, NEW + 1)
        per_op = {k: (v - short.get(k, 0.0)) / NEW for k, v in long.items()}
        total = sum(per_op.values())
        shares = {what: sum(per_op.get(op, 0.0) for op in ops) / total for what, ops in SHARES.items()}
        shares["other"] = 1 - sum(shares.values())
        out |= {f"decode{rows}_ms": round(step_s * 1e3, 2)}
        out |= {f"decode{rows}_share_{what}": round(v, 3) for what, v in shares.items()}
        top = sorted(per_op.items(), key=lambda kv: -kv[1])[:8]
        print(f"{rows} rows: {step_s * 1e3:.1f} ms a step; self-CPU a step: "
              + ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in top), flush=True)
        load.append(os.getloadavg()[0])
    out["loadavg_1m_max"] = round(max(load), 2)
    line = out | machine() | provenance()
    print(json.dumps(line), flush=True)
    return line


if __name__ == "__main__":
    main()
