"""What does a step's data cost per rank to move? The old path (`all_gather_object` of the
records: every rank receives and holds the whole step) against the new one (issue #20,
packing/exchange.py: metadata all-gathered, each sample sent once to the rank that trains it).

8 gloo ranks on 127.0.0.1, one process group per path (fresh processes, so each path's
peak memory is its own). Each rank generates its 1/8 of the step's records as a rollout
does (rl/rollout/engine.py `make_record`: int64 tokens, bool action mask, fp32 rollout log-probs,
int64 `routed_experts [L, K, T]`, 0-d episode scalars), then, after the high-water mark is
reset (`/proc/self/clear_refs`), runs the path: the global decisions (GRPO advantages, the
microbatch plan over the 8 ranks) and the move of the records to the rank whose plan entry
holds them, ending with every rank's training records (advantages attached) in hand.

    bytes   per rank, counted at the collectives: what it receives from other ranks and what
            of its own data other ranks receive (an all-gather's input counts once per peer;
            all_gather_object's buffers are padded to the largest pickle, as torch does)
    memory  VmHWM - VmRSS just before the path (the path's own peak), glibc serving every
            allocation over 64 KiB by mmap so freed tensors leave RSS at once
    trained_bytes_per_rank  the bytes (as records: int64 routing) of the samples the plan
            gives that rank, the ones it generated itself included

The step: 1024 samples with bimodal lengths (75% short answers, 25% near the length
limit), MoE routing of 48 layers x top-8 of 128 experts. Lengths are scaled down (prompts
16..48 tokens, samples up to 128 tokens, ~55 tokens on average instead of ~4k) so that the
old path, which holds the whole step on each of the 8 ranks, fits a 2-core machine in a
couple of minutes; both paths scale linearly in the step's bytes.

    python bench/data_path.py [--quick] [--samples 1024] [--ranks 8] [--max-len 128]
"""

from __future__ import annotations

import ctypes
import gc
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import emit, lengths, quick_flag  # noqa: E402  (common puts the repo root on sys.path)
from procfs import reset_peak, status  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402


def _trim() -> None:
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass


def make_step(rank: int, world: int, a) -> tuple[list[int], list]:
    """The step's lengths (all ranks) and this rank's records (its slice of the samples)."""
    from rl.rollout.engine import make_record

    seq = lengths("bimodal", a.samples, seed=0, max_len=a.max_len, prompt=(16, 48))
    per = a.samples // world
    gen = torch.Generator().manual_seed(1 + rank)
    records = []
    for i in range(rank * per, (rank + 1) * per):
        T = seq[i]
        P = min(int(torch.randint(16, 49, (1,), generator=gen)), T - 1)
        routed = torch.randint(0, a.experts, (a.layers, a.topk, T), generator=gen)
        rec = make_record(torch.randint(0, 50000, (P,), generator=gen), torch.randint(0, 50000, (T - P,), generator=gen),
                          -torch.rand(T - P, generator=gen), prompt_index=i // 8, routed_experts=routed)
        rec.rewards = (torch.rand((), generator=gen) < 0.4).float()
        records.append(rec)
    return seq, records


def _dest(seq: list[int], world: int, max_tokens: int) -> list[list[int]]:
    from packing import plan_microbatches

    dest = [[] for _ in seq]
    for rank, microbatches in enumerate(plan_microbatches(seq, max_tokens, world)):
        for items in microbatches:
            for i in items or [0]:
                dest[i].append(rank)
    return dest


def _bytes(rec) -> int:
    from packing.exchange import FIELDS

    return sum(getattr(rec, n).numel() * getattr(rec, n).element_size() for n in FIELDS if getattr(rec, n) is not None)


def _count_collectives(counter: dict, world: int) -> list:
    """Wrap the collectives the paths use (at c10d, so all_gather_object's inner calls count)."""
    import torch.distributed.distributed_c10d as c10d

    saved = [(c10d, "all_gather", c10d.all_gather), (c10d, "all_to_all_single", c10d.all_to_all_single)]

    def all_gather(tensor_list, tensor, group=None, async_op=False):
        size = tensor.numel() * tensor.element_size()
        counter["sent"] += size * (world - 1)
        counter["received"] += size * (world - 1)
        return saved[0][2](tensor_list, tensor, group=group, async_op=async_op)

    def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, group=None, async_op=False):
        me, item = dist.get_rank(group), input.element_size()
        counter["sent"] += item * (sum(input_split_sizes) - input_split_sizes[me])
        counter["received"] += item * (sum(output_split_sizes) - output_split_sizes[me])
        return saved[1][2](output, input, output_split_sizes, input_split_sizes, group=group, async_op=async_op)

    c10d.all_gather, c10d.all_to_all_single = all_gather, all_to_all_single
    dist.all_gather, dist.all_to_all_single = all_gather, all_to_all_single
    return saved


