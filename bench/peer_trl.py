"""The TRL arm of `make bench-peer` (bench/peer.py): TRL's `GRPOTrainer` on this project's job, or, with
`--teacher` (`bench/peer.py --job distill`), TRL's on-policy `GKDTrainer` distilling from that teacher.

Runs inside `.venv-trl` (TRL 1.16.0, torch 2.13.0+cpu, transformers 5.18.0; requirements-trl.txt),
never in the project's `.venv`. The job is the project's `+experiment=smollm2_arithmetic` (the
defaults below), or the one bench/peer.py passes (`--job long`: `--max-new-tokens 256
--task-options '{..., "template": "... step by step ..."}'`, read from its experiment config):

* model: SmolLM2-135M-Instruct (the folder `make model` writes), fp32, `--threads` threads
* task: the project's `ArithmeticTask` (rl/tasks/arithmetic.py, imported from the repo root; it needs only
  torch and transformers) with the job's `task.options` (`--task-options`): step s trains on `task.prompts(4, seed=round_seed(seed, s))`, the
  prompts the project's trainer draws at step s (rl/seeds.py, rl/rollout/source.py), in that
  order (`shuffle_dataset=False`), each as one user message that TRL renders with the
  tokenizer's chat template (checked token for token against the project's prompt ids)
* reward: `rl.tasks.answers.math_reward` on the completion text (its last number against the answer)
* GRPO as TRL runs it by default: group-normalized advantages (`scale_rewards="group"`),
  `loss_type="dapo"` (token-mean over the global batch), `beta=0` (no reference model),
  `num_iterations=1`, clip epsilon 0.2; 4 prompts x 8 samples per optimizer step
  (`per_device_train_batch_size=32`, one accumulation step), 16 new tokens (`--max-new-tokens`:
  `max_completion_length`), temperature 1.0,
  lr 1e-5, grad clip 1.0
* set because of this machine or this job, not TRL's defaults: `use_cpu=True`, `bf16=False`,
  `gradient_checkpointing=False` (TRL's defaults are GPU ones: bf16 and checkpointing on),
  `lr_scheduler_type="constant"` (the Trainer default decays linearly to 0; the project's
  trainer.lr_schedule is constant), `learning_rate=1e-5` (TRL's default is 1e-6)
  `shuffle_dataset=False` (same problems in the same order), `logging_steps=1`,
  `save_strategy="no"`, `report_to="none"`

On-policy distillation (`--teacher DIR`, the job `+experiment=smollm2_arithmetic_distill`): TRL's
`trl.experimental.gkd.GKDTrainer` as its documentation sets up on-policy GKD: `lmbda=1` (every step
samples the student: fully on-policy), `beta=1` (the generalized JSD at beta 1 is the reverse KL
KL(student || teacher), over the full vocabulary at every completion position), `temperature=1.0`,
`max_new_tokens` the job's, the teacher loaded with `AutoModelForCausalLM.from_pretrained` (fp32, as the
student). The dataset is conversational (`messages`: the user prompt and, as the collator requires, the
problem's answer as the assistant turn, which on-policy training replaces by the student's samples), each
prompt repeated `--samples-per-prompt` times so that one batch of 4 x 8 rows holds the project's step
(`train_sampling_strategy="sequential"`: the same prompts in the same order; the collator's prompt ids
are checked against the project's). The rest as the GRPO arm: lr, constant schedule, grad clip 1.0, fp32,
no checkpointing. Generation time: `GKDTrainer.generate_on_policy_outputs` (the student's `generate`),
timed by a wrapper; the training reward is `math_reward` of those samples (logged, not trained on).

Timing: a `TrainerCallback` takes each step's wall time (on_step_end to on_step_end, the
first from on_train_begin), so it holds generation, rewards, forward, backward and the
optimizer step; the held-out evaluation runs outside `trainer.train()` and is never in it.
The generation time is TRL's own `profiling_context(self, "transformers.generate")` span,
read by wrapping `ProfilingContext._log_metrics` (which only records the duration; nothing
in the trainer changes). Token counts come from the reward function (`completion_ids`).

Evaluation (before and after training, and after every `--eval-every` steps, as the project's
`eval.every`, outside the step timing): greedy decoding with `model.generate` (max
`--max-new-tokens` new tokens, stop at the tokenizer's EOS `<|im_end|>`) on `task.heldout(n)`, the problems the
project's `eval_accuracy` uses; a problem is correct when `math_reward` of the decoded
completion (special tokens skipped) is 1.

    .venv-trl/bin/python bench/peer_trl.py --steps 40 --out outputs/bench-peer/trl.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

GENERATE_SPANS = (".transformers.generate", ".transformers.generate_batch", ".vLLM.generate")  # TRL's span names


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=str(ROOT / ".cache/models/SmolLM2-135M-Instruct"))
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--eval-prompts", type=int, default=200)
    p.add_argument("--eval-every", type=int, default=0,
                   help="also evaluate after every k optimizer steps (the project's eval.every; 0: before and after only)")
    p.add_argument("--eval-batch-size", type=int, default=64, help="problems decoded together (the project's eval.batch_size)")
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--seed", type=int, default=0, help="the project's cfg.seed: step s trains on prompts(4, round_seed(seed, s))")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--prompts-per-step", type=int, default=4, help="task.prompts_per_step")
    p.add_argument("--samples-per-prompt", type=int, default=8, help="task.samples_per_prompt (num_generations)")
    p.add_argument("--max-new-tokens", type=int, default=16, help="task.max_new_tokens (max_completion_length)")
    p.add_argument("--task-options", default="{}", help="task.options as JSON (ArithmeticTask keywords)")
    p.add_argument("--lora-rank", type=int, default=0,
                   help="LoRA rank r through TRL's peft_config (0 = full fine-tuning)")
    p.add_argument("--lora-alpha", type=float, default=32.0)
    p.add_argument("--lora-dropout", type=float, default=0.0)
    p.add_argument("--lora-targets", default="q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj",
                   help="LoRA target_modules, comma-separated")
    p.add_argument("--teacher", default=None,
                   help="a teacher checkpoint folder: TRL's on-policy GKDTrainer (lmbda=1, beta=1) instead of GRPO")
    p.add_argument("--out", required=True, help="JSON file for the figures")
    return p.parse_args(argv)


def build_dataset(task, steps: int, seed: int, prompts_per_step: int, samples_per_prompt: int = 0):
    """One row per training prompt, step by step: the project's prompts in the project's order.
    `samples_per_prompt` > 0 (GKD): the dataset is conversational, each prompt `samples_per_prompt`
    times in a row with its answer as the assistant turn (DataCollatorForChatML needs one)."""
    from datasets import Dataset

    from rl.seeds import round_seed

    rows = []
    for step in range(steps):
        for ids, meta in task.prompts(prompts_per_step, seed=round_seed(seed, step)):
            rows.append({"prompt": [{"role": "user", "content": task.template.format(problem=meta["problem"])}],
                         "answer": str(meta["answer"]), "prompt_ids": ids.tolist()})
    if samples_per_prompt:
        return rows, Dataset.from_list([{"messages": r["prompt"] + [{"role": "assistant", "content": r["answer"]}]}
                                        for r in rows for _ in range(samples_per_prompt)])
    return rows, Dataset.from_list([{"prompt": r["prompt"], "answer": r["answer"]} for r in rows])


def check_prompt_ids(tokenizer, rows) -> None:
    """TRL renders a conversational prompt with the tokenizer's chat template: the ids must be
    the project's prompt ids, or the two arms would not train on the same input."""
    for r in rows:
        ids = tokenizer.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=True)
        ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        if ids != r["prompt_ids"]:
            raise SystemExit(f"peer_trl: TRL's prompt ids differ from the project's for {r['prompt']!r}:\n"
                             f"  chat template: {ids}\n  project:       {r['prompt_ids']}")


