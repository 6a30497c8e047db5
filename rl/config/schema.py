"""The typed config schema. Hydra merges conf/*.yaml onto it, so an unknown or mistyped key,
or a value outside a closed choice (an `Enum` field), fails at start-up with the key's name.
`validate` then checks what types cannot (sizes, paths, combinations) before any model is
built, each message naming the key."""

from __future__ import annotations

import importlib.util
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

import torch

from model.families import FAMILIES, MOE
from model.kernels import KERNELS, resolve as resolve_kernel
from model.lora import LoraSettings, check_settings as check_lora
from model.parallel_dims import ParallelDims, resolve_device
from rl.algos.distill import check_teacher
from rl.algos.advantages import ADVANTAGE_ESTIMATORS, AdvantageConfig, get_advantage_estimator
from rl.choice import Choice
from rl.rollout.scheduler import RolloutMode
from rl.rollout.replica import ReplicaMode, RolloutEngineName, check_sharded
from rl.algos.losses import KLConfig, KLMode, PolicyLossConfig, check_policy_loss_config
from rl.tasks.calls import Isolation, OnError
from rl.trainer.metrics import Logger
from rl.tasks.base import Task
from rl.tasks.registry import TaskName
from rl.algos.schedule import LRSchedule


# the supported families (model/families.py); a checkpoint names its own in config.json
ModelName = Choice("ModelName", [(name.upper(), name) for name in FAMILIES], module=__name__)
# the varlen kernel of packed attention (model/kernels.py); auto = torch's own on CUDA fp16/bf16, sdpa on CPU
AttentionKernel = Choice("AttentionKernel", [(name.upper(), name) for name in KERNELS], module=__name__)


class DType(Choice):
    FLOAT32 = "float32"
    BFLOAT16 = "bfloat16"
    FLOAT16 = "float16"


class Device(Choice):
    AUTO = "auto"
    CPU = "cpu"
    CUDA = "cuda"


@dataclass
class TeacherConfig:
    """`algo.teacher.*`: the frozen model whose log-probs of the student's samples are the
    distillation signal (rl/algos/distill.py, docs/algorithms.md Distillation). It lives as its own
    FSDP2 shards on the training device, without gradients or optimizer state, like the reference model."""

    # a local checkpoint folder of a supported family (dense or MoE) with the student's vocabulary and
    # tokenizer; null = no teacher
    path: Optional[str] = None
    dtype: Optional[DType] = None  # the teacher's weights as loaded; null = model.dtype
    # at start-up, compare the teacher's log-probs on a few fixed sequences with a plain transformers forward
    # and refuse a difference above self_test_tol
    self_test: bool = True
    # the self-test's bound on the largest |log-prob difference|; null = 1e-3 for float32 compute, 0.1 for bf16/fp16
    self_test_tol: Optional[float] = None


class OldLogProbs(Choice):
    POLICY = "policy"  # a no-grad pass of the pre-update policy (only when the policy changes within a step)
    ROLLOUT = "rollout"  # the rollout engine's log-probs


@dataclass
class ModelConfig:
    # the family of a random-init model; None with pretrained_path = the checkpoint's own (config.json)
    name: Optional[ModelName] = ModelName.QWEN3_MOE
    pretrained_path: Optional[str] = None  # a local checkpoint folder; None = tiny random init
    dtype: DType = DType.FLOAT32  # the master weights, as built / loaded: what AdamW steps (FSDP2 shards them)
    # the compute dtype: FSDP2's MixedPrecisionPolicy(param_dtype), gradients reduced in fp32, the rollout copy
    # computes in it too; null = auto: bfloat16 on CUDA over float32 masters, else model.dtype (CPU: fp32 unless asked)
    param_dtype: Optional[DType] = None
    temperature: float = 1.0  # the sampling temperature: rollout samples and training scores the same softmax(z / T)
    # bytes of one [rows, vocab] fp32 chunk of the log-prob head: rows = bytes // (4 x vocab), so every
    # vocabulary reaches the same peak; a microbatch that fits one chunk skips the backward recompute
    logprob_chunk_bytes: int = 512 * 2**20
    # run each prompt a pack repeats (a GRPO group's samples) once through the body (model/actor.py
    # _shared_prompt_view), dense and MoE, any cp and ep; padded batches and packs without a repeat run as before
    share_prompts: bool = True
    # the packed path's attention kernel (model/kernels.py): auto = torch's varlen_attn on CUDA fp16/bf16 (else
    # flash-attn, else per-sequence sdpa), per-sequence sdpa on CPU; torch / flash fail at start-up where they cannot run
    attention: AttentionKernel = AttentionKernel.AUTO
    overrides: Dict[str, Any] = field(default_factory=dict)  # Hugging Face config fields
    # LoRA adapters on the policy (model/lora.py, PEFT): rank 0 = full fine-tuning; the reference is the
    # same model with its adapters disabled, the weight sync sends adapters only
    lora: LoraSettings = field(default_factory=LoraSettings)


