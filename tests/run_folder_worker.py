"""Rank body of tests/test_run_folder.py: two gloo ranks given different local state (a free
memory reading, a folder only one of them sees, a node-local temporary folder each), checking
that every start-up decision is the same on both and that a checkpoint one rank cannot see is
never published. Every rank returns what it saw."""

from __future__ import annotations

import logging
import os
import tempfile
from pathlib import Path

import torch.distributed as dist

from checkpoint_worker import config, trainer_for
from model.models import build_model
from rl.rollout import build, replica
from rl.trainer.checkpoint import Checkpointer, complete_checkpoints, save_checkpoint
from rl.trainer.run_folder import claim

SMALL = ("task.prompts_per_step=2", "task.samples_per_prompt=2", "model=dense_tiny", "checkpoint.keep=3")


def _error(fn) -> str:
    try:
        fn()
    except Exception as error:  # noqa: BLE001 - the test reads the message
        return f"{type(error).__name__}: {error}"
    return ""


def decisions(rank: int, world_size: int, tmp: str) -> dict:
    tmp_path, out = Path(tmp), {}
    mine = tmp_path / f"rank{rank}"  # a folder only this rank uses: an unshared filesystem
    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    logging.getLogger("rl.trainer.checkpoint").addHandler(Keep())
    logging.getLogger("rl.trainer.checkpoint").setLevel(logging.INFO)

    # 1. the replica plan: rank 1 reads almost no free memory, rank 0 plenty
    local = replica.device_budget
    if rank == 1:
        replica.device_budget = lambda device, **kw: (1, "patched: 1 byte free on rank 1")
    out["own_budget"] = replica.device_budget(torch_cpu(), budget_gb=None, local_ranks=2)[0]
    cfg, trainer = trainer_for(*SMALL, "rollout.replica=auto")
    replica.device_budget = local
    out["replica"] = trainer.engine.replica.mode
    out["replica_source"] = trainer.engine.replica.budget_source

    # 2. the shared-folder probe: a folder both see passes, a folder of the same name on each rank's own disk refuses
    claim([tmp_path / "shared"], trainer.dims).close()
    out["unshared_probe"] = _error(lambda: claim([mine / "run"], trainer.dims))

    # 3. a save into a folder rank 0 does not share: never published (no COMPLETE), an error on both ranks
    out["unshared_save"] = _error(lambda: save_checkpoint(trainer, mine / "checkpoints", 1, cfg, trainer.dims))
    out["unshared_published"] = [p.name for p in complete_checkpoints(mine / "checkpoints")]
    out["unshared_tmp"] = sorted(p.name for p in (mine / "checkpoints" / "step_00000001.tmp").iterdir())

    # 4. resume=auto: rank 0 sees checkpoints at steps 1 and 2, rank 1 an empty folder of the same role
    shared = tmp_path / "shared"
    for step in (1, 2):
        save_checkpoint(trainer, shared / "checkpoints", step, cfg, trainer.dims)
    run_dir = shared if rank == 0 else mine / "empty_run"
    out["own_listing"] = [p.name for p in complete_checkpoints(Path(run_dir) / "checkpoints")]
    chosen = Checkpointer(config(*SMALL, "resume=auto"), trainer.dims, run_dir).resume_from
    out["chosen"] = str(chosen)

    # 5. a truncated newest checkpoint (rank 1's shard file): resume=auto loads the one before, keeps it aside
    if rank == 0:
        shard = shared / "checkpoints" / "step_00000002" / "__1_0.distcp"
        os.truncate(shard, shard.stat().st_size // 2)
    dist.barrier()
    ckpt = Checkpointer(config(*SMALL, "resume=auto"), trainer.dims, shared)
    out["truncated_fallback"] = (str(ckpt.resume_from), ckpt.resume(trainer))

    # 6. a shard of the right size whose bytes are garbage: found by the load itself (rank 1 reads it), every rank
    #    falls back together
    save_checkpoint(trainer, shared / "checkpoints", 3, cfg, trainer.dims)
    if rank == 0:
        shard = shared / "checkpoints" / "step_00000003" / "__1_0.distcp"
        shard.write_bytes(b"\0" * shard.stat().st_size)
    dist.barrier()
    ckpt = Checkpointer(config(*SMALL, "resume=auto"), trainer.dims, shared)
    out["garbage_chosen"] = str(ckpt.resume_from)
    out["garbage_fallback"] = ckpt.resume(trainer)
    out["kept"] = sorted(p.name for p in (shared / "checkpoints").iterdir())
    out["log"] = records

    # 7. vLLM's random-init folder: each rank is the first of its own node with its own temporary folder
    os.environ["LOCAL_RANK"] = "0"
    tempfile.tempdir = str(tmp_path / f"node{rank}")
    os.makedirs(tempfile.tempdir, exist_ok=True)
    folder = build._random_init_folder(lambda device=None: build_model("llama", seed=0, device=device), trainer.dims)
    out["init_folder"] = (Path(folder).name, Path(folder).parent.name, (Path(folder) / "config.json").is_file())
    return out


def torch_cpu():
    import torch

    return torch.device("cpu")
