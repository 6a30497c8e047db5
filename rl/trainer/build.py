"""`build_trainer`: what a run builds once, before its first step, handed to `Trainer` (rl/trainer/trainer.py).

    task       rl/tasks/registry.py, first: its errors (files, tokenizer, held-out size) come before any weight loads
    policy     an Actor over the causal LM (model.lora.rank > 0: the base with adapters, model/lora.py)
    critic     a Critic (algo.uses_critic)
    reference  what the score stage's base log-probs come from (algo.kl_coef): a frozen copy, or the LoRA
               policy with its adapters off (`adapters_off`: no copy)
    teacher    rl/algos/distill.py `build_teacher`, on the reference copy's path (`ModelBuilder.frozen`)
    engines    rl/rollout/build.py: the rollout engine and the held-out evaluation's
    scheduler  rl/rollout/scheduler.py over rl/rollout/source.py: when each step's rollout is generated

Every model goes one way (`ModelBuilder.parallel`): built on the meta device and read shard by shard
from its checkpoint (model/loading.py), or built whole from the seed on every rank alike, then
parallelized (CP attention, EP, activation checkpointing, FSDP2: model/parallelize.py).
"""

from __future__ import annotations

from typing import Callable

import torch

from model import kernels
from model.actor import Actor, Critic
from runtime.allocator import release_memory
from model.loading import load_sharded, materialize
from model.lora import adapters_disabled, apply_lora
from model.models import build_model, compute_copy, model_config_value
from model.moe import is_moe, shard_experts
from runtime.parallel_dims import ParallelDims
from model.parallelize import parallelize
from rl.algos.distill import build_teacher
from rl.config import Config, check_task_fits, max_staleness
from rl.rollout.build import build_engine, evaluation_engine, vllm_engine
from rl.rollout.dedicated import Generator, RemoteRollouts, WeightPush, received_weights
from rl.rollout.engine import HFRolloutEngine
from rl.rollout.evaluate import heldout_problems
from rl.rollout.replica import RolloutEngineName
from rl.rollout.scheduler import RolloutScheduler
from rl.rollout.source import RolloutSource
from rl.rollout.sync import resolve_bucket_bytes, sync_weights, tensor_order
from rl.tasks.calls import UserCalls
from rl.tasks.registry import build_task
from rl.trainer.trainer import Trainer


class ModelBuilder:
    """The run's one way to build a model: `parallel` (the policy, the critic) and `frozen` (the
    reference copy, the distillation teacher: no gradients, eval mode)."""

    def __init__(self, cfg: Config, dims: ParallelDims) -> None:
        m = self.settings = cfg.model
        self.cfg, self.dims = cfg, dims
        self.dtype = getattr(torch, m.dtype.value)
        self.param_dtype = getattr(torch, m.param_dtype.value) if m.param_dtype is not None else None

    def lm(self, device=None):
        """The policy's causal LM before its adapters: `model.pretrained_path`, else random from the seed."""
        m = self.settings
        return build_model(m.name.value if m.name is not None else None, pretrained_path=m.pretrained_path,
                           seed=self.cfg.seed, dtype=self.dtype, device=device, **m.overrides)

    def policy_lm(self, device=None, adapters_on=None):
        """The policy's causal LM: with model.lora.rank > 0 the base with adapters (model/lora.py),
        allocated on `adapters_on` when the base is a meta skeleton (None: left on meta)."""
        m = self.settings
        lm = self.lm(device)
        return apply_lora(lm, m.lora, seed=self.cfg.seed, device=adapters_on) if m.lora.rank else lm

    def parallel(self, wrap, lm=None, path=None, *, activation_checkpointing=None, dense_ok=False):
        """`wrap(lm(device))` (an Actor or Critic), parallelized. A checkpoint (`path`, by default
        model.pretrained_path) is built on the meta device and each rank reads only its shard of it
        (model/loading.py); a random-init model is built whole from the seed on every rank alike,
        then sharded."""
        lm, path = lm or self.lm, path if path is not None else self.settings.pretrained_path
        checkpointing = (self.cfg.trainer.activation_checkpointing if activation_checkpointing is None
                         else activation_checkpointing)
        module = parallelize(wrap(lm("meta" if path is not None else None)), self.dims, param_dtype=self.param_dtype,
                             activation_checkpointing=checkpointing, dense_ok=dense_ok)
        return load_sharded(module, path, self.dims) if path is not None else module

    def actor(self, lm: torch.nn.Module, *, temperature: float, replay: bool = True) -> Actor:
        m = self.settings
        return Actor(lm, temperature=temperature, chunk_bytes=m.logprob_chunk_bytes, dims=self.dims, replay=replay,
                     actions_only=True, share_prompts=m.share_prompts)

    def frozen(self, lm=None, path=None, *, temperature: float, replay: bool = True, **parallel) -> Actor:
        """A frozen Actor (no gradients, eval mode) over `lm` read from `path` (by default the
        policy's model): the reference copy, or the distillation teacher (its own routing: `replay=False`)."""
        def wrap(model):
            return self.actor(model.requires_grad_(False), temperature=temperature, replay=replay)
        return self.parallel(wrap, lm, path, **parallel).eval()


