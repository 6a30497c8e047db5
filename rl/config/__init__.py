"""The run's config: the typed schema (schema.py). The names callers import from `rl.config`."""

from rl.config.cli import CONF, check_command_line, compose, load, register, run_id
from rl.config.schema import FULL_FINETUNE_MAX_LR, RANGES, AlgoConfig, Balance, Config, DType, ModelName
from rl.config.schema import TrainerConfig, check_task_fits, compute_dtype
from rl.config.schema import learning_rate_warning, longest_sample, max_staleness, plot_warning, validate

__all__ = ["CONF", "FULL_FINETUNE_MAX_LR", "RANGES", "AlgoConfig", "Balance", "Config", "DType", "ModelName",
           "TrainerConfig", "check_command_line", "check_task_fits", "compose", "compute_dtype",
           "learning_rate_warning", "load", "longest_sample", "max_staleness", "plot_warning",
           "register", "run_id", "validate"]