@dataclass
class ParallelConfig:
    dp: int = -1  # -1: world_size // cp
    cp: int = 1  # context parallelism: ranks that split each packed microbatch's tokens (ring attention)
    ep: int = 1  # expert parallelism (MoE): ranks that split the experts (num_experts / ep each)


class Balance(Choice):
    """`batch.balance`: what the microbatch planner evens out across DP ranks and microbatches."""

    TOKENS = "tokens"
    FLOPS = "flops"  # a * tokens + b * tokens^2 from the model config (packing/planner.py flop_cost)


@dataclass
class BatchConfig:
    packed: bool = True  # true: THD microbatches (samples packed in one row, no padding); false: padded [B, T]
    max_tokens: int = 4096  # token budget of one microbatch (token-budget planner; a hard cap)
    micro_batch_size: Optional[int] = None  # fixed samples per microbatch instead of a token budget
    balance: Balance = Balance.FLOPS  # what the planner evens out over DP ranks and microbatches: tokens or flops


@dataclass
class AlgoConfig(PolicyLossConfig, KLConfig, AdvantageConfig):
    """`algo.*`: the policy-loss, KL and advantage fields (one source of truth each, in
    rl/algos/losses.py and rl/algos/advantages.py) plus how a step turns into updates. A critic is
    trained when `advantage=gae`."""

    mini_batches: int = 1  # optimizer steps per epoch: the step's global batch split in k
    epochs: int = 1  # passes over the step's batch
    # the log-probs the ratio divides by: policy (a no-grad pass of the pre-update policy) or rollout (the engine's)
    old_log_probs: OldLogProbs = OldLogProbs.POLICY
    # the loss subtracts entropy_coef x the entropy (aggregated as algo.loss_agg): an exploration bonus; 0 = off
    entropy_coef: float = 0.0
    # PPO value clipping: the critic's loss is the larger of its values' and of those values clipped to the
    # old ones +- value_clip; None = off
    value_clip: Optional[float] = 0.2
    vf_coef: float = 0.5  # the value loss's weight in the critic's loss (algo.advantage=gae)
    critic_lr: float = 1e-3  # the critic's AdamW learning rate (algo.advantage=gae)
    routing_replay: bool = True  # R3: replay the rollout's routed_experts in training
    # MoE load-balancing loss (Switch / Qwen3-MoE's router_aux_loss_coef) over real tokens;
    # 0 = off (the default: measured on the default run, see README)
    router_aux_loss_coef: float = 0.0
    # DAPO dynamic sampling: drop prompt groups whose rewards are all equal (zero advantage)
    # and roll out more prompts until the step has task.prompts_per_step groups, at most
    # max_sampling_rounds rollouts per step (then train on what was kept; logged).
    dynamic_sampling: bool = False
    max_sampling_rounds: int = 3  # dynamic sampling: rollouts per step at most
    # DAPO overlong shaping: the last overlong_buffer tokens before task.max_new_tokens cost
    # up to overlong_penalty_factor of reward, linearly (None = off).
    overlong_buffer: Optional[int] = None
    overlong_penalty_factor: float = 1.0  # overlong shaping: the reward a reply reaching task.max_new_tokens loses
    teacher: TeacherConfig = field(default_factory=TeacherConfig)  # on-policy distillation's teacher
    # on-policy distillation added to the task estimator's advantages: + distill_coef x -(log p_student -
    # log p_teacher) per token (algo.teacher.path needed); 0 = off. algo.advantage=distill is the signal alone
    distill_coef: float = 0.0
    # the distillation advantage of token t: sum_k>=t distill_discount^(k-t) x -(log p_s - log p_t)_k; 0 = each
    # token its own term, 1 = the return-to-go (its expectation is the exact reverse-KL gradient)
    distill_discount: float = 0.0

    @property
    def uses_critic(self) -> bool:
        return get_advantage_estimator(self.advantage).uses_critic

    @property
    def kl_in_reward(self) -> bool:
        """The KL to the reference is shaped into the token rewards (`kl_mode=reward`, kl_coef > 0)."""
        return bool(self.kl_coef) and self.kl_mode == KLMode.REWARD


