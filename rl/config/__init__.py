"""The run's config: the typed schema (schema.py). The names callers import from `rl.config`."""

from rl.config.schema import CONF, FULL_FINETUNE_MAX_LR, RANGES, AlgoConfig, Balance, Config, DType, ModelName
from rl.config.schema import TrainerConfig, check_command_line, check_task_fits, compose, compute_dtype
from rl.config.schema import learning_rate_warning, load, longest_sample, max_staleness
from rl.config.schema import plot_warning, register, run_id, validate

__all__ = ["CONF", "FULL_FINETUNE_MAX_LR", "RANGES", "AlgoConfig", "Balance", "Config", "DType", "ModelName",
           "TrainerConfig", "check_command_line", "check_task_fits", "compose", "compute_dtype",
           "learning_rate_warning", "load", "longest_sample", "max_staleness", "plot_warning",
           "register", "run_id", "validate"]
