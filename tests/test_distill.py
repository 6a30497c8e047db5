"""On-policy distillation (rl/algos/distill.py, `algo.advantage=distill`, `algo.distill_coef`).

The estimator's values, and its expected gradient against the exact reverse-KL gradient by
enumerating every response of a tiny tabular model; the start-up refusals (keys, vocabulary,
tokenizer files) before any model is built; the teacher's self-test; and one-process trainer
steps: teacher == student gives zero advantages and no update (a different teacher: both
non-zero), packed == padded, a LoRA student (no reference copy), an MoE student with a dense
teacher and the other way round.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from model.models import build_model
from packing import Experience
from rl.algos.advantages import compute_advantages
from rl.algos.losses import policy_loss
from rl.config import AlgoConfig
from testing.inprocess import SMALL, compose, trainer, weights

VOCAB = 64  # conf/model/{moe,dense}_tiny.yaml's vocab_size


def checkpoint(folder, family: str, seed: int, **overrides) -> str:
    """A tiny random `family` checkpoint as the run's tiny model of that seed (save_pretrained)."""
    build_model(family, seed=seed, vocab_size=VOCAB, max_position_embeddings=512, **overrides).save_pretrained(folder)
    return str(folder)


# ------------------------------------------------------------------ the estimator
def _record(student: list[float], teacher: list[float], reward: float = 0.0, prompt: int = 0) -> Experience:
    n = len(student)
    return Experience(sequences=torch.arange(n + 2), action_mask=torch.tensor([False] + [True] * n),
                      action_log_probs=torch.tensor([0.0] + student), rewards=torch.tensor(reward),
                      teacher_action_log_probs=torch.tensor([0.0] + teacher), prompt_index=torch.tensor(prompt))


def test_distill_advantages_are_the_negative_log_ratio_discounted_into_a_return_to_go():
    rec = _record([-1.0, -2.0, -0.5], [-1.5, -1.0, -0.5])
    compute_advantages([rec], "distill")
    r = [-(s - t) for s, t in zip([-1.0, -2.0, -0.5], [-1.5, -1.0, -0.5])]
    assert rec.advantages.tolist() == [0.0, *r]  # the prompt slot 0; unwhitened (distill's default)
    compute_advantages([rec], "distill", distill_discount=0.5)
    want = [r[0] + 0.5 * r[1] + 0.25 * r[2], r[1] + 0.5 * r[2], r[2]]
    assert torch.allclose(rec.advantages, torch.tensor([0.0, *want]))
    same = _record([-1.0, -2.0], [-1.0, -2.0])  # teacher == student: zero, exactly
    compute_advantages([same], "distill", distill_discount=1.0)
    assert same.advantages.abs().max() == 0.0


def test_distill_coef_adds_the_signal_to_the_task_estimator_and_a_record_without_teacher_is_named():
    recs = [_record([-1.0, -2.0], [-1.5, -1.0], reward=float(i), prompt=0) for i in range(2)]
    compute_advantages(recs, "grpo")
    grpo = [r.advantages.clone() for r in recs]
    compute_advantages(recs, "grpo", distill_coef=0.5)
    for r, g in zip(recs, grpo):
        assert torch.allclose(r.advantages, g + 0.5 * torch.tensor([0.0, -0.5, 1.0]))
    bare = _record([-1.0], [-1.0])
    bare.teacher_action_log_probs = None
    with pytest.raises(ValueError, match="needs 'teacher_action_log_probs' on every item: record 1"):
        compute_advantages([recs[0], bare], "distill")


def test_expected_gradient_equals_the_analytic_reverse_kl_gradient_by_enumeration():
    """A tabular student p_s(y1) p_s(y2 | y1) over a vocabulary of 8, responses of 2 tokens:
    sum over all 64 responses of p_s(y) x the gradient of the PPO loss on the distill
    advantages (discount 1) equals the gradient of KL(p_s || p_t) exactly; the per-token
    signal (discount 0) is a different (biased) direction: the control."""
    v = 8
    gen = torch.Generator().manual_seed(0)
    theta1 = torch.randn(v, generator=gen, dtype=torch.float64).requires_grad_()
    theta2 = torch.randn(v, v, generator=gen, dtype=torch.float64).requires_grad_()
    t1, t2 = torch.randn(v, generator=gen).double().log_softmax(-1), torch.randn(v, v, generator=gen).double().log_softmax(-1)

    def student(y):  # [2] per-token log-probs of response y
        return torch.stack([theta1.log_softmax(-1)[y[0]], theta2[y[0]].log_softmax(-1)[y[1]]])

    responses = list(itertools.product(range(v), repeat=2))
    kl = sum(student(y).sum().exp() * (student(y).sum() - (t1[y[0]] + t2[y[0], y[1]])) for y in responses)
    exact = torch.autograd.grad(kl, (theta1, theta2))

    def expected(discount: float):
        records = []
        for y in responses:
            s = student(y).detach().float().tolist()
            records.append(_record(s, [float(t1[y[0]]), float(t2[y[0], y[1]])]))
        compute_advantages(records, "distill", distill_discount=discount)
        algo = AlgoConfig()
        total = 0.0
        for y, rec in zip(responses, records):
            lp = torch.cat([torch.zeros(1, dtype=torch.float64), student(y)])
            rec.action_log_probs = rec.action_log_probs.double()
            loss, _ = policy_loss(lp, rec, algo)  # the PPO clipped surrogate at ratio 1: -A grad log p
            total = total + lp[1:].detach().sum().exp() * loss.sum()
        return torch.autograd.grad(total, (theta1, theta2))

    got = expected(1.0)
    for g, e in zip(got, exact):
        assert torch.allclose(g, e, atol=1e-6, rtol=1e-5), (g - e).abs().max()
    biased = expected(0.0)
    assert max(float((b - e).abs().max()) for b, e in zip(biased, exact)) > 1e-2


