"""One LoRA GRPO step on identical samples: the project's adapter gradients against TRL+PEFT's.

`make bench-peer JOB=lora` trains both arms 40 steps on the same prompts, each with its own
samples; this check takes the sampling out and compares the update rule itself:

1. the project's side (`.venv`): the real step 0 of `+experiment=smollm2_arithmetic_lora
   seed=S`, run through the trainer's own stages (rollout, collate, score, advantages, train);
   kept: its samples (prompt and completion ids, rewards, in the step's order), the adapters
   as initialised, and their gradients before the optimizer step;
2. TRL's side (`.venv-trl`: this file again, with `--trl`): `GRPOTrainer` with
   bench/peer_trl.py's config and `LoraConfig` for one step, a `rollout_func` (TRL's hook for
   custom rollouts) serving the same completions in TRL's prompt order, a reward function
   returning the same rewards, the adapters loaded with the project's initial values; the
   gradients read in `on_pre_optimizer_step`.

At step 0 B = 0, so only the lora_B gradients are nonzero in either arm (dB = s G A^T with the
same A). `--rewards varied` replaces step 0's rewards (mostly 0) with a fixed pattern that
varies within every group, so every prompt contributes. `--eps 1e-4` runs the project's side
with TRL's GRPO std epsilon (the project's is 1e-6): what remains is the rest of the two paths.

    .venv/bin/python bench/peer_step.py --seed 1 --rewards real varied   # bench/results/peer-step.json
    .venv/bin/python bench/peer_step.py --rewards real --steps 8         # peer-step-8.json: 8 steps

With `--steps N` both trainers take N steps on the same samples (this trainer's, step by step):
each step's gradients are compared, and the adapters' change over the N steps.

The last line is the comparison as JSON, per reward kind: both norms, the cosine, the relative
difference of the gradients over every adapter tensor.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
from bench.common import emit, json_stdout  # noqa: E402
TRL_PYTHON = ROOT / ".venv-trl/bin/python"
EXPERIMENT = "smollm2_arithmetic_lora"


def ours(seed: int, rewards: str, eps: float | None = None, steps: int = 1) -> dict:
    """`steps` steps of the experiment through the project's trainer (`Trainer.step`): each
    step's samples and adapter gradients, the adapters before and after.
    `eps`: GRPO's std epsilon instead of the project's 1e-6 (TRL's is 1e-4)."""
    import contextlib
    import functools
    from unittest import mock

    import rl.trainer.trainer as trainer_module
    from hydra import compose, initialize_config_dir

    from runtime.parallel_dims import init_distributed
    from rl.config import load, register
    from rl.trainer.build import build_trainer

    register()
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        cfg = load(compose("config", overrides=[f"+experiment={EXPERIMENT}", f"seed={seed}", "eval.every=0"]))
    trainer = build_trainer(cfg, init_distributed(1, 1, 1, device="cpu"))
    torch.manual_seed(cfg.seed)  # as train.py
    lm = trainer.actor.model
    adapters = lambda: {n: p.detach().clone() for n, p in lm.named_parameters() if p.requires_grad}  # noqa: E731
    before = adapters()
    samples: list[list[dict]] = []  # per step
    grads: list[dict[str, torch.Tensor]] = []
    rollout, optimizer_step = trainer.rollout, trainer.optimizer_step

    def recorded(step):
        rollouts = rollout(step)
        if rewards == "varied":
            for i, sample in enumerate(rollouts.samples):
                sample.rewards.fill_((i * 7) % 3 / 2)  # 0, 0.5, 1 in turn: every group of 8 varies
        samples.append([])
        for sample in rollouts.samples:
            ids = rollouts.records[sample.source[1]].sequences.reshape(-1).tolist()
            n = int(sample.response_length)
            samples[-1].append({"prompt_index": int(sample.prompt_index), "prompt_ids": ids[:-n],
                                "completion_ids": ids[-n:], "reward": float(sample.rewards)})
        return rollouts

    def captured():
        grads.append({n: p.grad.detach().clone() for n, p in lm.named_parameters() if p.grad is not None})
        return optimizer_step()

    trainer.rollout, trainer.optimizer_step = recorded, captured
    with (mock.patch.object(trainer_module, "compute_advantages",  # for these steps only
                            functools.partial(trainer_module.compute_advantages, eps=eps))
          if eps is not None else contextlib.nullcontext()):
        for step in range(steps):
            trainer.step(step)
    return {"samples": samples, "adapters": before, "after": adapters(), "grads": grads,
            "lora": dataclasses.asdict(cfg.model.lora), "lr": cfg.trainer.lr}


def trl(state: dict, seed: int) -> dict:
    """TRL's GRPOTrainer on `state`'s samples, step by step, from its adapters: each step's
    gradients, the adapters after."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOTrainer

    from bench.peer_trl import build_dataset, parse_args, trl_config
    from rl.tasks.arithmetic import ArithmeticTask

    lora, steps = state["lora"], len(state["samples"])
    args = parse_args(["--steps", str(steps), "--seed", str(seed), "--lr", str(state["lr"]), "--out", "-",
                       "--lora-rank", str(lora["rank"]), "--lora-alpha", str(lora["alpha"]),
                       "--lora-dropout", str(lora["dropout"]), "--lora-targets", ",".join(lora["target_modules"])])
    torch.set_num_threads(args.threads)
    rows, dataset = build_dataset(ArithmeticTask(args.model), steps, seed, args.prompts_per_step)
    per_step = []  # {prompt text: that prompt's samples}, step by step
    for step, samples in enumerate(state["samples"]):
        groups: dict[int, list[dict]] = {}
        for sample in samples:
            groups.setdefault(sample["prompt_index"], []).append(sample)
        step_rows = rows[step * args.prompts_per_step:(step + 1) * args.prompts_per_step]
        for index, row in zip(sorted(groups), step_rows):
            if groups[index][0]["prompt_ids"] != row["prompt_ids"]:
                raise SystemExit(f"peer_step: step {step} prompt {index}: TRL's dataset row is another prompt")
        per_step.append({row["prompt"][-1]["content"]: groups[index] for index, row in zip(sorted(groups), step_rows)})
    served: list[dict] = []

    def rollout_func(prompts, trainer):
        queues = {text: list(samples) for text, samples in per_step[len(grads)].items()}
        served[:] = [queues[p[-1]["content"]].pop(0) for p in prompts]
        return {"prompt_ids": [s["prompt_ids"] for s in served],
                "completion_ids": [s["completion_ids"] for s in served],
                "logprobs": [[0.0] * len(s["completion_ids"]) for s in served]}  # unused without vLLM

    def reward(prompts, completions, completion_ids, **kwargs):
        if [list(c) for c in completion_ids] != [s["completion_ids"] for s in served]:
            raise SystemExit("peer_step: TRL scored other completions than the ones served")
        return [s["reward"] for s in served]

    grads: list[dict[str, torch.Tensor]] = []

    class Capture(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, **kwargs):
            grads.append({n.removeprefix("base_model.model."): p.grad.detach().clone()
                          for n, p in trainer.model.named_parameters() if p.grad is not None})

    config, peft_config = trl_config(args, tempfile.mkdtemp(prefix="peer_step_"))
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(args.model, local_files_only=True)
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=config, train_dataset=dataset,
                          processing_class=tokenizer, peft_config=peft_config, rollout_func=rollout_func,
                          callbacks=[Capture()])
    params = dict(trainer.model.named_parameters())
    with torch.no_grad():
        for name, value in state["adapters"].items():
            params[f"base_model.model.{name}"].copy_(value)
    trainer.train()
    after = {n.removeprefix("base_model.model."): p.detach().clone()
             for n, p in trainer.model.named_parameters() if p.requires_grad}
    return {"grads": grads, "after": after}


def compare(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> dict:
    """Norms, cosine and relative difference of two sets of tensors (ours `a`, TRL's `b`) by name."""
    if a.keys() != b.keys():
        raise SystemExit(f"peer_step: tensor names differ: {sorted(a.keys() ^ b.keys())[:3]}")
    dot = sum(float((a[n].double() * b[n].double()).sum()) for n in a)
    norm_a = sum(float(a[n].double().square().sum()) for n in a) ** 0.5
    norm_b = sum(float(b[n].double().square().sum()) for n in a) ** 0.5
    diff = sum(float((a[n].double() - b[n].double()).square().sum()) for n in a) ** 0.5
    out = {"norm": norm_a, "trl_norm": norm_b, "tensors": len(a),
           "nonzero_tensors": sum(bool(t.any()) for t in a.values())}
    if not norm_b:  # a step whose rewards are all equal: no gradient in either arm
        return out | {"cosine": None, "rel_diff": None if norm_a else 0.0}
    return out | {"cosine": dot / (norm_a * norm_b), "rel_diff": diff / norm_b}


def main(argv=None) -> dict | None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seed", type=int, default=1, help="the run's seed (seed 0's step 0 has no reward)")
    p.add_argument("--rewards", nargs="+", choices=["real", "varied"], default=["real", "varied"])
    p.add_argument("--steps", type=int, default=1, help="steps on the same samples (the first one's gradients "
                   "compared, and after the last the adapters' change)")
    p.add_argument("--eps", type=float, help="the project's GRPO std epsilon for this check (TRL's: 1e-4)")
    p.add_argument("--trl", metavar="STATE", help=argparse.SUPPRESS)  # TRL's side, in .venv-trl
    args = p.parse_args(argv)
    if args.trl:
        torch.save(trl(torch.load(args.trl), args.seed), args.trl + ".trl")
        return None
    json_stdout()
    summary = {"experiment": EXPERIMENT, "seed": args.seed, "eps": args.eps}
    for rewards in args.rewards:
        state = ours(args.seed, rewards, args.eps, args.steps)
        with tempfile.TemporaryDirectory() as tmp:
            path = str(Path(tmp) / "state.pt")
            torch.save(state, path)
            subprocess.run([str(TRL_PYTHON), __file__, "--trl", path, "--seed", str(args.seed)], check=True,
                           env={**os.environ, "TRL_EXPERIMENTAL_SILENCE": "1"})
            theirs = torch.load(path + ".trl")
        first = state["samples"][0]
        summary[rewards] = {"rewards_nonzero": sum(s["reward"] != 0 for s in first), "samples": len(first),
                            **compare(state["grads"][0], theirs["grads"][0])}
        if args.steps > 1:  # each step's gradients, and the adapters' change over the steps
            summary[rewards]["steps"] = args.steps
            summary[rewards]["per_step"] = [compare(a, b) for a, b in zip(state["grads"], theirs["grads"])]
            change = {n: state["after"][n] - state["adapters"][n] for n in state["after"]}
            summary[rewards]["change"] = compare(change, {n: theirs["after"][n] - state["adapters"][n] for n in change})
    summary["steps"] = args.steps
    name = "peer-step" + ("-eps" if args.eps is not None else "") + (f"-{args.steps}" if args.steps > 1 else "")
    return emit(name, summary)


if __name__ == "__main__":
    main()