@dataclass
class TaskConfig:
    name: TaskName = TaskName.TARGET_TOKEN  # a built-in task (rl/tasks/registry.py TaskName) or "file"
    prompts_per_step: int = 16  # global, split over DP ranks
    samples_per_prompt: int = 8  # the GRPO group size
    max_new_tokens: int = 12  # the longest reply, in tokens (per turn of a multi-turn task)
    prompts_path: Optional[str] = None  # task=file|math: JSONL prompts
    reward_fn: Optional[str] = None  # task=file: "module:function"
    tokenizer_path: Optional[str] = None  # task=math (and text prompts): a local tokenizer folder
    options: Dict[str, Any] = field(default_factory=dict)  # extra task arguments
    # the user's code (reward, environment; rl/tasks/calls.py): skip = an exception or a timeout ends that
    # sample (reward 0, counted as episodes_error / episodes_timeout) and the run goes on; raise = it stops the run
    on_error: OnError = OnError.SKIP
    timeout_s: Optional[float] = 60.0  # wall-clock limit of one reward / environment call (any thread); null: none
    # where rewards and environments run (rl/tasks/calls.py; tools: in the trainer's process either way):
    # thread = in the trainer's process, a call past timeout_s abandoned (it runs on: a busy one takes CPU, a
    # GIL-holding one overruns the limit); process = worker processes (one per running call or episode, forked
    # from one made at start-up: rl/tasks/processes.py), a call past timeout_s killed with what it started
    isolation: Isolation = Isolation.THREAD


@dataclass
class TrainerConfig:
    max_steps: int = 20  # training steps (each: a rollout, then algo.epochs x algo.mini_batches updates)
    # the policy's AdamW learning rate (peak, after warmup): 3e-3 fits the tiny random models; model=pretrained
    # (and model=smollm2) set 1e-5 for full fine-tuning, and start-up warns above FULL_FINETUNE_MAX_LR (1e-4) on
    # a checkpoint without LoRA; LoRA's adapters take ~20x full fine-tuning's (the LoRA experiment: 2e-4)
    lr: float = 3e-3
    lr_schedule: LRSchedule = LRSchedule.CONSTANT  # after warmup: constant, or cosine decay to 0 at the last update
    # optimizer updates of linear warmup: the lr of update i < warmup_steps is lr x (i + 1) / warmup_steps
    warmup_steps: int = 0
    weight_decay: float = 0.0  # AdamW's decoupled weight decay
    grad_clip: float = 1.0  # the largest global gradient 2-norm: gradients are scaled down to it; 0 = no clipping
    device: Device = Device.AUTO  # auto: CUDA when available, else CPU
    # recompute each decoder layer's activations in backward (less memory, more compute)
    activation_checkpointing: bool = False
    max_bad_steps: int = 3  # consecutive non-finite updates skipped before the run stops
    min_entropy: Optional[float] = None  # warn when the mean entropy falls below it
    # where the step metrics go besides metrics.jsonl (always written): tensorboard, wandb, mlflow
    # (rl/trainer/metrics.py); a resumed run continues the same W&B / MLflow run
    loggers: List[Logger] = field(default_factory=lambda: [Logger.JSONL])
    project: str = "rl"  # the W&B project / MLflow experiment
    # each step's first N episodes (prompt, every turn's reply, tool calls with their results and status, the
    # environment's answers, reward, status) to <run>/samples.jsonl, and a W&B table / MLflow artifact when those
    # loggers are on (rl/rollout/samples.py); rank 0's own samples, the step's first; 0 = off
    log_samples: int = 4
    plot: bool = True  # write <run>/curves.png when the run ends
    progress: bool = True  # the tqdm progress bar on rank 0


