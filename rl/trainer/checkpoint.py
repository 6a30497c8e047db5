"""Checkpoints of a run: sharded, atomic, resumable on any layout.

    ckpt = Checkpointer(cfg, dims, run_dir)  # checks checkpoint.* and resume before any model is built
    start = ckpt.resume(trainer)             # 0, or the steps completed by the checkpoint it loaded
    for step in range(start, cfg.trainer.max_steps):
        ...                                  # the step, its metrics line
        ckpt.after_step(trainer, step + 1)   # saves every `checkpoint.every` steps and after the last

One folder per save, named by the steps it completed, under `checkpoint.dir` (default
`<run folder>/checkpoints`; the run folder of a torchrun run is its run id, kept across
`--max-restarts` restarts, so `resume=auto` finds it again):

    step_00000004/
        .metadata, __<rank>_0.distcp   torch.distributed.checkpoint (DCP): each rank writes its shards
                                       (a dedicated generator its queued rollouts: see below)
        config.yaml                    the run's resolved config: provenance, and checked on resume
        hf_config.json                 the policy's Hugging Face config (what `rl.trainer.export` rebuilds)
        COMPLETE                       written last (JSON: step, layout); a folder without it is never loaded

`resume`: `never` (the default) starts fresh, `auto` takes the newest complete checkpoint
of `checkpoint.dir`, a path takes that checkpoint (or the newest in that folder). With `auto`
train.py first picks the run folder (`run_to_continue`, on rank 0: rl/trainer/run_folder.py):
the newest run of the same experiment under `outputs/` (or the run whose `checkpoints/`
`checkpoint.dir` names), continued in place. A group that torchrun restarted after a failure
(`--max-restarts`, TORCHELASTIC_RESTART_COUNT > 0) always continues from its run's newest
checkpoint when there is one, whatever `resume` says: restarting from scratch would overwrite
the run it is meant to continue. Which checkpoint is decided on rank 0 and broadcast. Under
`auto` and after a restart, a checkpoint that does not load (a file missing or truncated, found
before any model is built; or a load that fails on any rank) is passed over for the newest one
that does; the failing file is logged and the checkpoint kept as `step_N.unloadable`.

Atomic: every rank writes into `step_00000004.tmp`; DCP's save is a collective that returns
once every rank's files and the metadata are on disk; then rank 0 checks that every file the
metadata names (each rank's `__<rank>_0.distcp`) is there at its size, writes COMPLETE,
renames the folder, and only then removes checkpoints beyond the newest `checkpoint.keep`. A
kill at any point leaves the previous checkpoint the newest complete one; a rank whose shards
rank 0 cannot see (folders not shared between nodes) makes the save an error on every rank,
never a COMPLETE checkpoint that cannot load.

What a checkpoint holds (`Trainer.state_dict` plus the two entries added here):
  actor     policy weights + AdamW state      critic    the same, when the algorithm has one
  scheduler the LR schedule                   kl_coef   the (adaptive) KL coefficient
  step      steps completed                   rng       every rank's RNG states (torch CPU/CUDA, python)
  rollout   rollout.max_staleness >= 1: the queued rollouts, generated and not yet trained
            (their steps, policy versions, and every rank's records: rl/rollout/scheduler.py);
            with dedicated rollout ranks (parallel.rollout_ranks) the generators' alone: the save
            and the load run over every rank, a generator's part is its queue and RNG state
            (rl/rollout/dedicated.py `Generator`), so COMPLETE covers every generator's file too
The reference model is frozen and rebuilt from the same seed or pretrained path, so it is not
saved. A step's prompts and samples come from generators seeded by (seed, step, prompt index)
(rl/rollout/source.py), so the step is the prompt cursor; what the rollout thread
has generated ahead of it is `rollout`, so a resumed run trains on exactly the samples the
uninterrupted one would have. A `rollout` entry that does not apply is let go, with a log line,
and the step's prompts are generated again (none skipped, none repeated): a checkpoint without
one (a sync run's) resumed with max_staleness >= 1, one resumed with max_staleness=0, or one
saved on another world size or number of rollout ranks (the records are per rank).

Resharding: with world_size > 1 every entry is a DTensor, and DCP stores each shard at its
global offsets, so any layout loads any other's checkpoint (RNG states only load on the same
world size; nothing in a step draws from them today). The model and optimizer entries, expert
shards included, are described in rl/trainer/state.py.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import shutil
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import yaml
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from runtime.library_noise import quiet_single_process
from runtime.parallel_dims import ParallelDims, decided_on_rank0, gathered
from rl.trainer.metrics import flatten
from rl.trainer.state import rng_state, set_rng_state

if TYPE_CHECKING:
    from rl.config import Config


class Checkpointable(Protocol):
    """What a checkpoint saves and restores (the trainer is one; this module never imports it)."""

    hf_config: Any  # the policy's Hugging Face config, written beside the tensors for `rl.trainer.export`

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...

log = logging.getLogger(__name__)

MARKER = "COMPLETE"
SET_ASIDE = ".unloadable"  # a checkpoint resume=auto fell back past: kept, renamed, never loaded or rotated away
_NAME = re.compile(r"^step_(\d+)$")
# config keys that define the saved tensors: a difference refuses the checkpoint, naming the key;
# the model's shape is the effective Hugging Face config (hf_config.json), not the override dicts
MODEL_KEYS = ("model.name", "model.dtype")
# Hugging Face config fields that do not shape a tensor
_HF_IGNORED = {"transformers_version", "_name_or_path", "architectures", "dtype", "torch_dtype", "use_cache",
               "output_router_logits"}


class CheckpointMismatch(ValueError):
    """A checkpoint of another model or algorithm: refused, never fallen back past."""


def checkpoint_name(step: int) -> str:
    return f"step_{step:08d}"


def complete_checkpoints(root: str | Path) -> list[Path]:
    """The complete checkpoints under `root`, oldest first (folders without COMPLETE, and
    `.tmp` folders of saves in progress or killed, are not checkpoints)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _NAME.match(p.name)) and (p / MARKER).is_file()]
    return [p for _, p in sorted(found)]


