"""The checks of a typed `Config` that types cannot make (sizes, paths, combinations, what a
checkpoint or the machine allows), before any model is built: `validate`, each error naming its
key, returning what it resolves (`Checked`: the config as the run uses it, the parallel sizes);
the start-up warnings; `max_staleness`; and the check of a built task against the batch
(`check_task_fits`)."""

from __future__ import annotations

import dataclasses
import importlib.util
import typing
from pathlib import Path
from typing import Any, Callable, NamedTuple, Optional

import torch

from model.families import MOE
from model.kernels import resolve as resolve_kernel
from model.lora import check_settings as check_lora
from runtime.parallel_dims import ParallelDims, resolve_device
from rl.algos.advantages import ADVANTAGE_ESTIMATORS, get_advantage_estimator
from rl.algos.distill import check_teacher
from rl.algos.losses import KLMode, check_policy_loss_config
from rl.config.schema import Config, DType, ModelName, OldLogProbs, RolloutConfig
from rl.rollout.replica import ReplicaMode, RolloutEngineName, check_sharded
from rl.rollout.scheduler import RolloutMode
from rl.tasks.base import Task, longest_sample


class Checked(NamedTuple):
    """What `validate` resolves: the config as the run uses it and the run's parallel sizes."""

    cfg: Config  # a copy of the config given, model.param_dtype's auto (null) resolved for the device
    dims: ParallelDims  # sizes only: `init_distributed` joins the group and builds the meshes


def validate(cfg: Config, world_size: int) -> Checked:
    """Everything checkable before a model is built; each error names its key. Returns what it
    resolves (`Checked`); `cfg` itself is not written."""
    _check_ranges(cfg)
    generators = _check_rollout_ranks(cfg, world_size)
    # the one check of the parallel sizes (cp, dp, ep against the training ranks): ParallelDims' own
    dims = ParallelDims(dp=cfg.parallel.dp, cp=cfg.parallel.cp, ep=cfg.parallel.ep,
                        world_size=world_size - generators, rollout_ranks=generators)
    if cfg.task.prompts_per_step % dims.dp:
        raise ValueError(f"task.prompts_per_step={cfg.task.prompts_per_step} does not divide over dp={dims.dp} "
                         f"ranks (world_size={world_size}, parallel.cp={dims.cp})")
    _check_algo(cfg)
    check_teacher(cfg)  # rl/algos/distill.py: the keys, the checkpoint, its vocabulary and tokenizer
    family = _check_paths(cfg)
    _check_task(cfg)
    _check_experts(cfg, dims.ep, family)
    check_lora(cfg.model.lora, moe=family in MOE, engine=RolloutEngineName(cfg.rollout.engine).value)
    compute = compute_dtype(cfg.model.dtype, cfg.model.param_dtype, resolve_device(cfg.trainer.device.value))
    run = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, param_dtype=compute))  # auto, resolved once
    _check_device(run)
    if generators:
        _check_dedicated(run)
    _check_rollout(run, world_size, family)
    return Checked(run, dims)


def _check_rollout_ranks(cfg: Config, world_size: int) -> int:
    """`parallel.rollout_ranks` R: at least one rank left to train, and the step's prompts split
    evenly over the generators (generator g rolls out slice g of R)."""
    r = cfg.parallel.rollout_ranks
    if isinstance(r, bool) or not isinstance(r, int) or not 0 <= r < world_size:
        raise ValueError(f"parallel.rollout_ranks={r!r}: expected an int in [0, world_size={world_size}) (the last R "
                         f"ranks generate, the others train: at least one trains)")
    if r and cfg.task.prompts_per_step % r:
        raise ValueError(f"task.prompts_per_step={cfg.task.prompts_per_step} does not divide over "
                         f"parallel.rollout_ranks={r} generators")
    return r


def _check_dedicated(cfg: Config) -> None:
    """What dedicated rollout ranks (parallel.rollout_ranks > 0) run today: the project's engine or
    vLLM (cpu or cuda), on a dense or MoE model (routing replay: the records carry the routes the
    generators' engines recorded) with full fine-tuning or LoRA (the first push the full model, later
    ones the adapters only: vLLM takes them as adapter versions), the trainers data, context and expert
    parallel over their own mesh, dynamic sampling as colocated (max_staleness=0: `_check_rollout_mode`),
    on-policy distillation (the teacher the trainers', scoring in their score stage: the generators only
    sample), held-out evaluation on the trainers with the policy itself (rl/rollout/build.py
    `evaluation_engine`, the generators taking no part); docs/rollouts.md."""
    p, r = cfg.parallel, cfg.rollout
    keys = "parallel.rollout_ranks=" + str(p.rollout_ranks)
    refused = [
        (ReplicaMode(r.replica) is ReplicaMode.SHARDED, "rollout.replica=sharded: a generator holds its own copy; "
                                                        "use rollout.replica=auto or keep"),
        (r.tensor_parallel_size > 1, f"rollout.tensor_parallel_size={r.tensor_parallel_size}: expected 1"),
    ]
    for bad, why in refused:
        if bad:
            raise ValueError(f"{keys} (dedicated rollout ranks): {why}")