@dataclass
class RolloutConfig:
    """`rollout.*`: which engine generates, and the vLLM engine's settings (rl/rollout/vllm_engine.py)."""

    # what generates the rollouts: hf (a transformers copy of the policy, rl/rollout/engine.py) or vllm
    # (rl/rollout/vllm_engine.py; needs `make install-vllm`)
    engine: RolloutEngineName = RolloutEngineName.HF
    # where generation gets its weights (rl/rollout/replica.py): auto = keep an unsharded copy if the start-up
    # memory plan says it fits, else sharded (generate with the FSDP2-sharded policy itself)
    replica: ReplicaMode = ReplicaMode.AUTO
    memory_budget_gb: Optional[float] = None  # the plan's per-rank budget; None = the device's free memory
    # weight sync: bytes of full tensors gathered per bucket (rl/rollout/sync.py; also vLLM's shared-memory
    # bucket); None = one rank's share of the model (full bytes / world), <= 256 MiB, >= the largest tensor
    sync_bucket_bytes: Optional[int] = None
    tensor_parallel_size: int = 1  # vLLM TP inside the torchrun ranks (cuda, external_launcher); 1 on cpu
    gpu_memory_utilization: float = 0.3  # cuda: vLLM's share of the GPU beside the colocated trainer
    enable_sleep_mode: bool = True  # cuda: vLLM sleeps (level 1) during training, wakes for the sync
    enforce_eager: bool = True  # no torch.compile / CUDA graphs (start-up in seconds)
    kv_cache_gb: float = 1.0  # cpu: VLLM_CPU_KVCACHE_SPACE
    max_model_len: Optional[int] = None  # None = the task's longest sample: prompt + every turn's reply and answer
    # when a step's rollout is generated (rl/rollout/scheduler.py): max_staleness k = 0 at the step's start, with
    # the policy the step starts from; k >= 1 by a rollout thread up to k steps ahead, rollout j with the policy
    # of version j - k (needs algo.tis_cap or algo.old_log_probs=rollout); null = from mode, else 0
    max_staleness: Optional[int] = None
    # an alias of max_staleness: sync = 0, one_step_off = 1, async = max_staleness (1 when not given)
    mode: Optional[RolloutMode] = None


@dataclass
class EvalConfig:
    """Greedy pass@1 on the task's held-out split (rl/rollout/evaluate.py)."""

    every: int = 0  # evaluate before step 0, every k steps and after the last; 0 = never
    num_prompts: int = 200  # held-out problems, split over the DP ranks
    max_new_tokens: Optional[int] = None  # None = task.max_new_tokens
    batch_size: int = 64  # problems decoded together per rank


