"""One run folder per job, whatever the launch; seen by every rank; held by one run at a time.

    folder = start_folder(cfg, run_dir)   # train.py, before Hydra: the run id and resume=auto's folder, agreed
    held = claim(out_dir, dims)           # after the process group, before any model: locked, seen by every rank

The run id. Hydra names the run folder (`outputs/${run_id:}`) before the process group
exists, in every process on its own. torchrun's run id (`--rdzv-id`) is the same on every
rank and kept across restarts; a static rendezvous (`--master-addr --master-port
--node-rank`, and single-node `torchrun --master-port`) and c10d without `--rdzv-id` give the
id `none`. Then rank 0 draws the id (a timestamp and a random suffix) and every rank reads it
from torchrun's own store: the agent's TCPStore at MASTER_ADDR:MASTER_PORT, which the workers
join as clients (TORCHELASTIC_USE_AGENT_STORE) before any process group exists. The store
outlives a `--max-restarts` restart, so a restarted group finds its folder again; where it
did not (a c10d round hosted elsewhere) the restart refuses rather than start a second run.
`resume=auto`'s choice of the folder to continue (`run_to_continue`, a listing of outputs/)
is made on rank 0 and read the same way. A launch with WORLD_SIZE > 1 and no torchrun store
(RANK, MASTER_ADDR... set by hand) refuses at the command-line check unless `hydra.run.dir`
names the folder.

Seen by every rank. Checkpoints need one filesystem under the run folder: every rank writes
its shards into one checkpoint folder, which rank 0 publishes. `claim` proves it at start-up:
rank 0 writes a fresh token into the folder's lock file, and every rank reads it back there;
a rank that does not find it refuses the run on every rank, naming that rank's host and
folder. The same holds for `checkpoint.dir` when it lies outside the run folder.

Held by one run. Rank 0 holds `fcntl.flock` on `<folder>/.run.lock` for the run's life; a
second run started in the folder (the same `hydra.run.dir`, or `resume=auto` continuing a run
that still runs) refuses at start-up naming the first one's pid and host, and touches nothing
of it: a folder known before Hydra runs is locked then (`start_folder`), before Hydra writes
its `.hydra/` files; a folder Hydra names (a fresh run id) is locked by `claim`. The kernel releases the lock when the process ends, however it ends (a SIGKILL
included), so a crashed run's folder can be continued at once. On NFS, flock is a POSIX lock
the server keeps (Linux >= 2.6.12).
"""

from __future__ import annotations

import datetime
import fcntl
import json
import os
import socket
import uuid
from pathlib import Path
from typing import Any, Callable

from omegaconf import OmegaConf

from runtime.parallel_dims import ParallelDims, decided_on_rank0, gathered

LOCK = ".run.lock"
TIMEOUT_S = 600  # how long a rank waits for rank 0's answer in torchrun's store (the process group's timeout)
_PREFIX = "packed-rl/"
_kept: dict[str, Any] = {}  # this process's answers to keys agreed once per job (the run id)


class RunFolderInUse(RuntimeError):
    """Another run holds the folder: the refusal touches nothing of it (no FAILED mark, no log line)."""


def world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def _agent_store():
    """torchrun's store (a client of the agent's TCPStore), or None when the workers have none."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != str(True):
        return None
    from torch.distributed import TCPStore

    return TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                    timeout=datetime.timedelta(seconds=TIMEOUT_S))


def agreed_before_init(key: str, decide: Callable[[], Any], *, per_job: bool = False) -> Any:
    """`decide()` (a JSON-able value) run on rank 0, read by every rank from torchrun's store
    before any process group exists; an error raised by it on rank 0 is raised on every rank.
    One process decides alone (each call). `per_job`: decided once for the job and kept across torchrun's
    restarts (the run id); otherwise decided again at each attempt. A ValueError when the
    world has several ranks and torchrun's store is absent."""
    if world_size() == 1:
        return decide()
    if per_job and key in _kept:
        return _kept[key]
    value = _through_store(key, decide, per_job)
    if per_job:
        _kept[key] = value
    return value