def _check_algo(cfg: Config) -> None:
    """`algo.*` against the step's size and each other: the policy loss's own check, overlong
    shaping, the estimator's groups, and where the KL to the reference goes."""
    samples = cfg.task.prompts_per_step * cfg.task.samples_per_prompt
    if cfg.algo.mini_batches > samples:
        raise ValueError(f"algo.mini_batches={cfg.algo.mini_batches} exceeds the step's {samples} samples "
                         f"(task.prompts_per_step x task.samples_per_prompt)")
    check_policy_loss_config(cfg.algo, prefix="algo.")
    if cfg.algo.overlong_buffer is not None and not 0 < cfg.algo.overlong_buffer <= cfg.task.max_new_tokens:
        raise ValueError(f"algo.overlong_buffer={cfg.algo.overlong_buffer}: expected 1..task.max_new_tokens="
                         f"{cfg.task.max_new_tokens} or null")
    advantage = get_advantage_estimator(cfg.algo.advantage, "algo.advantage")
    if advantage.needs_groups and cfg.task.samples_per_prompt < 2:
        raise ValueError(f"algo.advantage={advantage.name} with task.samples_per_prompt={cfg.task.samples_per_prompt}: "
                         "a group of one sample has advantage 0 everywhere (nothing to learn); use >= 2")
    # the KL to the reference is either a loss term or a reward penalty, never both (rl/algos/advantages.py)
    kl_mode = KLMode(cfg.algo.kl_mode)
    if cfg.algo.kl_in_reward and not advantage.reads_kl:
        # a sequence-level estimator's group baseline would need every sample's KL, but a rank
        # holds only its own samples' KL (only the rewards are gathered): it reads no KL at all
        token_level = sorted(e.name for e in ADVANTAGE_ESTIMATORS.values() if e.reads_kl)
        raise ValueError(f"algo.kl_mode=reward with algo.advantage={advantage.name}: its group baseline would need "
                         f"every sample's KL on every rank; use algo.kl_mode=loss, or a token-level estimator "
                         f"({', '.join(token_level)}) that reads the KL per token")
    if cfg.algo.kl_coef and kl_mode is KLMode.LOSS and advantage.kl_in_reward:
        raise ValueError(f"algo.advantage={advantage.name} with algo.kl_coef={cfg.algo.kl_coef} and "
                         f"algo.kl_mode=loss: {advantage.name} puts the KL in the reward (-kl_coef * kl per "
                         f"token), not in the loss; set algo.kl_mode=reward")


def _check_paths(cfg: Config) -> str:
    """The model's checkpoint folder (config.json, weights, a supported family) or its family, and
    the task's files, exist; a random-init model's context leaves room for a prompt. Returns the
    model's family."""
    if cfg.model.pretrained_path is not None:
        if not Path(cfg.model.pretrained_path).is_dir():
            raise ValueError(f"model.pretrained_path={cfg.model.pretrained_path!r}: folder not found (a local "
                             "checkpoint folder is expected; nothing is downloaded)")
        family = _model_family(cfg)  # config.json, weights and a supported model_type, before any weight is read
    elif cfg.model.name is None:
        raise ValueError("model.name=null needs model.pretrained_path (a random-init model needs a family: "
                         f"one of {ModelName.values()})")
    else:
        family = cfg.model.name.value
    for key in ("prompts_path",):
        value = getattr(cfg.task, key)
        if value is not None and not Path(value).is_file():
            raise ValueError(f"task.{key}={value!r}: file not found")
    if cfg.task.tokenizer_path is not None and not Path(cfg.task.tokenizer_path).is_dir():
        raise ValueError(f"task.tokenizer_path={cfg.task.tokenizer_path!r}: folder not found")
    if cfg.model.pretrained_path is None:
        limit = cfg.model.overrides.get("max_position_embeddings")
        if limit is not None and cfg.task.max_new_tokens >= limit:
            raise ValueError(f"task.max_new_tokens={cfg.task.max_new_tokens} leaves no room for a prompt within "
                             f"model.overrides.max_position_embeddings={limit}")
    return family