def adapters_off(actor: Actor) -> Callable:
    """The LoRA policy's base as the reference: `actor`'s log-probs with every adapter skipped
    (model/lora.py `adapters_disabled`), no copy built; the policy is left in eval mode, as the
    score stage has it."""
    def reference(batch):
        actor.eval()
        with adapters_disabled(actor.model):
            return actor(batch)
    return reference


def build_trainer(cfg: Config, dims: ParallelDims) -> Trainer:
    """The task, the models (each parallelized: EP, activation checkpointing, FSDP2), the rollout
    engine (an unsharded copy synced from the policy, or the sharded policy itself: rollout.replica,
    rl/rollout/replica.py) and its scheduler, handed to a `Trainer`."""
    m, build = cfg.model, ModelBuilder(cfg, dims)
    kernels.select(m.attention, dims.device, build.param_dtype or build.dtype)  # logs the packed attention kernel
    vocab_size = model_config_value(cfg, "vocab_size")[0]
    task = build_task(cfg.task.name, prompts_path=cfg.task.prompts_path, reward_fn=cfg.task.reward_fn,
                      tokenizer_path=cfg.task.tokenizer_path, vocab_size=vocab_size, **cfg.task.options,
                      calls=UserCalls(cfg.task.on_error, cfg.task.timeout_s,  # how its user code is called
                                      cfg.task.isolation))
    check_task_fits(cfg, task)  # batch.max_tokens holds the task's longest prompt + task.max_new_tokens
    heldout = heldout_problems(task, cfg.eval.num_prompts, cfg.task.name.value) if cfg.eval.every else []

    actor = build.parallel(lambda lm: build.actor(lm, temperature=m.temperature),
                           lambda device: build.policy_lm(device, adapters_on=dims.device))
    critic = build.parallel(lambda lm: Critic(lm, dims=dims, share_prompts=m.share_prompts)) if cfg.algo.uses_critic \
        else None
    reference = None  # what the base log-probs come from: a frozen copy; LoRA: the policy's base, no copy built
    if cfg.algo.kl_coef:
        reference = adapters_off(actor) if m.lora.rank else build.frozen(temperature=m.temperature)
    # on-policy distillation's teacher (rl/algos/distill.py): its own shards, before the engine's memory plan;
    # with dedicated generators the trainers' alone (their mesh: the generators only sample, `build_generator`)
    teacher = build_teacher(cfg, dims, build.frozen, param_dtype=build.param_dtype) if cfg.algo.teacher.path else None
    k = max_staleness(cfg.rollout)
    if dims.rollout_ranks:  # dedicated generators (rl/rollout/dedicated.py): the trainers push, hold no engine
        engine = WeightPush(dims, resolve_bucket_bytes(actor.model, cfg.rollout.sync_bucket_bytes,
                                                       world=dims.world_size))
        sync_weights(engine, actor.model)  # version 0, to every generator (`build_generator`)
        # the held-out evaluation (eval.every): the policy itself, over the trainers alone
        return Trainer(cfg, dims, actor=actor, critic=critic, reference=reference, engine=engine,
                       eval_engine=evaluation_engine(dims, task, actor, engine, k) if cfg.eval.every else engine,
                       scheduler=RemoteRollouts(engine, dims, cfg, task), task=task, heldout=heldout, teacher=teacher)
    # rollout.engine: hf | vllm (rl/rollout/build.py); its memory plan counts the teacher
    engine = build_engine(cfg, dims, task, actor, build.policy_lm, teacher=teacher, max_staleness=k)
    release_memory()  # what loading and sharding freed, back to the OS (runtime/allocator.py)
    source = RolloutSource(cfg, dims, engine, task)  # what each rollout round generates; the scheduler says when
    scheduler = RolloutScheduler(
        source, engine, max_staleness=k, max_steps=cfg.trainer.max_steps,
        samples_per_step=cfg.task.prompts_per_step * cfg.task.samples_per_prompt, rank=dims.rank, device=dims.device)
    return Trainer(cfg, dims, actor=actor, critic=critic, reference=reference, engine=engine,
                   eval_engine=evaluation_engine(dims, task, actor, engine, k), scheduler=scheduler, task=task,
                   heldout=heldout, teacher=teacher)