def _through_store(key: str, decide: Callable[[], Any], per_job: bool) -> Any:
    store = _agent_store()
    if store is None:
        raise ValueError(f"WORLD_SIZE={world_size()} without torchrun's rendezvous store "
                         "(TORCHELASTIC_USE_AGENT_STORE unset: ranks started by hand?): the ranks cannot agree on "
                         f"{key}; launch with torchrun, or name the run folder with hydra.run.dir=<a folder every "
                         "rank sees>")
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT") or "0"
    name = _PREFIX + key + ("" if per_job else f"/attempt_{attempt}")
    if int(os.environ.get("RANK", "0")) == 0:
        if per_job and store.check([name]):  # a restarted group: the job's first answer
            answer = store.get(name).decode()
        elif per_job and attempt != "0":
            answer = json.dumps({"error": f"torchrun restarted the group (attempt {attempt}) and its store no longer "
                                          f"holds the {key} agreed at the first attempt (a new c10d round hosted "
                                          "elsewhere?): pass --rdzv-id=<job id> (it names the run folder and is "
                                          "kept across restarts)"})
            store.set(name, answer)
        else:
            try:
                answer = json.dumps({"value": decide()})
            except Exception as error:  # the other ranks stop with it, not time out
                store.set(name, json.dumps({"error": str(error), "in_use": isinstance(error, RunFolderInUse)}))
                raise
            store.set(name, answer)
    else:
        answer = store.get(name).decode()  # waits for rank 0
    got = json.loads(answer)
    if "error" in got:
        raise (RunFolderInUse if got.get("in_use") else ValueError)(got["error"])
    return got["value"]


def new_run_id() -> str:
    """A timestamp plus a random suffix, so two runs never share a folder."""
    return f"{datetime.datetime.now():%Y-%m-%d_%H-%M-%S}_{uuid.uuid4().hex[:6]}"


def run_id() -> str:
    """The run folder's name, the same on every rank of a job: torchrun's run id (`--rdzv-id`,
    kept across restarts), else a timestamp plus a random suffix (two runs never share a
    folder) drawn by rank 0 and read by every rank through torchrun's store, kept across
    restarts too (module docstring)."""
    elastic = os.environ.get("TORCHELASTIC_RUN_ID")
    if elastic and elastic != "none":
        return elastic
    return agreed_before_init("run_id", new_run_id, per_job=True)


def register_run_id() -> None:
    """Hydra's `${run_id:}` (conf/config.yaml's run folders) resolves to `run_id`, drawn once per process."""
    if not OmegaConf.has_resolver("run_id"):
        OmegaConf.register_new_resolver("run_id", run_id, use_cache=True)


def start_folder(cfg, run_dir: str | None) -> str | None:
    """train.py before Hydra, on every rank: the run id agreed now when Hydra's folder name
    uses it (`run_dir` None: a sweep, whose folder does), and the folder `resume=auto`
    continues (`run_to_continue`, decided on rank 0); None: the folder Hydra names. A folder
    known now (that one, or a `hydra.run.dir` without interpolation) is locked now by rank 0,
    before Hydra writes into it: a run holding it is refused (`RunFolderInUse`, on every rank)
    with nothing of its folder touched."""
    from rl.trainer.checkpoint import run_to_continue

    if world_size() > 1 and (run_dir is None or "${run_id:" in run_dir):
        run_id()  # drawn by rank 0 now (a ValueError without torchrun's store), kept for Hydra's resolver

    def decide() -> str:
        found = run_to_continue(cfg, run_dir)
        known = found or (run_dir if run_dir and "${" not in run_dir else None)
        if known and int(os.environ.get("RANK", "0")) == 0:
            folder = Path(known).resolve()
            _early.setdefault(folder, _take(folder))
        return str(found or "")

    if world_size() > 1 and not _agent_store_named():  # hydra.run.dir names the folder: nothing to agree on
        return decide() or None
    return agreed_before_init("resume_folder", decide) or None