# above it, full fine-tuning of a pretrained checkpoint warns at start-up (`learning_rate_warning`): the
# usual full fine-tuning rates are 1e-6 (TRL's GRPO default) to 1e-5 (this project's SmolLM2 runs); 3e-3, the
# tiny random models' default, wrecks a pretrained checkpoint within a few steps
FULL_FINETUNE_MAX_LR = 1e-4


def learning_rate_warning(cfg: Config) -> str | None:
    """The start-up warning for full fine-tuning of a pretrained checkpoint (model.pretrained_path set,
    model.lora.rank 0) at a `trainer.lr` above `FULL_FINETUNE_MAX_LR`; None when the rate is not suspect."""
    if cfg.model.pretrained_path is None or cfg.model.lora.rank or cfg.trainer.lr <= FULL_FINETUNE_MAX_LR:
        return None
    return (f"trainer.lr={cfg.trainer.lr:g} is above {FULL_FINETUNE_MAX_LR:g} for full fine-tuning of the pretrained "
            f"checkpoint model.pretrained_path={cfg.model.pretrained_path}: such rates wreck a pretrained model in a "
            f"few steps; full fine-tuning usually takes 1e-6..1e-5 (model=pretrained's default: 1e-5), LoRA "
            f"(model.lora.rank > 0) about 2e-4")


def plot_warning(cfg: Config) -> str | None:
    """The start-up warning for `trainer.plot` without matplotlib, which draws curves.png after the
    last step: the plot is turned off (`trainer.plot` set false) rather than the run failing once
    training is over. None when there is nothing to say. train.py asks once, on rank 0 (the rank
    that plots), beside `learning_rate_warning`."""
    if not cfg.trainer.plot or importlib.util.find_spec("matplotlib") is not None:
        return None
    cfg.trainer.plot = False
    return ("trainer.plot=true but matplotlib is not installed: no curves.png will be drawn (the metrics are in "
            "metrics.jsonl; pip install matplotlib, or set trainer.plot=false to silence this)")


def _positive(x: Any) -> bool:
    return x > 0


def _non_negative(x: Any) -> bool:
    return x >= 0


def _fraction(x: Any) -> bool:
    return 0 <= x <= 1


# every numeric field of the schema and the range it must lie in (a None value, where the schema
# allows it, means "off" and is not checked); algo's policy-loss fields are check_policy_loss_config's,
# parallel's ParallelDims'
RANGES: dict[str, tuple[Callable[[Any], bool], str]] = {
    **{key: (_positive, "a positive number") for key in (
        "model.temperature", "model.logprob_chunk_bytes", "batch.max_tokens", "batch.micro_batch_size",
        "algo.mini_batches", "algo.epochs", "algo.max_sampling_rounds", "algo.kl_target", "algo.kl_horizon",
        "algo.kl_clamp", "algo.kl_log_ratio_clamp", "algo.value_clip", "task.prompts_per_step",
        "task.samples_per_prompt", "task.max_new_tokens", "trainer.max_steps", "trainer.max_bad_steps",
        "rollout.kv_cache_gb", "rollout.memory_budget_gb", "rollout.max_model_len", "eval.num_prompts",
        "eval.max_new_tokens", "eval.batch_size", "checkpoint.keep", "task.timeout_s")},
    **{key: (_non_negative, ">= 0") for key in (
        "algo.entropy_coef", "algo.distill_coef", "algo.distill_kl_coef", "algo.vf_coef", "algo.critic_lr",
        "algo.router_aux_loss_coef", "algo.kl_coef",
        "algo.overlong_penalty_factor", "trainer.lr", "trainer.warmup_steps", "trainer.weight_decay",
        "trainer.grad_clip", "trainer.min_entropy", "rollout.max_staleness", "eval.every", "checkpoint.every",
        "trainer.log_samples", "seed")},
    **{key: (_fraction, "in [0, 1]") for key in ("algo.gamma", "algo.lam", "algo.distill_discount")},
}


def _check_ranges(cfg: Config) -> None:
    """Each `RANGES` field in its range, named by its key (trainer.lr=-1 would otherwise reach
    torch's "Invalid learning rate" once the model is built)."""
    for key, (ok, expected) in RANGES.items():
        section, name = key.split(".") if "." in key else (None, key)
        value = getattr(getattr(cfg, section) if section else cfg, name)
        if value is not None and not ok(value):
            raise ValueError(f"{key}={value!r}: expected {expected}"
                             + (" or null" if _optional(type(getattr(cfg, section) if section else cfg), name) else ""))


