"""A sandbox for model-written Python: the built-in `python` tool's runner (rl/tasks/tools.py).

    result = run_python("print(6 * 7)", Limits(wall_s=5, cpu_s=2, memory_mb=256))
    result.status, result.output          # Outcome.OK, "42\n"

Each call runs `sys.executable -I` (isolated: no PYTHON* variables, no user site, no cwd on the
path) in a new session (its own process group) with a fresh scratch directory as its working
directory, HOME and TMPDIR, stdin closed and a minimal environment. A bootstrap (`_BOOTSTRAP`,
run in the child before the code) sets the limits and installs the guards, then runs the code
with `exec`. Every call ends with the whole process group killed (SIGKILL) and the scratch
directory removed, whether the code finished, failed or ran out of time.

What enforces what (be precise: the kernel's limits hold against any code; the Python guards
only against code that stays in Python, which is why the escapes from Python are closed too):

* wall clock (`wall_s`): the parent kills the process group at the deadline -> `timeout`.
  Kernel-enforced (a signal), for every process that stays in the group; `os.setsid` and
  `os.setpgid` are deleted in the child so Python code cannot leave it.
* CPU time (`cpu_s`): RLIMIT_CPU, per process; SIGXCPU at the limit -> `cpu_limit`. Kernel.
* memory (`memory_mb`): RLIMIT_AS, per process: an allocation past it fails (Python raises
  MemoryError -> `memory_limit`). Kernel. It bounds address space, not resident memory.
* processes (`max_processes`): RLIMIT_NPROC. Kernel, with two caveats: it counts every process
  of the user id (and the kernel ignores it for root), so when the parent runs as root the
  child first drops to the `nobody` user (uid/gid 65534), and the limit is this user's
  processes at start plus `max_processes`. A fork refused is an `OSError` in the code. As
  `nobody` it keeps one capability, CAP_DAC_READ_SEARCH, to read the interpreter wherever it is
  installed (none where the parent lacks it, as root in a default Docker container).
* file size (`max_file_mb`): RLIMIT_FSIZE, and RLIMIT_NOFILE (64 open files). Kernel.
* network: the child first tries a new network namespace (unshare(CLONE_NEWNET) as root,
  unshare(CLONE_NEWUSER | CLONE_NEWNET) otherwise, where unprivileged user namespaces are
  allowed): it has only a loopback device that is down, so no connection leaves it, even from
  C code. Kernel. Where neither works (a container without those rights) only the Python guard
  below refuses sockets. `SandboxResult.network` says which held ("namespace" or "audit hook").
* writes outside the scratch directory: when the parent is root the child runs as `nobody`, so
  the kernel's file permissions refuse writes to anything `nobody` cannot write (everything but
  world-writable places such as /tmp and /dev/shm). In every case a Python audit hook
  (`sys.addaudithook`, which code cannot remove) refuses `open` for writing, and the os
  functions that create, remove, rename, link or change files, on any path that does not
  resolve (symlinks followed) inside the scratch directory. The hook is Python: it checks the
  path once, so a symlink swapped between the check and the use by a second process of the
  sandbox is not caught (a race), and C code is not seen by it, hence:
* escapes from Python are refused by the same hook: starting programs (`os.exec*`,
  `os.posix_spawn`, `os.system`, `subprocess`; `_posixsubprocess` cannot be imported, as its
  fork_exec raises no audit event) and `ctypes` (its calls into C raise none; importing it is an
  ImportError, which numpy takes in its stride).
  `os.fork` is allowed (the child keeps the hook; RLIMIT_NPROC bounds it). Reading files is
  not restricted (the interpreter and its libraries must be read); as `nobody` the kernel
  restricts it to what `nobody` may read.
* output: stdout and stderr (one pipe) are read as they come and kept up to `max_output_bytes`;
  the rest is read and dropped (so the child never blocks on a full pipe) and the result says
  `truncated`.

Not covered: the machine's disk outside RLIMIT_FSIZE per file (many files in the scratch
directory; it is deleted after the call), CPU time of many processes together (each has
`cpu_s`, the wall clock ends them all), and anything a kernel exploit can do. A sandbox for
untrusted code at scale wants a container or a microVM around this.
"""

from __future__ import annotations

import enum
import json
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass

NOBODY = 65534


