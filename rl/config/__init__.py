"""The run's config: the typed schema (schema.py), its checks (checks.py) and the command line
(cli.py, Hydra). The names callers import from `rl.config`."""

from rl.config.cli import CONF, check_command_line, compose, load, register
from rl.config.checks import FULL_FINETUNE_MAX_LR, RANGES, check_task_fits, compute_dtype, learning_rate_warning
from rl.config.checks import max_staleness, plot_warning, validate
from rl.config.schema import AlgoConfig, Balance, Config, DType, ModelName, TrainerConfig

__all__ = ["CONF", "FULL_FINETUNE_MAX_LR", "RANGES", "AlgoConfig", "Balance", "Config", "DType", "ModelName",
           "TrainerConfig", "check_command_line", "check_task_fits", "compose", "compute_dtype",
           "learning_rate_warning", "load", "max_staleness", "plot_warning",
           "register", "validate"]
