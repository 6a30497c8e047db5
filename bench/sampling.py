"""The rollout engine's samples against Hugging Face's `generate`, on a real model: same prompts,
temperature 1, no top-k / top-p, 16 new tokens, stop at EOS. The engine draws each token by
inverse CDF from a per-sample counter-based stream (rl/rollout/sampler.py), `generate` by
`torch.multinomial`; if the two sample the same distribution, the reward and the length of their
samples agree within their standard errors. Issue 43 asked whether the sampler explains the
LoRA arm's held-out gap to TRL (whose samples come from `generate`).

    .venv/bin/python bench/sampling.py --model DIR --batches 60    # bench/results/sampling.json

DIR: a Hugging Face folder of the arithmetic job's policy, e.g. a LoRA run's final checkpoint as
`python -m rl.trainer.export outputs/<run>/checkpoints DIR` writes it (merged weights), so that
the reward is far from 0 and 1; the base model's is ~0.03.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

import torch  # noqa: E402

from common import emit, json_stdout  # noqa: E402

PROMPTS, GROUP, NEW = 4, 8, 16  # the job's 4 prompts x 8 samples x 16 new tokens per batch


def main(argv=None) -> dict:
    import argparse

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="a Hugging Face folder (the arithmetic job's policy)")
    p.add_argument("--batches", type=int, default=60, help="batches of 4 prompts x 8 samples, each arm")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    json_stdout()
    torch.set_num_threads(args.threads)
    from runtime.library_noise import silence_library_noise

    silence_library_noise()
    from transformers import AutoModelForCausalLM, GenerationConfig

    from rl.rollout.engine import HFRolloutEngine
    from rl.tasks.answers import math_reward
    from rl.tasks.arithmetic import ArithmeticTask

    task = ArithmeticTask(args.model)
    eos = task.stop_token_id
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32, local_files_only=True).eval()
    engine = HFRolloutEngine(model, stop_token_id=eos)
    config = GenerationConfig(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=NEW,
                              eos_token_id=eos, pad_token_id=eos)
    arms = {"engine": {"reward": [], "length": []}, "generate": {"reward": [], "length": []}}

    def score(arm, rows, metas):
        for row, meta in zip(rows, metas):
            row = row[:row.index(eos) + 1] if eos in row else row
            arms[arm]["reward"].append(math_reward(task.tokenizer.decode(row, skip_special_tokens=True), meta["answer"]))
            arms[arm]["length"].append(len(row))

    t0 = time.perf_counter()
    for b in range(args.batches):
        drawn = task.prompts(PROMPTS, seed=50_000 + b)
        prompts = [ids for ids, _ in drawn for _ in range(GROUP)]
        metas = [meta for _, meta in drawn for _ in range(GROUP)]
        records = engine.generate(prompts, prompt_indices=[i // GROUP for i in range(len(prompts))],
                                  max_new_tokens=NEW, temperature=1.0, seed=b)
        score("engine", [r.sequences[p.numel():].tolist() for p, r in zip(prompts, records)], metas)
        width = max(p.numel() for p in prompts)  # left padding
        ids = torch.full((len(prompts), width), eos)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(prompts):
            ids[i, width - p.numel():], mask[i, width - p.numel():] = p, 1
        torch.manual_seed(b)
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
        score("generate", out[:, width:].tolist(), metas)
        if b % 10 == 9:
            print(f"sampling: {b + 1}/{args.batches} batches, reward engine "
                  f"{statistics.fmean(arms['engine']['reward']):.4f} generate "
                  f"{statistics.fmean(arms['generate']['reward']):.4f} ({time.perf_counter() - t0:.0f} s)", flush=True)

    def summary(values):
        return statistics.fmean(values), statistics.stdev(values) / len(values) ** 0.5

    line = {"model": str(args.model), "samples": len(arms["engine"]["reward"])}
    for arm, v in arms.items():
        (line[f"{arm}_reward"], line[f"{arm}_reward_se"]), (line[f"{arm}_length"], _) = (summary(v["reward"]),
                                                                                         summary(v["length"]))
    line["reward_diff"] = line["engine_reward"] - line["generate_reward"]
    line["reward_diff_se"] = (line["engine_reward_se"] ** 2 + line["generate_reward_se"] ** 2) ** 0.5
    return emit("sampling", line)


if __name__ == "__main__":
    main()