class Outcome(str, enum.Enum):
    """How a sandboxed run ended (`SandboxResult.status`)."""

    OK = "ok"  # the code ran to its end (exit status 0)
    ERROR = "error"  # it raised (the traceback is in the output) or exited non-zero
    TIMEOUT = "timeout"  # past wall_s: the process group was killed
    CPU_LIMIT = "cpu_limit"  # past cpu_s of CPU time (SIGXCPU)
    MEMORY_LIMIT = "memory_limit"  # an allocation past memory_mb (MemoryError)
    REFUSED = "refused"  # the code tried what the sandbox forbids (a write outside, a socket, a program, ctypes)
    KILLED = "killed"  # ended by another signal (e.g. SIGXFSZ: a file past max_file_mb)


@dataclass(frozen=True)
class Limits:
    """The limits of one run (`task.options.sandbox` for the `python` tool)."""

    wall_s: float = 5.0
    cpu_s: int = 3
    memory_mb: int = 512
    max_processes: int = 8
    max_file_mb: int = 16
    max_output_bytes: int = 4096

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if not value > 0:
                raise ValueError(f"task.options.sandbox.{name}={value!r}: expected a positive number")


@dataclass
class SandboxResult:
    status: Outcome
    output: str  # stdout and stderr as they came, cut to max_output_bytes
    returncode: int | None
    truncated: bool  # output was longer than max_output_bytes
    seconds: float  # wall clock of the run
    network: str  # what kept the network away: "namespace" (kernel) or "audit hook" (Python only)
    user: str  # "nobody" (the parent was root) or "unchanged"
    pid: int  # the child's pid = its process group's id (killed when the call returned)
    refused: list[str]  # what the guard refused, in order (the code may have caught the error and gone on)


_REFUSED_EXIT = 86  # the bootstrap's exit status when the hook refused something the code did not catch
_MEMORY_EXIT = 87
_SETUP_EXIT = 88

