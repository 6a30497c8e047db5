"""How much training state does one rank hold? Parameters + gradients + AdamW state of the
default policy (conf/model/moe_tiny.yaml) per rank at world 1, 4 and 8 (gloo, FSDP2, ep=2
from world 4 on), against the replicated layout (every rank holding everything), and the
extra memory of the weight sync (`rl.rollout.sync.buckets` at the default bucket size: the
largest bucket of full tensors).

    python bench/state_memory.py        # last line: {"ratio_world4": ..., "ratio_world8": ..., ...}
"""

from __future__ import annotations

from common import ROOT, emit, quick_flag  # common puts the repo root on sys.path

import torch  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402

from testing.distributed import run_distributed  # noqa: E402  (gloo ranks on 127.0.0.1)


def _bytes(t: torch.Tensor) -> int:
    from torch.distributed.tensor import DTensor

    local = t.to_local() if isinstance(t, DTensor) else t
    return local.numel() * local.element_size()


def measure(rank: int, world: int) -> dict:
    from model.actor import Actor
    from model.models import build_model
    from runtime.parallel_dims import init_distributed
    from model.parallelize import parallelize
    from packing import make_experience_batch
    from rl.rollout.sync import buckets
    from testing.records import make_records

    overrides = OmegaConf.to_container(OmegaConf.load(ROOT / "conf/model/moe_tiny.yaml"))["overrides"]
    dims = init_distributed(ep=2 if world > 1 else 1)
    actor = parallelize(Actor(build_model("qwen3_moe", seed=0, **overrides), dims=dims), dims)
    optimizer = torch.optim.AdamW(actor.parameters(), lr=1e-3)
    batch = make_experience_batch(make_records([40, 25, 60, 33], vocab=overrides["vocab_size"], seed=rank), packed=True)
    (actor(batch) * batch.action_mask).sum().backward()
    optimizer.step()  # creates the AdamW moments
    params = sum(_bytes(p) for p in actor.parameters())
    grads = sum(_bytes(p.grad) for p in actor.parameters() if p.grad is not None)
    adam = sum(_bytes(t) for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t) and t.dim())
    peak_sync = max(sum({t.data_ptr(): t.nbytes for _, t in b}.values()) for b in buckets(actor.model))  # tied once
    return {"params": params, "grads": grads, "adam": adam, "total": params + grads + adam, "sync_peak": peak_sync}


def main() -> None:
    args = quick_flag(__doc__).parse_args()
    worlds = (1, 4) if args.quick else (1, 4, 8)
    per_world = {w: run_distributed(measure, w, timeout=600) for w in worlds}
    replicated = per_world[1][0]["total"]
    rows = {}
    for w, ranks in per_world.items():
        worst = max(r["total"] for r in ranks)
        rows[w] = {"max_rank_bytes": worst, "ratio_to_replicated": worst / replicated,
                   "sync_peak_bytes": max(r["sync_peak"] for r in ranks), "per_rank": ranks}
        print(f"world {w}: max per-rank params+grads+AdamW {worst / 2**20:.3f} MiB = "
              f"{worst / replicated:.3f} of replicated; weight-sync peak one bucket {rows[w]['sync_peak_bytes'] / 2**10:.0f} KiB")
    emit("state_memory", {f"ratio_world{w}": rows[w]["ratio_to_replicated"] for w in worlds}
         | {"replicated_bytes": replicated, "sync_peak_bytes": rows[worlds[-1]]["sync_peak_bytes"]},
         {str(w): r for w, r in rows.items()})


if __name__ == "__main__":
    main()