def check_collator_prompt_ids(collator, dataset, rows, samples_per_prompt: int) -> None:
    """GKD generates from the prompts its collator cuts out of `messages`: they must be the project's
    prompt ids (left padding stripped), or the two arms would not sample from the same input."""
    for i, r in enumerate(rows):
        batch = collator([dataset[i * samples_per_prompt]])
        ids = batch["prompts"][0][batch["prompt_attention_mask"][0].bool()].tolist()
        if ids != r["prompt_ids"]:
            raise SystemExit(f"peer_trl: GKD's collator prompt ids differ from the project's for {r['prompt']!r}:\n"
                             f"  collator: {ids}\n  project:  {r['prompt_ids']}")


def trl_config(args, work: str):
    """TRL's `GRPOConfig` for the job, or `GKDConfig` with `--teacher` (see the module docstring),
    and the PEFT `LoraConfig` of `--lora-rank` (None: full fine-tuning)."""
    common = dict(
        output_dir=work,
        # the job
        max_steps=args.steps,
        per_device_train_batch_size=args.prompts_per_step * args.samples_per_prompt,
        gradient_accumulation_steps=1,
        temperature=1.0,
        learning_rate=args.lr,
        lr_scheduler_type="constant",
        max_grad_norm=1.0,
        seed=args.seed,
        # this machine: CPU, fp32, no activation checkpointing
        use_cpu=True,
        bf16=False,
        gradient_checkpointing=False,
        # no side work
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
    )
    if args.teacher:
        from trl.experimental.gkd import GKDConfig

        config = GKDConfig(**common, lmbda=1.0, beta=1.0, max_new_tokens=args.max_new_tokens,
                           train_sampling_strategy="sequential")
    else:
        from trl import GRPOConfig

        config = GRPOConfig(**common, num_generations=args.samples_per_prompt,
                            max_completion_length=args.max_new_tokens, beta=0.0, num_iterations=1,
                            loss_type="dapo", shuffle_dataset=False)
    peft_config = None
    if args.lora_rank:  # LoRA as a TRL user asks for it: a PEFT LoraConfig handed to the trainer
        from peft import LoraConfig

        peft_config = LoraConfig(r=args.lora_rank, lora_alpha=args.lora_alpha, lora_dropout=args.lora_dropout,
                                 target_modules=args.lora_targets.split(","), task_type="CAUSAL_LM")
    return config, peft_config