# Runs in the child, before the code; argv[1] = JSON {limits, scratch, code path}. Kept as source
# text so that nothing of the parent (its imports, its threads) exists in the child.
_BOOTSTRAP = r'''
import json, os, resource, sys
cfg = json.loads(sys.argv[1])
scratch = os.path.realpath(cfg["scratch"])
network = "audit hook"

import ctypes
libc = ctypes.CDLL(None, use_errno=True)
CLONE_NEWUSER, CLONE_NEWNET, PR_SET_KEEPCAPS, CAP_DAC_READ_SEARCH = 0x10000000, 0x40000000, 8, 2

def _read_only_caps():
    # keep one capability, CAP_DAC_READ_SEARCH (read any file: the interpreter may live in a
    # folder `nobody` cannot read, such as /root), and nothing else: no write, no resource override
    # (where the parent never had it, e.g. root in a default Docker container: none at all)
    for keep in (1 << CAP_DAC_READ_SEARCH, 0):
        header = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this process
        data = (ctypes.c_uint32 * 6)(keep, keep, 0, 0, 0, 0)
        if libc.capset(header, data) == 0:
            return
    raise OSError(ctypes.get_errno(), "capset")

try:
    if os.geteuid() == 0:
        if libc.unshare(CLONE_NEWNET) == 0:
            network = "namespace"
        os.setgroups([])
        os.setgid(cfg["nobody"])
        if libc.prctl(PR_SET_KEEPCAPS, 1, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_KEEPCAPS)")
        os.setuid(cfg["nobody"])
        _read_only_caps()
    elif libc.unshare(CLONE_NEWUSER | CLONE_NEWNET) == 0:
        network = "namespace"
except Exception as e:
    print(f"sandbox set-up failed: {type(e).__name__}: {e}", file=sys.stderr)
    sys.exit(%(setup)d)
os.write(cfg["report_fd"], f"network={network}\n".encode())

def _mine():
    uid, n = os.getuid(), 0
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                n += os.stat(f"/proc/{pid}").st_uid == uid
            except OSError:
                pass
    return n

lim = cfg["limits"]
MB = 1 << 20
resource.setrlimit(resource.RLIMIT_CPU, (lim["cpu_s"], lim["cpu_s"] + 1))
resource.setrlimit(resource.RLIMIT_AS, (lim["memory_mb"] * MB, lim["memory_mb"] * MB))
resource.setrlimit(resource.RLIMIT_FSIZE, (lim["max_file_mb"] * MB, lim["max_file_mb"] * MB))
resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
nproc = _mine() + lim["max_processes"]
resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))
os.chdir(scratch)
with open(cfg["code"], encoding="utf-8") as f:
    source = f.read()
for name in ("ctypes", "_ctypes"):
    sys.modules.pop(name, None)
for name in ("setsid", "setpgid", "setpgrp"):
    if hasattr(os, name):
        delattr(os, name)

def _install(scratch, report):
    """The guards, as closures (nothing the code can rebind by name); returns the refusal's class."""
    class SandboxRefused(PermissionError):
        pass

    _realpath, _join, _sep, _isinstance, _str, _bytes, _int = (os.path.realpath, os.path.join, os.sep,
                                                               isinstance, str, bytes, int)
    _fsdecode, _write = os.fsdecode, os.write
    WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
    FILE_EVENTS = {"os.remove", "os.rename", "os.mkdir", "os.rmdir", "os.chmod", "os.chown", "os.link",
                   "os.symlink", "os.truncate", "os.utime", "os.chflags", "os.setxattr", "os.removexattr",
                   "os.mkfifo", "os.mknod", "shutil.copyfile", "shutil.copymode", "shutil.copystat",
                   "shutil.copytree", "shutil.move", "shutil.rmtree", "shutil.chown"}
    PROGRAM_EVENTS = {"os.exec", "os.posix_spawn", "os.spawn", "os.system", "subprocess.Popen", "os.startfile",
                      "os.forkpty"}

    def _inside(path):
        if _isinstance(path, _int):
            return True  # an open file descriptor: opened (and checked) before
        full = _realpath(_fsdecode(path))
        return full == scratch or full.startswith(scratch + _sep)

    def _refuse(what):
        try:
            _write(report, (what.replace("\n", " ") + "\n").encode())
        except OSError:
            pass
        raise SandboxRefused(f"sandbox: {what} is not allowed")

    def hook(event, args):
        if event == "open":
            path, mode, flags = args
            writing = (mode is not None and any(c in mode for c in "wax+")) or (mode is None and flags & WRITE_FLAGS)
            if writing and not _inside(path):
                _refuse(f"writing {path!r} (outside the scratch directory)")
        elif event in FILE_EVENTS:
            for a in args[:2]:
                if _isinstance(a, (_str, _bytes, os.PathLike)) and not _inside(a):
                    _refuse(f"{event} on {a!r} (outside the scratch directory)")
        elif event in PROGRAM_EVENTS:
            _refuse(f"starting a program ({event})")
        elif event.startswith("socket.") and event not in ("socket.gethostname", "socket.__new__"):
            _refuse(f"the network ({event})")
        elif event.startswith("ctypes."):
            _refuse(f"ctypes ({event})")

    class _NoPrograms:
        """Imports refused: `_posixsubprocess` (its fork_exec starts programs without an audit
        event), and ctypes (its calls into C raise none), as an ImportError: numpy goes on without it."""

        @staticmethod
        def find_spec(name, path=None, target=None):
            if name == "_posixsubprocess":
                _refuse("starting a program (import _posixsubprocess)")
            if name in ("ctypes", "_ctypes"):
                raise ImportError("sandbox: ctypes is not available")
            return None

    sys.addaudithook(hook)
    sys.modules.pop("_posixsubprocess", None)
    sys.meta_path.insert(0, _NoPrograms)
    return SandboxRefused

SandboxRefused = _install(scratch, cfg["report_fd"])
del libc, ctypes, _read_only_caps, _mine, _install, json, resource, cfg
try:
    exec(compile(source, "<python>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
except SystemExit:
    raise
except BaseException as e:  # the traceback from the code's first frame on: the bootstrap is not the model's
    import traceback
    traceback.print_exception(type(e), e, e.__traceback__.tb_next)
    if isinstance(e, MemoryError):
        print("sandbox: memory limit reached", file=sys.stderr)
    sys.exit(%(refused)d if isinstance(e, SandboxRefused) else %(memory)d if isinstance(e, MemoryError) else 1)
''' % {"refused": _REFUSED_EXIT, "memory": _MEMORY_EXIT, "setup": _SETUP_EXIT}