def find_checkpoint(path: str | Path) -> Path:
    """`path` if it is a complete checkpoint, else the newest complete one in the folder `path`;
    a ValueError saying why when there is none."""
    path = Path(path)
    if (path / MARKER).is_file() and not path.name.endswith(".tmp"):
        return path
    found = complete_checkpoints(path)
    if found:
        return found[-1]
    if not path.exists():
        raise ValueError(f"{path}: folder not found")
    raise ValueError(f"{path}: not a complete checkpoint (no {MARKER} file: a save that did not finish?) "
                     f"and no complete step_N checkpoint inside")


# ------------------------------------------------------------------- save / load
def save_checkpoint(trainer: Checkpointable, root: Path, step: int, cfg: "Config", dims: ParallelDims) -> Path:
    """Write the training state after `step` completed steps to `root/step_XXXXXXXX` (atomic:
    see the module docstring). A collective: every rank calls it."""
    final = root / checkpoint_name(step)
    tmp = final.with_name(final.name + ".tmp")
    if dims.rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # left by a save that was killed
        tmp.mkdir(parents=True)
    _barrier(dims)
    state = {**trainer.state_dict(), "step": step, "rng": {f"rank{dims.rank}": rng_state(dims)}}
    with quiet_single_process():  # over every rank, dedicated generators too: their parts are in the metadata
        dcp.save(state, checkpoint_id=tmp, no_dist=not dims.joined)  # returns once every rank has written
    decided_on_rank0(dims, lambda: _publish(trainer, tmp, final, step, cfg, dims))  # an error raised on every rank
    return final