def _optional(cls: type, name: str) -> bool:
    """The schema field `cls.name` may be None."""
    hints = typing.get_type_hints(cls)
    return type(None) in typing.get_args(hints[name])


def _check_task(cfg: Config) -> None:
    """The user's reward function (`task.reward_fn`) imports, and `task.options` are the task's
    with values it accepts (rl/tasks/registry.py `check_options`: names, reasoning-gym datasets,
    tools, the environment class and its options), before any model or tokenizer is built; the
    errors name the key (an import's, where the module was looked for)."""
    from rl.tasks.base import load_callable
    from rl.tasks.registry import check_options

    if isinstance(cfg.task.reward_fn, str):
        try:
            load_callable(cfg.task.reward_fn, "task.reward_fn")
        except (ImportError, AttributeError, TypeError) as e:
            raise ValueError(str(e)) from e
    check_options(cfg.task.name, cfg.task.options)


def _check_experts(cfg: Config, ep: int, family: str) -> None:
    """ep divides the expert count (what model.moe.shard_experts would refuse later, named by
    config key here); the sizes against the world are ParallelDims' check."""
    if ep > 1 and family == ModelName.QWEN3_MOE.value:
        from model.models import check_expert_split, model_config_value  # imports transformers: only when needed

        experts, key = model_config_value(cfg, "num_experts")
        check_expert_split(experts, ep, key)


def _model_family(cfg: Config) -> str:
    """model/models.py `model_family`, imported when asked (it imports transformers)."""
    from model.models import model_family

    return model_family(cfg)


def _check_rollout(cfg: Config, world_size: int, family: str) -> None:
    """`rollout.*`: sizes, and for the vLLM engine that the extra is installed, that vLLM
    knows the model's family and, for MoE routing replay, can return routed experts."""
    r = cfg.rollout
    if r.sync_bucket_bytes is not None and r.sync_bucket_bytes < 1 << 20:
        raise ValueError(f"rollout.sync_bucket_bytes={r.sync_bucket_bytes}: expected >= 1 MiB (1048576)")
    if r.gpu_memory_utilization is not None and not 0 < r.gpu_memory_utilization < 1:
        raise ValueError(f"rollout.gpu_memory_utilization={r.gpu_memory_utilization}: expected a fraction in (0, 1)")
    if r.tensor_parallel_size < 1 or world_size % r.tensor_parallel_size:
        raise ValueError(f"rollout.tensor_parallel_size={r.tensor_parallel_size}: expected >= 1 dividing "
                         f"world_size={world_size}")
    _check_rollout_mode(cfg)
    if ReplicaMode(r.replica) is ReplicaMode.SHARDED:
        check_sharded(cfg)
    if RolloutEngineName(r.engine) is not RolloutEngineName.VLLM:
        return
    from rl.rollout.vllm_checks import check_vllm_config  # imports vllm: only for rollout.engine=vllm

    check_vllm_config(cfg, world_size, family)


def max_staleness(r: RolloutConfig) -> int:
    """`rollout.max_staleness`, or what its alias `rollout.mode` says (sync 0, one_step_off 1,
    async 1 unless given); the two contradicting each other is an error naming both."""
    k = r.max_staleness
    if r.mode is None:
        return k or 0
    mode = RolloutMode(r.mode)
    implied = {RolloutMode.SYNC: 0, RolloutMode.ONE_STEP_OFF: 1}.get(mode)  # None: async, the given k
    if k is None:
        return 1 if implied is None else implied
    if (k != implied) if implied is not None else (k < 1):
        raise ValueError(f"rollout.max_staleness={k} with rollout.mode={mode.value}: the mode means max_staleness="
                         f"{implied if implied is not None else '>= 1'}; set one of the two")
    return k


