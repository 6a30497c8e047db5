"""One RL step, stage by stage (`Trainer.step`); each stage takes and returns named data:

    rollout    step -> Rollouts: this DP rank's prompts generated and rewarded (the records
               stay on this rank), every rank's samples gathered as metadata (stand-ins);
               the scheduler (rl/rollout/scheduler.py `rollouts`, the whole stage) says when they
               were generated: now (rollout.max_staleness=0), or by a rollout thread up to
               max_staleness steps ahead
    plan       stand-ins -> StepPlan: `algo.mini_batches` mini-batches, each planned into
               microbatches balanced over DP, and the ranks each sample goes to
    collate    Rollouts, StepPlan -> [MiniBatch]: each sample sent once, from the rank that
               generated it to the ranks that run it; this rank's microbatches collated once
    score      no grad, in place on the collated batches: old-policy log-probs (when the
               policy changes within the step, or distilling), reference log-probs, the
               teacher's log-probs (algo.teacher, rl/algos/distill.py), values, KL
    advantages in place on the collated batches, by the estimator (rl/algos/advantages.py),
               whitened over the step's tokens
    train      [MiniBatch] -> Stats: for each epoch, for each mini-batch, per microbatch forward ->
               objective (rl/algos/objective.py: loss, terms) -> backward, then one optimizer
               step (global-norm clipping)
    sync       the rollout copy gets the new weights, bucket by bucket, once the rollout thread
               no longer needs the old ones (none with rollout.replica=sharded; max_staleness >= 2:
               a staged host copy, which the rollout thread loads between two rollouts)
    metrics    Stats -> every metric, reduced in one collective

The rollout stage also counts this rank's tool calls and environment turns (rl/rollout/samples.py:
summed over the DP ranks with the step's other sums) and, on rank 0 with trainer.log_samples = N,
turns its first N records into `Trainer.samples` (train.py writes them to <run>/samples.jsonl):
rank 0 holds DP rank 0's records, the step's first, so these are the step's first N samples (at
most DP rank 0's share, task.prompts_per_step / dp x task.samples_per_prompt). With dedicated rollout
ranks the trainers hold no records: trainer 0 receives generator 0's rows and the generators' summed
counts (rl/rollout/dedicated.py `share_episodes`), the same rows and counts.

Data flow across ranks: each DP rank rolls out its slice of the step's prompts (CP peers
of one DP rank generate the same samples); the records stay there. Only per-sample metadata
(lengths, prompt index, reward, action tokens) is all-gathered (runtime/exchange.py), so every
rank holds the step as lightweight stand-ins, computes the token normalizers, the
dynamic-sampling decisions and the plan identically from them (and, after scoring, each
sample's advantage scalar: group baselines see whole groups); then each sample moves
once, as flat tensors (one `all_to_all_single` per field over the DP group, the splits known
from the metadata), from the rank that generated it to the DP rank whose plan entry holds it
(CP rank c of the sender to CP rank c of the receiver). No rank holds the whole step.
The step's prompts and samples depend only on the seed, the step and the global prompt
index, never on the DP rank or the world size, so a layout change does not change the
experiment.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

from runtime.allocator import release_memory
from model.lora import trainable_parameters
from model.moe import moe_blocks, reset_expert_load, router_aux_loss
from model.parallelize import clip_grad_norm_, expert_load_metrics, sharded_on_host
from packing import Experience, make_experience_batch, plan_microbatches
from packing.flops import flop_cost
from runtime.exchange import StandIn
from rl.algos.advantages import compute_advantages
from rl.algos.distill import distilling, teacher_on_device, topk_kl
from rl.trainer.state import load_sharded_state, sharded_state
from rl.config import Balance, Config
from rl.config.schema import OldLogProbs
from rl.trainer.guard import DivergenceGuard, poison
from rl.algos.losses import build_kl_controller, loss_normalizer
from rl.algos.objective import Objective
from rl.algos.schedule import make_lr_scheduler
from rl.tasks.reward import varied_groups
from rl.rollout.dedicated import exchange_records
from rl.rollout.sync import sync_weights
from rl.rollout.evaluate import evaluate
from rl.rollout.episodes import episode_metrics
from rl.rollout.scheduler import Rollouts


def adamw_options(device: torch.device) -> dict:
    """AdamW's implementation: on CUDA the fused kernel (the whole update in one multi-tensor
    kernel, not a few foreach passes over the state); on CPU torch's default (foreach)."""
    return {"fused": True} if device.type == "cuda" else {}


