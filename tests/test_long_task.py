"""The long-answer job of the peer bench (`make bench-peer JOB=long`, bench/peer.py --job long):
conf/experiment/smollm2_arithmetic_steps.yaml is the headline job with a worked-steps prompt and
256 new tokens, nothing else changed; its reward reads the final answer at the end of the reply.

The tokenizer is the one tests/test_tasks.py trains here: nothing is downloaded.
"""

import importlib.util
import sys
from pathlib import Path

import pytest
from testing.inprocess import compose
from omegaconf import OmegaConf
from test_tasks import tokenizer_dir  # noqa: F401 - fixture

from rl.tasks.registry import build_task
from rl.trainer.checkpoint import config_dict
from rl.trainer.metrics import flatten

ROOT = Path(__file__).resolve().parents[1]
LONG, SHORT = "smollm2_arithmetic_steps", "smollm2_arithmetic"


def test_the_long_job_is_the_short_one_with_worked_steps_and_256_new_tokens():
    # every leaf of each composed config as 'a.b.c' -> value (the model path is not needed to compose)
    long, short = (flatten(config_dict(compose(f"+experiment={name}", check=False))) for name in (LONG, SHORT))
    assert set(long) - {"task.options.template"} == set(short)
    changed = {k for k in long if long[k] != short.get(k)}
    # only the prompt, the answer budget and the held-out count differ: a drift anywhere else fails here
    assert changed == {"task.options.template", "task.max_new_tokens", "eval.num_prompts"}, changed
    assert long["task.max_new_tokens"] == 256 and short["task.max_new_tokens"] == 16
    assert "step by step" in long["task.options.template"] and "{problem}" in long["task.options.template"]


def test_the_worked_steps_prompt_is_rewarded_on_its_final_answer(tokenizer_dir):
    template = OmegaConf.load(ROOT / f"conf/experiment/{LONG}.yaml").task.options.template
    task = build_task("arithmetic", tokenizer_path=str(tokenizer_dir), template=template)
    short = build_task("arithmetic", tokenizer_path=str(tokenizer_dir))
    (ids, meta), = task.prompts(1, seed=3)
    (short_ids, short_meta), = short.prompts(1, seed=3)
    assert meta == short_meta  # the same problem at the same seed: only the wording of the prompt changed
    assert "step by step" in task.tokenizer.decode(ids.tolist()) and ids.numel() > short_ids.numel()
    a, b = (int(x) for x in meta["problem"].split(" + "))
    right, wrong = meta["answer"], meta["answer"] + 1
    worked = (f"First add the tens: {a // 10 * 10} + {b // 10 * 10} = {a // 10 * 10 + b // 10 * 10}. "
              f"Then the ones: {a % 10} + {b % 10} = {a % 10 + b % 10}. ")
    enc = task.tokenizer.encode
    assert task.reward(ids, enc(worked + f"So {meta['problem']} = {right}."), meta) == 1.0
    # control: the right number inside the steps but another final answer is wrong
    assert task.reward(ids, enc(f"{right} is a guess. " + worked + f"So the answer is {wrong}."), meta) == 0.0


def _load_bench(name: str):
    sys.path.insert(0, str(ROOT / "bench"))
    spec = importlib.util.spec_from_file_location(f"bench_{name}", ROOT / f"bench/{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_the_bench_reads_each_jobs_shape_and_the_trl_arm_defaults_to_the_short_one():
    peer, peer_trl = _load_bench("peer"), _load_bench("peer_trl")
    long, short = peer.job_shape(peer.JOBS["long"]), peer.job_shape(peer.JOBS["short"])
    assert (long.max_new_tokens, long.samples_per_step) == (256, 32) and "step by step" in long.template
    assert (short.max_new_tokens, short.samples_per_step, short.template) == (16, 32, None)
    assert peer.JOBS["short"].results == "peer" and peer.JOBS["long"].results == "peer-long"
    trl = peer_trl.parse_args(["--out", "x.json"])  # what the short job's TRL arm ran before --job existed
    assert (trl.prompts_per_step, trl.samples_per_prompt, trl.max_new_tokens) == (
        short.prompts_per_step, short.samples_per_prompt, short.max_new_tokens)
    args = peer.parse_args(["--job", "long"])
    assert (args.steps, args.eval_prompts) == (peer.JOBS["long"].steps, peer.JOBS["long"].eval_prompts)
    with pytest.raises(SystemExit):
        peer.parse_args(["--job", "medium"])


def test_the_distill_job_gives_both_arms_the_experiments_teacher_and_the_short_jobs_shape():
    peer = _load_bench("peer")
    distill, short = peer.job_shape(peer.JOBS["distill"]), peer.job_shape(peer.JOBS["short"])
    assert distill.teacher == str(ROOT / ".cache/models/SmolLM2-arithmetic-teacher")  # what `make distill-teacher` writes
    assert short.teacher is None  # control: a GRPO job has no teacher, its TRL arm stays GRPOTrainer
    same = ("prompts_per_step", "samples_per_prompt", "max_new_tokens", "options", "lr", "lora")
    assert [getattr(distill, k) for k in same] == [getattr(short, k) for k in same]
    assert peer.JOBS["distill"].results == "peer-distill"
