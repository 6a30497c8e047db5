"""A run asked to stop (SIGTERM, SIGUSR1) stops at a step boundary with a checkpoint, every rank alike.

    with StopSignal(dims) as stop:
        for step in ...:
            ...                           # the step, its checkpoint when due
            if stop.requested():          # a collective: every rank asks after every step
                save, log, break

Who sends what: `kill`, Kubernetes (pod deletion, preemption) and `launch/local.sh`'s torchrun
get SIGTERM; torchrun passes the signal it got on to every rank (to each rank's process group)
and waits `--shutdown-timeout` seconds (default 30) before SIGKILL. Under SLURM,
`launch/slurm.sbatch` asks for SIGUSR1 before the time limit (`--signal=B:USR1@...`): srun turns
a SIGTERM into SIGKILL for its tasks but passes SIGUSR1 on, and the script tells torchrun to pass
SIGUSR1 on too (`--signals-to-handle`); the script's header says why.

The handler only records the signal (nothing else is safe between two bytecodes of the
step). `requested` all-reduces the flag (MAX over the world), so a signal that reached one
rank stops every rank after the same step: each then writes its shards of the same checkpoint
(a collective) and leaves the loop. A second signal changes nothing; SIGKILL still kills.
"""

from __future__ import annotations

import signal
import threading

import torch
import torch.distributed as dist

from runtime.parallel_dims import ParallelDims

SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class StopSignal:
    """Records SIGTERM / SIGUSR1 while the `with` block runs (the previous handlers come back
    after it); `requested()` says, on every rank alike, whether any rank got one."""

    def __init__(self, dims: ParallelDims) -> None:
        self.dims = dims
        self.received: str | None = None  # the first signal's name on this rank
        self._previous: dict[signal.Signals, object] = {}

    def __enter__(self) -> "StopSignal":
        if threading.current_thread() is threading.main_thread():  # Python sets handlers on the main thread only
            for sig in SIGNALS:
                self._previous[sig] = signal.signal(sig, self._record)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _record(self, signum: int, frame) -> None:
        self.received = self.received or signal.Signals(signum).name

    def requested(self) -> bool:
        """Whether any rank has received a stop signal (a collective over the world group)."""
        flag = torch.tensor([1.0 if self.received else 0.0], device=self.dims.device)
        if self.dims.joined:  # the generators of parallel.rollout_ranks too: they stop after the same step
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())
