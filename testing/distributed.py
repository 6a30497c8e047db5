"""Multi-process test launcher: `run_distributed(fn, world_size, *args)` on gloo over 127.0.0.1.

Each rank is a fresh spawned process that joins one gloo process group (a free TCP port on
127.0.0.1), runs `fn(rank, world_size, *args)` and returns a picklable value (tensors
allowed; they travel through torch.save files in a temporary folder, not a pipe). A rank
that raises fails the test with every failing rank's traceback; ranks still blocked in a
collective with a dead peer are terminated after a short grace period.

`fn` must be importable by name in a fresh interpreter (a module-level function of a
module on sys.path), as spawn requires. Process start-up costs seconds: put many checks
in one launch.
"""

from __future__ import annotations

import datetime
import multiprocessing
import os
import socket
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import torch


class DistributedTestError(AssertionError):
    """One or more ranks failed, crashed or timed out; the message holds their tracebacks."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(rank: int, world_size: int, port: int, out_dir: str, fn: Callable, args: tuple,
           timeout: float, threads: int | None) -> None:
    import torch.distributed as dist

    out = Path(out_dir) / f"rank{rank}.pt"
    if sys.platform.startswith("linux"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # stay on loopback
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world_size, timeout=datetime.timedelta(seconds=timeout))
        try:
            result = fn(rank, world_size, *args)
        finally:
            dist.destroy_process_group()
        torch.save({"ok": True, "result": result}, out)
    except BaseException:  # report everything, KeyboardInterrupt included, then exit nonzero
        torch.save({"ok": False, "error": traceback.format_exc()}, out)
        sys.exit(1)


def run_distributed(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 300.0,
                    threads: int | None = 1, grace: float = 5.0) -> list[Any]:
    """Run `fn(rank, world_size, *args)` on `world_size` gloo ranks; return the per-rank results.

    `timeout` bounds the whole launch (and each collective); `threads` sets torch's intra-op
    threads per rank (1 keeps a few ranks from fighting over a small machine; None leaves
    torch's default); `grace` is how long the surviving ranks get once one has failed.
    """
    if world_size < 1:
        raise ValueError(f"world_size={world_size} must be >= 1")
    ctx = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="run_distributed_") as out_dir:
        port = free_port()
        procs = [ctx.Process(target=_child, args=(r, world_size, port, out_dir, fn, args, timeout, threads),
                             name=f"rank{r}", daemon=True) for r in range(world_size)]
        for p in procs:
            p.start()
        deadline, failed_at = time.monotonic() + timeout, None
        try:
            while any(p.is_alive() for p in procs):
                now = time.monotonic()
                if failed_at is None and any(p.exitcode not in (None, 0) for p in procs):
                    failed_at = now
                if now > deadline or (failed_at is not None and now > failed_at + grace):
                    break
                time.sleep(0.05)
        finally:
            hung = [r for r, p in enumerate(procs) if p.is_alive()]
            for p in procs:
                if p.is_alive():
                    p.terminate()
            for p in procs:
                p.join(5)
                if p.is_alive():
                    p.kill()
                    p.join()

        results, errors = [], []
        for r, p in enumerate(procs):
            path = Path(out_dir) / f"rank{r}.pt"
            report = torch.load(path, weights_only=False) if path.exists() else None
            if report is not None and report["ok"]:
                results.append(report["result"])
            elif report is not None:
                errors.append(f"--- rank {r} raised:\n{report['error']}")
            elif r in hung:
                why = "timed out" if failed_at is None else "was terminated after another rank failed"
                errors.append(f"--- rank {r} {why} (still running; blocked in a collective?)")
            else:
                errors.append(f"--- rank {r} exited with code {p.exitcode} without a report (crashed?)")
        if errors:
            raise DistributedTestError(f"{fn.__qualname__} on {world_size} ranks failed:\n" + "\n".join(errors))
        return results
