"""runtime/exchange.py and the trainer's data path (issue #20): ranks gather only per-sample
metadata, and each sample moves once, as flat tensors, from the rank that generated it to
the ranks the plan runs it on.

* every rank's received samples: exactly at the ranks the plan names, bit for bit the
  generating rank's record, routing narrowed in transit (int8 / int16) and restored;
* advantages (grpo, rloo, reinforce_pp, reinforce_pp_baseline, whitened or not) on the
  stand-ins equal those on the records all-gathered the old way (`all_gather_object`);
* CP peers that generated different samples stop every rank with the same error;
* the trainer: same seed -> the same metrics as the old `all_gather_object` path (recorded with
  it in tests/exchange_old_path_metrics.json), at 1 and 4 ranks (dp2 x cp2, ep2), with dynamic sampling.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from testing.distributed import run_distributed
from testing.inprocess import matches_recorded
from packing import Experience, plan_microbatches
from runtime.exchange import FIELDS, StandIn, exchange, gather_metadata, routing_dtype

LAYERS, TOPK = 3, 2
ESTIMATORS = [("grpo", None), ("grpo", True), ("rloo", None), ("reinforce_pp", None), ("reinforce_pp_baseline", None),
              ("reinforce_pp", False)]


def _records(dp_rank: int, n: int, experts: int | None, seed: int = 0, long: bool = False) -> list[Experience]:
    """Rollout-like records (rl/rollout/engine.py `make_record`) of one DP rank: bimodal lengths,
    float32 rewards, int64 routing with some -1 (no record), a bf16 field, every fourth an
    action mask with holes (a multi-turn episode's environment tokens) (`long`: only
    27..47-token samples, no two of which fit 47 tokens)."""
    from rl.rollout.engine import make_record

    gen = torch.Generator().manual_seed(1000 * seed + dp_rank)
    out = []
    for i in range(n):
        P = int(torch.randint(2, 9, (1,), generator=gen))
        R = int(torch.randint(1, 6, (1,), generator=gen)) if i % 3 else int(torch.randint(20, 40, (1,), generator=gen))
        R = int(torch.randint(25, 40, (1,), generator=gen)) if long else R
        routed = None
        if experts is not None:
            routed = torch.randint(0, experts, (LAYERS, TOPK, P + R), generator=gen)
            routed[:, :, :1] = -1
        rec = make_record(torch.randint(0, 500, (P,), generator=gen), torch.randint(0, 500, (R,), generator=gen),
                          -torch.rand(R, generator=gen), prompt_index=dp_rank * 100 + i // 2, routed_experts=routed,
                          actions=None if i % 4 else torch.arange(R) % 3 != 1)
        rec.rewards = torch.rand((), generator=gen).round(decimals=1).to(torch.float32)
        rec.turns = torch.tensor(1 if i % 4 else 2)  # an episode field: the holey ones took two turns
        rec.policy_version = torch.tensor(7 - i % 3)  # rollouts of several policy versions (rollout.mode=async)
        rec.values = torch.randn(P + R - 1, generator=gen).to(torch.bfloat16)
        out.append(rec)
    return out


def _dest(standins, dp: int, max_tokens: int, mini_batches: int = 2, micro_batch_size=None) -> list[list[int]]:
    """The ranks each sample runs on: the trainer's rule (rl/trainer/trainer.py `plan`)."""
    bounds = [round(i * len(standins) / mini_batches) for i in range(mini_batches + 1)]
    dest = [set() for _ in standins]
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        plan = plan_microbatches([int(s.total_length) for s in standins[lo:hi]], max_tokens, dp,
                                 micro_batch_size=micro_batch_size)
        for rank, microbatches in enumerate(plan):
            for items in microbatches:
                for i in items or [0]:
                    dest[lo + i].add(rank)
    return [sorted(d) for d in dest]


