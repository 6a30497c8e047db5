"""On-policy distillation on dedicated rollout ranks (`parallel.rollout_ranks`, rl/rollout/dedicated.py;
`algo.teacher.path`, rl/algos/distill.py). The generators only sample; the teacher lives on the trainers
(their FSDP2 shards over the trainers' mesh, its self-test's verdict shared over the trainers' group) and
scores the received samples in their score stage, as a colocated rank's teacher scores its own. Against
the colocated dp = R run with the same teacher and max_staleness: the records bit for bit, the
distillation figures, losses and final weights within the dedicated tests' tolerance; the control, the
colocated run with another teacher, tells each of those comparisons apart."""

import pytest
import torch
from test_dedicated import DENSE, STEPS, TOL, _check_records, _check_training, _same, run_rank
from test_distill import checkpoint
from testing.distributed import run_distributed
from testing.inprocess import compose

from model.models import build_model

# the sampled tokens' signal and the teacher's top-k reverse KL, read in the same forward
DISTILL = ("algo.advantage=distill", "algo.distill_kl=topk", "algo.distill_topk=8", "rollout.max_staleness=1")
FIGURES = ("distill_reverse_kl", "teacher_log_prob", "distill_argmax_agreement", "distill_topk_kl",
           "distill_topk_kl_zero")


def run_distill_rank(rank: int, world: int, overrides: tuple[str, ...], steps: int) -> dict:
    """`run_rank` (tests/test_dedicated.py), with each teacher this rank builds as its self-test gets it
    (before any forward: FSDP2 keeps the root's parameters gathered after a forward no backward follows):
    the ranks of the meshes its parameters are sharded over, whether all are and none takes gradients, and
    the self-test's difference (every trainer's: the verdict shared over the trainers)."""
    from torch.distributed.tensor import DTensor

    from rl.algos import distill

    test, teachers = distill.self_test, []

    def tested(teacher, *args, **kwargs):
        params = list(teacher.parameters())
        teachers.append({"meshes": {tuple(p.device_mesh.mesh.flatten().tolist()) for p in params
                                    if isinstance(p, DTensor)},
                         "sharded": all(isinstance(p, DTensor) for p in params),
                         "frozen": not any(p.requires_grad for p in params),
                         "verdict": test(teacher, *args, **kwargs)})
        return teachers[-1]["verdict"]

    distill.self_test = tested
    return {**run_rank(rank, world, overrides, steps), "teachers": teachers}


def test_a_teacher_on_dedicated_rollout_ranks_passes_the_start_up_checks(tmp_path):
    """The refusal is lifted: a distillation config with generators validates (the teacher's keys,
    family, vocabulary and tokenizer checked as colocated), and its checks still refuse a bad teacher."""
    teacher = checkpoint(tmp_path / "t", "qwen3", seed=1)
    cfg = compose(*DENSE, *DISTILL, f"algo.teacher.path={teacher}", "parallel.rollout_ranks=2", world_size=4)
    assert cfg.parallel.rollout_ranks == 2 and cfg.algo.teacher.path == teacher
    other = tmp_path / "v"
    build_model("qwen3", seed=1, vocab_size=96).save_pretrained(other)
    with pytest.raises(ValueError, match=r"has vocab_size=96 \(its config.json\), the student 64"):
        compose(*DENSE, *DISTILL, f"algo.teacher.path={other}", "parallel.rollout_ranks=2", world_size=4)


@pytest.mark.slow
def test_distillation_on_dedicated_generators_gives_the_colocated_records_figures_and_training(tmp_path):
    """Dense, R = 2 generators beside T = 2 trainers, max_staleness=1, algo.advantage=distill with the
    top-k reverse KL term, a teacher other than the student (the tiny dense model of seed 1): the
    generators build no teacher; each trainer builds it frozen, sharded over the trainers' mesh
    (ranks 0, 1: the colocated run's), self-tested with one verdict on both; every step's records are the
    colocated dp = 2 run's bit for bit, its distillation figures, losses and the final weights within
    `TOL` (tests/test_dedicated.py). The control, the colocated run with the tiny model of seed 2 as
    teacher: the same rollouts 0 and 1 (version 0), others at rollout 2 (version 1 learnt from another
    teacher), step 0's figures and loss apart by more than `TOL`, and other final weights."""
    teacher, other = checkpoint(tmp_path / "t", "qwen3", seed=1), checkpoint(tmp_path / "o", "qwen3", seed=2)
    run = (*DENSE, *DISTILL, f"algo.teacher.path={teacher}")
    colocated = run_distributed(run_distill_rank, 2, run, STEPS, timeout=900)
    dedicated = run_distributed(run_distill_rank, 4, (*run, "parallel.rollout_ranks=2"), STEPS, timeout=900)
    control = run_distributed(run_distill_rank, 2, (*DENSE, *DISTILL, f"algo.teacher.path={other}"), STEPS,
                              timeout=900)

    trainers, generators = dedicated[:2], dedicated[2:]
    assert all(not g["teachers"] for g in generators)  # they only sample: no teacher built
    for t in (*trainers, *colocated):  # one teacher a trainer, sharded over ranks 0 and 1, self-tested in fp32
        (built,) = t["teachers"]
        assert built["meshes"] == {(0, 1)} and built["sharded"] and built["frozen"] and 0 < built["verdict"] <= 1e-3
    assert trainers[0]["teachers"] == trainers[1]["teachers"] == colocated[0]["teachers"]

    _check_records(colocated, dedicated, 2, 1)  # generator g (rank 2 + g) holds colocated rank g's rows, bit for bit
    _check_training(colocated, dedicated)  # losses, rewards, tokens within TOL; final weights within TOL
    for got, want in zip(trainers, colocated):
        for m, w in zip(got["metrics"], want["metrics"], strict=True):
            assert all(m[f] == pytest.approx(w[f], abs=TOL) for f in FIGURES), (m, w)
    first = trainers[0]["metrics"][0]
    assert first["distill_reverse_kl"] > 0 and first["teacher_log_prob"] < 0 and first["distill_topk_kl"] > 0
    assert 0 <= first["distill_argmax_agreement"] < 1

    # the control: another teacher, the same sampling up to version 0, then other records and training
    for g in (0, 1):
        col, ctl = colocated[g]["records"], control[g]["records"]
        assert _same(ctl[:2], col[:2]) and not _same(ctl[2:], col[2:]), f"rank {g}: the control"
    m, c = trainers[0]["metrics"][0], control[0]["metrics"][0]
    assert all(abs(m[f] - c[f]) > TOL for f in ("distill_reverse_kl", "teacher_log_prob", "distill_topk_kl",
                                                 "loss")), (m, c)
    with pytest.raises(AssertionError):
        _check_training(control, dedicated)
    assert max(float((trainers[0]["weights"][n] - v).abs().max()) for n, v in control[0]["weights"].items()) > TOL
