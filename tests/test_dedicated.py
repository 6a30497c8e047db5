"""Dedicated rollout ranks (`parallel.rollout_ranks`, rl/rollout/dedicated.py): the last R ranks only
generate, the first T train. Every step's records (tokens, the engine's log-probs, rewards, versions,
an MoE's routes) are bit for bit those of the colocated dp = R run with the same max_staleness k
(generator g rolls out colocated rank g's prompts with the same version of the weights), and the
losses and final weights are the colocated run's within the FSDP tolerance. The matrix, each case
against its colocated run: dense R = 2, T = 2, k = 1 (two dedicated runs identical; the control:
k = 0 gives other records from step 1, and, run from a checkpoint of the same weights, the same step
0); dense R = 1, T = 1, k = 2 (the control: a k = 1 run differs from rollout 2); dense R = 1 beside
T = 2 context-parallel trainers (cp = 2), k = 1, against the colocated dp = 1, cp = 2 run (the control:
k = 0 differs from step 1); MoE R = 2, T = 2,
k = 2; MoE R = 1, T = 2 expert-parallel trainers, k = 1 (T != R: bit for bit while rollouts use
version 0, then within rounding: T trainers sum their gradients in another order than R colocated
ranks; the control for MoE: the routes differ between tokens, samples and steps). LoRA rank 4, dense
R = 2, T = 2, k = 1: the colocated LoRA run's records, the full model pushed once and the adapters
after (the control: pushes of version 0's adapters give other records from step 2). Dynamic sampling,
dense R = 2, T = 2, k = 0: every round the colocated rank rolls out, extra rounds included, the samples
each trainer receives and the counts (the control: without it, other samples at the steps with extra rounds).
What trainer 0 logs, a multi-turn task, R = 2, T = 2, k = 1: colocated rank 0's rows (trainer.log_samples) and
the colocated environment-turn counts, both generators' summed (the controls: rank 1's and another step's rows).
Held-out evaluation (dense R = 2, T = 2, k = 1, eval.every=2): the trainers evaluate with the policy itself
and give the colocated run's evaluation records and figures bit for bit, and the run without evaluation
trains alike bit for bit (the control: a k = 0 run evaluates other versions differently); one trainer
(R = T = 1, k = 2) and two CP trainers evaluate as their colocated runs, bit for bit.
The unsupported combinations are refused at start-up, naming their keys."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from testing.distributed import run_distributed
from testing.inprocess import SMALL, compose

from model.models import build_model
from test_arithmetic import tiny_llama  # noqa: F401 - fixture
from test_tasks import tokenizer, tokenizer_dir  # noqa: F401 - fixtures

BASE = (*SMALL, "task.prompts_per_step=4", "algo.tis_cap=2.0", "eval.every=0", "checkpoint.final=false",
        "trainer.log_samples=0")
DENSE = (*BASE, "model=dense_tiny")
MOE = (*BASE, "model=moe_tiny")
DEDICATED = ("parallel.rollout_ranks=2",)
STEPS = 3
# routed_experts [L, K, T]: the generation's routes (MoE routing replay), None on a dense model
FIELDS = ("sequences", "rollout_log_probs", "rewards", "prompt_index", "policy_version", "routed_experts")
TOL = 7.8e-6  # the FSDP reductions' rounding (tests/test_fsdp.py)
# held-out evaluation: 5 problems over 2 trainers (3 and 2) in batches of 2, so trainer 1's last batch is empty
EVAL = ("eval.every=2", "eval.num_prompts=5", "eval.batch_size=2")
HELDOUT_SEED = 2**31 + 5
UNTIMED = ("_s", "tokens_per_s")  # a metric ending so is a time or a rate


def _fields(records) -> list[dict]:
    return [{name: getattr(r, name).clone() for name in FIELDS if getattr(r, name) is not None} for r in records]


def _recorded(scheduler) -> list[list[dict]]:
    """The records each `take` of `scheduler` hands over, step by step (filled as the steps run)."""
    take, records = scheduler.take, []

    def keep(step):
        taken = take(step)
        records.append(_fields(taken.records))
        return taken

    scheduler.take = keep
    return records


def _received() -> list[list[dict | None]]:
    """What the step's exchange hands this trainer, step by step: per sample of the step (global
    order: generator by generator, or colocated rank by rank) its fields, None where it is not a destination."""
    from rl.trainer import trainer

    exchange, received = trainer.exchange_records, []

    def keep(*args):
        mine = exchange(*args)
        received.append([None if r is None else _fields([r])[0] for r in mine])
        return mine

    trainer.exchange_records = keep
    return received


def _replayed() -> list[bool]:
    """Per MoE forward of this trainer's policy: whether it replayed recorded routes (model/actor.py
    enters model/moe.py's `routing_replay` with the batch's routes, None: live routing)."""
    from model import actor

    replay, seen = actor.routing_replay, []

    def keep(model, routed):
        seen.append(routed is not None)
        return replay(model, routed)

    actor.routing_replay = keep
    return seen


def _heldout() -> None:
    """target_token has no held-out split: the test gives it one (prompts from a seed the run draws no
    step's prompts from), so a held-out evaluation scores the task's fractional reward (the share of
    reply tokens equal to the target), which moves with the policy."""
    from rl.tasks.synthetic import TargetToken

    TargetToken.has_heldout = True
    TargetToken.heldout = lambda self, n: self.prompts(n, seed=HELDOUT_SEED)


def _evaluations(tr) -> list[list[dict]]:
    """The records of each held-out evaluation `tr` runs (this rank's problems, batch by batch),
    filled as it evaluates."""
    from rl.rollout import evaluate as module

    run, evaluate, evaluations = module.run_episodes, tr.evaluate, []

    def episodes(*args, **kwargs):
        records = run(*args, **kwargs)
        evaluations[-1].extend(_fields(records))
        return records

    def evaluated():
        evaluations.append([])
        return evaluate()

    module.run_episodes, tr.evaluate = episodes, evaluated
    return evaluations


def run_rank(rank: int, world: int, overrides: tuple[str, ...], steps: int) -> dict:
    """train.py's rank, in-process: a generator's records per step, or a trainer's metrics, final
    weights, (colocated) records and received samples per step; with eval.every > 0 also each held-out
    evaluation's records and train.py's evaluation after the last step (`final`), which a dedicated
    run's trainers run once the generators are done."""
    from runtime.parallel_dims import init_distributed
    from rl.trainer.build import build_generator, build_trainer
    from testing.inprocess import weights

    cfg = compose(*overrides, world_size=world)
    p = cfg.parallel
    dims = init_distributed(p.dp, p.cp, p.ep, device="cpu", rollout_ranks=p.rollout_ranks)
    torch.manual_seed(cfg.seed)
    if cfg.eval.every:
        _heldout()
    if dims.generates:
        generator = build_generator(cfg, dims)
        records = _recorded(generator.scheduler)
        for step in range(steps):
            generator.step(step)
        generator.close()
        return {"role": "generator", "records": records}
    tr = build_trainer(cfg, dims)
    records = _recorded(tr.rollout_scheduler) if not dims.rollout_ranks else []  # trainers: no records of their own
    received, replayed, evaluations = _received(), _replayed(), _evaluations(tr)
    metrics = [tr.step(s) for s in range(steps)]
    final = tr.evaluate() if cfg.eval.every else {}
    if hasattr(tr.rollout_scheduler, "close"):
        tr.rollout_scheduler.close()
    return {"role": "trainer", "records": records, "received": received, "replayed": replayed, "metrics": metrics,
            "weights": weights(tr), "evaluations": evaluations, "final": final}


def _same(a: list[list[dict | None]], b: list[list[dict | None]]) -> bool:
    """Step by step, record by record the same fields bit for bit (None, a sample not received, only as None)."""
    def equal(r: dict | None, s: dict | None) -> bool:
        if r is None or s is None:
            return r is s
        return r.keys() == s.keys() and all(torch.equal(r[k], s[k]) for k in r)

    return len(a) == len(b) and all(len(x) == len(y) and all(map(equal, x, y)) for x, y in zip(a, b))


def _check_records(colocated: list[dict], dedicated: list[dict], generators: int, k: int,
                   cp: int = 1) -> list[list[dict]]:
    """Generator g's records (rank T + g) against colocated DP rank g's (dp = R, rank g * `cp`, the same
    max_staleness `k`): bit for bit at every step when the trainers are as many as the colocated ranks (the
    same mesh). With other trainers the FSDP reductions sum in another order than the colocated run's, so a pushed version
    (>= 1) is its weights up to rounding: the steps at version 0 are bit for bit, later ones the same
    samples (tokens, routes, rewards) with log-probs within rounding, and not bit for bit (the
    control: a bit-for-bit comparison sees rounding-level weights). Every trainer receives in the
    exchange exactly the generators' records the plan sends it (routes included), and every sample
    reaches one. Returns each step's records in the step's order (generator by generator)."""
    trainers = len(dedicated) - generators
    assert [r["role"] for r in dedicated] == ["trainer"] * trainers + ["generator"] * generators
    steps = len(colocated[0]["records"])
    versions = [max(0, s - k) for s in range(steps)]  # rollout j uses version max(0, j - k)
    exact = steps if trainers == len(colocated) else versions.count(0)
    for g in range(generators):
        gen, col = dedicated[trainers + g]["records"], colocated[g * cp]["records"]
        assert [len(step) for step in gen] == [16 // generators] * steps  # 4 prompts x 4 samples a step
        assert [int(step[0]["policy_version"]) for step in gen] == versions
        assert _same(gen[:exact], col[:exact]), f"generator {g}: records differ from colocated rank {g}'s"
        if exact < steps:
            assert not _same(gen[exact:], col[exact:]), f"generator {g}: T={trainers} trainers' versions are " \
                                                        f"the colocated dp={generators} run's bit for bit"
            for x, y in zip(gen[exact:], col[exact:]):
                for r, c in zip(x, y):
                    assert r.keys() == c.keys() and all(torch.equal(r[f], c[f]) for f in r if f != "rollout_log_probs")
                    torch.testing.assert_close(r["rollout_log_probs"], c["rollout_log_probs"], atol=TOL, rtol=0)
    sent = [[r for g in range(generators) for r in dedicated[trainers + g]["records"][s]] for s in range(steps)]
    for s, records in enumerate(sent):
        got = [dedicated[t]["received"][s] for t in range(trainers)]
        assert all(len(mine) == len(records) for mine in got)
        for j, record in enumerate(records):
            arrived = [mine[j] for mine in got if mine[j] is not None]
            assert arrived and _same([arrived], [[record] * len(arrived)]), f"step {s} sample {j}: not received"
    return sent


def _check_training(colocated: list[dict], dedicated: list[dict]) -> None:
    """The trainers train on the samples the colocated ranks train on: the step's (global) losses,
    rewards and token counts and the final weights within the FSDP tolerance, trainer t against
    colocated rank t."""
    for got, want in zip(dedicated, colocated):
        if got["role"] != "trainer":
            break
        for m, w in zip(got["metrics"], want["metrics"], strict=True):
            assert m["loss"] == pytest.approx(w["loss"], abs=TOL) and m["reward_mean"] == w["reward_mean"]
            assert m["tokens"] == w["tokens"] and m["rollout_staleness_max"] == w["rollout_staleness_max"]
        for name, value in want["weights"].items():
            torch.testing.assert_close(got["weights"][name], value, atol=TOL, rtol=0)


def _figures(metrics: dict) -> dict:
    """A held-out evaluation's figures (its seconds left out)."""
    return {k: v for k, v in metrics.items() if k.startswith("eval_") and not k.endswith(UNTIMED)}


@pytest.mark.slow
def test_dedicated_generators_give_the_colocated_records_bit_for_bit_and_train_alike(tmp_path):
    """Dense, R = 2 generators beside T = 2 trainers, k = 1 (the module docstring), with the held-out
    evaluation (eval.every=2: before steps 0 and 2, and after the last) in the colocated, the dedicated
    and the control runs: the dedicated trainers evaluate with the policy itself, over their own groups,
    the colocated dp = 2 ranks with their rollout engine (the copy); every evaluation's records (tokens,
    log-probs, rewards) and figures are the colocated run's bit for bit, and the run without evaluation
    (`again`) has the same records, metrics and weights bit for bit. The control for evaluation: the
    k = 0 run evaluates the same version 0 at step 0 (the same records and figures) and other versions
    at step 2 and after the last step (other records)."""
    k1 = ("rollout.max_staleness=1",)
    colocated = run_distributed(run_rank, 2, (*DENSE, *k1, *EVAL), STEPS, timeout=600)
    dedicated = run_distributed(run_rank, 4, (*DENSE, *k1, *DEDICATED, *EVAL), STEPS, timeout=600)
    again = run_distributed(run_rank, 4, (*DENSE, *k1, *DEDICATED), STEPS, timeout=600)
    # the control reads the same weights from a checkpoint (the trainers' sharded load, without the generators)
    build_model("qwen3", seed=0, vocab_size=64, max_position_embeddings=512).save_pretrained(tmp_path)
    control = run_distributed(run_rank, 4, (*DENSE, "rollout.max_staleness=0", *DEDICATED, *EVAL,
                                            f"model.pretrained_path={tmp_path}"), STEPS, timeout=600)

    _check_records(colocated, dedicated, 2, 1)  # generator g (rank 2 + g) holds colocated rank g's rows
    for t in (0, 1):  # held-out evaluation: trainer t decodes colocated rank t's problems with the same version
        got, want, ctl = dedicated[t], colocated[t], control[t]
        assert [len(e) for e in got["evaluations"]] == [3 - t] * 3  # steps 0 and 2, and after the last step
        assert _same(got["evaluations"], want["evaluations"]), f"trainer {t}: evaluation records differ"
        assert [_figures(m) for m in got["metrics"]] == [_figures(m) for m in want["metrics"]]
        assert [bool(_figures(m)) for m in got["metrics"]] == [True, False, True]
        assert _figures(got["final"]) == _figures(want["final"]) and got["final"]["eval_s"] > 0
        # the control: the same version 0 gives the same evaluation, versions 2 and 3 of another run others
        assert _same(ctl["evaluations"][:1], got["evaluations"][:1])
        assert not any(_same([c], [e]) for c, e in zip(ctl["evaluations"][1:], got["evaluations"][1:]))
        # evaluation changes no training: the run without it has the same metrics and weights, bit for bit
        strip = [{k: v for k, v in m.items() if not k.startswith("eval_") and not k.endswith(UNTIMED)}
                 for m in got["metrics"]]
        assert strip == [{k: v for k, v in m.items() if not k.endswith(UNTIMED)} for m in again[t]["metrics"]]
        assert all(torch.equal(v, again[t]["weights"][n]) for n, v in got["weights"].items())
        assert not again[t]["evaluations"] and not any(_figures(m) for m in again[t]["metrics"])
    figures = [_figures(m) for m in (dedicated[0]["metrics"][0], dedicated[0]["metrics"][2], dedicated[0]["final"])]
    controls = [_figures(m).get("eval_reward_mean") for m in (*control[0]["metrics"], control[0]["final"])]
    print("held-out eval_reward_mean before steps 0 and 2 and after step 2:", [f["eval_reward_mean"] for f in figures],
          "; the control's before steps 0-2 and after step 2:", controls)
    assert all(0 < f["eval_reward_mean"] < 1 for f in figures)  # a fractional reward: the figures carry information
    assert len({f["eval_reward_mean"] for f in figures}) > 1, figures  # and move with the policy
    for g in (0, 1):
        gen = dedicated[2 + g]["records"]
        assert _same(gen, again[2 + g]["records"]), f"generator {g}: two dedicated runs differ (one evaluates)"
        # the control: at max_staleness=0 rollout j uses version j, not j - 1: the same step 0 (version 0, the
        # checkpoint's weights pushed), other records after
        ctl = control[2 + g]["records"]
        assert _same(gen[:1], ctl[:1]) and not _same(gen[1:2], ctl[1:2])
        assert [int(s[0]["policy_version"]) for s in ctl] == [0, 1, 2]

    _check_training(colocated, dedicated)
    first = dedicated[0]["metrics"]  # measured on trainer 0: the push and both sides' waits
    full = sum(v.numel() * v.element_size() for v in dedicated[0]["weights"].values())
    tied = full - sum(v.numel() * v.element_size() for n, v in dedicated[0]["weights"].items() if "lm_head" in n)
    for m in first:
        assert m["weight_sync_bytes"] in (full, tied)  # one model's bytes a push (a tied head once)
        assert m["weight_sync_s"] > 0 and m["rollout_s"] >= 0
        assert m["generator_generate_s"] > 0 and m["generator_wait_s"] >= 0
    assert "generator_generate_s" not in dedicated[1]["metrics"][0]  # reported on trainer 0 only


@pytest.mark.slow
def test_one_generator_at_max_staleness_2_gives_the_colocated_records_bit_for_bit():
    """Dense, R = 1 generator beside T = 1 trainer, max_staleness=2, four steps (rollout 3 is the first
    with a pushed version, 1): the records of the colocated one-rank run; the control, a colocated
    max_staleness=1 run, has the same rollouts 0-1 (version 0) and others from rollout 2 (version 1).
    Both evaluate (eval.every=2): the one trainer (no trainers' group) gives the colocated rank's
    evaluation records and figures bit for bit (both with the policy itself at k = 2)."""
    k2 = (*DENSE, "rollout.max_staleness=2", *EVAL)
    colocated = run_distributed(run_rank, 1, k2, 4, timeout=600)
    dedicated = run_distributed(run_rank, 2, (*k2, "parallel.rollout_ranks=1"), 4, timeout=600)
    control = run_distributed(run_rank, 1, (*DENSE, "rollout.max_staleness=1"), 4, timeout=600)

    _check_records(colocated, dedicated, 1, 2)
    _check_training(colocated, dedicated)
    got, want = dedicated[0], colocated[0]
    assert [len(e) for e in got["evaluations"]] == [5] * 3 and _same(got["evaluations"], want["evaluations"])
    assert [_figures(m) for m in got["metrics"]] == [_figures(m) for m in want["metrics"]]
    assert [bool(_figures(m)) for m in got["metrics"]] == [True, False, True, False]
    assert _figures(got["final"]) == _figures(want["final"])
    gen, ctl = dedicated[1]["records"], control[0]["records"]
    assert _same(gen[:2], ctl[:2]) and not _same(gen[2:3], ctl[2:3])


@pytest.mark.slow
def test_moe_generators_record_the_colocated_routes_and_the_trainers_replay_them():
    """MoE (model=moe_tiny, routing replay): R = 2 generators beside T = 2 trainers at max_staleness=2
    (four steps) give the colocated dp = 2 run's records bit for bit, routes included; R = 1 beside
    T = 2 expert-parallel trainers (parallel.ep=2) at max_staleness=1 the colocated one-rank run's
    (bit for bit at version 0, within rounding after: `_check_records`). The trainers receive the
    routes, every forward of their policy replays them (as a colocated rank's does), and they train
    as the colocated ranks do. The control: the routes carry information (they differ between
    tokens, samples and steps), so equal routes are not vacuous."""
    k2 = (*MOE, "rollout.max_staleness=2")
    colocated = run_distributed(run_rank, 2, k2, 4, timeout=600)
    dedicated = run_distributed(run_rank, 4, (*k2, *DEDICATED), 4, timeout=600)
    k1 = (*MOE, "rollout.max_staleness=1")
    one = run_distributed(run_rank, 1, k1, STEPS, timeout=600)
    uneven = run_distributed(run_rank, 3, (*k1, "parallel.rollout_ranks=1", "parallel.ep=2"), STEPS, timeout=600)

    steps = _check_records(colocated, dedicated, 2, 2)
    _check_training(colocated, dedicated)
    _check_records(one, uneven, 1, 1)
    _check_training(one, uneven)
    for t in (0, 1):  # every forward of a trainer's policy replays the routes it received, as a colocated rank's
        assert dedicated[t]["replayed"] == colocated[t]["replayed"] and all(dedicated[t]["replayed"])
        assert uneven[t]["replayed"] and all(uneven[t]["replayed"])
    routes = [[r["routed_experts"] for r in records] for records in steps]
    for step in routes:  # [L = 2 MoE layers, top-k = 2, T tokens] a sample, every token routed
        assert all(r.shape[:2] == (2, 2) and r.min() >= 0 and r.max() < 8 for r in step)
        assert len({tuple(r[:, :, t].flatten().tolist()) for r in step for t in range(r.shape[-1])}) > 8
        assert len({tuple(r[:, :, -4:].flatten().tolist()) for r in step}) > 1  # the replies route apart
    assert not all(torch.equal(a[0], b[0]) for a, b in zip(routes, routes[1:]))  # the steps' prompts too


@pytest.mark.slow
def test_context_parallel_trainers_receive_the_colocated_cp_ranks_records_and_train_alike():
    """Dense, R = 1 generator beside T = 2 trainers with parallel.cp=2 (dp = 1), max_staleness=1, against
    the colocated dp = 1, cp = 2 run: both colocated CP peers generate the same samples, the generator
    those samples bit for bit (tokens, log-probs, rewards, versions) at every step (its trainers are the
    colocated mesh, so every pushed version is bit for bit), each CP trainer receives every sample of the
    step in the exchange as the colocated CP rank of its coordinate does, and the losses and final weights
    are the colocated ranks' within `TOL` (`_check_training`'s bound; the trainers run the colocated ranks'
    FSDP2 and CP collectives over the same two ranks on the same batches). The control, the dedicated run
    at max_staleness=0: the same step 0 (version 0) and its loss, other records at step 1 (version 1) and
    a loss `_check_training` tells apart. Both evaluate (eval.every=2): each CP trainer decodes every
    held-out problem (dp = 1), as each colocated CP rank does, with the same records and figures bit for bit."""
    k1 = (*DENSE, "parallel.cp=2", "rollout.max_staleness=1", *EVAL)
    colocated = run_distributed(run_rank, 2, k1, STEPS, timeout=900)
    dedicated = run_distributed(run_rank, 3, (*k1, "parallel.rollout_ranks=1"), STEPS, timeout=900)
    control = run_distributed(run_rank, 3, (*DENSE, "parallel.cp=2", "rollout.max_staleness=0",
                                            "parallel.rollout_ranks=1"), 2, timeout=900)

    assert _same(colocated[0]["records"], colocated[1]["records"])  # CP peers of DP rank 0: the same samples
    _check_records(colocated, dedicated, 1, 1, cp=2)
    for t in (0, 1):  # dp = 1: every sample to both CP trainers, as to both colocated CP ranks
        got, want = dedicated[t]["received"], colocated[t]["received"]
        assert len(got) == STEPS and all(len(step) == 16 and None not in step for step in got)
        assert _same(got, want), f"trainer {t}: received other samples than colocated CP rank {t}"
        got, want = dedicated[t], colocated[t]  # held-out evaluation: steps 0 and 2, and after the last
        assert [len(e) for e in got["evaluations"]] == [5] * 3 and _same(got["evaluations"], want["evaluations"])
        assert [_figures(m) for m in got["metrics"]] == [_figures(m) for m in want["metrics"]]
        assert _figures(got["final"]) == _figures(want["final"])
    _check_training(colocated, dedicated)
    gen, ctl = dedicated[2]["records"], control[2]["records"]
    assert _same(gen[:1], ctl[:1]) and not _same(gen[1:2], ctl[1:2])
    (m0, m1), (w0, w1) = control[0]["metrics"], colocated[0]["metrics"][:2]
    assert m0["loss"] == pytest.approx(w0["loss"], abs=TOL) and m1["loss"] != pytest.approx(w1["loss"], abs=TOL)


def run_sampling_rank(rank: int, world: int, overrides: tuple[str, ...], steps: int) -> dict:
    """`run_rank`, with every round this rank generates (`rounds`: (step, round, the records' fields), in the
    order `RolloutSource.records` ran them: the step's rollout, then dynamic sampling's extra rounds)."""
    from rl.rollout.source import RolloutSource

    generate, rounds = RolloutSource.records, []

    def keep(self, step, round_, version):
        records = generate(self, step, round_, version)
        rounds.append((step, round_, _fields(records)))
        return records

    RolloutSource.records = keep
    return {**run_rank(rank, world, overrides, steps), "rounds": rounds}


SAMPLING = ("algo.dynamic_sampling=true", "rollout.max_staleness=0")
COUNTS = ("sampling_rounds", "dropped_groups", "kept_groups")


@pytest.mark.slow
def test_dynamic_sampling_on_generators_rolls_out_the_colocated_rounds_and_trains_on_the_colocated_samples():
    """algo.dynamic_sampling (max_staleness=0: refused beside a rollout thread in either placement), dense,
    R = 2 generators beside T = 2 trainers against the colocated dp = 2 run: every generator generates the
    rounds colocated rank g generates (step by step, the step's rollout and each extra round) bit for bit,
    the trainers join each extra round's gather, and each receives in the exchange exactly the samples the
    colocated rank of its place receives (the kept groups, from every round); the counts
    (`sampling_rounds`, `dropped_groups`, `kept_groups`) are the colocated run's, with extra rounds at one
    step at least; the losses and final weights within `TOL` (`_check_training`). The control, the same
    dedicated run without dynamic sampling: the same first rollout (version 0), one round a step, and
    other samples received at every step that had extra rounds (step 0 among them)."""
    colocated = run_distributed(run_sampling_rank, 2, (*DENSE, *SAMPLING), STEPS, timeout=900)
    dedicated = run_distributed(run_sampling_rank, 4, (*DENSE, *SAMPLING, *DEDICATED), STEPS, timeout=900)
    control = run_distributed(run_sampling_rank, 4, (*DENSE, "rollout.max_staleness=0", *DEDICATED), STEPS,
                              timeout=900)

    counts = [{c: m[c] for c in COUNTS} for m in colocated[0]["metrics"]]
    extra = [s for s, c in enumerate(counts) if c["sampling_rounds"] > 1]
    # step 0 (3 rounds: the cap, 7 groups dropped) and step 2 (2 rounds) here; at step 0 the control's weights
    # are the same (version 0), so what it receives differs there by dynamic sampling alone
    assert extra and extra[0] == 0, f"step 0 rolled out no extra round: {counts}"
    for g in (0, 1):  # generator g (rank 2 + g): colocated rank g's rounds
        gen, col = dedicated[2 + g]["rounds"], colocated[g]["rounds"]
        assert [(s, r) for s, r, _ in gen] == [(s, r) for s, r, _ in col]
        assert [(s, r) for s, r, _ in gen] == [(s, r) for s, c in enumerate(counts)
                                               for r in range(c["sampling_rounds"])]
        assert _same([f for _, _, f in gen], [f for _, _, f in col]), f"generator {g}: other rounds than rank {g}'s"
        assert all(len(f) == 8 for _, _, f in gen)  # 2 prompts x 4 samples a round
        ctl = control[2 + g]["rounds"]
        assert [(s, r) for s, r, _ in ctl] == [(s, 0) for s in range(STEPS)] and _same([ctl[0][2]], [gen[0][2]])
    for t in (0, 1):  # the trainers: the colocated counts, and each the samples its colocated rank receives
        assert [{c: m[c] for c in COUNTS} for m in dedicated[t]["metrics"]] == counts
        got, want = dedicated[t]["received"], colocated[t]["received"]
        assert len(got) == STEPS and _same(got, want), f"trainer {t}: received other samples than colocated rank {t}"
        assert all(not _same([control[t]["received"][s]], [want[s]]) for s in extra)  # the control
        assert "sampling_rounds" not in control[t]["metrics"][0]
    _check_training(colocated, dedicated)


def run_logging_rank(rank: int, world: int, overrides: tuple[str, ...], steps: int) -> dict:
    """`run_rank`, with what each step logs: `rows`, the trainer's `samples` after its rollout stage, and
    `counts`, each rank's own tool / environment counts (`Rollouts.counts` of its scheduler: a
    colocated rank's or a generator's). In a colocated run every rank logs its first trainer.log_samples
    records (rank 1's rows: the control)."""
    from rl.rollout.scheduler import RolloutScheduler
    from rl.trainer.trainer import Trainer

    rollout, rollouts, rows, counts = Trainer.rollout, RolloutScheduler.rollouts, [], []
    colocated = not any(o.startswith("parallel.rollout_ranks=") for o in overrides)
    n = compose(*overrides, check=False).trainer.log_samples

    def keep_rows(self, step):
        got = rollout(self, step)
        rows.append(self.samples)
        return got

    def keep_counts(self, step, *, log_samples=0):
        got = rollouts(self, step, log_samples=n if colocated else log_samples)
        counts.append(dict(got.counts))
        return got

    Trainer.rollout, RolloutScheduler.rollouts = keep_rows, keep_counts
    return {**run_rank(rank, world, overrides, steps), "rows": rows, "counts": counts}


@pytest.mark.slow
def test_trainer_0_logs_colocated_rank_0s_samples_and_the_colocated_episode_counts(tiny_llama, tokenizer_dir):
    """A multi-turn task (task=arithmetic_retry: environment turns), R = 2 generators beside T = 2 trainers,
    max_staleness=1, trainer.log_samples=3, against the colocated dp = 2 run: at every step trainer 0 logs
    the rows colocated rank 0 logs (generator 0's first 3 records: text, turns, rewards, statuses, places,
    versions), trainer 1 none, and every trainer's counts (env_steps, env_answers_cut) are the colocated
    run's: both generators' counts summed. The controls: colocated rank 1's rows and another step's rows
    differ from what trainer 0 logs (beyond their places), and generator 1 counts turns of its own."""
    run = ("model=pretrained", f"model.pretrained_path={tiny_llama}", "model.dtype=float32", "task=arithmetic_retry",
           f"task.tokenizer_path={tokenizer_dir}", "task.prompts_per_step=2", "task.samples_per_prompt=4",
           "task.max_new_tokens=6", "trainer.progress=false", "trainer.lr=1e-3", "eval.every=0",
           "checkpoint.final=false", "rollout.max_staleness=1", "algo.tis_cap=2.0", "trainer.log_samples=3")
    colocated = run_distributed(run_logging_rank, 2, run, STEPS, timeout=900)
    dedicated = run_distributed(run_logging_rank, 4, (*run, *DEDICATED), STEPS, timeout=900)

    def content(rows):  # a row without its place in the run
        return [{k: v for k, v in r.items() if k not in ("step", "sample")} for r in rows]

    logged, want = dedicated[0]["rows"], colocated[0]["rows"]
    assert len(logged) == STEPS and logged == want
    assert all([(r["step"], r["sample"]) for r in rows] == [(s, 0), (s, 1), (s, 2)] for s, rows in enumerate(logged))
    assert all(isinstance(r["prompt"], str) and r["turns"][0]["reply"] for rows in logged for r in rows)
    assert any(r["turns_taken"] == 2 and "environment" in r["turns"][0] for rows in logged for r in rows)
    assert dedicated[1]["rows"] == [[]] * STEPS  # trainer 1 logs nothing, as colocated rank 1
    for s in range(STEPS):  # the controls: rank 1's rows, another step's
        assert content(logged[s]) != content(colocated[1]["rows"][s])
        assert content(logged[s]) != content(want[(s + 1) % STEPS])

    keys = ("env_steps", "env_answers_cut")
    for s in range(STEPS):
        counts = {k: colocated[0]["metrics"][s][k] for k in keys}
        assert counts["env_steps"] == colocated[0]["metrics"][s]["turns_mean"] * 8  # every reply answered
        for t in (0, 1):
            assert {k: dedicated[t]["metrics"][s][k] for k in keys} == counts, f"trainer {t} step {s}"
        gen = [dedicated[2 + g]["counts"][s] for g in (0, 1)]  # the sum of both generators' counts
        assert gen == [colocated[g]["counts"][s] for g in (0, 1)]
        assert {k: gen[0][k] + gen[1][k] for k in keys} == counts
    assert any(dedicated[3]["counts"][s]["env_steps"] for s in range(STEPS))  # the control: generator 1 counts


def test_a_push_sends_a_tied_weight_once_as_the_generators_receive_it_wherever_its_names_fall(monkeypatch):
    """One process, the push group a queue: what `WeightPush.load_weights` (trainer 0) sends is what
    `received_weights` (a generator, grouping tied names by `tensor_order`) receives, for the sync's
    stream (tied names together) and a stream whose tied names are apart; the control: that stream
    sent name by name (a tied weight skipped only right after its first name) leaves a broadcast over."""
    from types import SimpleNamespace

    from rl.rollout import dedicated
    from rl.rollout.sync import full_parameter_buckets, tensor_order

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 2, bias=False), torch.nn.Linear(2, 2), torch.nn.Linear(3, 2))
    model[2].weight = model[0].weight  # tied, its names apart in the state dict
    named = list(model.named_parameters(remove_duplicate=False))
    assert [n for n, _ in named] == ["0.weight", "1.weight", "1.bias", "2.weight", "2.bias"]
    trainer, generator = SimpleNamespace(rank=0, push_group=None), SimpleNamespace(rank=1, push_group=None)
    channel: list[torch.Tensor] = []
    receiving = [False]

    def broadcast(tensor, src, group):
        tensor.copy_(channel.pop(0)) if receiving[0] else channel.append(tensor.clone())

    def receive() -> dict[str, torch.Tensor]:
        receiving[0] = True
        try:
            return dict(dedicated.received_weights(tensor_order(model), generator, torch.device("cpu")))
        finally:
            receiving[0] = False

    monkeypatch.setattr(dedicated.dist, "broadcast", broadcast)
    distinct = sum(p.numel() * p.element_size() for p in model.parameters())
    for stream in (full_parameter_buckets(model, 24), iter(named)):
        push = dedicated.WeightPush(trainer, None)
        push.load_weights(stream)
        assert len(channel) == 4 and push.loaded_bytes == distinct
        received = receive()
        assert not channel and received.keys() == model.state_dict().keys()
        assert all(torch.equal(received[n], t) for n, t in model.state_dict().items())
        assert received["0.weight"] is received["2.weight"]
    other = dedicated.WeightPush(generator, None)  # a trainer beside trainer 0 counts the same bytes, sends nothing
    other.load_weights(iter(named))
    assert other.loaded_bytes == distinct and not channel
    for _, tensor in named:  # the control
        broadcast(tensor, 0, None)
    with pytest.raises(RuntimeError, match="size"):  # the tied weight [2, 3] sent again, received as 2.bias [2]
        receive()


def test_unsupported_combinations_are_refused_at_start_up_naming_their_keys():
    ok = compose(*DENSE, *DEDICATED, world_size=4)
    assert ok.parallel.rollout_ranks == 2 and compose(*MOE, *DEDICATED, "parallel.ep=2", world_size=4).parallel.ep == 2
    assert compose(*DENSE, *DEDICATED, "parallel.cp=2", world_size=6).parallel.cp == 2  # dp = 2 x cp = 2 trainers
    assert compose(*DENSE, *DEDICATED, "algo.dynamic_sampling=true", world_size=4).algo.dynamic_sampling
    assert compose(*DENSE, *DEDICATED, *EVAL, world_size=4).eval.every == 2  # the trainers evaluate (no refusal)
    for extra, world, match in [
        ((), 2, r"parallel\.rollout_ranks=2: expected an int in \[0, world_size=2\)"),
        (("task.prompts_per_step=3",), 4, r"task\.prompts_per_step=3 does not divide over parallel\.rollout_ranks=2"),
        # the sizes fill the trainers: the error says world_size is torchrun's ranks less the generators
        (("parallel.dp=4",), 4, r"4 != world_size=2 \(parallel\.dp=-1 fills it\); world_size: torchrun's 4 ranks "
                                r"less parallel\.rollout_ranks=2"),
        # dynamic sampling runs at max_staleness=0 (above), refused beside a rollout thread as colocated
        (("algo.dynamic_sampling=true", "rollout.max_staleness=1"), 4,
         r"rollout\.max_staleness=1 with algo\.dynamic_sampling=true: its extra rounds depend"),
    ]:
        with pytest.raises(ValueError, match=match):
            compose(*DENSE, *DEDICATED, *extra, world_size=world)


LORA = ("model.lora.rank=4", "rollout.max_staleness=1")


def run_lora_rank(rank: int, world: int, overrides: tuple[str, ...], steps: int, stale_adapters: bool) -> dict:
    """`run_rank`, with the bytes of each push the trainers send (`pushes`: version 0 at build, then one a
    step). `stale_adapters`, the control: every push sends the adapters of version 0 again (a push that
    skips the update; the same bytes)."""
    from model.lora import is_adapter
    from rl.rollout.dedicated import WeightPush

    load, first, pushes = WeightPush.load_weights, {}, []

    def push(self, weights):
        if stale_adapters:
            weights = ((n, first.setdefault(n, t.clone()) if is_adapter(n) else t) for n, t in weights)
        load(self, weights)
        pushes.append(self.loaded_bytes)

    WeightPush.load_weights = push
    return {**run_rank(rank, world, overrides, steps), "pushes": pushes}


@pytest.mark.slow
def test_lora_on_dedicated_generators_gives_the_colocated_records_and_pushes_the_adapters_only():
    """LoRA rank 4 on the tiny dense model, R = 2 generators, T = 2 trainers, k = 1: every step's records
    are the colocated dp = 2 LoRA run's bit for bit; the first push (version 0, at build) sends the full
    model (base + adapters), each later one the adapters only (the colocated engine's `weight_sync_bytes`).
    The control pushes version 0's adapters every step: the same records at steps 0 and 1 (version 0),
    others from step 2 (version 1)."""
    from model.lora import adapter_bytes
    from rl.rollout.sync import full_tensor_bytes
    from rl.trainer.build import ModelBuilder

    colocated = run_distributed(run_lora_rank, 2, (*DENSE, *LORA), STEPS, False, timeout=600)
    dedicated = run_distributed(run_lora_rank, 4, (*DENSE, *LORA, *DEDICATED), STEPS, False, timeout=600)
    control = run_distributed(run_lora_rank, 4, (*DENSE, *LORA, *DEDICATED), STEPS, True, timeout=600)
    lm = ModelBuilder(compose(*DENSE, *LORA, *DEDICATED, world_size=4), None).policy_lm("meta")
    full, adapters = sum(full_tensor_bytes(lm).values()), adapter_bytes(lm)  # 361,984 and 32,768 bytes (0.091)

    _check_records(colocated, dedicated, 2, 1)  # generator g (rank 2 + g) holds colocated rank g's rows
    for g in (0, 1):
        col, ctl = colocated[g]["records"], control[2 + g]["records"]
        assert _same(ctl[:2], col[:2]) and not _same(ctl[2:], col[2:]), f"generator {g}: the control"
    _check_training(colocated, dedicated)
    for t in (0, 1):  # every trainer runs the push (the gathers); trainer 0 broadcasts: the full model, then adapters
        assert dedicated[t]["pushes"] == control[t]["pushes"] == [full] + [adapters] * STEPS
    assert 0 < adapters < full / 10
    for m, w in zip(dedicated[0]["metrics"], colocated[0]["metrics"]):  # the bytes a step's push sends
        assert m["weight_sync_bytes"] == w["weight_sync_bytes"] == adapters


@pytest.mark.slow
def test_train_py_runs_one_trainer_and_one_generator_and_a_generators_stop_signal_stops_every_rank(tmp_path):
    """torchrun 2 ranks, parallel.rollout_ranks=1 (one trainer: no trainers' collectives): train.py
    runs the generator's loop on rank 1; a SIGTERM to the generator as it starts rollout 3 (the fault
    hook, tests/fault/sitecustomize.py) stops both ranks after the same step, each writing its part of
    the checkpoint (tests/test_dedicated_resume.py resumes them); samples.jsonl holds each step's first
    trainer.log_samples=2 episodes, the generator's, written by trainer 0."""
    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "train.py",
           f"hydra.run.dir={out}", *DENSE, "parallel.rollout_ranks=1", "rollout.max_staleness=1",
           "trainer.max_steps=8", "trainer.plot=false", "trainer.log_samples=2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore",
           "PYTHONPATH": os.pathsep.join([str(root / "tests" / "fault"), str(root)]),
           "RL_TEST_KILL": "in_rollout:3:1", "RL_TEST_SIGNAL": "TERM"}
    done = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    log = (out / "train.log").read_text()
    assert "dp=1 cp=1 ep=1 rollout_ranks=1" in log
    stopped = re.search(r"a stop signal on another rank: stopped after (\d+) of 8 steps with the checkpoint (\S+);",
                        log)
    assert stopped, log[-2000:]
    saved = Path(stopped[2])
    assert saved == out / "checkpoints" / f"step_{int(stopped[1]):08d}"
    assert {"COMPLETE", "__0_0.distcp", "__1_0.distcp"} <= {p.name for p in saved.iterdir()}  # the generator's part
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert 3 <= int(stopped[1]) < 8 and [m["step"] for m in steps] == list(range(int(stopped[1])))
    assert all(m["rollout_staleness_max"] == (1.0 if m["step"] else 0.0) for m in steps)
    assert all(m["weight_sync_bytes"] > 0 and "generator_wait_s" in m for m in steps)
    rows = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert [(r["step"], r["sample"], r["policy_version"]) for r in rows] == [
        (m["step"], k, max(0, m["step"] - 1)) for m in steps for k in range(2)]
    assert all(r["prompt_ids"] and r["turns"][0]["reply_ids"] for r in rows)
    assert [p.name for p in (out / "checkpoints").iterdir()] == [saved.name]  # checkpoint.final=false: that one
