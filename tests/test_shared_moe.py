"""Shared prompts on the MoE blocks: every figure of the unshared pack and the padded batch.

With `share_prompts` a GRPO group's prompt runs once through the tiny Qwen3-MoE
(`model=moe_tiny`'s model/models.py TINY_MOE). A shared prompt row stands for its group's
k samples (`SharedPrompts.multiplicity`, model/moe.py `moe_token_weights`): it is dispatched
once and counted k times, so log-probs, gradients (the router's included), the router aux
loss, `expert_load`, recorded routing (put back on the pack's slots by `expand`) and replayed
routing (the pack's record picked onto the compressed rows by `keep`) equal the unshared
pack's and the padded batch's: floats within `SHARED_ULPS` eps32 of their magnitude, counts
and expert ids exactly. Each property has a control that breaks it. Run as a program, this
module prints the figures of one kernel set (the slow test launches it per kernel set):

    ATEN_CPU_CAPABILITY=avx2 python tests/test_shared_moe.py --threads 1,2
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]  # as a program

from tests.parity_check import assert_control_fails, assert_parity, max_abs, ulps  # noqa: E402
from test_shared_prompt import SHARED_ULPS, body_tokens  # noqa: E402

from model import actor as actor_module  # noqa: E402
from model.actor import Actor, _forward_slots  # noqa: E402
from model.models import build_model  # noqa: E402
from model.moe import (expert_load, moe_blocks, record_routing, reset_expert_load, router_aux_loss,  # noqa: E402
                       shard_experts)
from runtime.parallel_dims import ParallelDims  # noqa: E402
from packing.collate import make_experience_batch  # noqa: E402
from testing.records import grpo_records  # noqa: E402

AUX = 0.01  # router aux loss coefficient of the test loss


@pytest.fixture(scope="module")
def moe():
    return shard_experts(build_model("qwen3_moe", seed=0), None)


@pytest.fixture(scope="module")
def perturbed(moe):
    """A copy whose routers differ enough to route differently (the rollout policy of a replay)."""
    other = copy.deepcopy(moe)
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for block in moe_blocks(other):
            block.gate.weight.add_(0.2 * torch.randn(block.gate.weight.shape, generator=gen))
    return other


@pytest.fixture(scope="module")
def records():
    return grpo_records()


def collate(records, routed=None):
    """The pack and the padded batch of `records` (with per-record `routed_experts` if given)."""
    if routed is not None:
        records = [dataclasses.replace(r, routed_experts=x) for r, x in zip(records, routed)]
    return make_experience_batch(records, packed=True), make_experience_batch(records, packed=False)


def run(model, batch, *, share: bool, replay: bool = False) -> dict:
    """One training forward+backward (policy term + entropy + AUX x aux loss) and every figure."""
    actor = Actor(model, share_prompts=share, replay=replay)
    model.zero_grad(set_to_none=True)
    reset_expert_load(model)
    with router_aux_loss(model) as aux, record_routing(model) as rec, body_tokens(model) as seen:
        lp, ent = actor(batch, return_entropy=True)
    mask = batch.action_mask.float()
    tokens = torch.stack([n for _, n in aux])
    real = batch.sequences.numel() if batch.is_packed else int(batch.attention_mask.sum())
    balance = sum(a * n for a, n in aux) / (real * len(aux))  # as the trainer: over the batch's tokens and layers
    loss = ((-batch.advantages * lp - 0.01 * ent) * mask).sum() / mask.sum() + AUX * balance
    loss.backward()
    out = {"log_probs": lp.detach(), "entropy": ent.detach(), "aux": balance.detach(), "tokens": tokens,
           "load": expert_load(model)["per_layer"], "routed": rec.routed_experts, "rows": seen,
           "grads": {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}}
    model.zero_grad(set_to_none=True)
    reset_expert_load(model)
    return out


def per_sample(values, batch, records):
    """Per sample, `values` on its action slots (a pack `[1, N]` or padded `[B, T-1]`)."""
    if batch.is_packed:
        cu = batch.cu_seqlens.tolist()
        rows = [values[0, s:e - 1] for s, e in zip(cu[:-1], cu[1:])]
    else:
        rows = [values[i, :r.sequences.numel() - 1] for i, r in enumerate(records)]
    return [row[r.action_mask] for row, r in zip(rows, records)]


def routing_per_sample(routed, batch, records):
    """Per sample, its `[L, K, T]` record (a pack's `[1, L, K, N]` or padded `[B, L, K, T]`)."""
    if batch.is_packed:
        cu = batch.cu_seqlens.tolist()
        return [routed[0, ..., s:e] for s, e in zip(cu[:-1], cu[1:])]
    return [routed[i, ..., :r.sequences.numel()] for i, r in enumerate(records)]


def figures(a, batch_a, b, batch_b, records) -> dict:
    """eps32 figures (floats) and exact flags of `b` against `a`, as `assert_same` checks them."""
    out = {}
    for key in ("log_probs", "entropy"):
        xs, ys = per_sample(a[key], batch_a, records), per_sample(b[key], batch_b, records)
        out[key] = ulps(max_abs(x - y for x, y in zip(xs, ys)), max_abs(xs))
    out["aux"] = ulps(float((a["aux"] - b["aux"]).abs()), float(a["aux"].abs()))
    out["grads"] = ulps(max_abs(a["grads"][n] - b["grads"][n] for n in a["grads"]), max_abs(a["grads"].values()))
    ra, rb = routing_per_sample(a["routed"], batch_a, records), routing_per_sample(b["routed"], batch_b, records)
    out["exact"] = bool(torch.equal(a["tokens"], b["tokens"]) and torch.equal(a["load"], b["load"])
                        and all(torch.equal(x, y) for x, y in zip(ra, rb)))
    return out


def moe_parity() -> dict:
    """Every figure of the shared MoE forward vs the unshared pack and padded, live and replayed."""
    model = shard_experts(build_model("qwen3_moe", seed=0), None)
    rollout = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for block in moe_blocks(rollout):
            block.gate.weight.add_(0.2 * torch.randn(block.gate.weight.shape, generator=gen))
    records = grpo_records()
    pack, padded = collate(records)
    with torch.no_grad(), record_routing(rollout) as rec:
        Actor(rollout)(pack)
    r_pack, r_padded = collate(records, routed=routing_per_sample(rec.routed_experts, pack, records))
    out = {}
    for name, (pk, pd, replay) in {"live": (pack, padded, False), "replayed": (r_pack, r_padded, True)}.items():
        shared = run(model, pk, share=True, replay=replay)
        for ref_name, batch in (("pack", pk), ("padded", pd)):
            for key, value in figures(run(model, batch, share=False, replay=replay), batch, shared, pk,
                                      records).items():
                out[f"{name}_{key}_vs_{ref_name}"] = value
    return out


def assert_same(name, a, batch_a, b, batch_b, records):
    for key in ("log_probs", "entropy"):
        xs, ys = per_sample(a[key], batch_a, records), per_sample(b[key], batch_b, records)
        assert_parity(f"{name} {key}", max_abs(x - y for x, y in zip(xs, ys)), max_abs(xs), k=SHARED_ULPS)
    assert_parity(f"{name} aux loss", (a["aux"] - b["aux"]).abs(), a["aux"].abs(), k=SHARED_ULPS)
    assert torch.equal(a["tokens"], b["tokens"]), (name, a["tokens"], b["tokens"])
    assert torch.equal(a["load"], b["load"]), (name, a["load"], b["load"])
    ra, rb = routing_per_sample(a["routed"], batch_a, records), routing_per_sample(b["routed"], batch_b, records)
    assert all(torch.equal(x, y) for x, y in zip(ra, rb)), f"{name}: recorded routing differs"
    assert a["grads"].keys() == b["grads"].keys()
    assert_parity(f"{name} grads", max_abs(a["grads"][n] - b["grads"][n] for n in a["grads"]),
                  max_abs(a["grads"].values()), k=SHARED_ULPS)


# ------------------------------------------------------------------- live routing
def test_shared_moe_forward_equals_the_unshared_pack_and_padded_in_every_figure(moe, records):
    pack, padded = collate(records)
    shared = run(moe, pack, share=True)
    assert shared["rows"] == [pack.shared_prompts.keep.numel()] < [pack.sequences.numel()]  # it ran compressed
    assert shared["routed"].shape[-1] == pack.sequences.numel()  # recorded on the pack's N slots
    assert shared["tokens"].tolist() == [pack.sequences.numel()] * len(moe_blocks(moe))
    assert any(g.abs().sum() > 0 for n, g in shared["grads"].items() if "gate" in n)  # the routers learn
    assert_same("shared vs unshared pack", run(moe, pack, share=False), pack, shared, pack, records)
    assert_same("shared vs padded", run(moe, padded, share=False), padded, shared, pack, records)


def test_control_unit_weights_undercount_the_shared_prompts(moe, monkeypatch):
    """A shared prompt row weighing 1 (not its group's size): the aux loss, its token count and the
    expert load miss the unshared pack's (the log-probs do not: the weights only count). Long
    prompts, short answers (the shape sharing is for), so the miss is far outside the tolerance."""
    pack, _ = collate(grpo_records([(20, [2, 3, 2, 2]), (16, [3, 2, 4, 1])], seed=3, hole=False))
    plain = run(moe, pack, share=False)
    view = actor_module._shared_prompt_view
    monkeypatch.setattr(actor_module, "_shared_prompt_view",
                        lambda *a: (v := view(*a))._replace(weight=(v.weight > 0).long()))
    ones = run(moe, pack, share=True)
    assert ones["tokens"][0] < plain["tokens"][0] and not torch.equal(ones["load"], plain["load"])
    assert_control_fails("aux loss with unit weights", (ones["aux"] - plain["aux"]).abs(), plain["aux"].abs(),
                         k=SHARED_ULPS)


def test_control_records_without_expand_are_on_the_compressed_rows(moe, records, monkeypatch):
    pack, _ = collate(records)
    view = actor_module._shared_prompt_view
    monkeypatch.setattr(actor_module, "_shared_prompt_view", lambda *a: view(*a)._replace(expand=None))
    with torch.no_grad(), record_routing(moe) as rec:
        _forward_slots(moe, pack, ParallelDims(), replay=False, share_prompts=True)
    assert rec.routed_experts.shape[-1] == pack.shared_prompts.keep.numel() < pack.sequences.numel()


# ------------------------------------------------------------------ routing replay
@pytest.fixture(scope="module")
def replayed(perturbed, records):
    """Records of the perturbed router on the unshared pack (per sample), and the batches carrying them."""
    pack, _ = collate(records)
    with torch.no_grad(), record_routing(perturbed) as rec:
        Actor(perturbed)(pack)
    per = routing_per_sample(rec.routed_experts, pack, records)
    return collate(records, routed=per)


def test_replayed_routing_on_the_compressed_rows_equals_the_unshared_replay(moe, records, replayed):
    pack, padded = replayed
    live = run(moe, pack, share=False)
    shared = run(moe, pack, share=True, replay=True)
    # replay took: the recorded ids are the rollout router's, not this router's
    assert torch.equal(shared["routed"], pack.routed_experts) and not torch.equal(live["routed"], shared["routed"])
    assert_same("replayed, shared vs unshared pack", run(moe, pack, share=False, replay=True), pack, shared, pack,
                records)
    assert_same("replayed, shared vs padded", run(moe, padded, share=False, replay=True), padded, shared, pack,
                records)


def test_control_replay_without_the_keep_select_misses(moe, records, replayed, monkeypatch):
    """The pack's record cut to the first N_c slots instead of picked by `keep`: other experts
    for most rows, and log-probs far outside the tolerance."""
    pack, _ = replayed
    right = run(moe, pack, share=False, replay=True)
    view = actor_module._shared_prompt_view

    def unselected(model, experience, *rest):
        v = view(model, experience, *rest)
        return v._replace(routed=experience.routed_experts[..., :v.weight.shape[1]])

    monkeypatch.setattr(actor_module, "_shared_prompt_view", unselected)
    wrong = run(moe, pack, share=True, replay=True)
    assert not torch.equal(wrong["routed"], pack.routed_experts)
    xs, ys = per_sample(right["log_probs"], pack, records), per_sample(wrong["log_probs"], pack, records)
    assert_control_fails("log-probs replayed without keep", max_abs(x - y for x, y in zip(xs, ys)), max_abs(xs),
                         k=SHARED_ULPS)


# ------------------------------------------------------------------- EP suffix (one process)
def test_an_ep_suffix_on_the_shared_rows_is_its_own_segment_and_counts_nothing(moe, records):
    """The EP-equalized suffix appended to the compressed rows: real outputs, aux loss, load and
    records unchanged (it is a causal segment of its own, weighs 0, and restore cuts it)."""
    pack, _ = collate(records)
    n, rows = pack.sequences.numel(), pack.shared_prompts.keep.numel()
    with torch.no_grad():
        figures = {}
        for pad in (0, 5):
            reset_expert_load(moe)
            with router_aux_loss(moe) as aux, record_routing(moe) as rec, body_tokens(moe) as seen:
                hidden, view = _forward_slots(moe, pack, ParallelDims(), replay=False, pad=pad, share_prompts=True)
            figures[pad] = (hidden, aux, expert_load(moe)["per_layer"], rec.routed_experts, seen, view)
        reset_expert_load(moe)
    (h0, aux0, load0, rec0, seen0, _), (h5, aux5, load5, rec5, seen5, view5) = figures[0], figures[5]
    assert seen0 == [rows] and seen5 == [rows + 5] and h5.shape[1] == n + 5
    assert view5.restore(h5[..., 0]).shape == (1, n) and not view5.valid[0, n:].any()
    assert view5.inputs["shared_prompts"].lens_q[-1] == 5 and view5.weight[0, rows:].eq(0).all()
    assert_parity("hidden states with a 5-row suffix", (h5[:, :n] - h0).abs().max(), h0.abs().max())
    assert all(torch.equal(a[1], b[1]) for a, b in zip(aux0, aux5))
    assert_parity("aux loss with a suffix", max_abs(a[0] - b[0] for a, b in zip(aux0, aux5)),
                  max_abs(a[0] for a in aux0))
    assert torch.equal(load0, load5) and torch.equal(rec0, rec5[..., :n]) and (rec5[..., n:] == -1).all()


# ------------------------------------------------------------------------ the default run
def test_the_default_moe_run_trains_on_the_shared_forward(monkeypatch):
    """`model=moe_tiny` (the default config) with its defaults: every training forward of one GRPO
    step goes through `_shared_prompt_view` and runs compressed (the control: with
    `model.share_prompts=false` none does)."""
    from testing.inprocess import SMALL, trainer

    view = actor_module._shared_prompt_view
    for share in (True, False):
        taken: list[bool] = []
        monkeypatch.setattr(actor_module, "_shared_prompt_view",
                            lambda *a: taken.append((v := view(*a)) is not None) or v)
        tr = trainer("model=moe_tiny", *SMALL, f"model.share_prompts={str(share).lower()}")
        assert tr.actor.share_prompts is share and moe_blocks(tr.actor.model)
        tr.step(0)
        if share:
            assert taken and all(taken), taken
        else:
            assert taken == []


def test_activation_checkpointing_recomputes_the_shared_rows_with_their_weights_and_replay(moe, records, replayed):
    """Checkpointed decoder layers recompute inside backward, after the contexts exited: `moe_state`
    puts back the token weights, `expand` and the replay of the compressed rows, so log-probs,
    grads, aux loss, load and records equal the plain shared forward's (load counted once)."""
    from model import parallelize as par

    pack, _ = replayed

    def figures(checkpointed: bool) -> dict:
        model = copy.deepcopy(moe)
        actor = par.parallelize(Actor(model, share_prompts=True), ParallelDims(),
                                activation_checkpointing=checkpointed)
        model.zero_grad(set_to_none=True)
        reset_expert_load(model)
        with router_aux_loss(model) as aux, record_routing(model) as rec:
            lp = actor(pack)
        balance = sum(a * n for a, n in aux) / torch.stack([n for _, n in aux]).sum()
        mask = pack.action_mask.float()
        (((-pack.advantages * lp) * mask).sum() / mask.sum() + AUX * balance).backward()
        return {"lp": lp.detach(), "aux": balance.detach(), "load": expert_load(model)["per_layer"],
                "routed": rec.routed_experts, "grads": {n: p.grad for n, p in model.named_parameters()
                                                        if p.grad is not None}}

    plain, ckpt = figures(False), figures(True)
    assert_parity("log-probs, checkpointed shared", (ckpt["lp"] - plain["lp"]).abs().max(), plain["lp"].abs().max())
    assert_parity("aux loss, checkpointed shared", (ckpt["aux"] - plain["aux"]).abs(), plain["aux"].abs())
    assert torch.equal(ckpt["load"], plain["load"]) and torch.equal(ckpt["routed"], plain["routed"])
    assert torch.equal(plain["routed"], pack.routed_experts)
    assert_parity("grads, checkpointed shared", max_abs(ckpt["grads"][n] - g for n, g in plain["grads"].items()),
                  max_abs(plain["grads"].values()))


# ------------------------------------------------------------------ every kernel set
@pytest.mark.slow
@pytest.mark.parametrize("cap", ["default", "avx2", "avx512"])
def test_the_moe_figures_hold_on_every_kernel_set(cap):
    """This module run as a program under each ATen kernel set, with 1 and 2 threads."""
    flags = Path("/proc/cpuinfo").read_text().split() if Path("/proc/cpuinfo").exists() else []
    if cap != "default" and {"avx2": "avx2", "avx512": "avx512f"}[cap] not in flags:
        pytest.skip(f"this CPU has no {cap}")
    proc = subprocess.run([sys.executable, __file__, "--threads", "1,2"],
                          env={**os.environ, "ATEN_CPU_CAPABILITY": cap}, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    values = [v for run_ in result["threads"].values() for v in run_.values()]
    worst = max(v for v in values if not isinstance(v, bool))
    print(f"{result['capability']}: worst {worst:.2f} eps32 (limit {SHARED_ULPS})")
    assert worst <= SHARED_ULPS and all(v for v in values if isinstance(v, bool))


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", default=None, help="comma-separated thread counts")
    args = parser.parse_args()
    runs = {}
    for threads in [int(t) for t in args.threads.split(",")] if args.threads else [torch.get_num_threads()]:
        torch.set_num_threads(threads)
        runs[str(torch.get_num_threads())] = moe_parity()
    print(json.dumps({"capability": torch.backends.cpu.get_cpu_capability(), "threads": runs}))


if __name__ == "__main__":
    main()



def shared_forward_rank(rank: int, world_size: int, overrides: tuple[str, ...]) -> dict:
    """One step of the default MoE run on this rank, counting the training forwards that took the
    shared path (`_shared_prompt_view` returned a view) and those that did not."""
    from testing.inprocess import compose

    from runtime.parallel_dims import init_distributed
    from rl.trainer.build import build_trainer

    cfg = compose(*overrides, world_size=world_size)
    dims = init_distributed(cfg.parallel.dp, cfg.parallel.cp, cfg.parallel.ep, device="cpu")
    torch.manual_seed(cfg.seed)
    tr = build_trainer(cfg, dims)
    view, taken = actor_module._shared_prompt_view, []
    actor_module._shared_prompt_view = lambda *a: taken.append((v := view(*a)) is not None) or v
    try:
        metrics = tr.step(0)
    finally:
        actor_module._shared_prompt_view = view
    return {"taken": taken, "dims": (dims.dp, dims.cp, dims.ep),
            "metrics": {k: float(metrics[k]) for k in ("loss", "grad_norm", "entropy", "expert_tokens")}}


@pytest.mark.slow
def test_the_default_moe_run_at_dp2_cp2_ep2_trains_on_the_shared_forward():
    """`parallel=cp2_ep2` on 4 gloo ranks: every training forward of every rank takes the shared
    path (the compressed rows sharded over CP, experts over EP), and the step's loss, grad norm,
    entropy and expert tokens equal the one-process run's (the default run)."""
    from testing.inprocess import SMALL, trainer
    from testing.distributed import run_distributed

    one = trainer("model=moe_tiny", *SMALL).step(0)
    ranks = run_distributed(shared_forward_rank, 4, ("model=moe_tiny", *SMALL, "parallel=cp2_ep2"), timeout=300)
    for r in ranks:
        assert r["dims"] == (2, 2, 2) and r["taken"] and all(r["taken"]), r
        for key, value in r["metrics"].items():  # tests/test_train.py's tolerance for a run's layout
            ref = float(one[key])
            assert abs(value - ref) <= 1e-4 * max(1.0, abs(ref)), (key, value, ref)
        assert r["metrics"]["expert_tokens"] == float(one["expert_tokens"])