def test_the_chunked_head_returns_each_rows_argmax_without_a_full_logits_tensor():
    from model.logprobs import token_log_probs

    gen = torch.Generator().manual_seed(0)
    hidden, weight = torch.randn(2, 7, 16, generator=gen), torch.randn(50, 16, generator=gen)
    targets = torch.randint(0, 50, (2, 7), generator=gen)
    full = hidden @ weight.T
    budget = 3 * 4 * 50  # 3 rows a chunk: 5 chunks, the argmax read per chunk
    lp, ent, top = token_log_probs(hidden, weight, targets, chunk_bytes=budget, return_entropy=True, return_argmax=True)
    assert torch.equal(top, full.argmax(-1).float()) and top.shape == targets.shape
    assert torch.allclose(lp, full.log_softmax(-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1), atol=1e-5)
    assert torch.equal(token_log_probs(hidden, weight, targets, chunk_bytes=budget), lp)  # one output: as before
    with pytest.raises(ValueError, match="return_argmax and return_topk are scoring reads; call it without grad"):
        token_log_probs(hidden.requires_grad_(), weight, targets, return_argmax=True)


# ------------------------------------------------------------------ the exact top-k reverse KL
def _head(n=7, v=8, h=16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=gen, dtype=torch.float64).float().requires_grad_()
    weight = torch.randn(v, h, generator=gen).requires_grad_()
    teacher = torch.randn(n, v, generator=gen).log_softmax(-1)
    return hidden, weight, teacher, torch.randint(0, v, (n,), generator=gen), torch.rand(n, generator=gen)


def _exact_topk_kl(hidden, weight, teacher, k: int, w, chunk_bytes: int):
    """The head's (model/logprobs.py) top-k reverse KL, sum_i w_i KL_i, and its gradients."""
    from model.logprobs import token_log_probs, topk_reverse_kl

    t_lp, ids = teacher.topk(k, dim=-1)
    targets = torch.zeros(hidden.shape[0], dtype=torch.long)
    _, student = token_log_probs(hidden, weight, targets, chunk_bytes=chunk_bytes, extra_targets=ids)
    kl = topk_reverse_kl(student, t_lp)
    return kl.detach(), torch.autograd.grad((w * kl).sum(), (hidden, weight))


def test_the_full_vocabulary_reverse_kl_and_its_gradient_equal_the_analytic_ones_by_enumeration():
    """k = the vocabulary (8): per token KL(p_s || p_t) = sum over every v of p_s (log p_s - log p_t)
    from the full logits, its gradient in the logits the closed form p_s (log p_s - log p_t - KL);
    the chunked head (2 rows a chunk: 4 chunks) gives both. Top-k (k = 4) equals the same sums
    over the teacher's 4 ids renormalized, and is not the full KL (the control)."""
    hidden, weight, teacher, _, w = _head()
    z = hidden.detach() @ weight.detach().T
    lp = z.log_softmax(-1)
    full = (lp.exp() * (lp - teacher)).sum(-1)
    grad_z = w[:, None] * lp.exp() * (lp - teacher - full[:, None])  # the analytic gradient, no autograd
    kl, (g_h, g_w) = _exact_topk_kl(hidden, weight, teacher, 8, w, chunk_bytes=2 * 4 * 8)
    assert torch.allclose(kl, full, atol=1e-6)
    assert torch.allclose(g_h, grad_z @ weight.detach(), atol=1e-5)
    assert torch.allclose(g_w, grad_z.T @ hidden.detach(), atol=1e-5)
    ids = teacher.topk(4, dim=-1).indices
    qs, qt = z.gather(-1, ids).log_softmax(-1), teacher.gather(-1, ids).log_softmax(-1)
    want = (qs.exp() * (qs - qt)).sum(-1)
    grad_z4 = torch.zeros_like(z).scatter_(-1, ids, w[:, None] * qs.exp() * (qs - qt - want[:, None]))
    kl4, (g_h4, g_w4) = _exact_topk_kl(hidden, weight, teacher, 4, w, chunk_bytes=2 * 4 * 8)
    assert torch.allclose(kl4, want, atol=1e-6) and torch.allclose(g_h4, grad_z4 @ weight.detach(), atol=1e-5)
    assert torch.allclose(g_w4, grad_z4.T @ hidden.detach(), atol=1e-5)
    assert (kl4 - full).abs().max() > 1e-2 and (g_h4 - g_h).abs().max() > 1e-3  # the control: top-4 is not full
    same, _ = _exact_topk_kl(hidden, weight, lp, 8, w, chunk_bytes=2 * 4 * 8)  # teacher == student: ~0
    assert same.abs().max() < 1e-6