def _publish(trainer: Checkpointable, tmp: Path, final: Path, step: int, cfg: "Config", dims: ParallelDims) -> None:
    """Rank 0: every shard the metadata names present in `tmp` (each rank's, seen from here),
    then COMPLETE, the rename, the rotation. A checkpoint that would not load is never published."""
    missing = unloadable_files(tmp)
    if missing:
        raise RuntimeError(
            f"checkpoint {final} not published (its shards stay in {tmp}): " + "; ".join(missing)
            + ". Every rank writes its shards into this folder and rank 0 publishes it, so every rank must see it: "
            "put checkpoint.dir (default <run folder>/checkpoints) on a filesystem every node mounts at the same path")
    root = final.parent
    (tmp / "config.yaml").write_text(config_yaml(cfg))
    trainer.hf_config.to_json_file(tmp / "hf_config.json")
    info = {"step": step, "world_size": dims.world_size, "dp": dims.dp, "cp": dims.cp, "ep": dims.ep,
            "rollout_ranks": dims.rollout_ranks, "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S")}
    _write_synced(tmp / MARKER, json.dumps(info) + "\n")
    old = final.with_name(final.name + ".old")
    if final.exists():  # the same step saved before (a resume from an older checkpoint)
        shutil.rmtree(old, ignore_errors=True)
        final.rename(old)
    tmp.rename(final)
    _fsync(root)
    shutil.rmtree(old, ignore_errors=True)
    for stale in complete_checkpoints(root)[:-cfg.checkpoint.keep]:
        shutil.rmtree(stale)
    for stale in root.glob("step_*.tmp"):  # saves killed earlier
        shutil.rmtree(stale, ignore_errors=True)


def unloadable_files(path: Path) -> list[str]:
    """What keeps the checkpoint at `path` from loading, found without reading a tensor: its
    metadata unreadable, or a file the metadata names (rank r's `__<r>_0.distcp`) missing or
    shorter than the bytes it must hold. Empty: every file is there."""
    try:
        meta = dcp.FileSystemReader(path).read_metadata()
    except Exception as error:  # missing, truncated, not DCP's
        return [f"{path / '.metadata'}: unreadable ({type(error).__name__}: {error})"]
    need: dict[str, int] = {}
    for info in (meta.storage_data or {}).values():
        need[info.relative_path] = max(need.get(info.relative_path, 0), info.offset + info.length)
    problems = []
    for name, size in sorted(need.items()):
        rank = m.group(1) if (m := re.match(r"__(\d+)_", name)) else "?"
        try:
            got = (path / name).stat().st_size
        except FileNotFoundError:
            problems.append(f"{path / name} (rank {rank}'s shards) not found")
            continue
        if got < size:
            problems.append(f"{path / name} (rank {rank}'s shards) holds {got} bytes, the metadata needs {size} "
                            "(truncated)")
    return problems


def load_checkpoint(trainer: Checkpointable, path: str | Path, dims: ParallelDims) -> int:
    """Load the checkpoint at `path` into `trainer` (weights, optimizers, LR schedule, KL
    coefficient; the rollout engine gets the policy's weights) and this rank's RNG states
    when the world size is the saved one. Returns the steps it completed. A collective."""
    path = Path(path)
    info = json.loads((path / MARKER).read_text() or "{}")
    reader = dcp.FileSystemReader(path)
    saved = reader.read_metadata().state_dict_metadata
    state: dict[str, Any] = {**trainer.state_dict(), "step": 0}
    # checked on rank 0, raised on every rank: a dedicated generator holds no tensor of the checkpoint (its part:
    # `rollout`, `rng`), and would otherwise wait in the load below for trainers that refused it
    decided_on_rank0(dims, lambda: check_entries(state, saved, path))
    # the per-rank entries (RNG states, queued records) are keyed by global rank: the same trainers and generators
    saved_on, here = (info.get("world_size"), info.get("rollout_ranks", 0)), (dims.world_size, dims.rollout_ranks)
    same_world = saved_on == here
    if same_world:
        state["rng"] = {f"rank{dims.rank}": rng_state(dims)}
    buffered = any(k.startswith("rollout.") for k in saved)
    # the rollouts this rank restores; a dedicated trainer speaks for its generators (they load theirs, rank 0 logs)
    holds = "rollout" in state or (buffered and dims.rollout_ranks and not dims.generates)
    if holds and not (buffered and same_world):
        log.info("checkpoint %s: %s; the first step's rollout is generated again", path,
                 "no buffered rollout (saved with rollout.mode=sync)" if not buffered else
                 f"its buffered rollout was saved on {_layout(*saved_on)}, not restored on {_layout(*here)}")
        state.pop("rollout", None)
    elif buffered and not holds:
        log.info("checkpoint %s: its buffered rollouts (rollout.mode=one_step_off or async) are let go; the "
                 "first step's rollout is generated again", path)
    with quiet_single_process():
        dcp.load(state, storage_reader=reader, no_dist=not dims.joined)
    trainer.load_state_dict(state)
    if same_world:
        set_rng_state(state["rng"][f"rank{dims.rank}"], dims)
    else:
        log.info("checkpoint saved on %s, loaded on %s: RNG states not restored", _layout(*saved_on), _layout(*here))
    return int(state["step"])


