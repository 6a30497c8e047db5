"""The kill tests' fault hook (tests/test_checkpoint.py `launch`), outside production code:
on PYTHONPATH (with the repository root), Python imports this module at start-up in every
process of a run (torchrun, launch/local.sh and each rank). `RL_TEST_KILL=<point>:<step>[:<rank>]`
SIGKILLs that rank (default 0) at `point`, in a run's first attempt only (torchrun's
TORCHELASTIC_RESTART_COUNT is 0 or unset):
  in_save     the checkpoint of `step` steps has its shards written, not yet published
  after_step  `step` steps are done (and saved when due)
"""

import os
import signal

SPEC = os.environ.get("RL_TEST_KILL")
if SPEC and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from rl.trainer import checkpoint

    point, at, *who = SPEC.split(":")

    def _maybe_kill(where: str, step: int) -> None:
        rank = dist.get_rank() if dist.is_initialized() else 0
        if where == point and step == int(at) and rank == int(who[0] if who else 0):
            os.kill(os.getpid(), signal.SIGKILL)

    save, after_step = dcp.save, checkpoint.Checkpointer.after_step

    def _save(state, *args, **kwargs):
        out = save(state, *args, **kwargs)
        _maybe_kill("in_save", int(state["step"]))
        return out

    def _after_step(self, trainer, step):
        path = after_step(self, trainer, step)
        _maybe_kill("after_step", step)
        return path

    dcp.save, checkpoint.Checkpointer.after_step = _save, _after_step