def test_extra_targets_log_probs_and_gradient_equal_autograd_through_the_full_logits():
    """The head's log-probs of k given ids per row, beside the target's, and their gradient in
    one backward (one chunk: the kept buffer; 2 rows a chunk: recomputed), against autograd
    through `log_softmax(hidden @ W^T)`; the entropy's term with them. Control: the extra
    ids' softmax term left out of the gradient (a wrong head) fails the comparison."""
    import model.logprobs as logprobs

    hidden, weight, _, targets, w = _head(v=12)
    ids = torch.randint(0, 12, (7, 3), generator=torch.Generator().manual_seed(1))
    u = torch.randn(7, 3, generator=torch.Generator().manual_seed(2))
    full = (hidden @ weight.T).log_softmax(-1)
    ent = -(full.exp() * full).sum(-1)
    ref = (w * full.gather(-1, targets[:, None])[:, 0]).sum() + (u * full.gather(-1, ids)).sum() + 0.5 * ent.sum()
    want = torch.autograd.grad(ref, (hidden, weight))

    def ours(chunk_bytes):
        lp, h, extra = logprobs.token_log_probs(hidden, weight, targets, chunk_bytes=chunk_bytes, return_entropy=True,
                                                extra_targets=ids)
        assert torch.allclose(extra, full.gather(-1, ids), atol=1e-6)
        return torch.autograd.grad((w * lp).sum() + (u * extra).sum() + 0.5 * h.sum(), (hidden, weight))

    for budget in (2**20, 2 * 4 * 12):
        for g, e in zip(ours(budget), want):
            assert torch.allclose(g, e, atol=1e-5), (budget, (g - e).abs().max())
    real = logprobs._grad_logits_

    def broken(logp, targets, g_lp, g_h, entropy, g_x=None):
        grad = real(logp, targets, g_lp, g_h, entropy, None)
        return grad.scatter_add_(-1, g_x[0], g_x[1]) if g_x is not None else grad

    logprobs._grad_logits_ = broken
    try:
        assert not torch.allclose(ours(2**20)[0], want[0], atol=1e-3)
    finally:
        logprobs._grad_logits_ = real