def _layout(world_size, rollout_ranks) -> str:
    """A checkpoint's ranks as a log line names them: `world_size=4`, `world_size=2 + rollout_ranks=2`."""
    return f"world_size={world_size}" + (f" + rollout_ranks={rollout_ranks}" if rollout_ranks else "")


def _tensors(value: Any, key: str = "") -> dict[str, torch.Tensor]:
    """Every tensor in the nested state under the dotted key DCP stores it by
    ("actor.weights.<fqn>", "actor.optimizer.state.<fqn>.exp_avg", list items by index)."""
    if isinstance(value, torch.Tensor):
        return {key: value}
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, (list, tuple)) else ()
    out: dict[str, torch.Tensor] = {}
    for k, v in items:
        out.update(_tensors(v, f"{key}.{k}" if key else str(k)))
    return out


def check_entries(state: dict[str, Any], saved: dict[str, Any], path: Path) -> None:
    """Refuse a checkpoint whose tensors are not this run's, naming the entry: one missing,
    one this run lacks (a critic, a layer), or one of another shape."""
    ours = _tensors(state)
    problems = []
    for key, value in ours.items():
        meta = saved.get(key)
        if meta is None:
            problems.append(f"{key}: not in the checkpoint")
        elif tuple(value.shape) != (got := tuple(meta.size) if isinstance(meta, TensorStorageMetadata) else None):
            problems.append(f"{key}: shape {list(got) if got is not None else 'none (not a tensor)'} in the "
                            f"checkpoint, {list(value.shape)} in this run")
    extra = sorted(k for k, meta in saved.items()
                   if isinstance(meta, TensorStorageMetadata) and k not in ours and not k.startswith("rng."))
    problems += [f"{key}: in the checkpoint, not in this run" for key in extra]
    if problems:
        more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
        raise CheckpointMismatch(f"checkpoint {path} does not match this run (another model or algorithm?): "
                         + "; ".join(problems[:5]) + more)


# ---------------------------------------------------------------------- config
def config_dict(cfg: "Config") -> dict[str, Any]:
    """The config as plain YAML-able data (closed choices as their string values)."""
    return json.loads(json.dumps(dataclasses.asdict(cfg), default=str))


def config_yaml(cfg: "Config") -> str:
    return yaml.safe_dump(config_dict(cfg), sort_keys=False)


