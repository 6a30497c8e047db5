"""The kill tests' fault hook (tests/test_checkpoint.py `launch`), outside production code:
on PYTHONPATH (with the repository root), Python imports this module at start-up in every
process of a run (torchrun, launch/local.sh and each rank). `RL_TEST_KILL=<point>:<step>[:<rank>]`
SIGKILLs that rank (default 0) at `point`, in a run's first attempt only (torchrun's
TORCHELASTIC_RESTART_COUNT is 0 or unset), or sends it `RL_TEST_SIGNAL` instead (TERM, USR1: a stop
request, rl/trainer/stop.py):
  in_save     the checkpoint of `step` steps has its shards written, not yet published
  after_step  `step` steps are done (and saved when due)
  in_step     step `step` (0-based) begins
  in_rollout  rollout.max_staleness >= 1: the rollout thread's generation of `step`'s rollout
              has begun (while an earlier step trains: a rollout in flight)
`RL_TEST_TRACE=<file>` (every attempt) appends one JSON line per trained step and rank: the
attempt (torchrun's restart count), the rank, the prompt indices of the samples this rank
generated for it and a digest of their tokens. `RL_TEST_TAKES=<file>` (every attempt) appends one
JSON line per rollout taken (a colocated rank's or a dedicated generator's, rl/rollout/scheduler.py
`take`): the attempt, the rank, the step, its policy versions and prompt indices, and a digest of
the records (tokens, the engine's log-probs, rewards).
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
            os.kill(os.getpid(), getattr(signal, "SIG" + os.environ.get("RL_TEST_SIGNAL", "KILL")))

    from rl.rollout import scheduler

    save, after_step = dcp.save, checkpoint.Checkpointer.after_step
    run = scheduler.RolloutScheduler._run

    def _save(state, *args, **kwargs):
        out = save(state, *args, **kwargs)
        _maybe_kill("in_save", int(state["step"]))
        return out

    def _after_step(self, trainer, step):
        path = after_step(self, trainer, step)
        _maybe_kill("after_step", step)
        return path

    def _in_rollout(self, step, *args):
        _maybe_kill("in_rollout", step)
        return run(self, step, *args)

    dcp.save, checkpoint.Checkpointer.after_step = _save, _after_step
    scheduler.RolloutScheduler._run = _in_rollout
    if point == "in_step":  # the trainer module only when needed (it imports the model code)
        from rl.trainer import trainer as _trainer_module

        trainer_step = _trainer_module.Trainer.step

        def _in_step(self, at, *args, **kwargs):
            _maybe_kill("in_step", at)
            return trainer_step(self, at, *args, **kwargs)

        _trainer_module.Trainer.step = _in_step

TRACE = os.environ.get("RL_TEST_TRACE")
if TRACE:
    import hashlib
    import json

    import torch.distributed as dist

    from rl.trainer import trainer as _trainer

    collate = _trainer.Trainer.collate

    def _collate(self, rollouts, plan):
        records = [rollouts.records[k] for k in sorted(rollouts.records)]
        digest = hashlib.sha256(b"".join(r.sequences.numpy().tobytes() for r in records)).hexdigest()
        line = {"attempt": int(os.environ.get("TORCHELASTIC_RESTART_COUNT") or 0),
                "rank": dist.get_rank() if dist.is_initialized() else 0,
                "prompts": [int(r.prompt_index) for r in records], "tokens": digest}
        with open(TRACE, "a") as f:
            f.write(json.dumps(line) + "\n")
        return collate(self, rollouts, plan)

    _trainer.Trainer.collate = _collate

TAKES = os.environ.get("RL_TEST_TAKES")
if TAKES:
    import hashlib
    import json

    import torch.distributed as dist

    from rl.rollout import scheduler as _scheduler

    take = _scheduler.RolloutScheduler.take

    def _take(self, step):
        taken = take(self, step)
        fields = [t for r in taken.records for t in (r.sequences, r.rollout_log_probs, r.rewards)]
        line = {"attempt": int(os.environ.get("TORCHELASTIC_RESTART_COUNT") or 0),
                "rank": dist.get_rank() if dist.is_initialized() else 0, "step": step,
                "versions": sorted({int(r.policy_version) for r in taken.records}),
                "prompts": [int(r.prompt_index) for r in taken.records],
                "records": hashlib.sha256(b"".join(t.numpy().tobytes() for t in fields)).hexdigest()}
        with open(TAKES, "a") as f:
            f.write(json.dumps(line) + "\n")
        return taken

    _scheduler.RolloutScheduler.take = _take