def test_the_topk_reverse_kl_never_holds_a_tokens_by_vocabulary_tensor():
    """Every tensor allocated by the teacher's top-k read and by the student's extra-target
    forward and backward (a TorchDispatchMode sees each op's outputs), with 4 rows a chunk of
    64 tokens: none reaches [tokens, vocab]; the control (one chunk) does."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from model.logprobs import token_log_probs, topk_reverse_kl

    class Largest(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.numel = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor):
                    self.numel = max(self.numel, t.numel())
            return out

    n, v, h = 64, 200, 16
    hidden, weight, _, _, w = _head(n=n, v=v, h=h)
    targets = torch.zeros(n, dtype=torch.long)

    def largest(chunk_bytes):
        with Largest() as seen:
            with torch.no_grad():
                _, t_lp, ids = token_log_probs(hidden, weight.detach() * 0.5, targets, chunk_bytes=chunk_bytes,
                                               return_topk=5)
            _, s_lp = token_log_probs(hidden, weight, targets, chunk_bytes=chunk_bytes, extra_targets=ids)
            (w * topk_reverse_kl(s_lp, t_lp)).sum().backward()
        return seen.numel

    assert largest(4 * 4 * v) <= max(4 * v, n * h, v * h) < n * v  # a chunk [4, V], the gradients [N, H], [V, H]
    assert largest(2**20) >= n * v  # the control: one chunk holds [tokens, vocab]


# ------------------------------------------------------------------ start-up refusals
def test_the_keys_must_agree(tmp_path):
    teacher = checkpoint(tmp_path / "t", "qwen3_moe", seed=0)
    with pytest.raises(ValueError, match=r"algo.advantage=distill needs a teacher: set algo.teacher.path"):
        compose("algo.advantage=distill")
    with pytest.raises(ValueError, match=r"algo.distill_coef=0.5 needs a teacher"):
        compose("algo.distill_coef=0.5")
    with pytest.raises(ValueError, match=r"nothing reads the teacher"):
        compose(f"algo.teacher.path={teacher}")
    with pytest.raises(ValueError, match=r"distill is the signal alone"):
        compose("algo.advantage=distill", "algo.distill_coef=0.5", f"algo.teacher.path={teacher}")
    with pytest.raises(ValueError, match=r"algo.distill_discount=2.0: expected in \[0, 1\]"):
        compose("algo.advantage=distill", "algo.distill_discount=2.0", f"algo.teacher.path={teacher}")
    with pytest.raises(ValueError, match=r"algo.teacher.path='/nonexistent': folder not found"):
        compose("algo.advantage=distill", "algo.teacher.path=/nonexistent")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"algo.teacher.path='.*empty': no config.json"):
        compose("algo.advantage=distill", f"algo.teacher.path={tmp_path / 'empty'}")
    compose("algo.advantage=distill", f"algo.teacher.path={teacher}")  # the control: accepted
    with pytest.raises(ValueError, match=r"algo.distill_kl=topk needs a teacher"):
        compose("algo.distill_kl=topk")
    topk = ("algo.distill_kl=topk", f"algo.teacher.path={teacher}")
    with pytest.raises(ValueError, match=r"algo.distill_topk=1: expected >= 2 \(over one token both renormalized"):
        compose(*topk, "algo.distill_topk=1")
    with pytest.raises(ValueError, match=r"algo.distill_topk=65: above the vocabulary's 64 tokens"):
        compose(*topk, "algo.distill_topk=65")
    compose(*topk, "algo.distill_topk=64")  # the control: k = the vocabulary, the full KL; topk alone reads it
    six = checkpoint(tmp_path / "six", "qwen3_moe", seed=0, num_experts=6)
    with pytest.raises(ValueError, match=r"parallel.ep=4 does not divide the teacher's num_experts=6 "
                                         r"\(algo.teacher.path='.*six'\): each EP rank holds num_experts / ep"):
        compose("algo.advantage=distill", f"algo.teacher.path={six}", "parallel.ep=4", world_size=4)
    compose("algo.advantage=distill", f"algo.teacher.path={teacher}", "parallel.ep=4", world_size=4)  # 8 experts


def test_a_different_vocabulary_is_refused_naming_both_sizes(tmp_path):
    build_model("qwen3", seed=0, vocab_size=96).save_pretrained(tmp_path / "t")
    with pytest.raises(ValueError, match=r"algo.teacher.path='.*' has vocab_size=96 \(its config.json\), the "
                                         r"student 64 \(model.overrides.vocab_size\)"):
        compose("algo.advantage=distill", f"algo.teacher.path={tmp_path / 't'}")


def _tokenizer(folder, tokens: str, template: str | None, eos: str = "</s>") -> None:
    (folder / "tokenizer.json").write_text(f'{{"model": {{"vocab": "{tokens}"}}}}')
    config = {"eos_token": eos, **({"chat_template": template} if template is not None else {})}
    import json

    (folder / "tokenizer_config.json").write_text(json.dumps(config))


def test_a_different_tokenizer_is_refused_naming_each_file_that_differs(tmp_path, monkeypatch):
    student = checkpoint(tmp_path / "s", "qwen3", seed=0)
    teacher = checkpoint(tmp_path / "t", "qwen3", seed=1)
    _tokenizer(tmp_path / "s", "abc", "{{ messages }}")
    _tokenizer(tmp_path / "t", "abc", "{{ messages }}")
    run = ("model=pretrained", f"model.pretrained_path={student}", "model.name=null", "algo.advantage=distill",
           f"algo.teacher.path={teacher}")
    import model.models as models

    def no_model(*a, **k):
        raise AssertionError("a model was built before the refusal")

    monkeypatch.setattr(models, "build_model", no_model)
    compose(*run)  # the control: the same tokenizer files
    _tokenizer(tmp_path / "t", "abd", "{{ messages }}!", eos="<|end|>")
    with pytest.raises(ValueError) as e:
        compose(*run)
    message = str(e.value)
    assert "its tokenizer differs from the student's" in message and str(student) in message
    for item in ("chat template (sha256", "special tokens (sha256", "tokenizer.json (sha256"):
        assert item in message, message
    (tmp_path / "t" / "tokenizer.json").unlink()
    _tokenizer(tmp_path / "t", "abc", "{{ messages }}")
    (tmp_path / "t" / "tokenizer.json").unlink()
    with pytest.raises(ValueError, match=r"tokenizer.json \(only in the student\)"):
        compose(*run)


def test_each_tokenizer_file_is_hashed_once_per_version(tmp_path, monkeypatch):
    """train.py validates twice (the command line, then the run): the student's and the teacher's
    tokenizer.json are each read once. Control: a file written again (another size) is read again and
    its new hash refused."""
    from pathlib import Path

    student, teacher = checkpoint(tmp_path / "s", "qwen3", seed=0), checkpoint(tmp_path / "t", "qwen3", seed=1)
    _tokenizer(tmp_path / "s", "abc", None)
    _tokenizer(tmp_path / "t", "abc", None)
    reads, read_text = [], Path.read_text
    monkeypatch.setattr(Path, "read_text", lambda self, *a, **k: (
        reads.append(self.parent.name) if self.name == "tokenizer.json" else None, read_text(self, *a, **k))[1])
    run = ("model=pretrained", f"model.pretrained_path={student}", "model.name=null", "algo.advantage=distill",
           f"algo.teacher.path={teacher}")
    compose(*run)
    compose(*run)
    assert sorted(reads) == ["s", "t"], reads
    _tokenizer(tmp_path / "t", "abcd", None)
    with pytest.raises(ValueError, match=r"tokenizer.json \(sha256"):
        compose(*run)
    assert sorted(reads) == ["s", "t", "t"], reads


def test_a_tokenizer_saved_again_is_the_same_and_one_more_token_is_not(tmp_path):
    """The export's round trip (AutoTokenizer.from_pretrained(...).save_pretrained, with a
    padding setting on) keeps every hash; one added token changes tokenizer.json's."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    from rl.algos.distill import tokenizer_differences, tokenizer_fingerprint

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator([f"{a} plus {a + 1} is {2 * a + 1}" for a in range(50)],
                            trainers.BpeTrainer(vocab_size=80, special_tokens=["<unk>", "<eos>"]))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", unk_token="<unk>")
    fast.chat_template = "{% for m in messages %}{{ m.content }}{% endfor %}"
    fast.save_pretrained(tmp_path / "a")
    again = AutoTokenizer.from_pretrained(tmp_path / "a", local_files_only=True)
    again._tokenizer.enable_padding(length=12)  # a runtime setting tokenizer.json records
    again.save_pretrained(tmp_path / "b")
    assert (tmp_path / "a" / "tokenizer.json").read_bytes() != (tmp_path / "b" / "tokenizer.json").read_bytes()
    assert {"tokenizer.json", "special tokens", "chat template"} <= set(tokenizer_fingerprint(tmp_path / "a"))
    assert tokenizer_differences(tokenizer_fingerprint(tmp_path / "a"), tokenizer_fingerprint(tmp_path / "b")) == []
    again.add_tokens(["<extra>"])
    again.save_pretrained(tmp_path / "c")
    differ = tokenizer_differences(tokenizer_fingerprint(tmp_path / "a"), tokenizer_fingerprint(tmp_path / "c"))
    assert any(d.startswith("tokenizer.json (sha256") for d in differ)


