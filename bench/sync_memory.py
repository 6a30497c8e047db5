"""What does a weight sync cost in memory? Peak extra host memory of one rank while the HF
engine's replica is refreshed from the FSDP2 shards: today's `full_parameters` (one
`full_tensor()` all-gather per tensor) against `rl.rollout.sync.full_parameter_buckets`
(the tensors cut into buckets, each gathered into its own buffer) at two bucket sizes and at the
default (`rollout.sync_bucket_bytes=null`: one rank's share of the model, `default_bucket_bytes`);
2 gloo ranks (`--world`), a dense Qwen3 of ~150M parameters (~600 MB in fp32).

How it is measured: each rank resets its peak resident set (`/proc/self/clear_refs` 5),
runs the sync, and reads the peak (`VmHWM`) back; extra = peak - resident before. Allocations
of 1 MiB and more are mmapped (`MALLOC_MMAP_THRESHOLD_`, set before the ranks start), so a
freed tensor leaves the resident set at once and the peak is that of the bytes alive at once.
Also counted: the buckets (today: one per tensor, each its own `full_tensor()`; bucketed:
one all-gather per tensor within a bucket, see rl/rollout/sync.py `_gather_dim0`) and the
wall time of a sync. Linux only.

    python bench/sync_memory.py [--quick] [--world 4]     # last line: {"today_peak_mib": ..., ...}
"""

from __future__ import annotations

import os
import time

from common import emit, quick_flag  # common puts the repo root on sys.path
from procfs import reset_peak, status

import torch  # noqa: E402

from scripts.distributed import run_distributed  # noqa: E402  (gloo ranks on 127.0.0.1)

MIB = 2**20
SHAPE = dict(vocab_size=16000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=16,
             num_key_value_heads=8, head_dim=64, max_position_embeddings=512, tie_word_embeddings=False)
QUICK = dict(SHAPE, num_hidden_layers=2)
BUCKETS = (64 * MIB, 256 * MIB)


def _peak_extra(fn) -> tuple[int, float]:
    """Peak resident bytes above the resident set before `fn()`, and its wall seconds."""
    import gc

    gc.collect()
    reset_peak()
    before = status("VmRSS")
    t0 = time.perf_counter()
    fn()
    seconds = time.perf_counter() - t0
    return status("VmHWM") - before, seconds


def measure(rank: int, world: int, shape: dict) -> dict:
    import torch.distributed as dist

    from model.actor import Actor
    from model.models import build_model
    from model.parallel_dims import init_distributed
    from model.parallelize import full_parameters, parallelize
    from rl.rollout.engine import HFRolloutEngine
    from torch.distributed.tensor import DTensor

    from rl.rollout.sync import buckets, full_parameter_buckets, full_tensor_bytes, resolve_bucket_bytes

    torch.set_num_threads(1)
    dims = init_distributed(device="cpu")
    actor = parallelize(Actor(build_model("qwen3", seed=0, **shape), dims=dims), dims)
    engine = HFRolloutEngine(build_model("qwen3", seed=1, **shape))
    sizes = full_tensor_bytes(actor.model)
    variants = {"today": (lambda: engine.load_weights(full_parameters(actor.model)),
                          sum(isinstance(v, DTensor) for v in actor.model.state_dict().values()))}
    for b in BUCKETS:
        variants[f"bucket_{b // MIB}mib"] = (lambda b=b: engine.load_weights(full_parameter_buckets(actor.model, b)),
                                             sum(1 for _ in buckets(actor.model, b)))
    variants["default"] = (lambda: engine.load_weights(full_parameter_buckets(actor.model, None)),
                           sum(1 for _ in buckets(actor.model, None)))
    out = {"model_bytes": sum(sizes.values()), "largest_tensor_bytes": max(sizes.values()),
           "default_bucket_bytes": resolve_bucket_bytes(actor.model, None),
           "tensors": len(sizes), "shard_bytes": sum(p.to_local().numel() * 4 for p in actor.parameters())}
    for repeat in range(2):  # the second round checks the first was not flattered by a warm heap
        for name, (fn, gathers) in variants.items():
            dist.barrier()
            extra, seconds = _peak_extra(fn)
            prev = out.get(name, {"peak_extra_bytes": 0, "seconds": float("inf")})
            out[name] = {"peak_extra_bytes": max(extra, prev["peak_extra_bytes"]),
                         "seconds": min(seconds, prev["seconds"]), "buckets": gathers}
    reference = dict(full_parameters(actor.model))
    out["replica_equal"] = all(torch.equal(engine.model.state_dict()[k], v) for k, v in reference.items())
    return out


def main() -> None:
    parser = quick_flag(__doc__)
    parser.add_argument("--world", type=int, default=2, help="gloo ranks")
    args = parser.parse_args()
    os.environ["MALLOC_MMAP_THRESHOLD_"] = str(MIB)  # inherited by the spawned ranks
    ranks = run_distributed(measure, args.world, QUICK if args.quick else SHAPE, timeout=900, threads=1)
    r0 = ranks[0]
    print(f"model {r0['model_bytes'] / MIB:.0f} MiB in {r0['tensors']} tensors (largest "
          f"{r0['largest_tensor_bytes'] / MIB:.1f} MiB); this rank's shards {r0['shard_bytes'] / MIB:.0f} MiB; "
          f"{args.world} ranks; default bucket {r0['default_bucket_bytes'] / MIB:.1f} MiB")
    summary = {"model_mib": r0["model_bytes"] / MIB, "largest_tensor_mib": r0["largest_tensor_bytes"] / MIB,
               "world": args.world, "default_bucket_mib": r0["default_bucket_bytes"] / MIB}
    for name in ("today", *(f"bucket_{b // MIB}mib" for b in BUCKETS), "default"):
        peak = max(r[name]["peak_extra_bytes"] for r in ranks)
        print(f"{name:>16}: peak extra {peak / MIB:7.1f} MiB ({peak / r0['model_bytes']:.2f} of the model), "
              f"{r0[name]['buckets']} buckets, {r0[name]['seconds']:.2f} s")
        summary.update({f"{name}_peak_mib": peak / MIB, f"{name}_buckets": r0[name]["buckets"],
                        f"{name}_s": r0[name]["seconds"]})
    summary["replica_equal"] = all(r["replica_equal"] for r in ranks)
    emit("sync_memory", summary, {"ranks": ranks, "shape": QUICK if args.quick else SHAPE})


if __name__ == "__main__":
    main()