@dataclass
class CheckpointConfig:
    every: int = 0  # save every k steps (0 = only the final checkpoint)
    keep: int = 2  # newest k complete checkpoints kept
    dir: Optional[str] = None  # None = <run folder>/checkpoints
    final: bool = True  # save a checkpoint after the last step


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    batch: BatchConfig = field(default_factory=BatchConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    resume: str = "never"  # never | auto (this experiment's newest run, continued in its folder) | a checkpoint path
    seed: int = 0  # seeds the random-init model, the prompts and the sampling


def validate(cfg: Config, world_size: int) -> ParallelDims:
    """Everything checkable before a model is built; each error names its key. Returns the
    run's `ParallelDims` (sizes only: `init_distributed` joins the group and builds the meshes)."""
    _check_ranges(cfg)
    # the one check of the parallel sizes (cp, dp, ep against the world): ParallelDims' own
    dims = ParallelDims(dp=cfg.parallel.dp, cp=cfg.parallel.cp, ep=cfg.parallel.ep, world_size=world_size)
    dp, cp = dims.dp, dims.cp
    if cfg.task.prompts_per_step % dp:
        raise ValueError(f"task.prompts_per_step={cfg.task.prompts_per_step} does not divide over dp={dp} ranks "
                         f"(world_size={world_size}, parallel.cp={cp})")
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
    check_teacher(cfg)  # rl/algos/distill.py: the keys, the checkpoint, its vocabulary and tokenizer
    if cfg.model.pretrained_path is not None:
        if not Path(cfg.model.pretrained_path).is_dir():
            raise ValueError(f"model.pretrained_path={cfg.model.pretrained_path!r}: folder not found (a local "
                             "checkpoint folder is expected; nothing is downloaded)")
        _model_family(cfg)  # config.json, weights and a supported model_type, before any weight is read
    elif cfg.model.name is None:
        raise ValueError("model.name=null needs model.pretrained_path (a random-init model needs a family: "
                         f"one of {ModelName.values()})")
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
    _check_task(cfg)
    _check_experts(cfg, dims.ep)
    family = _model_family(cfg) if cfg.model.pretrained_path is not None else cfg.model.name.value
    check_lora(cfg.model.lora, moe=family in MOE, engine=RolloutEngineName(cfg.rollout.engine).value)
    cfg.model.param_dtype = compute_dtype(cfg.model.dtype, cfg.model.param_dtype,
                                          resolve_device(cfg.trainer.device.value))  # auto, resolved once
    _check_device(cfg)
    _check_rollout(cfg, world_size)
    return dims


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
        "algo.entropy_coef", "algo.distill_coef", "algo.vf_coef", "algo.critic_lr", "algo.router_aux_loss_coef", "algo.kl_coef",
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


def _check_experts(cfg: Config, ep: int) -> None:
    """ep divides the expert count (what model.moe.shard_experts would refuse later, named by
    config key here); the sizes against the world are ParallelDims' check."""
    if ep > 1 and _model_family(cfg) == ModelName.QWEN3_MOE.value:
        from model.models import model_config_value  # imports transformers: only when needed

        experts, key = model_config_value(cfg, "num_experts")
        if experts is not None and experts % ep:
            raise ValueError(f"parallel.ep={ep} does not divide {key}={experts}: each EP rank holds "
                             f"num_experts / ep experts")


def _model_family(cfg: Config) -> str:
    """model/models.py `model_family`, imported when asked (it imports transformers)."""
    from model.models import model_family

    return model_family(cfg)


def _check_rollout(cfg: Config, world_size: int) -> None:
    """`rollout.*`: sizes, and for the vLLM engine that the extra is installed, that vLLM
    knows the model's family and, for MoE routing replay, can return routed experts."""
    r = cfg.rollout
    if r.sync_bucket_bytes is not None and r.sync_bucket_bytes < 1 << 20:
        raise ValueError(f"rollout.sync_bucket_bytes={r.sync_bucket_bytes}: expected >= 1 MiB (1048576)")
    if not 0 < r.gpu_memory_utilization < 1:
        raise ValueError(f"rollout.gpu_memory_utilization={r.gpu_memory_utilization}: expected a fraction in (0, 1)")
    if r.tensor_parallel_size < 1 or world_size % r.tensor_parallel_size:
        raise ValueError(f"rollout.tensor_parallel_size={r.tensor_parallel_size}: expected >= 1 dividing "
                         f"world_size={world_size}")
    _check_rollout_mode(cfg)
    if ReplicaMode(r.replica) is ReplicaMode.SHARDED:
        check_sharded(cfg)
    if RolloutEngineName(r.engine) is not RolloutEngineName.VLLM:
        return
    from rl.rollout.vllm_engine import check_vllm_config  # imports vllm: only for rollout.engine=vllm

    check_vllm_config(cfg, world_size, _model_family(cfg))


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
    if RolloutEngineName(r.engine) is not RolloutEngineName.HF:
        raise ValueError(f"{m} with rollout.engine={RolloutEngineName(r.engine).value}: only rollout.engine=hf "
                         "generates in the background thread so far")
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


def longest_sample(task: Task, max_new_tokens: int) -> int | None:
    """The most tokens one sample of `task` can hold with replies of up to `max_new_tokens`: its
    longest prompt, plus a reply per turn of a multi-turn task (`max_turns`) and an environment
    answer of up to `max_observation_len` between two turns. None when the task does not say how
    long its prompts are. What start-up checks against `batch.max_tokens`, and the vLLM engine's
    `max_model_len` (rl/rollout/build.py): the last turn's context holds every earlier one."""
    prompt, turns = task.max_prompt_len, task.max_turns
    if prompt is None:
        return None
    return int(prompt) + max_new_tokens * turns + (turns - 1) * task.max_observation_len


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