def test_a_teachers_topk_of_other_rows_is_refused_naming_both_shapes():
    """The student's forward reads the teacher's top-k ids row by row: ids from another batch's forward
    are refused by the head (model/logprobs.py, `extra_targets`), naming the field, the shape seen and the
    one expected. Control: the teacher's top-k of the same batch is read."""
    from model.actor import Actor
    from packing import make_experience_batch

    actor = Actor(build_model("qwen3", seed=0, vocab_size=VOCAB), actions_only=True)

    def pack(*lengths):
        return make_experience_batch([Experience(sequences=torch.arange(n) % VOCAB, action_mask=torch.ones(
            n - 1, dtype=torch.bool)) for n in lengths], packed=True)

    with torch.no_grad():
        _, *top = actor(pack(5, 7), return_topk=3)
        _, *other = actor(pack(5, 4), return_topk=3)
    assert tuple(top[1].shape) == (10, 3) and tuple(other[1].shape) == (7, 3)  # the action rows of each pack
    lp, kl = actor(pack(5, 7), teacher_topk=tuple(top))  # the control
    assert kl.shape == lp.shape
    with pytest.raises(ValueError, match=r"token_log_probs: extra_targets has shape \(7, 3\), expected \[10, k\]"):
        actor(pack(5, 7), teacher_topk=tuple(other))


# ------------------------------------------------------------------ the self-test
def test_self_test_passes_the_teacher_and_refuses_a_forward_that_differs(tmp_path):
    from model.actor import Actor
    from runtime.parallel_dims import ParallelDims
    from rl.algos.distill import self_test

    path = checkpoint(tmp_path / "t", "qwen3_moe", seed=2)
    good = Actor(build_model(None, pretrained_path=path), dims=ParallelDims(), replay=False, actions_only=True)
    assert self_test(good, path, ParallelDims(), dtype=torch.float32, tol=1e-3) <= 1e-4
    hot = Actor(build_model(None, pretrained_path=path), temperature=1.5, dims=ParallelDims(), replay=False,
                actions_only=True)  # the control: another distribution
    with pytest.raises(ValueError, match=r"self-test failed: its log-probs differ from a plain transformers forward "
                                         r"by up to .* above the bound algo.teacher.self_test_tol=0.001"):
        self_test(hot, path, ParallelDims(), dtype=torch.float32, tol=1e-3)


def test_the_smollm2_distill_experiment_reads_the_teacher_the_make_target_builds():
    from pathlib import Path

    cfg = compose("+experiment=smollm2_arithmetic_distill", check=False)
    assert cfg.algo.advantage == "distill" and cfg.model.pretrained_path.endswith("SmolLM2-135M-Instruct")
    makefile = (Path(__file__).resolve().parents[1] / "Makefile").read_text()
    assert f"TEACHER_DIR := {cfg.algo.teacher.path}\n" in makefile
    assert "-m rl.trainer.export .cache/distill-teacher/checkpoints $(TEACHER_DIR)" in makefile


# ------------------------------------------------------------------ trainer steps
def _stages(tr, step: int = 0):
    """The step's stages up to the update: (minibatches, advantages of every batch)."""
    rollouts = tr.rollout(step)
    mbs = tr.collate(rollouts, tr.plan(rollouts.samples))
    tr.score(mbs)
    tr.advantages(rollouts.samples, mbs)
    return rollouts, mbs


def _changed(before: dict, after: dict) -> float:
    return max(float((before[k] - after[k]).abs().max()) for k in before)


