"""Input checks that never stall an accelerator.

`check_on_device(cond, message, detail)`: `cond` is a 0-d bool tensor computed on the data's
device. On an accelerator it becomes a device-side assertion (`torch._assert_async`: no host
sync; CUDA reports `message` at the next synchronizing call); on the CPU it fails at once, and
then `detail()` (which may read values back: the failure path only) makes the ValueError name
what was seen.
"""

from __future__ import annotations

from typing import Callable

import torch


def check_on_device(cond: torch.Tensor, message: str, detail: Callable[[], str]) -> None:
    try:
        torch._assert_async(cond, message)
    except RuntimeError:
        raise ValueError(detail()) from None