@dataclass
class MiniBatchPlan:
    """One mini-batch as this rank runs it, decided on every rank alike from the metadata.
    `rows[i]`: the step's samples (places in `Rollouts.samples`) of this rank's microbatch i;
    `weights[i]` is 0 for a padding microbatch (a rank with fewer samples than the lockstep
    count runs a zero-weight forward/backward, on the mini-batch's first sample)."""

    rows: list[list[int]]
    weights: list[float]
    tokens: float  # global action tokens of the mini-batch (the denominator of the token metrics)
    normalizer: float  # what its loss shares are divided by (`loss_normalizer` for algo.loss_agg)
    all_tokens: int  # global tokens (prompt + response) of the mini-batch


@dataclass
class StepPlan:
    """This rank's part of each of the step's `algo.mini_batches` mini-batches, and for each
    sample of the step the DP ranks that run it (where `collate` sends it)."""

    minibatches: list[MiniBatchPlan]
    destinations: list[list[int]]


@dataclass
class MiniBatch:
    """A planned mini-batch, collated: `batches[i]` holds the samples `plan.rows[i]`, on this rank's device."""

    plan: MiniBatchPlan
    batches: list[Experience]


class StagePeaks:
    """The device's peak memory per stage of a step, on CUDA: `mark(stage)` ends a stage, recording
    `torch.cuda.max_memory_allocated` since the previous mark as `peak_memory_<stage>_gib`, and resets
    the peak for the next (`mark(None)` resets only). On another device it records nothing: CPU
    memory is the process's RSS, which the allocator's releases (runtime/allocator.py) make a
    step-level figure (bench/rank_memory.py), not a stage's."""

    def __init__(self, device: torch.device) -> None:
        self.device, self.peaks = device, {}
        self.on = device.type == "cuda"

    def mark(self, stage: str | None) -> None:
        if not self.on:
            return
        if stage is not None:
            self.peaks[f"peak_memory_{stage}_gib"] = torch.cuda.max_memory_allocated(self.device) / 2**30
        torch.cuda.reset_peak_memory_stats(self.device)

    def take(self) -> dict[str, float]:
        peaks, self.peaks = self.peaks, {}
        return peaks