def exchange_rank(rank: int, world_size: int, cp: int, experts: int | None, n: int, max_tokens: int) -> dict:
    from rl.algos.advantages import compute_advantages

    dp, dp_rank, cp_rank = world_size // cp, rank // cp, rank % cp
    groups = [dist.new_group([d * cp + c for d in range(dp)]) for c in range(cp)]  # every rank creates every group
    records = _records(dp_rank, n if dp_rank != 1 else n + 4, experts, long=n == 2)  # uneven counts per rank
    standins = gather_metadata(records, "r0", dp_rank=dp_rank, dp=dp, cp=cp)
    # the old path, as the reference: every record on every rank
    gathered = [None] * world_size
    dist.all_gather_object(gathered, records if cp_rank == 0 else None)
    full = [rec for part in gathered if part is not None for rec in part]
    same_advantages = {}
    for name, whiten in ESTIMATORS:  # as the trainer: the step's rewards read from the stand-ins
        via = [dataclasses.replace(rec) for rec in full]
        compute_advantages(via, name, samples=standins, rows=[[j] for j in range(len(via))], whiten=whiten)
        compute_advantages(full, name, whiten=whiten)
        same_advantages[f"{name}/{whiten}"] = all(
            torch.equal(v.advantages, f.advantages) and torch.equal(v.returns, f.returns) for v, f in zip(via, full))
    scalars = all(torch.equal(getattr(s, k), getattr(f, k)) and getattr(s, k).dtype == getattr(f, k).dtype
                  for s, f in zip(standins, full) for k in ("rewards", "prompt_index", "response_length", "total_length",
                                                                        "turns", "policy_version"))
    scalars &= all(s.action_tokens == f.action_tokens for s, f in zip(standins, full))
    # n == 2: one sample per microbatch, 6 per mini-batch over dp 4: two ranks run an empty microbatch
    dest = _dest(standins, dp, 47 if n == 2 else max_tokens)
    calls = []
    original = dist.all_to_all_single

    def watch(output, input, output_split_sizes, input_split_sizes, group=None):
        calls.append(sum(output_split_sizes) - output_split_sizes[dist.get_rank(group)])  # bytes from other ranks
        return original(output, input, output_split_sizes, input_split_sizes, group=group)

    dist.all_to_all_single = watch
    try:
        local = {("r0", i): rec for i, rec in enumerate(records)}
        received = exchange(local, standins, dest, dp_rank=dp_rank, dp=dp, group=groups[cp_rank] if dp > 1 else None)
    finally:
        dist.all_to_all_single = original
    return {"generated": records, "received": {j: r for j, r in enumerate(received) if r is not None},
            "sources": [s.source for s in standins], "dest": dest, "same_advantages": same_advantages,
            "scalars": scalars, "calls": len(calls), "received_bytes": sum(calls), "order": len(standins) == len(full)}