def check_config(path: Path, cfg: "Config") -> None:
    """Refuse a checkpoint of another model (a `MODEL_KEYS` value differs), naming the key;
    log the other settings that changed since it was saved."""
    saved = flatten(yaml.safe_load((path / "config.yaml").read_text()))
    now = flatten(config_dict(cfg))
    changed = _changed(saved, now)
    for key in changed:
        if any(key == m or key.startswith(m + ".") for m in MODEL_KEYS):
            raise CheckpointMismatch(f"resume={str(path)!r}: the checkpoint was saved with "
                             f"{key}={saved.get(key, '<unset>')!r}, this run has {key}={now.get(key, '<unset>')!r} "
                             "(a checkpoint of another model)")
    _check_model_shape(path, cfg)
    changed = [k for k in changed if k != "resume"]
    if changed:
        log.info("resuming from %s with changed settings: %s", path,
                 ", ".join(f"{k}={saved.get(k, '<unset>')!r}->{now.get(k, '<unset>')!r}" for k in changed))


def _check_model_shape(path: Path, cfg: "Config") -> None:
    """The run's effective Hugging Face config (the checkpoint's or the tiny family's, with
    `model.overrides`; no weight is read) against the one the checkpoint was saved with: a
    field that differs refuses it, naming the field, both values and where the run's comes
    from. An override equal to the default it replaces is the same model."""
    from model.models import model_config

    m = cfg.model
    config = model_config(m.name.value if m.name is not None else None, pretrained_path=m.pretrained_path,
                          **m.overrides)
    saved, now = type(config).from_json_file(path / "hf_config.json").to_dict(), config.to_dict()
    for key in sorted((saved.keys() | now.keys()) - _HF_IGNORED):
        if saved.get(key) != now.get(key):
            names = {key} | {alias for alias, field in config.attribute_map.items() if field == key}
            given = [f"model.overrides.{k}" for k in m.overrides if k in names]
            source = given[0] if given else (f"{m.pretrained_path}/config.json" if m.pretrained_path
                                             else f"the tiny {config.model_type} default")
            raise CheckpointMismatch(f"resume={str(path)!r}: the checkpoint's model has {key}={saved.get(key)!r}, this run's "
                             f"has {key}={now.get(key)!r} (from {source}): a checkpoint of another model")


# ---------------------------------------------------------- the run to continue
# settings that say how long and how a run goes, not what it trains: `resume=auto` continues a
# run whose checkpoint differs from this command's config in these only (evaluation does not
# change training: tests/test_train.py)
RUN_CONTROL = ("resume", "trainer.max_steps", "trainer.progress", "trainer.plot", "trainer.loggers", "trainer.project",
               "checkpoint", "eval")


def run_to_continue(cfg: "Config", run_dir: str | None) -> Path | None:
    """`resume=auto`: the run folder this run continues in place (checkpoints, metrics.jsonl,
    TensorBoard, curves and train.log of one run stay in one folder), decided before Hydra makes
    a new one. With `checkpoint.dir=<run>/checkpoints`, that run; with the default run folder
    (`hydra.run.dir` ending in `${run_id:}`), the newest folder beside it (`outputs/`) with a
    complete checkpoint of the same experiment (its config.yaml equals this config but for
    `RUN_CONTROL`). None: a new folder (nothing to continue, another resume, a folder named
    on the command line, a sweep, or a group torchrun restarted, which keeps its run id)."""
    if cfg.resume != "auto" or run_dir is None or int(os.environ.get("TORCHELASTIC_RESTART_COUNT") or 0) > 0:
        return None
    if cfg.checkpoint.dir:
        root = Path(cfg.checkpoint.dir)
        return root.parent if root.name == "checkpoints" and (root.parent / ".hydra").is_dir() else None
    head, sep, _ = run_dir.partition("${run_id:}")
    outputs = Path(head or ".")
    if not sep or not outputs.is_dir():
        return None
    now, found, others = flatten(config_dict(cfg)), [], []
    for folder in outputs.iterdir():
        # the newest checkpoint whose config reads (a truncated one is the Checkpointer's to fall back past)
        saved = next(((p, c) for p in reversed(complete_checkpoints(folder / "checkpoints"))
                      if (c := _saved_config(p)) is not None), None)
        if saved is None:
            continue
        differ = [k for k in _changed(flatten(saved[1]), now) if not any(k == c or k.startswith(c + ".") for c in RUN_CONTROL)]
        (others if differ else found).append(((saved[0] / MARKER).stat().st_mtime, folder, differ))
    if found:
        _, folder, _ = max(found, key=lambda f: f[0])
        _say(f"resume=auto: continuing {folder}, the newest run of this experiment under {outputs}")
        return folder
    if others:
        _, folder, differ = max(others, key=lambda f: f[0])
        _say(f"resume=auto: no run under {outputs} has a checkpoint of this experiment (the newest, {folder}, "
             f"differs in {', '.join(differ[:5])}); starting a new run")
    return None