class Trainer:
    """The step (`step`) over the parts rl/trainer/build.py `build_trainer` builds: the policy, the
    critic, the reference (what the base log-probs come from: a frozen copy, or the LoRA policy
    with its adapters off; None without a KL term), the teacher, the rollout and evaluation
    engines, and the scheduler that says when each rollout is generated."""

    def __init__(self, cfg: Config, dims, *, actor, critic, reference: Callable | None, engine, eval_engine,
                 scheduler, task, heldout: list | None = None, teacher=None) -> None:
        self.cfg, self.dims = cfg, dims
        self.actor, self.critic, self.reference = actor, critic, reference
        self.teacher = teacher  # on-policy distillation (algo.teacher.path): frozen, scored in `score`
        self.teacher_topk = cfg.algo.distill_topk if topk_kl(cfg.algo) else 0  # algo.distill_kl=topk: its top-k
        self.engine, self.eval_engine, self.task = engine, eval_engine, task
        self.rollout_scheduler, self.source = scheduler, scheduler.source  # when, and what, each rollout generates
        self.heldout = heldout or []  # the held-out problems of `evaluate` (eval.every > 0)
        fused = adamw_options(dims.device)
        # LoRA: the adapters only (model/lora.py `trainable_parameters` refuses a trainable base weight)
        self.optimizer = torch.optim.AdamW(trainable_parameters(actor), lr=cfg.trainer.lr,
                                           weight_decay=cfg.trainer.weight_decay, **fused)
        self.critic_optimizer = (
            torch.optim.AdamW(critic.parameters(), lr=cfg.algo.critic_lr, **fused) if critic is not None else None
        )
        algo = cfg.algo
        updates = cfg.trainer.max_steps * algo.mini_batches * algo.epochs
        self.scheduler = make_lr_scheduler(self.optimizer, cfg.trainer.warmup_steps, updates, cfg.trainer.lr_schedule)
        self.kl_ctl = build_kl_controller(algo.kl_coef, algo.kl_target, algo.kl_horizon)
        # the microbatch's (loss, terms); Dr. GRPO's constant: the response budget (a multi-turn episode's: all turns)
        token_sum_norm = algo.loss_agg_norm or float(cfg.task.max_new_tokens * task.max_turns)
        self.objective = Objective(algo, token_sum_norm=token_sum_norm, kl_ctl=self.kl_ctl,
                                   moe_layers=len(moe_blocks(actor.model, strict=False)))
        self.guard = DivergenceGuard(cfg.trainer.max_bad_steps, cfg.trainer.min_entropy, verbose=dims.rank == 0,
                                     signal_hint=task.signal_hint(),  # what the task's reward reads
                                     teacher_signal=distilling(algo))
        # batch.balance=flops: the planner evens out a * tokens + b * tokens^2 (linear layers + attention)
        self.cost = flop_cost(self.hf_config) if cfg.batch.balance is Balance.FLOPS else None
        self.samples: list[dict] = []  # the last step's first trainer.log_samples episodes, on rank 0 (samples.py)
        self._sharded_on_host = sharded_on_host(actor)
        self.on_progress = None  # train.py's progress bar: on_progress(**what the step is doing now), or None
        self.stage_peaks = StagePeaks(dims.device)  # CUDA: peak memory per stage in the step's metrics
        engine.on_progress = eval_engine.on_progress = self._progress  # decode steps and turns of a generation

    def _release_memory(self) -> None:
        """A rank of a sharded CPU run hands what a stage freed back to the OS (runtime/allocator.py),
        so its memory falls with the world size; one process keeps its heap for the next step."""
        if self._sharded_on_host:
            release_memory()

    def _progress(self, **now: str) -> None:
        if self.on_progress is not None:
            self.on_progress(**now)

    # ---------------------------------------------------------------- the step
    def evaluate(self) -> dict[str, float]:
        """Greedy pass@1 of the current policy on the held-out problems (rl/rollout/evaluate.py)."""
        e = self.cfg.eval
        return evaluate(self.eval_engine, self.task, self.heldout, self.dims, batch_size=e.batch_size,
                        max_new_tokens=e.max_new_tokens or self.cfg.task.max_new_tokens,
                        progress=self.cfg.trainer.progress and self.dims.rank == 0)

    def step(self, step: int) -> dict[str, float]:
        """One step, stage by stage (the module docstring); the held-out evaluation of the
        policy it starts from when one is due (before step 0 and every `eval.every` steps;
        train.py evaluates after the last)."""
        every = self.cfg.eval.every
        evaluation = self.evaluate() if every and step % every == 0 else {}
        t0 = time.perf_counter()
        self.stage_peaks.mark(None)
        rollouts = self.rollout(step)  # max_staleness=0: the engine then sleeps until the sync refills it
        self.stage_peaks.mark("rollout")
        self._release_memory()
        minibatches = self.collate(rollouts, self.plan(rollouts.samples))
        self.score(minibatches)
        self.stage_peaks.mark("score")
        self._release_memory()
        self.advantages(rollouts.samples, minibatches)
        self.guard.begin(rewards=[r.rewards for r in rollouts.samples],
                         advantages=[b.advantages for mb in minibatches for b in mb.batches])
        stats = self.train(minibatches)
        self.stage_peaks.mark("train")
        self._release_memory()
        t_sync = time.perf_counter()
        # in buckets; vLLM: wakes, reloads in place, resets its cache; max_staleness >= 2: into the stage
        produced = self.rollout_scheduler.sync(self.actor.model)
        t_sync = time.perf_counter() - t_sync - produced.get("rollout_publish_wait_s", 0.0)
        self.stage_peaks.mark("sync")
        self._release_memory()
        stats.maxes.update(self.stage_peaks.take())  # the largest rank's, in the step's one MAX all-reduce
        metrics = self.metrics(step, rollouts, minibatches, stats, elapsed=time.perf_counter() - t0)
        metrics["weight_sync_s"] = t_sync  # trainer -> rollout engine, after the step's last update
        metrics["weight_sync_bytes"] = float(self.engine.loaded_bytes)  # what the engine received (LoRA: adapters)
        metrics.update(produced)  # the rollout thread's waits and overlap (max_staleness >= 1)
        kl = metrics.get("kl", 0.0)
        if self.cfg.algo.kl_coef and math.isfinite(kl):  # a bad step (rl/trainer/guard.py) leaves it as is
            self.kl_ctl.update(kl, len(rollouts.samples))
        self.guard.end(step, metrics)  # warns; raises after trainer.max_bad_steps bad steps in a row
        return dict(sorted((metrics | evaluation).items()))

    # ----------------------------------------------------------------- rollout
    def rollout(self, step: int) -> Rollouts:
        """The step's samples, every rank's metadata gathered, dynamic sampling's extra rounds
        included, the engine rested (rl/rollout/scheduler.py `RolloutScheduler.rollouts`); on
        rank 0 its first trainer.log_samples records as `self.samples`."""
        n = self.cfg.trainer.log_samples if self.dims.rank == 0 else 0
        with self.guard.rollout(step):  # non-finite logits: a DivergenceError naming the step
            rollouts = self.rollout_scheduler.rollouts(step, log_samples=n)
        self.samples = rollouts.rows
        return rollouts

    # -------------------------------------------------------------------- plan
    def plan(self, samples: list[StandIn]) -> StepPlan:
        """Mini-batches (contiguous slices of the step, whole prompt groups when `mini_batches`
        divides the prompt count), each planned into microbatches over the DP ranks, from the
        lengths, identically on every rank. A rank with an empty microbatch runs a zero-weight
        one on the mini-batch's first sample, so that sample goes there too."""
        k, dims, b = self.cfg.algo.mini_batches, self.dims, self.cfg.batch
        bounds = [round(i * len(samples) / k) for i in range(k + 1)]
        minibatches, dest = [], [set() for _ in samples]
        for lo, hi in zip(bounds[:-1], bounds[1:]):
            part = samples[lo:hi]
            shared = self.cfg.model.share_prompts and b.packed  # a group's prompt runs once per microbatch
            plan = plan_microbatches([_length(r) for r in part], b.max_tokens, dims.dp,
                                     micro_batch_size=b.micro_batch_size, cost=self.cost,
                                     groups=[int(r.prompt_index) for r in part] if shared else None,
                                     prompt_lengths=[_length(r) - int(r.response_length) for r in part])
            for rank, microbatches in enumerate(plan):
                for items in microbatches:
                    for i in items or [0]:  # [0]: the zero-weight stand-in
                        dest[lo + i].add(rank)
            mine = plan[dims.dp_rank]
            minibatches.append(MiniBatchPlan(rows=[[lo + i for i in items] if items else [lo] for items in mine],
                                             weights=[1.0 if items else 0.0 for items in mine],
                                             tokens=float(sum(r.action_tokens for r in part)),
                                             normalizer=loss_normalizer(part, self.cfg.algo.loss_agg),
                                             all_tokens=sum(_length(r) for r in part)))
        return StepPlan(minibatches, [sorted(d) for d in dest])

    # ----------------------------------------------------------------- collate
    def collate(self, rollouts: Rollouts, plan: StepPlan) -> list[MiniBatch]:
        """Each sample moved once, from the rank that generated it to the ranks that run it
        (runtime/exchange.py), then this rank's microbatches collated, once, onto its device
        (on CUDA by non-blocking copies from pinned memory: the host collates the next one meanwhile).
        The generated records are let go, and the stand-ins keep only their scalars (the
        rewards `advantages` reads)."""
        dims = self.dims
        mine = exchange_records(rollouts, plan.destinations, dims)  # dedicated rollout ranks: they send
        rollouts.records.clear()
        packed = self.cfg.batch.packed
        return [MiniBatch(mb, [make_experience_batch([mine[j] for j in rows], packed=packed)
                               .to(dims.device, non_blocking=True) for rows in mb.rows])
                for mb in plan.minibatches]

    # ------------------------------------------------------------------- score
    @torch.no_grad()
    def score(self, minibatches: list[MiniBatch]) -> None:
        """Fields read before the update, in place on the collated batches."""
        algo = self.cfg.algo
        updates = algo.mini_batches * algo.epochs > 1
        # algo.teacher.placement=offload: the teacher onto the device for this stage, back to the host after
        with teacher_on_device(self.teacher, algo.teacher.placement, self.dims.device):
            for mb in minibatches:
                for batch in mb.batches:
                    student_argmax = None  # distillation: the student's most likely tokens, for the agreement metric
                    if algo.old_log_probs == OldLogProbs.ROLLOUT:
                        batch.action_log_probs = batch.rollout_log_probs
                    elif self.teacher is not None:  # distillation: the student's log-probs, always
                        self.actor.eval()
                        batch.action_log_probs, student_argmax = self.actor(batch, return_argmax=True)
                    elif updates or algo.kl_in_reward:
                        self.actor.eval()
                        batch.action_log_probs = self.actor(batch)
                    if self.reference is not None:  # the frozen copy, or the LoRA policy with its adapters off
                        batch.base_action_log_probs = self.reference(batch)
                    if self.teacher is not None:  # its own routing, never the student's replay records
                        k = self.teacher_topk  # its top-k: this rank's rows, for `train`
                        batch.teacher_action_log_probs, teacher_argmax, *top = self.teacher(
                            batch, return_argmax=True, return_topk=k)
                        if k:
                            batch.teacher_topk_log_probs, batch.teacher_topk_ids = top
                        if student_argmax is not None:
                            batch.teacher_argmax_agrees = (student_argmax == teacher_argmax).float()
                    if self.critic is not None:
                        batch.values = self.critic(batch)
                    if algo.kl_in_reward:
                        batch.kl = self.objective.kl(batch.action_log_probs, batch.base_action_log_probs)
        self.actor.train()

    def advantages(self, samples: list[StandIn], minibatches: list[MiniBatch]) -> None:
        """The step's advantages and returns, in place on this rank's collated batches, by
        `algo.advantage`'s estimator (rl/algos/advantages.py): each sample's scalar from the
        step's rewards and prompt groups (`samples`: every rank holds the whole step's, so a
        group baseline sees whole groups), then per token, whitened over every action token
        of the step (the moments summed over the DP ranks)."""
        algo = self.cfg.algo
        compute_advantages([b for mb in minibatches for b in mb.batches], algo.advantage, samples=samples,
                           rows=[r for mb in minibatches for r in mb.plan.rows],
                           weights=[w for mb in minibatches for w in mb.plan.weights], group=self.dims.dp_group,
                           whiten=algo.whiten_advantages, gamma=algo.gamma, lam=algo.lam,
                           kl_coef=self.kl_ctl.value if algo.kl_in_reward else 0.0,
                           scale_by_std=algo.grpo_scale_by_std, distill_coef=algo.distill_coef,
                           distill_discount=algo.distill_discount)

    # ------------------------------------------------------------------- train
    def train(self, minibatches: list[MiniBatch]) -> "Stats":
        """`algo.epochs` passes over the mini-batches: forward/backward per microbatch, one
        optimizer step per mini-batch. Returns the step's training terms, not yet reduced."""
        stats = Stats()
        if moe_blocks(self.actor.model, strict=False):
            reset_expert_load(self.actor.model)  # the load metric counts the training forwards only
        total, done = self.cfg.algo.epochs * sum(len(mb.batches) for mb in minibatches), 0
        for _ in range(self.cfg.algo.epochs):
            for mb in minibatches:
                for batch, weight in zip(mb.batches, mb.plan.weights):
                    self._progress(train=f"{done}/{total}")
                    self.train_microbatch(batch, weight, mb, stats)
                    done += 1
                stats.add_step(self.optimizer_step())
        stats.add(self.guard.flags())
        return stats

    def train_microbatch(self, batch: Experience, weight: float, mb: MiniBatch, stats: "Stats") -> None:
        """Forward (actor, and critic) -> objective (rl/algos/objective.py) -> backward, `weight` x."""
        with router_aux_loss(self.actor.model, enabled=bool(self.cfg.algo.router_aux_loss_coef)) as aux:
            top = batch.teacher_topk_log_probs, batch.teacher_topk_ids  # algo.distill_kl=topk: the KL per token
            log_probs, entropy, *exact_kl = self.actor(batch, return_entropy=True,
                                                       teacher_topk=top if top[0] is not None else None)
        values = self.critic(batch) if self.critic is not None else None
        loss, terms = self.objective(batch, log_probs, entropy, values, aux, normalizer=mb.plan.normalizer,
                                     tokens=mb.plan.tokens, all_tokens=mb.plan.all_tokens,
                                     topk_kl=exact_kl[0] if exact_kl else None)
        self.guard.check("loss", terms["loss"], terms.get("value_loss"))
        (loss * weight).backward()
        stats.add(terms, weight)

    def optimizer_step(self) -> dict[str, torch.Tensor]:
        """Clip by the global norm and step; or skip the update, on every rank alike, when a
        term of the step is not finite (rl/trainer/guard.py): a rank that saw a non-finite reward,
        advantage or loss poisons its gradients, so the global norm is NaN everywhere."""
        clip = self.cfg.trainer.grad_clip
        out = {"lr": self.optimizer.param_groups[0]["lr"]}
        if self.guard.seen():
            poison(self.actor.parameters())
        out["grad_norm"] = clip_grad_norm_(self.actor.parameters(), clip, self.dims)
        optimizers = [self.optimizer]
        if self.critic is not None:
            out["critic_grad_norm"] = clip_grad_norm_(self.critic.parameters(), clip, self.dims)
            optimizers.append(self.critic_optimizer)
        finite = all(bool(torch.isfinite(out[k])) for k in ("grad_norm", "critic_grad_norm") if k in out)
        if finite:  # global norms: the same verdict on every rank
            for optimizer in optimizers:
                optimizer.step()
            self.scheduler.step()  # the schedule counts the updates applied
        for optimizer in optimizers:
            optimizer.zero_grad(set_to_none=True)
        out["skipped_update"] = 0.0 if finite else 1.0
        return out

    # --------------------------------------------------------------------- log
    def metrics(self, step: int, rollouts: Rollouts, minibatches: list[MiniBatch], stats: "Stats", *,
                elapsed: float) -> dict[str, float]:
        """The step's metrics, every term reduced over the DP ranks in one collective."""
        dims, samples, t_rollout = self.dims, rollouts.samples, rollouts.seconds
        real = sum(_length(r) for r in samples)  # the gathered metadata: no rank holds every record
        local_real = sum(b.sequences.numel() * w if b.is_packed else int(b.attention_mask.sum()) * w
                         for mb in minibatches for b, w in zip(mb.batches, mb.plan.weights))
        processed = sum(b.sequences.numel() for mb in minibatches for b in mb.batches)
        sums = stats.sums | {"_real": torch.tensor(float(local_real)), "_processed": torch.tensor(float(processed))}
        sums |= {f"_count_{k}": torch.tensor(v) for k, v in rollouts.counts.items()}  # tool calls, environment turns
        reduced = reduce_sums(sums, dims)
        per_update = 1.0 / (self.cfg.algo.epochs * len(minibatches))  # loss terms: averages over updates
        metrics = {k: v * per_update for k, v in reduced.items() if not k.startswith("_")}
        metrics.update({k: v / stats.steps for k, v in stats.step_sums.items()})  # grad_norm, lr: mean over updates
        metrics.update(reduce_maxes(stats.maxes, dims))
        train_s = elapsed - t_rollout
        metrics.update(
            step=step,
            reward_mean=float(torch.stack([r.rewards for r in samples]).mean()),
            reward_varied_groups=varied_groups(samples),  # 0: no group-relative advantage (guard.py warns)
            response_length=float(torch.stack([torch.as_tensor(r.response_length) for r in samples]).float().mean()),
            tokens=real,
            action_tokens=int(sum(mb.plan.tokens for mb in minibatches)),
            tokens_per_s=real / elapsed,
            rollout_tokens_per_s=real / max(t_rollout if rollouts.generated_s is None else rollouts.generated_s, 1e-9),
            train_tokens_per_s=real * self.cfg.algo.epochs / max(train_s, 1e-9),
            rollout_s=t_rollout,
            step_s=elapsed,
            padding_efficiency=reduced["_real"] / max(reduced["_processed"], 1.0),
            microbatches=sum(len(mb.batches) for mb in minibatches),
            optimizer_steps=stats.steps,
        )
        metrics.update(episode_metrics(samples))  # episodes_done, _max_turns, _truncated, _error, _timeout
        metrics.update({k[len("_count_"):]: v for k, v in reduced.items() if k.startswith("_count_")})
        if self.task.calls is not None:
            metrics["calls_hung"] = float(self.task.calls.hung)  # user calls past task.timeout_s still running
        if samples and samples[0].turns is not None:  # a multi-turn task: model turns per episode
            metrics["turns_mean"] = float(torch.stack([r.turns for r in samples]).float().mean())
        if samples and samples[0].policy_version is not None:  # policy versions behind the step, per sample
            staleness = [step - int(r.policy_version) for r in samples]
            metrics.update(rollout_staleness_mean=sum(staleness) / len(staleness),
                           rollout_staleness_max=float(max(staleness)))
        metrics.update(expert_load_metrics(self.actor.model, dims))
        metrics.update(rollouts.sampling)
        if self.cfg.algo.kl_coef:
            metrics["kl_coef"] = self.kl_ctl.value
        return dict(sorted(metrics.items()))

    # -------------------------------------------------------------- checkpoint
    @property
    def hf_config(self) -> Any:
        """The policy's Hugging Face config (a checkpoint writes it for `rl.trainer.export`)."""
        return self.actor.model.config

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint holds of the trainer (rl/trainer/checkpoint.py): the policy and critic,
        each `{"weights", "optimizer"}` as sharded DTensors of their global shapes, the LR
        schedule, the KL coefficient, the divergence guard's count of bad steps in a row, and
        with rollout.max_staleness >= 1 the scheduler's queued rollouts (`rollout`: the samples
        generated and not yet trained, rl/rollout/scheduler.py). The reference is frozen (rebuilt
        from the seed or pretrained path), so it is not part of the state. `dcp.load` fills this
        dict in place; `load_state_dict` puts it back."""
        state = {"actor": sharded_state(self.actor, self.optimizer, self.dims),
                 "scheduler": self.scheduler.state_dict(), "kl_coef": self.kl_ctl.value,
                 "bad_steps": self.guard.bad_steps}
        if produced := self.rollout_scheduler.state_dict():
            state["rollout"] = produced
        if self.critic is not None:
            state["critic"] = sharded_state(self.critic, self.critic_optimizer, self.dims)
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Put a loaded `state_dict` back; the rollout engine gets the loaded policy weights."""
        load_sharded_state(self.actor, self.optimizer, state["actor"], self.dims)
        if self.critic is not None:
            load_sharded_state(self.critic, self.critic_optimizer, state["critic"], self.dims)
        self.scheduler.load_state_dict(state["scheduler"])
        self.kl_ctl.value = float(state["kl_coef"])
        self.guard.bad_steps = int(state["bad_steps"])  # a streak of skipped updates continues
        self.rollout_scheduler.load_state_dict(state.get("rollout"), int(state.get("step", 0)))
        sync_weights(self.engine, self.actor.model)


