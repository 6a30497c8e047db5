"""`task=reasoning_gym` (rl/tasks/reasoning.py): reasoning-gym's procedural datasets, generated
offline with seeds, scored by each dataset's own `score_answer`; held-out problems disjoint from
training; several datasets mixed by weight; a run on the tiny model path (no real model)."""

from collections import Counter

import pytest
from testing.inprocess import compose, trainer
from test_arithmetic import tiny_llama  # noqa: F401 - fixture
from test_tasks import tokenizer, tokenizer_dir  # noqa: F401 - fixtures

from rl.tasks.registry import build_task

SMALL = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1, "operators": ["+"],
         "allow_negation": False, "allow_parentheses": False}  # 100 distinct problems


def gym(tokenizer_dir, **options):
    return build_task("reasoning_gym", tokenizer_path=str(tokenizer_dir), **options)


def questions(prompts):
    return [meta["question"] for _, meta in prompts]


def test_heldout_problems_are_disjoint_from_training_in_seeds_and_in_questions(tokenizer_dir):
    """The held-out seeds start past every training item's seed, and a held-out question that a
    small space repeats from training is dropped. Controls: the training seed regenerates the
    training questions, and the held-out seed range alone does repeat training questions here."""
    from reasoning_gym.composite import CompositeConfig, CompositeDataset, DatasetSpec

    task = gym(tokenizer_dir, dataset="basic_arithmetic", dataset_config=SMALL, size=40, dataset_seed=7)
    heldout = questions(task.heldout(30))
    assert len(set(heldout)) == 30 and not set(heldout) & task.train_questions
    assert task.heldout_seed >= task.train_seeds.stop and task.heldout_seed > max(task.train_seeds)

    def raw(seed, n):
        data = CompositeDataset(CompositeConfig(size=n, seed=seed, datasets=[DatasetSpec("basic_arithmetic", 1.0, SMALL)]))
        return [data[i]["question"] for i in range(n)]

    assert set(raw(7, 40)) == task.train_questions  # control: the same seed, the same problems
    assert set(raw(task.heldout_seed, 60)) & task.train_questions  # control: 100 problems, seeds alone collide
    assert questions(task.heldout(30)) == heldout  # the same held-out list every time
    # a larger space: the training prompts drawn over many steps never meet the held-out ones
    wide = gym(tokenizer_dir, dataset="basic_arithmetic", size=200)
    trained = {m["question"] for s in range(100) for _, m in wide.step_prompts(4, seed=s, run_seed=1, start=4 * s)}
    assert trained == wide.train_questions and not trained & set(questions(wide.heldout(100)))


def test_problems_are_seeded_and_walked_in_epochs(tokenizer_dir):
    a = gym(tokenizer_dir, dataset="chain_sum", size=30)
    b = gym(tokenizer_dir, dataset="chain_sum", size=30)
    c = gym(tokenizer_dir, dataset="chain_sum", size=30, dataset_seed=1)
    assert questions(a.prompts_at(0, 30, seed=3)) == questions(b.prompts_at(0, 30, seed=3))
    assert sorted(questions(a.prompts_at(0, 30, seed=3))) == sorted(m["question"] for _, m in a.items)  # each once
    assert a.train_questions != c.train_questions  # another dataset_seed, other problems


def test_the_reward_is_the_datasets_own_score_answer(tokenizer_dir, tokenizer):
    import reasoning_gym

    task = gym(tokenizer_dir, dataset="basic_arithmetic", dataset_config=SMALL, size=10)
    ids, meta = task.prompts(1, seed=0)[0]
    answer = meta["answer"]
    score = lambda text: task.reward(ids, tokenizer.encode(text), meta)  # noqa: E731
    assert score(f"so <answer>{answer}</answer>") == 1.0
    assert score(f"<answer>{int(answer) + 1}</answer>") == 0.0 and score(answer) == 0.0  # no tag: no answer
    reference = reasoning_gym.create_dataset("basic_arithmetic", **SMALL, size=10, seed=1)
    assert score(f"<answer>{answer} apples</answer>") == reference.score_answer(f"{answer} apples", meta) < 1.0
    whole = gym(tokenizer_dir, dataset="basic_arithmetic", dataset_config=SMALL, size=10, answer_tag="")
    assert whole.reward(ids, tokenizer.encode(f" {answer} "), meta) == 1.0
    prose = f"{meta['question'].rstrip('.').split()[-3]} + x = {answer}"
    assert 0 < whole.reward(ids, tokenizer.encode(prose), meta) < 1.0  # the whole reply: partial credit
    last = gym(tokenizer_dir, dataset="basic_arithmetic", dataset_config=SMALL, size=10, answer_pattern=r"-?\d+")
    assert last.reward(ids, tokenizer.encode(prose), meta) == 1.0  # its last number is the answer
    assert last.reward(ids, tokenizer.encode(f"{answer} + 1 = {int(answer) + 1}"), meta) == 0.0  # control
    assert last.reward(ids, tokenizer.encode("no number"), meta) == 0.0