def greedy_accuracy(model, tokenizer, problems, *, batch_size: int, max_new_tokens: int) -> dict:
    """Greedy pass@1 on the held-out problems: `model.generate`, max `max_new_tokens`, stop at EOS."""
    import torch
    from transformers import GenerationConfig

    from rl.tasks.answers import math_reward

    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    config = GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=eos, pad_token_id=pad,
                              use_cache=True)  # GRPOTrainer sets model.config.use_cache=False
    was_training = model.training
    model.eval()
    t0 = time.perf_counter()
    correct = 0
    with torch.no_grad():
        for start in range(0, len(problems), batch_size):
            chunk = problems[start:start + batch_size]
            width = max(ids.numel() for ids, _ in chunk)
            input_ids = torch.full((len(chunk), width), pad, dtype=torch.long)
            mask = torch.zeros((len(chunk), width), dtype=torch.long)
            for i, (ids, _) in enumerate(chunk):  # left padding (every prompt has the same length here)
                input_ids[i, width - ids.numel():] = ids
                mask[i, width - ids.numel():] = 1
            out = model.generate(input_ids=input_ids, attention_mask=mask, generation_config=config)
            for row, (_, meta) in zip(out[:, width:].tolist(), chunk):
                if eos in row:
                    row = row[:row.index(eos) + 1]
                text = tokenizer.decode(row, skip_special_tokens=True)
                correct += int(math_reward(text, meta["answer"]) >= 1.0)
    model.train(was_training)
    return {"accuracy": correct / max(len(problems), 1), "correct": correct, "problems": len(problems),
            "eval_s": time.perf_counter() - t0}