def _length(sample: Experience) -> int:
    """Tokens (prompt + response) of a record or a stand-in."""
    return int(sample.total_length) if sample.total_length is not None else sample.sequences.numel()


class Stats:
    """Per-microbatch terms (each already a share of a global mean) and per-update values."""

    def __init__(self) -> None:
        self.sums: dict[str, torch.Tensor] = {}
        self.maxes: dict[str, torch.Tensor] = {}
        self.step_sums: dict[str, float] = {}
        self.steps = 0

    def add(self, terms: dict[str, torch.Tensor], weight: float = 1.0) -> None:
        """Sums of `weight` x each term; a `_max` key's maximum instead (over microbatches, updates and
        ranks: `reduce_maxes`), a zero-weight microbatch's left out."""
        for k, v in terms.items():
            if k.endswith("_max"):
                if weight:
                    v = v.detach().double()
                    self.maxes[k] = torch.maximum(self.maxes[k], v) if k in self.maxes else v
            else:  # stays on the device: no sync per microbatch
                self.sums[k] = self.sums.get(k, 0.0) + (v * weight).detach().double()

    def add_step(self, values: dict[str, torch.Tensor]) -> None:
        self.steps += 1
        for k, v in values.items():
            self.step_sums[k] = self.step_sums.get(k, 0.0) + float(v)


def reduce_maxes(maxes: dict[str, torch.Tensor], dims) -> dict[str, float]:
    """Every value's maximum over all ranks in one all-reduce (MAX): CP peers hold different
    values here (their token shards' largest gap, their own memory peaks), unlike the sums."""
    if not maxes:
        return {}
    keys = sorted(maxes)
    flat = torch.stack([torch.as_tensor(maxes[k], dtype=torch.float64, device=dims.device).reshape(()) for k in keys])
    if dims.trainer_group is not None:
        dist.all_reduce(flat, op=dist.ReduceOp.MAX, group=dims.trainer_group)
    return dict(zip(keys, flat.tolist()))


def reduce_sums(sums: dict[str, torch.Tensor], dims) -> dict[str, float]:
    """Sum every value over the DP ranks in one all-reduce (CP peers hold the same values)."""
    keys = sorted(sums)
    flat = torch.stack([torch.as_tensor(sums[k], dtype=torch.float64, device=dims.device).reshape(()) for k in keys])
    if dims.dp_group is not None:
        dist.all_reduce(flat, group=dims.dp_group)
    return dict(zip(keys, flat.tolist()))