def _saved_config(path: Path) -> dict | None:
    """A checkpoint's config.yaml as a dict; None when it does not read."""
    try:
        saved = yaml.safe_load((path / "config.yaml").read_text())
    except (OSError, yaml.YAMLError):
        return None
    return saved if isinstance(saved, dict) else None


def _say(line: str) -> None:
    """A line on stderr from rank 0 before Hydra has set up logging (the run folder is not chosen yet)."""
    if os.environ.get("RANK", "0") == "0":
        print(line, file=sys.stderr, flush=True)


def _changed(saved: dict[str, Any], now: dict[str, Any]) -> list[str]:
    return sorted(k for k in saved.keys() | now.keys() if saved.get(k, "<unset>") != now.get(k, "<unset>"))


# ------------------------------------------------------------------ checkpointer
class Checkpointer:
    """When to save, where, and which checkpoint a run resumes from (see the module docstring).
    Which checkpoint is decided on rank 0 and read by every rank (a listing may differ between
    nodes: NFS caches attributes). `resume=auto` and a torchrun restart fall back past a
    checkpoint that does not load to the newest one that does: the failing file is logged
    and the checkpoint kept, renamed `step_N.unloadable` (never loaded again, never rotated away)."""

    def __init__(self, cfg: "Config", dims: ParallelDims, run_dir: str | Path) -> None:
        c = cfg.checkpoint  # its ranges are rl.config.validate's
        self.cfg, self.dims = cfg, dims
        self.root = Path(c.dir) if c.dir else Path(run_dir) / "checkpoints"
        self.resume_from, self.fallback = decided_on_rank0(dims, lambda: self._choose(cfg.resume))

    def _choose(self, resume: str) -> tuple[Path | None, bool]:
        """Rank 0: (the checkpoint to resume, None for a fresh start; whether to fall back past it)."""
        restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT") or 0)
        if restart > 0 and complete_checkpoints(self.root):  # torchrun restarted the group after a failure
            log.info("torchrun restart %d: continuing from this run's newest checkpoint", restart)
            return self._newest_loadable(), True
        if resume == "never":
            return None, False
        if resume == "auto":  # the run folder is this experiment's newest run (`run_to_continue`)
            if not complete_checkpoints(self.root):
                log.warning("resume=auto: no complete checkpoint under %s, starting fresh", self.root)
                return None, True
            return self._newest_loadable(), True
        try:
            path = find_checkpoint(resume)
        except ValueError as e:
            raise ValueError(f"resume={resume!r}: {e}; expected never, auto, a checkpoint folder "
                             f"(e.g. {self.root / checkpoint_name(4)}) or a folder of them") from None
        problems = _unreadable(path)
        if problems:
            raise ValueError(f"resume={resume!r}: {path} does not load: {'; '.join(problems)}")
        check_config(path, self.cfg)
        return path, False

    def _newest_loadable(self, failed: dict[Path, str] | None = None) -> Path:
        """Rank 0: the newest complete checkpoint of `root` whose files are all there (its config
        checked against this run's); those that are not, and `failed` (loads that failed), set
        aside. A RuntimeError naming every failing file when none is left."""
        failed = dict(failed or {})
        for path in reversed(complete_checkpoints(self.root)):
            if path in failed:
                continue
            problems = _unreadable(path)
            if problems:
                failed[path] = "; ".join(problems)
                continue
            check_config(path, self.cfg)  # another model: refused, not fallen back past
            for bad, why in failed.items():
                kept = _set_aside(bad)
                log.warning("checkpoint %s does not load (%s): kept as %s; resuming from %s", bad, why, kept.name,
                            path.name)
            return path
        raise RuntimeError(f"no checkpoint under {self.root} loads: "
                           + "; ".join(f"{p.name}: {why}" for p, why in failed.items())
                           + " (all kept as they are; resume=never starts over, in another hydra.run.dir)")

    def resume(self, trainer: Checkpointable) -> int:
        """Load the checkpoint chosen by `resume`; the number of steps already done (0 when fresh).
        A collective: a load that fails on any rank is retried from the checkpoint before it on
        every rank (resume=auto, restarts), else raised on every rank."""
        if self.resume_from is None:
            return 0
        t0 = time.perf_counter()
        while True:
            try:
                step, failed = load_checkpoint(trainer, self.resume_from, self.dims), ""
            except CheckpointMismatch:
                raise
            except (Exception, CheckpointException) as error:  # a file that does not read: agreed below, on every rank
                step, failed = -1, _reason(error)
            failures = list(dict.fromkeys(why for why in gathered(self.dims, failed) if why))
            if not failures:
                break
            why = "; ".join(failures)
            if not self.fallback:
                raise RuntimeError(f"resume={self.cfg.resume!r}: {self.resume_from} does not load: {why}")
            self.resume_from = decided_on_rank0(self.dims, lambda: self._newest_loadable({self.resume_from: why}))
        log.info("resumed from %s (%d steps done) in %.2f s", self.resume_from, step, time.perf_counter() - t0)
        if step >= self.cfg.trainer.max_steps:
            log.warning("the checkpoint has %d steps done, trainer.max_steps=%d: nothing left to run", step,
                        self.cfg.trainer.max_steps)
        return step

    def after_step(self, trainer: Checkpointable, step: int) -> Path | None:
        """`step` steps are complete: save when one is due (every `checkpoint.every`, and the last)."""
        c = self.cfg.checkpoint
        if (c.every and step % c.every == 0) or (c.final and step == self.cfg.trainer.max_steps):
            return self.save(trainer, step)
        return None

    def save(self, trainer: Checkpointable, step: int) -> Path:
        """Save `step` steps now (a collective; train.py's stop signal too): the checkpoint's path."""
        t0 = time.perf_counter()
        path = save_checkpoint(trainer, self.root, step, self.cfg, self.dims)
        log.info("saved %s in %.2f s", path, time.perf_counter() - t0)
        return path