def _agent_store_named() -> bool:
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True)


# ------------------------------------------------------------------ after init
_early: dict[Path, int] = {}  # folders rank 0 locked before Hydra: claim() keeps these locks


class Held:
    """The lock files this run holds (released when closed, or when the process ends)."""

    def __init__(self) -> None:
        self.fds: list[int] = []

    def close(self) -> None:
        for fd in self.fds:
            os.close(fd)
        self.fds.clear()


def claim(folders: list[str | Path | None], dims: ParallelDims) -> Held:
    """Lock each folder for this run and check that every rank sees it (module docstring): a
    `RunFolderInUse` naming the holder's pid, or a RuntimeError naming the ranks that do not
    see it, on every rank. A folder inside an earlier one (the default checkpoints/) and None
    are skipped. A collective; before any model is built."""
    held, done = Held(), []
    for folder in (Path(f).resolve() for f in folders if f):
        if any(folder.is_relative_to(d) for d in done):
            continue
        done.append(folder)
        token = decided_on_rank0(dims, lambda: _lock(folder, held))
        seen = gathered(dims, _reads(folder, token))
        blind = [f"rank {r} on {host} reads {where}: {why}" for r, (host, where, why) in enumerate(seen) if why]
        if blind:
            held.close()
            raise RuntimeError(
                f"{seen[0][1]} (rank 0 on {seen[0][0]}) is not seen by every rank: " + "; ".join(blind)
                + ". Every rank must see the run folder and the checkpoint folder (one shared filesystem: each rank "
                "writes its shards of a checkpoint that rank 0 publishes): put hydra.run.dir (and checkpoint.dir) "
                "on a filesystem every node mounts at the same path, and start every node from the same directory "
                "(a relative hydra.run.dir is resolved against each node's working directory)")
    return held


def _lock(folder: Path, held: Held) -> str:
    """Rank 0: take the folder's lock (or a RunFolderInUse naming its holder) and write a fresh
    token beside this process's pid and host; the token."""
    fd = _early.pop(folder, None)
    if fd is None:
        fd = _take(folder)
    token = uuid.uuid4().hex
    _write(fd, token)
    held.fds.append(fd)
    return token


def _take(folder: Path) -> int:
    """The folder's lock file, opened and locked by this process; a RunFolderInUse naming the holder."""
    folder.mkdir(parents=True, exist_ok=True)
    fd = os.open(folder / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _holder(fd)
        os.close(fd)
        raise RunFolderInUse(f"{folder} is in use by another run: pid {holder.get('pid', '?')} on host "
                             f"{holder.get('host', '?')} (started {holder.get('started', '?')}) holds {folder / LOCK}; "
                             "wait for it to end or stop it, or give this run another hydra.run.dir") from None
    _write(fd, "")
    return fd


def _write(fd: int, token: str) -> None:
    """The lock file's content: who holds it (for a refused run's message) and rank 0's token."""
    os.ftruncate(fd, 0)
    os.pwrite(fd, (json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "token": token,
                               "started": f"{datetime.datetime.now():%Y-%m-%dT%H:%M:%S}"}) + "\n").encode(), 0)
    os.fsync(fd)


def _holder(fd: int) -> dict:
    try:
        return json.loads(os.pread(fd, 4096, 0) or b"{}")
    except ValueError:  # written at this moment
        return {}


def _reads(folder: Path, token: str) -> tuple[str, str, str]:
    """(host, the folder as this rank resolves it, why it does not see rank 0's token; '' if it does)."""
    path = folder / LOCK
    try:
        got = json.loads(path.read_text() or "{}").get("token")
    except FileNotFoundError:
        return socket.gethostname(), str(folder), f"{path} not found"
    except (OSError, ValueError) as error:
        return socket.gethostname(), str(folder), f"{path}: {error}"
    why = "" if got == token else f"{path} holds another run's token (a folder of the same name, not rank 0's)"
    return socket.gethostname(), str(folder), why