def test_the_no_signal_hint_names_where_the_answer_is_read_and_its_suggestion_rewards_prose(tokenizer_dir,
                                                                                              tokenizer):
    """What the divergence guard's no-signal warning names for the task (rl/trainer/guard.py)."""
    import re

    tagged = gym(tokenizer_dir, dataset="basic_arithmetic", dataset_config=SMALL, size=10)
    hint = tagged.signal_hint()
    assert "<answer>...</answer> (task.options.answer_tag=answer)" in hint and "task.options.answer_pattern" in hint
    suggested = re.search(r"answer_pattern \(e.g. '([^']+)'", hint).group(1)
    ids, meta = tagged.prompts(1, seed=0)[0]
    prose = tokenizer.encode(f"The sum is {meta['answer']}.")
    assert tagged.reward(ids, prose, meta) == 0.0  # what the hint is about: prose is never rewarded
    fixed = gym(tokenizer_dir, dataset="basic_arithmetic", dataset_config=SMALL, size=10, answer_pattern=suggested)
    assert fixed.reward(ids, prose, meta) == 1.0  # the suggestion rewards it
    assert "task.options.answer_pattern='-?\\\\d+'" in fixed.signal_hint()  # the hint names the pattern in use
    assert "task.options.answer_tag=''" in gym(tokenizer_dir, dataset="basic_arithmetic", dataset_config=SMALL,
                                              size=10, answer_tag="").signal_hint()


def test_datasets_mix_by_weight_and_each_scores_its_own(tokenizer_dir, tokenizer):
    task = gym(tokenizer_dir, datasets={"basic_arithmetic": {"weight": 3, "config": SMALL},
                                        "chain_sum": {"weight": 1}}, size=400)
    counts = Counter(meta["metadata"]["source_dataset"] for _, meta in task.items)
    assert set(counts) == {"basic_arithmetic", "chain_sum"} and 0.65 < counts["basic_arithmetic"] / 400 < 0.85
    for _, meta in task.prompts(20, seed=0):
        assert task.reward(None, tokenizer.encode(f"<answer>{meta['answer']}</answer>"), meta) == 1.0
    heavy = gym(tokenizer_dir, datasets={"basic_arithmetic": {"weight": 1, "config": SMALL},
                                         "chain_sum": {"weight": 3}}, size=400)
    assert Counter(m["metadata"]["source_dataset"] for _, m in heavy.items)["chain_sum"] > 250  # control


def test_bad_options_name_the_field(tokenizer_dir):
    with pytest.raises(ValueError, match=r"needs task.options.dataset=NAME"):
        gym(tokenizer_dir)
    with pytest.raises(ValueError, match=r"task.options.dataset: 'no_such_dataset' is not a reasoning-gym dataset"):
        gym(tokenizer_dir, dataset="no_such_dataset")
    with pytest.raises(ValueError, match=r"task.options.datasets.chain_sum.weight=0.0"):
        gym(tokenizer_dir, datasets={"chain_sum": {"weight": 0}})
    with pytest.raises(ValueError, match=r"task.options.answer_pattern='\(': not a regular expression"):
        gym(tokenizer_dir, dataset="basic_arithmetic", dataset_config=SMALL, answer_pattern="(")
    with pytest.raises(ValueError, match=r"eval.num_prompts=150: only \d+ held-out problems"):
        gym(tokenizer_dir, dataset="basic_arithmetic", dataset_config=SMALL, size=40).heldout(150)


@pytest.mark.slow
def test_the_config_composes_and_a_run_trains_and_evaluates(tiny_llama, tokenizer_dir):
    run = ("model=pretrained", f"model.pretrained_path={tiny_llama}", "model.dtype=float32", "task=reasoning_gym",
           "task.options.dataset=basic_arithmetic", f"task.tokenizer_path={tokenizer_dir}", "task.options.size=50",
           "task.prompts_per_step=2", "task.samples_per_prompt=4", "task.max_new_tokens=6", "trainer.progress=false",
           "eval.every=1", "eval.num_prompts=6")
    assert compose(*run).task.options["dataset"] == "basic_arithmetic"
    tr = trainer(*run)
    metrics = [tr.step(s) for s in range(2)]
    assert all(0.0 <= m["reward_mean"] <= 1.0 and 0.0 <= m["eval_accuracy"] <= 1.0 for m in metrics)
    assert len(tr.heldout) == 6 and not set(questions(tr.heldout)) & tr.task.train_questions


@pytest.mark.slow
def test_train_log_warns_at_start_up_on_a_high_lr_and_at_the_first_step_without_signal(tiny_llama, tokenizer_dir,
                                                                                         tmp_path):
    """train.py on a pretrained (tiny) checkpoint: full fine-tuning at trainer.lr=3e-3 warns before the
    first step, naming the key and the bound; the default answer_tag, which the untrained model never
    writes, gives no reward signal, and step 0 warns naming task.options.answer_tag / answer_pattern."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    out = tmp_path / "run"
    cmd = [sys.executable, "train.py", f"hydra.run.dir={out}", "model=pretrained",
           f"model.pretrained_path={tiny_llama}", "task=reasoning_gym", "task.options.dataset=basic_arithmetic",
           f"task.tokenizer_path={tokenizer_dir}", "task.options.size=20", "task.prompts_per_step=2", "task.samples_per_prompt=2", "task.max_new_tokens=4",
           "trainer.max_steps=1", "trainer.lr=3e-3", "trainer.progress=false", "trainer.plot=false",
           "checkpoint.final=false"]
    proc = subprocess.run(cmd, cwd=Path(__file__).resolve().parents[1], env={**os.environ, "OMP_NUM_THREADS": "1"},
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    log = (out / "train.log").read_text()
    assert "trainer.lr=0.003 is above 0.0001 for full fine-tuning of the pretrained checkpoint" in log
    assert log.index("trainer.lr=0.003 is above") < log.index("step 0 reward")  # at start-up
    assert "step 0: no prompt group had rewards that differ" in log and "No reward fired (reward_mean 0)" in log
    assert "(task.options.answer_tag=answer): a model that answers in prose never writes it" in log