# --------------------------------------------------------------------- helpers
def _unreadable(path: Path) -> list[str]:
    """Why the complete checkpoint at `path` would not load, from its files alone (no tensor read)."""
    problems = []
    for name in (MARKER, "hf_config.json"):
        try:
            json.loads((path / name).read_text() or "{}")
        except (OSError, ValueError) as error:
            problems.append(f"{path / name}: {type(error).__name__}: {error}")
    if _saved_config(path) is None:
        problems.append(f"{path / 'config.yaml'}: unreadable")
    return problems + unloadable_files(path)


def _reason(error: BaseException) -> str:
    """A load's error on one line a rank: DCP's CheckpointException holds each failing rank's."""
    if isinstance(error, CheckpointException):
        return "; ".join(f"rank {r}: {_reason(e)}" for r, (e, _) in sorted(error.failures.items()))
    return f"{type(error).__name__}: {str(error).strip().splitlines()[0] if str(error).strip() else ''}"


def _set_aside(path: Path) -> Path:
    """Rename a checkpoint that does not load out of the way (kept for inspection)."""
    kept, n = path.with_name(path.name + SET_ASIDE), 1
    while kept.exists():
        n += 1
        kept = path.with_name(f"{path.name}{SET_ASIDE}{n}")
    path.rename(kept)
    return kept


def _barrier(dims: ParallelDims) -> None:
    if dims.joined:
        dist.barrier()


def _write_synced(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _fsync(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