def _check_rollout_mode(cfg: Config) -> None:
    """`rollout.max_staleness` (or `rollout.mode`, rl/rollout/scheduler.py); what only the built
    engine tells (rollout.replica=auto resolving to sharded) is `RolloutScheduler`'s check."""
    r, algo = cfg.rollout, cfg.algo
    k = max_staleness(r)
    if not k:
        return
    m = f"rollout.mode={RolloutMode(r.mode).value}" if r.mode is not None else f"rollout.max_staleness={k}"
    if r.tensor_parallel_size > 1:  # before the engine's check below, which may be lifted alone
        raise ValueError(f"{m} with rollout.tensor_parallel_size={r.tensor_parallel_size}: a TP group gathers its "
                         "prompts (a collective) on the rollout thread while the main thread trains, which no GPU "
                         "test has run yet; set rollout.max_staleness=0 or rollout.tensor_parallel_size=1")
    if ReplicaMode(r.replica) is ReplicaMode.SHARDED:
        raise ValueError(f"{m} with rollout.replica=sharded: generation would use the training policy's shards "
                         "while they train; set rollout.replica=keep (or auto)")
    if RolloutEngineName(r.engine) is not RolloutEngineName.HF and not cfg.parallel.rollout_ranks:
        raise ValueError(f"{m} with rollout.engine={RolloutEngineName(r.engine).value} colocated: only "
                         "rollout.engine=hf generates in a training rank's rollout thread; run vLLM asynchronously "
                         "on dedicated rollout ranks (parallel.rollout_ranks=R: the last R ranks of the job only "
                         "generate, docs/rollouts.md), or set rollout.max_staleness=0")
    if algo.dynamic_sampling:
        raise ValueError(f"{m} with algo.dynamic_sampling=true: its extra rounds depend on the step's gathered "
                         "rewards; use rollout.max_staleness=0 with dynamic sampling")
    if algo.tis_cap is None and OldLogProbs(algo.old_log_probs) is not OldLogProbs.ROLLOUT:
        raise ValueError(f"{m} with algo.tis_cap=null and algo.old_log_probs=policy: the samples are policy "
                         "versions old and nothing would correct for it; set algo.tis_cap (truncated "
                         "importance sampling against the behaviour log-probs, e.g. 2.0) or algo.old_log_probs=rollout")


def compute_dtype(master: DType, asked: Optional[DType], device: torch.device) -> Optional[DType]:
    """`model.param_dtype` as a run on `device` uses it: as asked; else (null = auto) bfloat16 on CUDA over
    float32 masters (fp32 weights and optimizer, bf16 matmuls); else null: compute in the masters' dtype
    (a CPU computes in fp32 unless asked: its bf16 kernels are slower than fp32)."""
    if asked is not None:
        return asked
    return DType.BFLOAT16 if device.type == "cuda" and master is DType.FLOAT32 else None


def _check_device(cfg: Config) -> None:
    """`trainer.device` exists here, and the model dtypes run on it: float16 on CPU does not
    (measured: the fp16 rollout samples from NaN probabilities); `model.attention`'s kernel runs
    on that device in the compute dtype."""
    device = resolve_device(cfg.trainer.device.value)  # trainer.device=cuda without CUDA: an error naming it
    if device.type == "cpu":
        for key, value in (("model.dtype", cfg.model.dtype), ("model.param_dtype", cfg.model.param_dtype)):
            if value is DType.FLOAT16:
                raise ValueError(f"{key}=float16 on cpu: CPU float16 kernels are not usable for training or "
                                 f"sampling; use float32 or bfloat16 (or run on CUDA)")
    compute = cfg.model.param_dtype or cfg.model.dtype
    resolve_kernel(cfg.model.attention.value, device, getattr(torch, compute.value))  # model.attention can run here


def check_task_fits(cfg: Config, task: Task) -> None:
    """After the task is built: its longest sample fits in one microbatch of `batch.max_tokens`
    (else the planner would refuse a sample mid-run): the longest prompt plus
    `task.max_new_tokens`, per turn of a multi-turn task, plus its observations between turns."""
    prompt, turns = task.max_prompt_len, task.max_turns
    if turns > 1 and cfg.algo.overlong_buffer is not None:
        raise ValueError(f"algo.overlong_buffer shapes the reward by one reply's length; task {cfg.task.name.value!r} is "
                         f"multi-turn (task.options.max_turns={turns}): set algo.overlong_buffer=null")
    if prompt is None:
        return
    observation = task.max_observation_len
    longest = longest_sample(task, cfg.task.max_new_tokens)
    if longest > cfg.batch.max_tokens:
        what = (f"plus task.max_new_tokens={cfg.task.max_new_tokens}" if turns == 1 else
                f"plus {turns} replies of task.max_new_tokens={cfg.task.max_new_tokens} and {turns - 1} "
                f"observations of up to {observation} tokens")
        raise ValueError(f"batch.max_tokens={cfg.batch.max_tokens} is below the longest possible sample: task "
                         f"{cfg.task.name.value!r} has prompts of up to {prompt} tokens, {what} = {longest}")