"""The typed config schema. Hydra merges conf/*.yaml onto it, so an unknown or mistyped key,
or a value outside a closed choice (an `Enum` field), fails at start-up with the key's name.
`validate` (rl/config/checks.py) then checks what types cannot (sizes, paths, combinations)
before any model is built, each message naming the key."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from model.families import FAMILIES
from model.kernels import KERNELS
from model.lora import LoraSettings
from rl.algos.distill import DistillKL, TeacherPlacement
from rl.algos.advantages import AdvantageConfig, get_advantage_estimator
from rl.algos.losses import KLConfig, KLMode, PolicyLossConfig
from rl.algos.schedule import LRSchedule
from rl.choice import Choice
from rl.rollout.replica import ReplicaMode, RolloutEngineName
from rl.rollout.scheduler import RolloutMode
from rl.tasks.calls import Isolation, OnError
from rl.tasks.registry import TaskName


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
    distillation signal (rl/algos/distill.py, docs/algorithms.md Distillation). It is its own FSDP2
    shards, without gradients or optimizer state, like the reference model; `placement` says where they live."""

    # a local checkpoint folder of a supported family (dense or MoE) with the student's vocabulary and
    # tokenizer; null = no teacher
    path: Optional[str] = None
    dtype: Optional[DType] = None  # the teacher's weights as loaded; null = model.dtype
    # at start-up, compare the teacher's log-probs on a few fixed sequences with a plain transformers forward
    # and refuse a difference above self_test_tol
    self_test: bool = True
    # the self-test's bound on the largest |log-prob difference|; null = 1e-3 for float32 compute, 0.1 for bf16/fp16
    self_test_tol: Optional[float] = None
    # sharded: its shards resident on the training device; offload: in host memory between steps, moved onto the
    # device for the score stage and back after (the rollout's memory plan counts the teacher's bytes either way)
    placement: TeacherPlacement = TeacherPlacement.SHARDED


class Logger(Choice):
    """`trainer.loggers`: where the step metrics go (rl/trainer/metrics.py). jsonl is always written."""

    JSONL = "jsonl"
    TENSORBOARD = "tensorboard"  # <run>/tensorboard/
    WANDB = "wandb"  # project `trainer.project`, run name = the run folder's; WANDB_MODE=offline works without a network
    MLFLOW = "mlflow"  # MLFLOW_TRACKING_URI, else a file store at <run>/mlruns; experiment `trainer.project`


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
    # dedicated rollout ranks (docs/rollouts.md): the last R of torchrun's ranks only generate, the others train
    # (dp x cp of them); the weights go to the generators after every update; 0 = every rank generates and trains
    rollout_ranks: int = 0


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
    # sampled: the sampled tokens' signal only (the two keys above); topk: plus a loss term, distill_kl_coef x each
    # action token's exact reverse KL over the teacher's distill_topk most likely tokens, both distributions
    # renormalized over them (chunked over tokens: model/logprobs.py); distill_topk = the vocabulary is the full KL
    distill_kl: DistillKL = DistillKL.SAMPLED
    distill_topk: int = 16  # algo.distill_kl=topk: k, in [2, vocab_size]
    distill_kl_coef: float = 1.0  # algo.distill_kl=topk: the term's weight in the loss (aggregated as algo.loss_agg)

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
    # loggers are on (rl/rollout/samples.py); rank 0's own samples (dedicated rollout ranks: generator 0's), the
    # step's first; 0 = off
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
    # cuda: vLLM's share of its GPU; null = 0.3 beside a colocated trainer, 0.85 on a dedicated generator's GPU
    gpu_memory_utilization: Optional[float] = None
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
