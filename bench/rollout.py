"""How fast does each rollout engine generate, and how long does a vLLM weight sync take?

The same prompts and sampling for three generators: transformers `generate` (do_sample,
temperature 1, no top-k/top-p), the project's `HFRolloutEngine` and `VLLMRolloutEngine`
(rl/rollout/vllm_engine.py; its threads bound to every allowed core: VLLM_CPU_OMP_THREADS_BIND
computed from the process affinity). Prompts: SmolLM2-135M-Instruct's chat template around
addition problems when `make model` has written .cache/models/SmolLM2-135M-Instruct,
else a tiny random Llama checkpoint with random prompts. Figure: response tokens per
second of wall time, median over repeats after one warm-up; each engine runs alone (the
machine must be idle: under contention the 2-thread transformers loop degrades far more).
The weight sync is `VLLMRolloutEngine.load_weights(state_dict)` of the whole model through
/dev/shm buckets (`--bucket-mb`), median of repeats, and its share of a training step
(`--step-s`, ~20 s for SmolLM2 on this machine, DESIGN.md).

    python bench/rollout.py [--quick] [--prompts 16 --samples 8 --new-tokens 32]

Stdout: one JSON object with hf_engine_tokens_per_s, generate_tokens_per_s, vllm_tokens_per_s,
vllm_over_hf, hf_over_generate, sync_s, sync_fraction_of_step; everything else, vLLM's
workers' exit logs included, goes to stderr (bench/common.py `json_stdout`).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

MODEL_DIR = ROOT / ".cache" / "models" / "SmolLM2-135M-Instruct"


def prompts_and_model(n: int, seed: int):
    """(model_dir, [prompt ids], stop_token_id, source)."""
    import torch

    if (MODEL_DIR / "config.json").is_file():
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(MODEL_DIR))
        gen = torch.Generator().manual_seed(seed)
        out = []
        for _ in range(n):
            a, b = (int(x) for x in torch.randint(10, 100, (2,), generator=gen))
            ids = tok.apply_chat_template([{"role": "user", "content": f"What is {a} + {b}?"}],
                                          add_generation_prompt=True, tokenize=True, return_dict=False)
            out.append(torch.tensor(ids, dtype=torch.int64))
        return str(MODEL_DIR), out, tok.convert_tokens_to_ids("<|im_end|>"), "SmolLM2-135M-Instruct"
    from model.models import build_model

    folder = Path(tempfile.mkdtemp(prefix="bench-rollout-"))
    build_model("llama", seed=seed, dtype=torch.float32, head_dim=32, vocab_size=512).save_pretrained(folder)
    gen = torch.Generator().manual_seed(seed)
    out = [torch.randint(3, 512, (int(torch.randint(20, 40, (1,), generator=gen)),), generator=gen) for _ in range(n)]
    return str(folder), out, 2, "tiny random llama (no model folder: `make model`)"


def timed(fn, repeats: int, name: str = "") -> tuple[float, object]:
    print(f"bench/rollout.py: {name} ...", file=sys.stderr, flush=True)
    fn()  # warm-up
    times, out = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="one repeat, 4 prompts x 4 samples")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--bucket-mb", type=float, default=64)
    p.add_argument("--step-s", type=float, default=20.0, help="a training step's seconds, for the sync share")
    args = p.parse_args()
    if args.quick:
        args.prompts, args.samples, args.repeats = 4, 4, 1
    from common import emit, json_stdout

    json_stdout()  # vLLM's workers log as they exit: everything but the JSON line goes to stderr

    import torch

    from model.models import build_model
    from rl.rollout.engine import HFRolloutEngine
    from rl.rollout.vllm_engine import VLLMRolloutEngine, cpu_threads_bind

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    torch.set_num_threads(cores)
    model_dir, prompts, stop, source = prompts_and_model(args.prompts, seed=0)
    batch = [q for q in prompts for _ in range(args.samples)]
    index = [i for i in range(len(prompts)) for _ in range(args.samples)]
    kw = dict(prompt_indices=index, max_new_tokens=args.new_tokens, temperature=1.0, seed=0)

    def count(records) -> int:
        return sum(int(r.response_length) for r in records)

    # transformers generate: one left-padded batch, the same sampling
    model = build_model(None, pretrained_path=model_dir).eval()
    P = max(q.numel() for q in batch)
    ids = torch.full((len(batch), P), stop)
    mask = torch.zeros(len(batch), P, dtype=torch.int64)
    for i, q in enumerate(batch):
        ids[i, P - q.numel():], mask[i, P - q.numel():] = q, 1

    def hf_generate() -> int:
        torch.manual_seed(0)
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0, top_k=0,
                                 top_p=1.0, max_new_tokens=args.new_tokens, eos_token_id=stop, pad_token_id=stop)
        resp = out[:, P:]
        n = 0
        for row in resp:
            hit = (row == stop).nonzero()
            n += int(hit[0]) + 1 if len(hit) else row.numel()
        return n

    t_gen, n_gen = timed(hf_generate, args.repeats, "transformers generate")
    engine = HFRolloutEngine(model, stop_token_id=stop)
    t_hf, recs = timed(lambda: engine.generate(batch, **kw), args.repeats, "HFRolloutEngine")
    n_hf = count(recs)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    del engine, model

    t0 = time.perf_counter()
    vllm = VLLMRolloutEngine(model_dir, stop_token_id=stop, sync_bucket_bytes=int(args.bucket_mb * 2**20))
    startup = time.perf_counter() - t0
    t_vllm, recs = timed(lambda: vllm.generate(batch, **kw), args.repeats, "VLLMRolloutEngine")
    n_vllm = count(recs)
    syncs = []
    for _ in range(max(args.repeats, 2)):
        vllm.load_weights(state.items())
        syncs.append(dict(vllm.last_sync))
    sync_s = statistics.median(s["sync_s"] for s in syncs)
    vllm.close()

    rate = {"generate": n_gen / t_gen, "hf": n_hf / t_hf, "vllm": n_vllm / t_vllm}
    summary = {
        "hf_engine_tokens_per_s": round(rate["hf"], 1),
        "generate_tokens_per_s": round(rate["generate"], 1),
        "vllm_tokens_per_s": round(rate["vllm"], 1),
        "vllm_over_hf": round(rate["vllm"] / rate["hf"], 3),
        "hf_over_generate": round(rate["hf"] / rate["generate"], 3),
        "sync_s": round(sync_s, 3),
        "sync_fraction_of_step": round(sync_s / args.step_s, 4),
        "sync_reload_s": round(statistics.median(s.get("reload_s", 0.0) for s in syncs), 3),
        "sync_bytes": int(syncs[-1].get("bytes", 0)),
        "sync_buckets": int(syncs[-1].get("buckets", 0)),
        "vllm_startup_s": round(startup, 1),
        "model": source,
        "rows": len(batch),
        "max_new_tokens": args.new_tokens,
        "vllm_threads_bind": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", cpu_threads_bind()),
        "torch_threads": torch.get_num_threads(),
    }
    details = {"seconds": {"generate": t_gen, "hf_engine": t_hf, "vllm": t_vllm},
               "tokens": {"generate": n_gen, "hf_engine": n_hf, "vllm": n_vllm}, "syncs": syncs}
    emit("rollout", summary, details, clock="wall")


if __name__ == "__main__":
    main()
