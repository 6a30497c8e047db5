"""`task=arithmetic` and the held-out evaluation (rl/rollout/evaluate.py).

The tokenizer is the one tests/test_tasks.py trains here (a small BPE with a chat template);
the model is a tiny random Llama checkpoint of that vocabulary: nothing is downloaded.
"""

import random

import pytest
import torch
from testing.inprocess import trainer
from test_tasks import CHAT, tokenizer, tokenizer_dir  # noqa: F401 - fixtures

from model.models import build_model
from runtime.parallel_dims import ParallelDims
from rl.rollout.evaluate import evaluate
from rl.rollout.engine import make_record
from rl.tasks.arithmetic import ArithmeticTask, arithmetic_value
from rl.tasks.registry import build_task


@pytest.fixture(scope="module")
def task(tokenizer_dir):
    return build_task("arithmetic", tokenizer_path=str(tokenizer_dir))


def test_train_and_heldout_problems_never_meet(task):
    heldout = [m["problem"] for _, m in task.heldout(200)]
    assert len(set(heldout)) == 200 and all(task.is_heldout(p) for p in heldout)
    trained = {m["problem"] for seed in range(400) for _, m in task.prompts(4, seed=seed)}
    assert len(trained) > 1000 and not trained & set(heldout)
    assert not any(task.is_heldout(p) for p in trained)
    # the held-out list is fixed: the same problems in every run and with any training seed
    assert [m["problem"] for _, m in task.heldout(200)] == heldout


def test_problems_are_seeded_and_answers_follow_precedence(tokenizer_dir):
    mixed = build_task("arithmetic", tokenizer_path=str(tokenizer_dir), operands=3, low=0, high=20, operators="+-*")
    a, b = mixed.prompts(8, seed=5), mixed.prompts(8, seed=5)
    assert [m for _, m in a] == [m for _, m in b] and [m for _, m in a] != [m for _, m in mixed.prompts(8, seed=6)]
    rng = random.Random(0)
    for _ in range(300):
        nums = [rng.randint(0, 99) for _ in range(4)]
        text = " ".join(f"{n} {rng.choice('+-*')}" for n in nums[:-1]) + f" {nums[-1]}"
        assert arithmetic_value(text) == eval(text), text  # Python's own precedence as the reference
    assert all(m["answer"] == eval(m["problem"]) for _, m in a)
    assert {op for _, m in mixed.prompts(50, seed=1) for op in m["problem"].split()[1::2]} == {"+", "-", "*"}


def test_prompts_are_the_chat_template_and_the_reward_reads_the_last_number(task, tokenizer):
    ids, meta = task.prompts(1, seed=0)[0]
    text = task.template.format(problem=meta["problem"])
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                             add_generation_prompt=True)
    assert ids.tolist() == tokenizer.encode(rendered, add_special_tokens=False)
    assert task.stop_token_id == tokenizer.eos_token_id
    right = tokenizer.encode(f"{meta['problem']} = {meta['answer']}") + [tokenizer.eos_token_id]
    wrong = tokenizer.encode(f"{meta['answer']} is not {meta['answer'] + 1}")
    assert task.reward(ids, right, meta) == 1.0 and task.reward(ids, wrong, meta) == 0.0
    assert len(ids) <= task.max_prompt_len


def test_bad_options_name_the_field(tokenizer_dir, tmp_path):
    with pytest.raises(ValueError, match=r"eval.num_prompts=5000: the held-out split .* has ~\d+ problems"):
        build_task("arithmetic", tokenizer_path=str(tokenizer_dir)).heldout(5000)
    with pytest.raises(ValueError, match="task.options.operators='/'"):
        build_task("arithmetic", tokenizer_path=str(tokenizer_dir), operators="/")
    from transformers import AutoTokenizer

    plain = AutoTokenizer.from_pretrained(tokenizer_dir)
    plain.chat_template = None
    plain.save_pretrained(tmp_path / "plain")
    (tmp_path / "plain" / "chat_template.jinja").unlink(missing_ok=True)
    with pytest.raises(ValueError, match="task.options.chat_template='tokenizer' but the tokenizer at .* has no chat template"):
        build_task("arithmetic", tokenizer_path=str(tmp_path / "plain"))


# ------------------------------------------------------------------ evaluation
class Oracle:
    """An engine that answers the problems whose answer is even, greedily, and records its calls."""

    def __init__(self, task: ArithmeticTask):
        self.task, self.calls = task, []

    def generate(self, prompts, *, prompt_indices, max_new_tokens, temperature, seed):
        self.calls.append((list(prompt_indices), temperature))
        out = []
        for prompt in prompts:
            meta = next(m for p, m in self.problems if torch.equal(p, prompt))
            said = meta["answer"] if meta["answer"] % 2 == 0 else meta["answer"] + 1
            response = torch.tensor(self.task.tokenizer.encode(f"It is {said}"))
            out.append(make_record(prompt, response, torch.zeros(len(response)), 0))
        return out