def _check_delivery(results, world_size: int, cp: int, experts: int | None):
    sources, dest = results[0]["sources"], results[0]["dest"]
    assert all(r["sources"] == sources and r["dest"] == dest for r in results)  # the same decisions everywhere
    assert all(r["scalars"] and r["order"] for r in results)
    for r in results:
        assert all(r["same_advantages"].values()), r["same_advantages"]
    for rank, r in enumerate(results):
        mine = {j for j, d in enumerate(dest) if rank // cp in d}
        assert set(r["received"]) == mine, rank  # exactly the samples the plan runs on this rank
        for j in mine:
            src, (_, i) = sources[j]
            want = results[src * cp + rank % cp]["generated"][i]  # the matching CP rank of the sender
            got = r["received"][j]
            for name in FIELDS:
                a, b = getattr(want, name), getattr(got, name)
                assert (a is None) == (b is None), name
                if a is not None:
                    assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), (rank, j, name)
    fields = [n for n in FIELDS if getattr(results[0]["generated"][0], n) is not None]
    assert all(r["calls"] == len(fields) for r in results)  # one all_to_all_single per field
    # bytes: a rank receives exactly the samples it runs that others generated, routing narrowed
    # (int8 up to 128 experts, int16 above), every other field in its own dtype
    for rank, r in enumerate(results):
        run = [r["received"][j] for j in r["received"] if sources[j][0] != rank // cp]
        narrowed = sum(_bytes(x) - (x.routed_experts.numel() * 7 if experts and experts <= 128 else
                                    x.routed_experts.numel() * 6 if experts else 0) for x in run)
        assert r["received_bytes"] == narrowed, (rank, r["received_bytes"], narrowed)


def _bytes(rec: Experience) -> int:
    return sum(getattr(rec, n).numel() * getattr(rec, n).element_size() for n in FIELDS if getattr(rec, n) is not None)


@pytest.mark.slow
@pytest.mark.parametrize("world_size,cp,experts,n", [(4, 1, 100, 8), (4, 2, 300, 6), (3, 1, None, 6), (4, 1, 100, 2)])
def test_each_sample_reaches_the_planned_ranks_bit_for_bit(world_size, cp, experts, n):
    results = run_distributed(exchange_rank, world_size, cp, experts, n, 50, timeout=120)
    _check_delivery(results, world_size, cp, experts)
    if n == 2:  # few samples: some rank runs an empty microbatch on a stand-in sample, which goes there too
        assert any(len(d) > 1 for d in results[0]["dest"])


def test_one_process_delivers_its_own_records():
    records = _records(0, 9, 100)
    standins = gather_metadata(records, 7)
    assert all(isinstance(s, StandIn) and s.source == (0, (7, i)) for i, s in enumerate(standins))
    got = exchange({(7, i): r for i, r in enumerate(records)}, standins, [[0]] * 9)
    assert all(torch.equal(g.routed_experts, r.routed_experts) and torch.equal(g.sequences, r.sequences)
               for g, r in zip(got, records))


def test_routing_dtype_is_the_narrowest_that_holds_the_ids():
    assert routing_dtype(-1, 127) == torch.int8 and routing_dtype(-1, 128) == torch.int16
    assert routing_dtype(-1, 40000) == torch.int32 and routing_dtype(0, 2**40) == torch.int64


def test_an_action_mask_with_holes_travels_with_its_record():
    """A multi-turn record's mask is False on the environment's tokens: the stand-in counts its
    action tokens (the token-mean normalizer), the record keeps the mask bit for bit."""
    records = _records(0, 6, None)
    holes = records[0].action_mask
    assert not holes.all() and holes[-1] and not holes[int(holes.nonzero()[0]):].all()  # True, False, True
    standins = gather_metadata(records)
    assert [s.action_tokens for s in standins] == [int(r.action_mask.sum()) for r in records]
    assert standins[0].action_tokens < int(records[0].response_length)  # control: not the response length
    got = exchange({(0, i): r for i, r in enumerate(records)}, standins, [[0]] * 6)
    assert all(torch.equal(g.action_mask, r.action_mask) for g, r in zip(got, records))


def cp_divergence_rank(rank: int, world_size: int) -> str:
    records = _records(rank // 2, 4, 10)
    if rank == 1:
        records[2].sequences[0] += 1  # CP rank 1 of DP rank 0 generated another token
    try:
        gather_metadata(records, dp_rank=rank // 2, dp=world_size // 2, cp=2)
    except RuntimeError as e:
        return str(e)
    return ""


@pytest.mark.slow
def test_cp_peers_that_generated_other_samples_stop_every_rank():
    for message in run_distributed(cp_divergence_rank, 4, timeout=60):
        assert "rank 1 (dp 0, cp 1)" in message and "CP rank 0" in message


# ---------------------------------------------------------- the trainer, old vs new
# The old data path's metrics (every rank all-gathered every record and planned and collated the whole
# step), recorded with it before it was retired: see the file's "recorded" note.
OLD_PATH = json.loads(Path(__file__).with_name("exchange_old_path_metrics.json").read_text())["cases"]


def _untimed(metrics: dict) -> dict:
    return {k: v for k, v in metrics.items() if not k.endswith("_s")}  # seconds and rates


def paths_rank(rank: int, world_size: int, overrides: tuple[str, ...], steps: int) -> list[dict]:
    """`steps` steps with the data path, from the seed."""
    from runtime.parallel_dims import init_distributed
    from rl.trainer.build import build_trainer
    from testing.inprocess import compose

    cfg = compose(*overrides, world_size=world_size)
    dims = init_distributed(cfg.parallel.dp, cfg.parallel.cp, cfg.parallel.ep, device="cpu")
    torch.manual_seed(cfg.seed)
    return [_untimed(m) for m in map(build_trainer(cfg, dims).step, range(steps))]


@pytest.mark.slow
@pytest.mark.parametrize("case", ["1", "4"], ids=["1_rank", "dp2_cp2_ep2"])
def test_the_trainer_gives_the_old_paths_metrics(case):
    """At 1 rank (dynamic sampling, 2 mini-batches, reinforce_pp_baseline) and 4 (dp2 x cp2, ep2, a
    40-token budget): every rank's metrics of 2 steps are the old path's, step for step."""
    world_size, overrides, want = (OLD_PATH[case][k] for k in ("world_size", "overrides", "metrics"))
    if world_size == 1:
        results = [paths_rank(0, 1, tuple(overrides), len(want))]
    else:
        results = run_distributed(paths_rank, world_size, tuple(overrides), len(want), timeout=600)
    for got in results:
        assert matches_recorded(got, want), (got, want)
    assert results[0][0]["tokens"] > 0