@pytest.mark.parametrize("model", ["dense_tiny", "moe_tiny"])
def test_teacher_equal_to_the_student_gives_zero_advantages_and_no_update(tmp_path, model):
    family = "qwen3" if model == "dense_tiny" else "qwen3_moe"
    same, other = checkpoint(tmp_path / "same", family, seed=0), checkpoint(tmp_path / "other", family, seed=1)
    run = (*SMALL, f"model={model}", "algo.advantage=distill", "eval.every=0", "trainer.log_samples=0")
    tr = trainer(*run, f"algo.teacher.path={same}")
    assert tr.reference is None and tr.teacher is not None
    before = weights(tr)
    rollouts, mbs = _stages(tr)
    batches = [b for mb in mbs for b in mb.batches]
    assert all(b.teacher_action_log_probs is not None for b in batches)
    assert max(float(b.advantages.abs().max()) for b in batches) == 0.0
    stats = tr.train(mbs)
    assert _changed(before, weights(tr)) == 0.0
    assert float(stats.sums["distill_reverse_kl"]) == 0.0
    assert float(stats.sums["distill_argmax_agreement"]) == pytest.approx(1.0, abs=1e-12)  # a token share: 1

    tr = trainer(*run, f"algo.teacher.path={other}")  # the control: another teacher
    assert tr.guard.teacher_signal  # no "rewards that differ" warning: the teacher's signal is per token
    before = weights(tr)
    metrics = tr.step(0)
    assert _changed(before, weights(tr)) > 0.0
    assert metrics["distill_reverse_kl"] > 0.0 and metrics["teacher_log_prob"] < 0.0, metrics
    assert 0.0 <= metrics["distill_argmax_agreement"] < 1.0


@pytest.mark.parametrize("kl", ["sampled", "topk"])
def test_packed_and_padded_agree(tmp_path, kl):
    teacher = checkpoint(tmp_path / "t", "qwen3_moe", seed=1)
    run = (*SMALL, "algo.advantage=distill", f"algo.teacher.path={teacher}", "algo.distill_discount=1.0",
           "eval.every=0", "trainer.log_samples=0", f"algo.distill_kl={kl}", "algo.distill_topk=8")
    packed, padded = trainer(*run).step(0), trainer(*run, "batch=padded").step(0)
    assert packed["reward_mean"] == padded["reward_mean"] and packed["action_tokens"] == padded["action_tokens"]
    assert ("distill_topk_kl" in packed) == (kl == "topk")
    for key in ("distill_reverse_kl", "teacher_log_prob", "distill_argmax_agreement", "loss", "grad_norm",
                *(["distill_topk_kl", "distill_topk_kl_zero"] if kl == "topk" else [])):
        assert abs(packed[key] - padded[key]) <= 1e-4 * max(1.0, abs(packed[key])), (key, packed[key], padded[key])


def test_the_topk_kl_term_is_zero_and_counted_for_the_teacher_itself_and_moves_the_student_otherwise(tmp_path):
    """algo.distill_kl=topk beside the sampled signal: with teacher == student the term is exactly
    0 on every action token, counted as such (distill_topk_kl_zero = 1), and the update is exactly
    none (its closed-form gradient is 0 where the two agree; autograd through log_softmax left a
    ~1e-8 gradient that AdamW turned into a 4e-4 step); another teacher gives a positive term on
    every token, and the term changes the update (distill_kl_coef 1 against 0, the same samples)."""
    same, other = checkpoint(tmp_path / "same", "qwen3_moe", seed=0), checkpoint(tmp_path / "o", "qwen3_moe", seed=1)
    run = (*SMALL, "algo.advantage=distill", "algo.distill_kl=topk", "algo.distill_topk=8", "eval.every=0",
           "trainer.log_samples=0")
    tr = trainer(*run, f"algo.teacher.path={same}")
    before = weights(tr)
    metrics = tr.step(0)
    assert metrics["distill_topk_kl"] == 0.0 and metrics["distill_topk_kl_zero"] == pytest.approx(1.0, abs=1e-12)
    assert _changed(before, weights(tr)) == 0.0
    moved = []
    for coef in (1.0, 0.0):
        tr = trainer(*run, f"algo.teacher.path={other}", f"algo.distill_kl_coef={coef}")
        before = weights(tr)
        metrics = tr.step(0)
        assert metrics["distill_topk_kl"] > 0 and metrics["distill_topk_kl_zero"] == 0.0, metrics
        moved.append({k: weights(tr)[k] - before[k] for k in before})
    assert _changed(*moved) > 1e-6  # the control: without the term the update is another


def test_a_lora_student_distills_with_no_reference_copy_and_only_its_adapters_move(tmp_path):
    same = checkpoint(tmp_path / "same", "qwen3", seed=0)
    other = checkpoint(tmp_path / "other", "qwen3", seed=1)
    run = (*SMALL, "model=dense_tiny", "model.lora.rank=4", "algo.advantage=distill", "eval.every=0",
           "trainer.log_samples=0", "trainer.lr=1e-2")
    tr = trainer(*run, f"algo.teacher.path={same}")  # the adapters start at B = 0: the student is the teacher
    assert tr.reference is None
    _, mbs = _stages(tr)
    assert max(float(b.advantages.abs().max()) for mb in mbs for b in mb.batches) == 0.0
    tr = trainer(*run, f"algo.teacher.path={other}", "algo.kl_coef=0.01")  # with a KL: the base, adapters off
    assert callable(tr.reference) and not isinstance(tr.reference, torch.nn.Module) and tr.teacher is not None
    before = weights(tr)
    metrics = tr.step(0)
    moved = {k for k in before if not torch.equal(before[k], weights(tr)[k])}
    assert moved and all("lora" in k for k in moved), sorted(moved)[:4]
    assert metrics["distill_reverse_kl"] > 0 and math.isfinite(metrics["kl"])


