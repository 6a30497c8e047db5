"""Peak host memory of loading a checkpoint: sharded (each rank reads its shard) vs one process.

A ~700 MB random Qwen3 checkpoint (178M parameters, fp32 safetensors, written once to
/tmp by `save_pretrained`) is loaded as the policy and the reference the way build_trainer
builds them with `model=pretrained` (model.dtype=bfloat16): a meta model, parallelized
(FSDP2), then `model.loading.load_sharded`. Each rank is a fresh process (gloo, one
thread); it reports its peak resident set (VmHWM: every page it touched, the checkpoint's
memory-mapped pages included) and its resident set before loading (imports only). The one
process figures: the same sharded loader at world 1, and the current path (a plain
`from_pretrained` on every rank, then sharded) at world 1. Last, the transformers engine's
replica: read from the checkpoint (the old path) vs allocated empty for the sync to fill.

    python bench/load_memory.py              # worlds 1, 2, 4; last line JSON
    python bench/load_memory.py --current 4  # also the current path at world 4 (~2 GB per rank)
"""

from __future__ import annotations

from common import emit, quick_flag  # common puts the repo root on sys.path
from procfs import status

import json  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

from testing.distributed import run_distributed  # noqa: E402  (gloo ranks on 127.0.0.1)

# 16 layers, hidden 768, vocab 49152, untied head: 176.2M parameters, 705 MB in fp32
SHAPE = dict(num_hidden_layers=16, hidden_size=768, intermediate_size=2048, num_attention_heads=12,
             num_key_value_heads=4, head_dim=64, vocab_size=49152, tie_word_embeddings=False,
             max_position_embeddings=2048)
FOLDER = Path(tempfile.gettempdir()) / "rl-load-memory-qwen3-176m"


def write_checkpoint(rank: int, world: int) -> dict:
    import torch

    from model.models import build_model

    if not (FOLDER / "model.safetensors").is_file() or json.loads((FOLDER / "bench.json").read_text()) != SHAPE:
        build_model("qwen3", seed=0, dtype=torch.float32, **SHAPE).save_pretrained(FOLDER)
        (FOLDER / "bench.json").write_text(json.dumps(SHAPE))
    return {"bytes": (FOLDER / "model.safetensors").stat().st_size}


def load(rank: int, world: int, current: bool) -> dict:
    """Policy + reference of the checkpoint on this rank; memory figures."""
    import torch

    from model.actor import Actor
    from model.loading import load_sharded
    from model.models import build_model
    from runtime.parallel_dims import init_distributed
    from model.parallelize import parallelize

    dims = init_distributed()
    before = status("VmRSS")
    models = []
    for frozen in (False, True):  # the policy, then the reference
        if current:  # today's path: the whole checkpoint on every rank, then sharded
            lm = build_model(None, pretrained_path=str(FOLDER), dtype=torch.bfloat16)
            models.append(parallelize(Actor(lm.requires_grad_(not frozen), dims=dims), dims))
        else:
            lm = build_model(None, pretrained_path=str(FOLDER), dtype=torch.bfloat16, device="meta")
            models.append(load_sharded(parallelize(Actor(lm.requires_grad_(not frozen), dims=dims), dims),
                                       FOLDER, dims))
    held = sum((p.to_local() if hasattr(p, "to_local") else p).numel() * p.element_size()
               for m in models for p in m.parameters())
    return {"peak": status("VmHWM"), "before": before, "after": status("VmRSS"), "held_bytes": held}


def replica(rank: int, world: int, current: bool) -> dict:
    """The transformers engine's unsharded copy (rollout.replica=keep) in bfloat16: `current` reads
    the checkpoint (`from_pretrained`, the old path), else it is allocated empty (`materialize`)
    and every element written once, as the first weight sync does. Peak RSS and seconds; on a
    GPU the copy is device memory and the new path touches no host memory for it at all."""
    import time

    import torch

    from model.loading import materialize
    from model.models import build_model

    before, t0 = status("VmRSS"), time.perf_counter()
    if current:
        lm = build_model(None, pretrained_path=str(FOLDER), dtype=torch.bfloat16)
    else:
        lm = materialize(build_model(None, pretrained_path=str(FOLDER), dtype=torch.bfloat16, device="meta"), "cpu")
        for p in lm.parameters():  # what the first sync writes (every element): the pages are touched
            p.data.zero_()
    seconds = time.perf_counter() - t0
    held = sum(p.numel() * p.element_size() for p in lm.parameters())
    return {"peak": status("VmHWM"), "before": before, "seconds": seconds, "held_bytes": held}


def main() -> None:
    parser = quick_flag(__doc__)
    parser.add_argument("--current", type=int, nargs="*", default=[1],
                        help="worlds measured on the current path too (world 1 always)")
    args = parser.parse_args()
    worlds = (1, 4) if args.quick else (1, 2, 4)
    size = run_distributed(write_checkpoint, 1, timeout=600)[0]["bytes"]
    print(f"checkpoint {FOLDER}: {size / 1e6:.0f} MB", flush=True)
    runs = {}
    for path, ws in (("sharded", worlds), ("current", sorted({1, *args.current}))):
        for w in ws:
            ranks = run_distributed(load, w, path == "current", timeout=600)
            runs[f"{path}_world{w}"] = ranks
            peak = max(r["peak"] for r in ranks)
            each = [round(r["peak"] / 1e9, 3) for r in ranks]
            print(f"{path} world {w}: peak RSS per rank {peak / 1e9:.3f} GB (max of {each}), "
                  f"before loading {max(r['before'] for r in ranks) / 1e9:.3f} GB, "
                  f"parameters held {max(r['held_bytes'] for r in ranks) / 1e9:.3f} GB", flush=True)
    for path in ("checkpoint", "empty"):  # the rollout replica: one process, each path fresh
        r = run_distributed(replica, 1, path == "checkpoint", timeout=600)[0]
        runs[f"replica_{path}"] = [r]
        print(f"rollout replica, {path}: peak RSS {r['peak'] / 1e9:.3f} GB (before {r['before'] / 1e9:.3f} GB), "
              f"{r['seconds']:.2f} s, replica {r['held_bytes'] / 1e9:.3f} GB", flush=True)
    peak = {k: max(r["peak"] for r in v) for k, v in runs.items()}
    base = {k: max(r["before"] for r in v) for k, v in runs.items()}
    top = max(worlds)
    summary = {
        "checkpoint_bytes": size,
        **{f"peak_gb_{k}": round(v / 1e9, 3) for k, v in peak.items()},
        f"ratio_world{top}_vs_current_one_process": round(peak[f"sharded_world{top}"] / peak["current_world1"], 3),
        f"ratio_world{top}_vs_sharded_one_process": round(peak[f"sharded_world{top}"] / peak["sharded_world1"], 3),
        **{f"ratio_world{w}_vs_current_one_process": round(peak[f"sharded_world{w}"] / peak["current_world1"], 3)
           for w in worlds if w not in (1, top)},
        "replica_s_checkpoint": round(runs["replica_checkpoint"][0]["seconds"], 2),
        "replica_s_empty": round(runs["replica_empty"][0]["seconds"], 2),
        # the loading alone: peak minus the resident set before loading (imports, process group)
        **{f"load_gb_{k}": round((peak[k] - base[k]) / 1e9, 3) for k in peak},
    }
    emit("load_memory", summary, runs)


if __name__ == "__main__":
    main()