def rank_body(rank: int, world: int, path: str, a) -> dict:
    from packing.exchange import exchange, gather_metadata
    from rl.algos.advantages import compute_advantages

    seq, records = make_step(rank, world, a)
    generated = sum(_bytes(r) for r in records)
    dest = _dest(seq, world, a.max_tokens)
    _trim()
    dist.barrier()
    reset_peak()  # VmHWM := VmRSS
    before = status("VmRSS")
    counter = {"sent": 0, "received": 0}
    saved = _count_collectives(counter, world)
    t0 = time.perf_counter()
    if path == "old":  # rl/trainer/trainer.py before issue #20
        gathered = [None] * world
        dist.all_gather_object(gathered, records)
        del records
        full = [rec for part in gathered for rec in part]
        del gathered
        compute_advantages(full, "grpo")
        mine = [full[j] for j, d in enumerate(dest) if rank in d]
        del full
    else:
        standins = gather_metadata(records, 0, dp_rank=rank, dp=world)
        compute_advantages(standins, "grpo")
        received = exchange({(0, i): r for i, r in enumerate(records)}, standins, dest, dp_rank=rank, dp=world,
                            group=dist.group.WORLD)
        del records
        mine = []
        for rec, s in zip(received, standins):
            if rec is not None:
                rec.advantages, rec.returns = s.advantages, s.returns
                mine.append(rec)
        del received, standins
    elapsed = time.perf_counter() - t0
    for module, name, fn in saved:
        setattr(module, name, fn)
        setattr(dist, name, fn)
    peak = status("VmHWM")
    trained = sum(_bytes(r) - r.advantages.numel() * 8 for r in mine)  # as generated: advantages are computed
    return {"sent": counter["sent"], "received": counter["received"], "peak_mb": (peak - before) / 2**20,
            "peak_abs_mb": peak / 2**20, "trained_bytes": trained, "generated_bytes": generated,
            "samples": len(mine), "seconds": elapsed}


def main() -> None:
    parser = quick_flag(__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=1024)
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--max-len", type=int, default=128)
    parser.add_argument("--layers", type=int, default=48)
    parser.add_argument("--topk", type=int, default=8)
    parser.add_argument("--experts", type=int, default=128)
    a = parser.parse_args()
    if a.quick:
        a.samples, a.max_len = 256, 96
    a.max_tokens = 4 * a.max_len
    os.environ.update(MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="65536")  # inherited by the ranks
    from scripts.distributed import run_distributed

    runs = {path: run_distributed(rank_body, a.ranks, path, a, timeout=900) for path in ("old", "new")}
    seq = lengths("bimodal", a.samples, seed=0, max_len=a.max_len, prompt=(16, 48))
    old, new = runs["old"], runs["new"]
    per_rank = {path: {k: [r[k] for r in rs] for k in rs[0]} for path, rs in runs.items()}
    step_bytes = sum(r["generated_bytes"] for r in new)
    trained = max(r["trained_bytes"] for r in new)
    # the scalars: the metadata all-gather (headers + rows) of the new path
    summary = {
        "ranks": a.ranks, "samples": a.samples, "tokens": sum(seq), "mean_len": round(sum(seq) / len(seq), 1),
        "routing": f"{a.layers}x{a.topk} of {a.experts}", "step_mb": round(step_bytes / 2**20, 1),
        "old_bytes_per_rank": max(r["received"] for r in old), "new_bytes_per_rank": max(r["received"] for r in new),
        "old_sent_per_rank": max(r["sent"] for r in old), "new_sent_per_rank": max(r["sent"] for r in new),
        "trained_bytes_per_rank": trained,
        "bytes_ratio": round(max(r["received"] for r in new) / max(r["received"] for r in old), 4),
        "new_over_trained": round(max(r["received"] / r["trained_bytes"] for r in new), 4),
        "old_peak_rss_mb": round(max(r["peak_mb"] for r in old), 1),
        "new_peak_rss_mb": round(max(r["peak_mb"] for r in new), 1),
        "step_over_ranks_mb": round(step_bytes / a.ranks / 2**20, 1),
        "old_s": round(max(r["seconds"] for r in old), 2), "new_s": round(max(r["seconds"] for r in new), 2),
        "quick": a.quick,
    }
    emit("data_path", summary, {"per_rank": per_rank, "args": vars(a)})


if __name__ == "__main__":
    main()