def test_evaluate_is_greedy_pass_at_1_over_every_problem_once(task):
    problems = task.heldout(40)
    engine = Oracle(task)
    engine.problems = problems
    result = evaluate(engine, task, problems, ParallelDims(), max_new_tokens=8, batch_size=16)
    even = sum(m["answer"] % 2 == 0 for _, m in problems) / len(problems)
    assert 0 < even < 1 and result["eval_accuracy"] == pytest.approx(even)
    assert sorted(i for indices, _ in engine.calls for i in indices) == list(range(40))
    assert {t for _, t in engine.calls} == {0.0} and max(len(i) for i, _ in engine.calls) == 16


def test_evaluation_shows_its_progress_when_asked(task, capsys):
    problems = task.heldout(8)
    engine = Oracle(task)
    engine.problems = problems
    for progress in (False, True):
        evaluate(engine, task, problems, ParallelDims(), max_new_tokens=8, batch_size=4, progress=progress)
        shown = capsys.readouterr().err
        assert ("held-out" in shown and "/2 " in shown) if progress else shown == ""  # 2 batches


def test_a_task_without_a_heldout_split_is_named_when_evaluation_is_asked():
    with pytest.raises(ValueError, match=r"eval.every > 0 but task 'target_token' has no held-out split"):
        trainer("task=target_token", "eval.every=1")


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory, tokenizer):
    folder = tmp_path_factory.mktemp("llama")
    build_model("llama", seed=0, vocab_size=len(tokenizer), tie_word_embeddings=True).save_pretrained(folder)
    return folder


def test_evaluation_is_logged_and_does_not_change_the_training_run(tiny_llama, tokenizer_dir):
    run = ("model=pretrained", f"model.pretrained_path={tiny_llama}", "model.dtype=float32", "task=arithmetic",
           f"task.tokenizer_path={tokenizer_dir}", "task.prompts_per_step=2", "task.samples_per_prompt=4",
           "task.max_new_tokens=6", "trainer.progress=false", "eval.num_prompts=12", "trainer.lr=1e-3")
    with_eval, without = trainer(*run, "eval.every=2"), trainer(*run, "eval.every=0")
    a = [with_eval.step(s) for s in range(3)]
    b = [without.step(s) for s in range(3)]
    assert ["eval_accuracy" in m for m in a] == [True, False, True] and not any("eval_accuracy" in m for m in b)
    timing = {"tokens_per_s", "rollout_tokens_per_s", "train_tokens_per_s", "rollout_s", "step_s", "weight_sync_s"}
    strip = lambda m: {k: v for k, v in m.items() if k not in timing and not k.startswith("eval_")}  # noqa: E731
    assert [strip(m) for m in a] == [strip(m) for m in b]
    assert 0.0 <= a[0]["eval_accuracy"] <= 1.0 and len(with_eval.heldout) == 12


def test_greedy_decoding_takes_the_argmax_and_ignores_the_seed(tiny_llama, task):
    from rl.rollout.engine import HFRolloutEngine

    lm = build_model(None, pretrained_path=str(tiny_llama))
    engine = HFRolloutEngine(lm, stop_token_id=task.stop_token_id)
    prompts = [p for p, _ in task.heldout(6)]
    a = engine.generate(prompts, prompt_indices=list(range(6)), max_new_tokens=5, temperature=0.0, seed=1)
    b = engine.generate(prompts[::-1], prompt_indices=list(range(6)), max_new_tokens=5, temperature=0.0, seed=2)
    assert [r.sequences.tolist() for r in a] == [r.sequences.tolist() for r in b[::-1]]
    sampled = engine.generate(prompts, prompt_indices=list(range(6)), max_new_tokens=5, temperature=1.0, seed=1)
    assert [r.sequences.tolist() for r in sampled] != [r.sequences.tolist() for r in a]  # control
    with torch.no_grad():
        for rec in a:
            P = rec.sequences.numel() - int(rec.response_length)
            logits = lm(rec.sequences[None]).logits[0, P - 1:-1]
            assert rec.sequences[P:].tolist() == logits.argmax(-1).tolist()
            torch.testing.assert_close(rec.rollout_log_probs[P - 1:],
                                       torch.log_softmax(logits, -1).max(-1).values, rtol=0, atol=1e-5)