def build_generator(cfg: Config, dims: ParallelDims) -> Generator:
    """A dedicated generator rank (parallel.rollout_ranks, rl/rollout/dedicated.py): the task, the
    engine rollout.engine names (the project's over an unsharded copy of the policy in the compute
    dtype; vLLM's, an engine of this rank's own over the checkpoint folder, recording an MoE's routes
    and taking LoRA's adapters as the colocated vLLM engine does), filled by the trainers' first push
    (version 0), and a `RolloutScheduler` over generator g's slice of the prompts (the
    slice a colocated DP rank g of R rolls out) whose syncs receive the pushes."""
    m, build = cfg.model, ModelBuilder(cfg, dims)
    compute = build.param_dtype or build.dtype
    kernels.select(m.attention, dims.device, compute)
    task = build_task(cfg.task.name, prompts_path=cfg.task.prompts_path, reward_fn=cfg.task.reward_fn,
                      tokenizer_path=cfg.task.tokenizer_path, vocab_size=model_config_value(cfg, "vocab_size")[0],
                      **cfg.task.options, calls=UserCalls(cfg.task.on_error, cfg.task.timeout_s, cfg.task.isolation))
    check_task_fits(cfg, task)
    # what a push sends: names, shapes and master dtypes in the trainers' order, an MoE's blocks as they train
    # them (model/moe.py's MoEBlocks); a skeleton of its own: a block's expert load is a buffer materialize refuses
    # (LoRA: the policy's adapters with the base; the full model, then once the engine holds the base, as
    # WeightPush.holds_base on the trainers, the adapters only)
    pushed = build.policy_lm("meta")
    pushed = shard_experts(pushed, None) if is_moe(pushed) else pushed
    order, adapters = tensor_order(pushed), tensor_order(pushed, adapters_only=True)
    if RolloutEngineName(cfg.rollout.engine) is RolloutEngineName.VLLM:  # loads a push as a colocated sync does
        engine = vllm_engine(cfg, dims, task, build.policy_lm,
                             resolve_bucket_bytes(pushed, cfg.rollout.sync_bucket_bytes, world=1), moe=is_moe(pushed),
                             alone=True)
    else:
        engine = HFRolloutEngine(materialize(compute_copy(build.policy_lm("meta"), compute), dims.device),
                                 stop_token_id=task.stop_token_id)  # the colocated copy's way (rl/rollout/build.py)
    engine.load_weights(received_weights(order, dims, dims.device))  # version 0

    def receive(target, _model) -> None:
        target.load_weights(received_weights(adapters if engine.holds_base and adapters else order, dims, dims.device))

    k = max_staleness(cfg.rollout)
    source = RolloutSource(cfg, dims, engine, task, part=(dims.rank - dims.world_size, dims.rollout_ranks))
    scheduler = RolloutScheduler(source, engine, max_staleness=k, max_steps=cfg.trainer.max_steps,
                                 samples_per_step=cfg.task.prompts_per_step * cfg.task.samples_per_prompt,
                                 rank=dims.rank, device=dims.device, staged=True, write=receive)
    return Generator(scheduler, dims)