@pytest.mark.parametrize("student, teacher_family", [("moe_tiny", "qwen3"), ("dense_tiny", "qwen3_moe")])
def test_a_dense_teacher_for_an_moe_student_and_the_other_way_round(tmp_path, student, teacher_family):
    from model.moe import moe_blocks

    teacher = checkpoint(tmp_path / "t", teacher_family, seed=1)
    tr = trainer(*SMALL, f"model={student}", "algo.advantage=grpo", "algo.distill_coef=0.5",
                 f"algo.teacher.path={teacher}", "eval.every=0", "trainer.log_samples=0")
    assert bool(moe_blocks(tr.teacher.model, strict=False)) == (teacher_family == "qwen3_moe")
    assert tr.teacher.replay is False  # its own routing, never the student's replay records
    metrics = tr.step(0)
    assert math.isfinite(metrics["loss"]) and metrics["distill_reverse_kl"] != 0.0
    assert -math.log(VOCAB) - 2 < metrics["teacher_log_prob"] < 0


# ------------------------------------------------------------------ where the teacher lives
def test_an_offloaded_teacher_is_on_the_device_for_the_score_stage_only_and_scores_as_a_resident_one(
        tmp_path, monkeypatch):
    """algo.teacher.placement=offload: parked on the host after its self-test, moved onto the
    device before the score stage's first forward and back after its last (on CPU both are
    'cpu': the order of the moves and forwards is what is checked), an exception in the stage
    too; the step's figures equal the resident (sharded) teacher's exactly."""
    import rl.algos.distill as distill

    teacher = checkpoint(tmp_path / "t", "qwen3_moe", seed=1)
    run = (*SMALL, "algo.advantage=distill", f"algo.teacher.path={teacher}", "eval.every=0", "trainer.log_samples=0")
    events, move = [], distill.move_teacher
    monkeypatch.setattr(distill, "move_teacher", lambda t, device: (events.append("move"), move(t, device)))
    tr = trainer(*run)
    resident = tr.step(0), weights(tr)
    assert events == []  # the control: a sharded teacher never moves
    tr = trainer(*run, "algo.teacher.placement=offload")
    assert events == ["move"]  # parked on the host at build, after the self-test
    tr.teacher.register_forward_pre_hook(lambda *_: events.append("forward"))
    offloaded = tr.step(0), weights(tr)
    forwards = events.count("forward")
    assert forwards > 0 and events == ["move", "move", *["forward"] * forwards, "move"], events
    figures = ("reward_mean", "loss", "grad_norm", "distill_reverse_kl", "teacher_log_prob", "distill_argmax_agreement")
    assert [offloaded[0][k] for k in figures] == [resident[0][k] for k in figures]
    assert _changed(resident[1], offloaded[1]) == 0.0
    events.clear()
    with pytest.raises(RuntimeError, match="in the stage"):
        with distill.teacher_on_device(tr.teacher, "offload", tr.dims.device):
            raise RuntimeError("in the stage")
    assert events == ["move", "move"]  # back on the host all the same


