"""The typed config schema. Hydra merges conf/*.yaml onto it, so an unknown or mistyped
key fails at start-up with the key's name instead of deep inside a run."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, Optional

from hydra.core.config_store import ConfigStore


@dataclass
class ModelConfig:
    name: str = "qwen3_moe"  # qwen3 | qwen3_moe
    pretrained_path: Optional[str] = None  # a local checkpoint folder; None = tiny random init
    dtype: str = "float32"
    temperature: float = 1.0  # applied to logits in training and in rollout alike
    logprob_chunk_size: int = 1024  # tokens per chunk of the fp32 log-softmax
    overrides: Dict[str, Any] = field(default_factory=dict)  # Hugging Face config fields


@dataclass
class ParallelConfig:
    dp: int = -1  # -1: world_size // cp
    cp: int = 1
    ep: int = 1


@dataclass
class BatchConfig:
    packed: bool = True
    max_tokens: int = 4096  # token budget of one microbatch (token-budget planner)
    micro_batch_size: Optional[int] = None  # fixed samples per microbatch instead of a token budget


@dataclass
class AlgoConfig:
    name: str = "grpo"  # grpo | ppo
    policy_loss: str = "ppo"  # ppo | gspo | cispo
    loss_agg: str = "token-mean"  # token-mean | seq-mean-token-mean | seq-mean-token-sum
    clip_low: float = 0.2
    clip_high: float = 0.2
    dual_clip: Optional[float] = None
    tis_cap: Optional[float] = None  # truncated IS against rollout_log_probs
    tis_level: str = "token"
    kl_coef: float = 0.0
    kl_estimator: str = "k3"  # k1 | k2 | k3
    kl_mode: str = "loss"  # loss | reward
    entropy_coef: float = 0.0
    grpo_scale_by_std: bool = True
    gamma: float = 1.0
    lam: float = 0.95
    value_clip: Optional[float] = 0.2
    vf_coef: float = 0.5
    critic_lr: float = 1e-3
    routing_replay: bool = True  # R3: replay the rollout's routed_experts in training


@dataclass
class TaskConfig:
    name: str = "target_token"  # a built-in task, or "file"
    prompts_per_step: int = 16  # global, split over DP ranks
    samples_per_prompt: int = 8  # the GRPO group size
    max_new_tokens: int = 12
    rollout_temperature: float = 1.0
    prompts_path: Optional[str] = None  # task=file: JSONL prompts
    reward_fn: Optional[str] = None  # task=file: "module:function"
    options: Dict[str, Any] = field(default_factory=dict)  # extra task arguments


@dataclass
class TrainerConfig:
    max_steps: int = 20
    lr: float = 3e-3
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    tensorboard: bool = False
    plot: bool = True
    progress: bool = True


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    batch: BatchConfig = field(default_factory=BatchConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    seed: int = 0


def register() -> None:
    ConfigStore.instance().store(name="schema", node=Config)