def main(argv=None) -> dict:
    args = parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    import torch

    torch.set_num_threads(args.threads)
    import transformers
    import trl
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOTrainer
    from trl.experimental.gkd import GKDTrainer
    from trl.experimental.utils import DataCollatorForChatML
    from trl.extras import profiling

    from rl.tasks.answers import math_reward
    from rl.tasks.arithmetic import ArithmeticTask

    t_start = time.perf_counter()
    task = ArithmeticTask(args.model, **json.loads(args.task_options))  # the project's task, the model's tokenizer
    rows, dataset = build_dataset(task, args.steps, args.seed, args.prompts_per_step,
                                  args.samples_per_prompt if args.teacher else 0)
    tokenizer = AutoTokenizer.from_pretrained(args.model, local_files_only=True)
    check_prompt_ids(tokenizer, rows)
    if args.teacher:
        check_collator_prompt_ids(DataCollatorForChatML(tokenizer=tokenizer), dataset, rows, args.samples_per_prompt)
    heldout = task.heldout(args.eval_prompts)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32, local_files_only=True)

    before = greedy_accuracy(model, tokenizer, heldout, batch_size=args.eval_batch_size,
                             max_new_tokens=args.max_new_tokens)
    print(f"peer_trl: held-out accuracy before {before['accuracy']:.3f} ({before['problems']} problems, "
          f"{before['eval_s']:.0f} s)", flush=True)

    # --- instrumentation: step wall times, TRL's own generate span, token counts, TRL's logs
    generate_spans: list[float] = []
    original_log = profiling.ProfilingContext._log_metrics

    def log_metrics(self, duration):
        if self.name.endswith(GENERATE_SPANS):  # "GRPOTrainer.transformers.generate"
            generate_spans.append(duration)
        return original_log(self, duration)

    profiling.ProfilingContext._log_metrics = log_metrics
    batches: list[dict] = []  # one per generation batch = one per step here

    def arithmetic_reward(prompts, completions, completion_ids, answer, **kwargs):
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        rewards = [math_reward(t, a) for t, a in zip(texts, answer)]
        batches.append({"completion_tokens": sum(len(c) for c in completion_ids), "samples": len(completion_ids),
                        "reward_mean": sum(rewards) / max(len(rewards), 1)})
        return rewards

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.t = None
            self.step_s: list[float] = []
            self.logs: list[dict] = []

        def on_train_begin(self, args, state, control, **kw):
            self.t = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            now = time.perf_counter()
            self.step_s.append(now - self.t)
            self.t = now
            print(f"peer_trl: step {len(self.step_s) - 1} {self.step_s[-1]:.1f} s", flush=True)

        def on_log(self, args, state, control, logs=None, **kw):
            if logs:
                self.logs.append({k: v for k, v in logs.items() if isinstance(v, (int, float))})

    timer = StepTimer()
    evals = [{"step": 0, "accuracy": before["accuracy"]}]

    class HeldOut(TrainerCallback):
        """Held-out accuracy after every `--eval-every` steps, as the project's eval.every; its
        time is kept out of the step timing (the timer restarts after it)."""

        def on_step_end(self, args_, state, control, model=None, **kw):
            step = state.global_step
            if args.eval_every and step % args.eval_every == 0 and step < args.steps:
                mid = greedy_accuracy(model, tokenizer, heldout, batch_size=args.eval_batch_size,
                                      max_new_tokens=args.max_new_tokens)
                evals.append({"step": step, "accuracy": mid["accuracy"]})
                print(f"peer_trl: held-out accuracy after step {step}: {mid['accuracy']:.3f}", flush=True)
                timer.t = time.perf_counter()

    config, peft_config = trl_config(args, tempfile.mkdtemp(prefix="peer_trl_"))
    if args.teacher:  # GKD: no reward function; its student generate timed and its samples scored here
        teacher = AutoModelForCausalLM.from_pretrained(args.teacher, dtype=torch.float32, local_files_only=True)
        original_generate = GKDTrainer.generate_on_policy_outputs
        rows_per_step = args.prompts_per_step * args.samples_per_prompt

        def generate_on_policy_outputs(model, inputs, generation_config):
            t0 = time.perf_counter()
            out = original_generate(model, inputs, generation_config)
            generate_spans.append(time.perf_counter() - t0)
            ids, _, labels = out
            step_rows = rows[len(batches) * args.prompts_per_step:][:args.prompts_per_step]
            completions = [tokenizer.decode(ids[i][labels[i] != -100], skip_special_tokens=True)
                           for i in range(ids.shape[0])]
            rewards = [math_reward(c, step_rows[i // args.samples_per_prompt]["answer"])
                       for i, c in enumerate(completions[:rows_per_step])]
            batches.append({"completion_tokens": int((labels != -100).sum()), "samples": ids.shape[0],
                            "reward_mean": sum(rewards) / max(len(rewards), 1)})
            return out

        GKDTrainer.generate_on_policy_outputs = staticmethod(generate_on_policy_outputs)
        trainer = GKDTrainer(model=model, teacher_model=teacher, args=config, train_dataset=dataset,
                             processing_class=tokenizer, callbacks=[timer, HeldOut()], peft_config=peft_config)
    else:
        trainer = GRPOTrainer(model=model, reward_funcs=arithmetic_reward, args=config, train_dataset=dataset,
                              processing_class=tokenizer, callbacks=[timer, HeldOut()], peft_config=peft_config)
    t_train = time.perf_counter()
    trainer.train()
    train_wall = time.perf_counter() - t_train
    profiling.ProfilingContext._log_metrics = original_log
    if args.teacher:
        GKDTrainer.generate_on_policy_outputs = staticmethod(original_generate)

    after = greedy_accuracy(trainer.model, tokenizer, heldout, batch_size=args.eval_batch_size,
                            max_new_tokens=args.max_new_tokens)
    evals.append({"step": args.steps, "accuracy": after["accuracy"]})
    print(f"peer_trl: held-out accuracy after {after['accuracy']:.3f} ({after['problems']} problems, "
          f"{after['eval_s']:.0f} s)", flush=True)

    pps = args.prompts_per_step
    prompt_tokens = [sum(len(r["prompt_ids"]) for r in rows[s * pps:(s + 1) * pps]) * args.samples_per_prompt
                     for s in range(args.steps)]
    steps = []
    for s, step_s in enumerate(timer.step_s):
        gen = generate_spans[s] if s < len(generate_spans) else float("nan")
        b = batches[s] if s < len(batches) else {}
        steps.append({"step": s, "step_s": step_s, "rollout_s": gen, "train_s": step_s - gen,
                      "generated_tokens": b.get("completion_tokens"),
                      "tokens": prompt_tokens[s] + b.get("completion_tokens", 0),
                      "reward_mean": b.get("reward_mean")})
    if len(generate_spans) != len(timer.step_s) or len(batches) != len(timer.step_s):
        print(f"peer_trl: warning: {len(timer.step_s)} steps, {len(generate_spans)} generate spans, "
              f"{len(batches)} reward calls (expected one of each per step)", flush=True)
    result = {
        "arm": "trl", "trl": trl.__version__, "transformers": transformers.__version__, "torch": torch.__version__,
        "threads": torch.get_num_threads(), "steps": args.steps,
        "step_s_median": statistics.median(timer.step_s) if timer.step_s else None,
        "accuracy_before": before["accuracy"], "accuracy_after": after["accuracy"],
        "eval_before_s": before["eval_s"], "eval_after_s": after["eval_s"], "evals": evals,
        "train_wall_s": train_wall, "wall_s": time.perf_counter() - t_start,
        "teacher": args.teacher,
        "config": {k: getattr(config, k, None) for k in (
            "per_device_train_batch_size", "gradient_accumulation_steps", "num_generations", "generation_batch_size",
            "steps_per_generation", "max_completion_length", "temperature", "top_p", "top_k", "learning_rate",
            "lr_scheduler_type", "max_grad_norm", "beta", "num_iterations", "loss_type", "scale_rewards", "epsilon",
            "epsilon_high", "importance_sampling_level", "optim", "weight_decay", "bf16", "gradient_checkpointing",
            "shuffle_dataset", "use_vllm", "use_transformers_continuous_batching", "mask_truncated_completions",
            "lmbda", "max_new_tokens", "seq_kd", "train_sampling_strategy")},
        "task_options": json.loads(args.task_options),
        "lora": peft_config and {"rank": args.lora_rank, "alpha": args.lora_alpha, "dropout": args.lora_dropout,
                                 "target_modules": args.lora_targets.split(","),
                                 "peft": __import__("peft").__version__,
                                 "trainable_parameters": sum(p.numel() for p in trainer.model.parameters()
                                                             if p.requires_grad)},
        "per_step": steps, "trl_logs": timer.logs,
    }
    result["config"] = {k: (v.value if hasattr(v, "value") else v) for k, v in result["config"].items()}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1, default=str) + "\n")
    print(json.dumps({k: result[k] for k in ("arm", "steps", "step_s_median", "accuracy_before", "accuracy_after")}),
          flush=True)
    return result


if __name__ == "__main__":
    main()