def test_the_memory_plan_counts_the_teachers_shards_by_placement(tmp_path):
    """The rollout's start-up plan (rl/rollout/replica.py) names the teacher's shard bytes; an
    offloaded teacher comes back beside the awake copy with max_staleness >= 1 and is counted to
    come (a budget that fits the copy and the state but not the teacher then drops the copy, which
    one step off refuses), a resident one is already out of the measured budget, and at
    max_staleness=0 the copy sleeps through the score stage."""
    from rl.algos.distill import TeacherPlacement
    from rl.rollout.replica import GIB, local_shard_bytes

    teacher = checkpoint(tmp_path / "t", "qwen3", seed=1)
    run = (*SMALL, "model=dense_tiny", "algo.advantage=distill", f"algo.teacher.path={teacher}", "eval.every=0")
    off = ("rollout.mode=one_step_off", "algo.tis_cap=2.0")
    sharded = trainer(*run, *off).engine.replica
    tr = trainer(*run, *off, "algo.teacher.placement=offload")
    offload, shards = tr.engine.replica, local_shard_bytes(tr.teacher)
    assert shards == sum(p.numel() * p.element_size() for p in tr.teacher.parameters()) > 0
    assert (sharded.teacher_placement, sharded.teacher_bytes, sharded.teacher_to_come) == ("sharded", shards, 0)
    assert (offload.teacher_placement, offload.teacher_bytes, offload.teacher_to_come) == ("offload", shards, shards)
    assert all(type(p) is TeacherPlacement for p in (sharded.teacher_placement, offload.teacher_placement))  # not str
    assert "algo.teacher.placement=offload" in offload.describe() and "the teacher to come" in offload.describe()
    assert trainer(*run, "algo.teacher.placement=offload").engine.replica.teacher_to_come == 0  # sync: it sleeps
    between = (offload.replica_bytes + offload.state_bytes + shards // 2) / GIB  # fits all but the teacher
    budget = (f"rollout.memory_budget_gb={between!r}", *off)
    assert trainer(*run, *budget).engine.replica.mode == "keep"  # the control: resident, nothing to come
    with pytest.raises(ValueError, match=r"rollout.replica=auto -> sharded generates with the training policy's"):
        trainer(*run, *budget, "algo.teacher.placement=offload")  # the copy dropped: one step off cannot run


@pytest.mark.slow
@pytest.mark.parametrize("family, student", [
    ("qwen3_moe", ("algo.distill_kl=topk", "algo.distill_topk=8")),
    ("qwen3", ("model.lora.rank=4", "model.lora.target_modules=[q_proj,k_proj,v_proj,o_proj]", "trainer.lr=1e-2")),
], ids=["moe_teacher_topk", "dense_teacher_lora_student"])
def test_train_py_distills_and_one_process_equals_cp2_ep2(tmp_path, family, student):
    """train.py end to end with an MoE teacher (its own EP shards and routing; with the exact
    top-k reverse KL term) for the MoE student, or a dense one (whole on each EP rank) for a LoRA
    MoE student (the teacher separate, no reference copy): one process and torchrun 4 ranks
    (dp2 x cp2, ep2) give the same samples and figures."""
    from tests.test_train import layout_gaps, train

    teacher = checkpoint(tmp_path / "t", family, seed=1)
    run = ("trainer.max_steps=2", "algo.advantage=distill", f"algo.teacher.path={teacher}", "trainer.plot=false",
           "checkpoint.final=false", "trainer.log_samples=0", *student)
    one = train(tmp_path, "one", *run)
    four = train(tmp_path, "cp2_ep2", *run, "parallel=cp2_ep2", nproc=4)
    figures = ("reward_mean", "tokens", "loss", "grad_norm", "distill_reverse_kl", "teacher_log_prob",
               *(("distill_topk_kl", "distill_topk_kl_zero") if student and "topk" in student[0] else ()))
    assert layout_gaps(one, four, keys=figures, rel=1e-4) == []
    for a, b in zip(one, four):  # a share of argmaxes: a near-tie may flip one token between layouts, not two
        assert abs(a["distill_argmax_agreement"] - b["distill_argmax_agreement"]) * a["action_tokens"] <= 1 + 1e-6
    assert one[0]["distill_reverse_kl"] > 0 and one[0]["teacher_log_prob"] < 0


def test_distillation_composes_with_tis_max_staleness_and_rollout_log_probs(tmp_path):
    teacher = checkpoint(tmp_path / "t", "qwen3_moe", seed=1)
    run = (*SMALL, "algo.advantage=distill", f"algo.teacher.path={teacher}", "eval.every=0", "trainer.log_samples=0")
    off = trainer(*run, "rollout.mode=one_step_off", "algo.tis_cap=2.0")
    got = [off.step(s) for s in range(2)]
    assert got[-1]["rollout_staleness_max"] == 1.0
    assert all(math.isfinite(m["loss"]) and m["distill_reverse_kl"] != 0 for m in got)
    assert all("distill_argmax_agreement" in m for m in got)
    engine = trainer(*run, "algo.old_log_probs=rollout")  # the student's log-probs: the engine's
    rollouts, mbs = _stages(engine)
    for b in (b for mb in mbs for b in mb.batches):
        want = -(b.rollout_log_probs - b.teacher_action_log_probs) * b.action_mask
        assert torch.equal(b.advantages, want) and b.teacher_argmax_agrees is None
    engine.rollout_scheduler.sync(engine.actor.model)  # the partial step skipped the sync that wakes the engine
    assert "distill_argmax_agreement" not in engine.step(1)


@pytest.mark.slow
def test_a_killed_distillation_run_resumes_with_the_uninterrupted_metrics(tmp_path):
    """SIGKILL after 3 of 4 steps, checkpoint every 2, resume=auto: the teacher is rebuilt from its
    path (not part of the checkpoint) and the run's metrics are the uninterrupted run's, bit for bit."""
    import signal

    from tests.test_checkpoint import launch, metrics, ok

    teacher = checkpoint(tmp_path / "t", "qwen3", seed=1)
    run = ("trainer.max_steps=4", "trainer.plot=false", "trainer.progress=false", "model=dense_tiny",
           "algo.advantage=distill", f"algo.teacher.path={teacher}", *SMALL[:2])
    ok(launch(tmp_path / "whole", *run))
    out = tmp_path / "run"
    killed = launch(out, *run, "checkpoint.every=2", kill="after_step:3")
    assert killed.returncode == -signal.SIGKILL and len(metrics(out)) == 3
    ok(launch(out, *run, "checkpoint.every=2", "resume=auto"))
    whole = metrics(tmp_path / "whole")
    assert metrics(out) == whole and all(m["distill_reverse_kl"] != 0 for m in whole)