def run_python(code: str, limits: Limits | None = None) -> SandboxResult:
    """Run `code` in the sandbox (see the module docstring) and say how it ended. Never raises for
    what the code does; an OSError only if the child cannot be started at all."""
    limits = limits or Limits()
    scratch = tempfile.mkdtemp(prefix="rl-sandbox-")
    code_path = os.path.join(scratch, "main.py")
    with open(code_path, "w", encoding="utf-8") as f:
        f.write(code)
    root = os.geteuid() == 0
    if root:  # the scratch directory and the code belong to the user the child becomes
        os.chown(scratch, NOBODY, NOBODY)
        os.chown(code_path, NOBODY, NOBODY)
    report_r, report_w = os.pipe()  # the child's side channel: its network mode, each refusal
    cfg = {"limits": asdict(limits), "scratch": scratch, "code": code_path, "nobody": NOBODY, "report_fd": report_w}
    env = {"PATH": "/usr/bin:/bin", "HOME": scratch, "TMPDIR": scratch, "LANG": "C.UTF-8",
           "PYTHONDONTWRITEBYTECODE": "1", "PYTHONIOENCODING": "utf-8", "OMP_NUM_THREADS": "1"}
    start = time.monotonic()
    try:
        proc = subprocess.Popen([sys.executable, "-I", "-c", _BOOTSTRAP, json.dumps(cfg)], cwd=scratch, env=env,
                                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                start_new_session=True, pass_fds=(report_w,))
    except BaseException:
        os.close(report_r)
        shutil.rmtree(scratch, ignore_errors=True)
        raise
    finally:
        os.close(report_w)
    out, report = _Capped(limits.max_output_bytes), _Capped(1 << 16)
    timed_out = False
    try:
        with selectors.DefaultSelector() as sel:
            sel.register(proc.stdout.fileno(), selectors.EVENT_READ, out)
            sel.register(report_r, selectors.EVENT_READ, report)
            while sel.get_map():
                left = start + limits.wall_s - time.monotonic()
                if left <= 0:
                    timed_out = True
                    break
                ready = sel.select(min(left, 0.05))
                for key, _ in ready:
                    chunk = os.read(key.fd, 1 << 16)
                    if chunk:
                        key.data.add(chunk)
                    else:
                        sel.unregister(key.fd)  # every writer closed it
                if not ready and proc.poll() is not None:
                    break  # it ended; what processes it left still write is not waited for
    finally:
        _kill_group(proc.pid)  # whatever happened: nothing of the run outlives the call
        proc.wait()
        proc.stdout.close()
        os.close(report_r)
        shutil.rmtree(scratch, ignore_errors=True)
    lines = report.text().splitlines()
    refused = [line for line in lines if not line.startswith("network=")]
    network = next((line.partition("=")[2] for line in lines if line.startswith("network=")), "none (not started)")
    status = _outcome(proc.returncode, timed_out)
    if refused and status in (Outcome.OK, Outcome.ERROR):
        status = Outcome.REFUSED  # it tried something forbidden, caught the refusal and went on
    return SandboxResult(status=status, output=out.text(), returncode=proc.returncode, truncated=out.dropped > 0,
                         seconds=time.monotonic() - start, network=network, user="nobody" if root else "unchanged",
                         pid=proc.pid, refused=refused)


class _Capped:
    """Bytes kept up to `limit`; the rest counted and dropped."""

    def __init__(self, limit: int) -> None:
        self.limit, self.kept, self.dropped = limit, bytearray(), 0

    def add(self, chunk: bytes) -> None:
        room = max(0, self.limit - len(self.kept))
        self.kept += chunk[:room]
        self.dropped += max(0, len(chunk) - room)

    def text(self) -> str:
        return self.kept.decode("utf-8", errors="replace")


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _outcome(returncode: int, timed_out: bool) -> Outcome:
    if timed_out:
        return Outcome.TIMEOUT
    if returncode == 0:
        return Outcome.OK
    if returncode == -signal.SIGXCPU:
        return Outcome.CPU_LIMIT
    if returncode == _MEMORY_EXIT:
        return Outcome.MEMORY_LIMIT
    if returncode == _REFUSED_EXIT:
        return Outcome.REFUSED
    if returncode < 0:
        return Outcome.KILLED
    return Outcome.ERROR
