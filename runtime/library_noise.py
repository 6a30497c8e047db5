"""Library noise at start-up, silenced at its source and no wider: each filter drops one
known message of one library's logger, so every other warning still shows.

* torchao logs "Failed to load .../torchao/_C_mxfp8...so" (and the cutlass 90a kernels) on
  import: GPU kernels that cannot load on a machine without CUDA. On CUDA they stay visible.
* torch's pytree logs that `register_constant()` on an Enum subclass is deprecated, once for
  each of torchao's two enums (KernelPreference, ScaleCalculationMode): torchao's call, not ours.
* torch's DCP warns that it assumes a single process on every load and save of a one-process
  run, even when told so (`no_dist=True`): `quiet_single_process()` around those calls.
"""

from __future__ import annotations

import contextlib
import logging
import warnings


class _Drop(logging.Filter):
    def __init__(self, keep) -> None:
        super().__init__()
        self.keep = keep

    def filter(self, record: logging.LogRecord) -> bool:
        return self.keep(record)


def _torchao_kernel(record: logging.LogRecord) -> bool:
    message = record.getMessage()
    return not (message.startswith("Failed to load ") and "torchao/_C" in message)


def _torchao_enum(record: logging.LogRecord) -> bool:
    enum = record.args[0] if isinstance(record.args, tuple) and record.args else None
    return not (str(record.msg).startswith("%s is an Enum subclass and is now natively supported")
                and getattr(enum, "__module__", "").startswith("torchao"))


def silence_library_noise() -> None:
    """Install the filters (idempotent); call before the imports that log them (transformers
    imports torchao)."""
    import torch

    filters = [("torch.utils._pytree", _torchao_enum)]
    if not torch.cuda.is_available():
        filters.append(("torchao", _torchao_kernel))
    for name, keep in filters:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _Drop) and f.keep is keep for f in logger.filters):
            logger.addFilter(_Drop(keep))


@contextlib.contextmanager
def quiet_single_process():
    """DCP's "torch.distributed is disabled, unavailable or uninitialized, assuming the intent is
    to load (save) in a single process" dropped inside the block: it is one."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is (disabled, )?unavailable or uninitialized")
        yield
