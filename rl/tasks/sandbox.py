"""A sandbox for model-written Python: the built-in `python` tool's runner (rl/tasks/tools.py).

    result = run_python("print(6 * 7)", Limits(wall_s=5, cpu_s=2, memory_mb=256))
    result.status, result.output          # Outcome.OK, "42\n"

Model-written code is adversarial in RL (a policy rewarded for answers finds whatever gets through),
so the boundary is the kernel's. Two backends (`Limits.backend`, `task.options.sandbox.backend`):

backend=bwrap (the default): each call runs `sys.executable -I` under bubblewrap (`bwrap`), which
the parent starts in a new session with stdin closed and a minimal environment. What the kernel
enforces, against any code (C, programs, forks):

* namespaces: new PID, mount, network, IPC and UTS namespaces (and cgroup, where possible). The call
  sees only its own processes, so it cannot signal the trainer or a concurrent call; it has only a
  loopback device of its own (no connection leaves it; abstract Unix sockets are per namespace).
* user: as a non-root user, a new user namespace too (`--unshare-user`, and `--disable-userns` where
  bwrap has it, 0.8+: the code cannot make another), mapped to the caller's uid. As root, no user namespace (it would map host
  root); bwrap keeps CAP_SETUID and CAP_SETGID for the bootstrap alone, which drops to the call's own
  uid (`SANDBOX_UIDS`: a random uid in [2^30, 2^30 + 2^29), used by nothing else on the machine), and
  the kernel clears every capability on that drop (checked: the bootstrap exits if any is left).
  No capabilities either way; no_new_privs (bwrap's): no setuid program or file capability elevates.
* filesystem: a read-only view of what the interpreter needs and nothing else: /usr (and the
  /bin, /lib... links or folders), /etc/ld.so.cache, and the interpreter's prefix and base prefix
  (a venv and the Python it came from, e.g. pyenv's under /root), each bound read-only at its own
  path; the folders above them are empty ones (so of /root only the path down to the interpreter
  exists), on a root that is read-only too (`--remount-ro /`: as a user it is bwrap's own tmpfs of
  no size, owned by the code's user). Not the checkout, not /home, not the rest of /root or /etc. A fresh private tmpfs of
  `scratch_mb` is /tmp: the working directory, HOME and TMPDIR; another is /dev/shm; /dev holds only
  the standard devices (read-only); /proc is the call's own.
* lifetime: `--die-with-parent`, `--new-session`; when the call returns the parent kills the PID
  namespace's init (a pidfd from bwrap's `--info-fd`), the kernel kills every process of the
  namespace, and the parent waits until init is gone, which happens only after all of them are:
  nothing the call started (a double-forked daemon included) outlives it.
* limits (rlimits, per process, set by the bootstrap before the code runs; the code cannot raise
  them): CPU time `cpu_s` (SIGXCPU -> `cpu_limit`), address space `memory_mb` (MemoryError ->
  `memory_limit`), file size `max_file_mb` (SIGXFSZ -> `killed`), 64 open files, and processes
  `max_processes`: RLIMIT_NPROC set to the processes of the code's uid in the call's PID namespace
  plus `max_processes`, which is exactly what the kernel counts (as root: the call's own uid; as a
  user: its user namespace's processes of that uid), so the code can start exactly `max_processes`
  more. As a user, bwrap's init (PID 1) runs as the code's user and can be ptraced by it: the
  bootstrap gives init the same limits (prlimit), so code that drives init gains none. The wall clock
  `wall_s`: the parent kills the namespace at the deadline -> `timeout`.
* memory in aggregate: at most (`max_processes` + 1) processes of `memory_mb` address space each,
  plus the two tmpfs of `scratch_mb` each. A cgroup bound (memory.max) is not used: it needs a
  cgroup v2 subtree delegated to the trainer with the memory controller enabled, which a trainer
  cannot count on (the project's CI machine mounts the memory controller on cgroup v1, its v2
  hierarchy offers only hugetlb, and bwrap makes no cgroups); kernel memory of the call (page
  tables, pipe and socket buffers) is bounded only through those limits. Not bounded (found by an
  adversarial probe with memory_mb=64, scratch_mb=8, max_processes=1, i.e. 144 MB: each held 576 to
  900 MB): shared memory outside any address space and any tmpfs of the call's: memfds
  (`max_file_mb` each, 64 open ones a process, more in flight over a Unix socket), SysV shared
  memory (segments stay after shmdt), and as root a tmpfs of the code's own in a user namespace it
  makes (bwrap's --disable-userns needs --unshare-user). The wall clock ends them with the call; a
  seccomp filter (bwrap --seccomp) or a cgroup would bound them.

backend=process (explicit only; logged at start-up as not a security boundary): today's runner, a
plain `python -I` child in a new session with a fresh scratch directory (removed afterwards) as its
working directory, HOME and TMPDIR. The same rlimits and wall clock (the parent kills the process
group). As root it runs as `nobody`, keeping CAP_DAC_READ_SEARCH (it reads every file, /etc/shadow
included); a network namespace where one can be made. Processes are counted by uid across the
machine (after unshare(CLONE_NEWUSER) every process of the machine looks like the user's: the bound
is far too high), a process that leaves the group (`posix.setsid`) outlives the call, the code can
signal its parent and concurrent calls of its user, and it reads (and writes) what its user may
wherever the Python guards below do not look.

The Python guards, in both backends a second layer that nothing relies on (code that digs into the
interpreter through `gc` disarms them; tests/test_sandbox_escape.py does, and backend=bwrap holds):
an audit hook refuses writes outside the scratch directory, sockets, starting programs and ctypes,
`_posixsubprocess` and `ctypes` cannot be imported, `os.setsid`/`setpgid` are deleted; each refusal is
reported on a pipe and makes the status `refused` even when the code caught it. The bootstrap's last
report ends that pipe: a run that ended by itself without it (the code closed the pipe to hide its
refusals, or left by `os._exit`) is `refused` too. A determined code can still forge that report:
the status is a diagnosis, the kernel is the boundary.

Output: stdout and stderr (one pipe) are read as they come and kept up to `max_output_bytes`; the
rest is read and dropped (so the child never blocks on a full pipe) and the result says `truncated`.

Not covered: the machine's disk is not written by backend=bwrap (its tmpfs are memory); CPU time of
many processes together (each has `cpu_s`, the wall clock ends them all); kernel exploits (the call
runs unprivileged code against the host's kernel, as a container would; a microVM goes further).
"""

from __future__ import annotations

import enum
import functools
import json
import logging
import os
import secrets
import select
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass

NOBODY = 65534
SANDBOX_UIDS = (1 << 30, 1 << 29)  # backend=bwrap as root: each call's own uid, base + a random offset below this
log = logging.getLogger(__name__)


class Backend(str, enum.Enum):
    """`task.options.sandbox.backend`: what isolates a call (see the module docstring). A plain
    Enum, not rl.choice.Choice: this module imports the standard library only (a copy of it runs
    alone as another user in tests/test_sandbox_escape.py)."""

    BWRAP = "bwrap"  # bubblewrap: kernel namespaces, a read-only view of the interpreter, a private tmpfs
    PROCESS = "process"  # a plain child process with rlimits and Python guards: not a security boundary


class SandboxUnavailable(RuntimeError):
    """backend=bwrap cannot run here; the message names the cause and the fix."""


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
    """The limits of one run, and the backend that enforces them (`task.options.sandbox` for the `python` tool)."""

    wall_s: float = 5.0
    cpu_s: int = 3
    memory_mb: int = 512
    max_processes: int = 8
    max_file_mb: int = 16
    max_output_bytes: int = 4096
    scratch_mb: int = 64  # backend=bwrap: the size of the private tmpfs /tmp (scratch, HOME) and of /dev/shm
    backend: Backend = Backend.BWRAP

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "backend", Backend(self.backend))
        except ValueError:
            raise ValueError(f"task.options.sandbox.backend={self.backend!r}: expected one of "
                             f"{', '.join(b.value for b in Backend)}") from None
        for name, value in asdict(self).items():
            if name != "backend" and not value > 0:
                raise ValueError(f"task.options.sandbox.{name}={value!r}: expected a positive number")


@dataclass
class SandboxResult:
    status: Outcome
    output: str  # stdout and stderr as they came, cut to max_output_bytes
    returncode: int | None
    truncated: bool  # output was longer than max_output_bytes
    seconds: float  # wall clock of the run
    network: str  # what kept the network away: "namespace" (kernel) or "audit hook" (Python only)
    user: str  # the code's user: "uid N" (bwrap as root), "nobody" (process as root) or "unchanged"
    pid: int  # process: the child's pid = its process group's id; bwrap: bwrap's pid (the sandbox is killed with it)
    refused: list[str]  # what the guard refused, in order (the code may have caught the error and gone on)


_REFUSED_EXIT = 86  # the bootstrap's exit status when the hook refused something the code did not catch
_MEMORY_EXIT = 87
_SETUP_EXIT = 88

# Runs in the child, before the code; argv[1] = JSON {backend, limits, scratch, code_fd, report_fd, uid}.
# Kept as source text so that nothing of the parent (its imports, its threads) exists in the child.
_BOOTSTRAP = r'''
import json, os, resource, sys
cfg = json.loads(sys.argv[1])
scratch = os.path.realpath(cfg["scratch"])
with open(cfg["code_fd"], encoding="utf-8") as f:  # the code, from a memfd the parent wrote (closed here)
    source = f.read()

def _bwrap_user(uid):
    # bwrap as root: it kept CAP_SETUID and CAP_SETGID for this drop to the call's own uid alone
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)  # from root to another uid: the kernel clears every capability
    with open("/proc/self/status") as f:
        caps = [line.split() for line in f if line.startswith(("CapPrm", "CapEff", "CapAmb"))]
    if any(int(value, 16) for _, value in caps):
        raise OSError(f"capabilities left after the drop to uid {uid}: {caps}")

def _process_user():
    # backend=process: a network namespace where one can be made; as root, the `nobody` user
    global network
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

network = "audit hook"
try:
    if cfg["backend"] == "bwrap":
        network = "namespace"  # bwrap --unshare-net
        if cfg["uid"] is not None:
            _bwrap_user(cfg["uid"])
    else:
        _process_user()
except Exception as e:
    print(f"sandbox set-up failed: {type(e).__name__}: {e}", file=sys.stderr)
    sys.exit(%(setup)d)
os.write(cfg["report_fd"], f"network={network}\n".encode())

def _mine():
    # this uid's processes: under bwrap /proc is the call's own PID namespace, so this counts what the
    # kernel counts for RLIMIT_NPROC (the call's uid outside, or its user namespace's processes)
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
nproc = _mine() + lim["max_processes"]
for limit, value in ((resource.RLIMIT_CPU, (lim["cpu_s"], lim["cpu_s"] + 1)),
                     (resource.RLIMIT_AS, (lim["memory_mb"] * MB,) * 2),
                     (resource.RLIMIT_FSIZE, (lim["max_file_mb"] * MB,) * 2),
                     (resource.RLIMIT_NOFILE, (64, 64)), (resource.RLIMIT_NPROC, (nproc, nproc))):
    resource.setrlimit(limit, value)
    if cfg["backend"] == "bwrap" and cfg["uid"] is None:
        # bwrap's init (PID 1) is then this user's too, so the code could ptrace it (or write its
        # /proc/1/mem) and make it start processes: init gets the same limits, and gives nothing more
        resource.prlimit(1, limit, value)
os.chdir(scratch)
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
_report = cfg["report_fd"]
del _bwrap_user, _process_user, _mine, _install, json, resource, cfg
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
finally:  # the last report: without it the parent knows the code closed the channel or left by os._exit
    try:
        os.write(_report, b"end\n")
    except OSError:
        pass
''' % {"refused": _REFUSED_EXIT, "memory": _MEMORY_EXIT, "setup": _SETUP_EXIT}


def run_python(code: str, limits: Limits | None = None) -> SandboxResult:
    """Run `code` in the sandbox (see the module docstring) and say how it ended. Never raises for
    what the code does; `SandboxUnavailable` where backend=bwrap cannot run (`check_backend`), an
    OSError if the child cannot be started at all."""
    limits = limits or Limits()
    if limits.backend is Backend.BWRAP:
        check_backend(limits.backend)
    return _run(code, limits)


def _run(code: str, limits: Limits) -> SandboxResult:
    bwrap = limits.backend is Backend.BWRAP
    root = os.geteuid() == 0
    uid = SANDBOX_UIDS[0] + secrets.randbelow(SANDBOX_UIDS[1]) if bwrap and root else None
    code_fd = _code_fd(code)
    scratch = "/tmp" if bwrap else tempfile.mkdtemp(prefix="rl-sandbox-")  # bwrap: its private tmpfs
    if root and not bwrap:  # the scratch directory belongs to the user the child becomes
        os.chown(scratch, NOBODY, NOBODY)
    report_r, report_w = os.pipe()  # the child's side channel: its network mode, each refusal, its end
    info_r, info_w = os.pipe() if bwrap else (None, None)  # bwrap --info-fd: the pid of the sandbox's init
    cfg = {"backend": limits.backend.value, "limits": asdict(limits) | {"backend": limits.backend.value},
           "scratch": scratch, "code_fd": code_fd, "nobody": NOBODY, "report_fd": report_w, "uid": uid}
    env = {"PATH": "/usr/bin:/bin", "HOME": scratch, "TMPDIR": scratch, "LANG": "C.UTF-8",
           "PYTHONDONTWRITEBYTECODE": "1", "PYTHONIOENCODING": "utf-8", "OMP_NUM_THREADS": "1"}
    python = [sys.executable, "-I", "-c", _BOOTSTRAP, json.dumps(cfg)]
    command = _bwrap_command(limits, root, info_w) + python if bwrap else python
    start = time.monotonic()
    try:
        proc = subprocess.Popen(command, cwd="/" if bwrap else scratch, env=env, stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
                                pass_fds=(code_fd, report_w) + ((info_w,) if bwrap else ()))
    except BaseException:
        _close(report_r, info_r)
        if not bwrap:
            shutil.rmtree(scratch, ignore_errors=True)
        raise
    finally:
        _close(code_fd, report_w, info_w)
    out, report, timed_out = _watch(proc, limits, start, report_r, info_r, None if bwrap else scratch)
    return _result(proc, out, report, timed_out, start, bwrap,
                   user=f"uid {uid}" if uid is not None else "nobody" if root and not bwrap else "unchanged")


def _code_fd(code: str) -> int:
    """A memfd holding `code` (the child's bootstrap reads and closes it), at offset 0."""
    code_fd = os.memfd_create("code")
    try:  # code that cannot be written (not a str, a lone surrogate from JSON) leaves nothing behind
        with os.fdopen(os.dup(code_fd), "w", encoding="utf-8") as f:
            f.write(code)
    except BaseException:
        os.close(code_fd)
        raise
    os.lseek(code_fd, 0, os.SEEK_SET)
    return code_fd


def _close(*fds: int | None) -> None:
    for fd in fds:
        if fd is not None:
            os.close(fd)


def _watch(proc: subprocess.Popen, limits: Limits, start: float, report_r: int, info_r: int | None,
           scratch: str | None) -> tuple[_Capped, _Capped, bool]:
    """Read the run's output and report pipes until it ends or its wall clock runs out, then end
    it: nothing of the run outlives the call. `info_r` (bwrap): where bwrap says its init's pid;
    `scratch` (backend=process): the folder removed afterwards. -> (output, report, timed out)."""
    bwrap = info_r is not None
    out, report, info = _Capped(limits.max_output_bytes), _Capped(1 << 16), _Capped(1 << 12)
    init = None  # bwrap: a pidfd of the sandbox's init (PID 1 of its namespace)
    timed_out = False
    try:
        with selectors.DefaultSelector() as sel:
            sel.register(proc.stdout.fileno(), selectors.EVENT_READ, out)
            sel.register(report_r, selectors.EVENT_READ, report)
            if bwrap:
                sel.register(info_r, selectors.EVENT_READ, info)
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
                        if key.fd == info_r and init is None:  # as soon as bwrap says, while init is its child
                            init = _pidfd(info.text())
                    else:
                        sel.unregister(key.fd)  # every writer closed it
                if not ready and proc.poll() is not None:
                    break  # it ended; what processes it left still write is not waited for
    finally:
        # whatever happened: nothing of the run outlives the call
        if bwrap:
            _end_sandbox(proc, init)
        else:
            _kill_group(proc.pid)
            proc.wait()
        proc.stdout.close()
        _close(report_r, info_r)
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)
    return out, report, timed_out


def _result(proc: subprocess.Popen, out: _Capped, report: _Capped, timed_out: bool, start: float, bwrap: bool,
            user: str) -> SandboxResult:
    """How the run ended, from its exit status and its report (network mode, refusals, its end)."""
    lines = report.text().splitlines()
    refused = [line for line in lines if not line.startswith("network=") and line != "end"]
    network = next((line.partition("=")[2] for line in lines if line.startswith("network=")), "none (not started)")
    returncode = proc.returncode
    if bwrap and returncode is not None and 128 < returncode <= 128 + 64:
        returncode = 128 - returncode  # bwrap reports a signal n as the exit status 128 + n
    status = _outcome(returncode, timed_out)
    if status in (Outcome.OK, Outcome.ERROR) and "end" not in lines and "network=" in report.text():
        refused.append("the sandbox's report channel was closed, or the code left by os._exit: what it tried "
                       "is not known")
    if refused and status in (Outcome.OK, Outcome.ERROR):
        status = Outcome.REFUSED  # it tried something forbidden, caught the refusal and went on
    return SandboxResult(status=status, output=out.text(), returncode=returncode, truncated=out.dropped > 0,
                         seconds=time.monotonic() - start, network=network, user=user, pid=proc.pid,
                         refused=refused)


def _bwrap_command(limits: Limits, root: bool, info_fd: int) -> list[str]:
    """bubblewrap's arguments for one call (see the module docstring)."""
    cmd = [shutil.which("bwrap") or "bwrap", "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts",
           "--unshare-cgroup-try", "--hostname", "sandbox", "--die-with-parent", "--new-session", "--cap-drop", "ALL"]
    if root:  # no user namespace (it would map host root); the bootstrap drops to the call's uid with these two
        cmd += ["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
    else:
        cmd += ["--unshare-user"] + (["--disable-userns"] if _bwrap_has("--disable-userns") else [])
    size = str(limits.scratch_mb << 20)
    # the private mounts first: an interpreter folder below /tmp (a venv in a checkout under /tmp) is bound on top
    cmd += ["--ro-bind", "/usr", "/usr", "--proc", "/proc", "--dev", "/dev", "--perms", "1777", "--size", size,
            "--tmpfs", "/tmp", "--perms", "1777", "--size", size, "--tmpfs", "/dev/shm"]
    for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):  # merged /usr: links; else the folders
        if os.path.islink(top):
            cmd += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            cmd += ["--ro-bind", top, top]
    bound = ["/usr"]
    if os.path.isfile("/etc/ld.so.cache"):  # the dynamic loader's index of libraries; nothing else of /etc
        cmd += ["--ro-bind", "/etc/ld.so.cache", "/etc/ld.so.cache"]
        bound.append("/etc/ld.so.cache")
    for folder in _interpreter_folders():
        cmd += ["--ro-bind", folder, folder]
        bound.append(folder)
    made = set()  # the folders bwrap makes above a bound one are mode 0700: opened to the call's uid
    for folder in bound[1:]:
        parent = os.path.dirname(folder)
        while parent not in ("/", "/tmp", "/dev/shm") and not any(parent == b or parent.startswith(b + "/")
                                                                    for b in bound):  # the scratch mounts keep 1777
            made.add(parent)
            parent = os.path.dirname(parent)
    for parent in sorted(made):
        cmd += ["--chmod", "0755", parent]
    cmd += ["--remount-ro", "/dev", "--remount-ro", "/", "--chdir", "/tmp", "--info-fd", str(info_fd), "--"]
    return cmd


@functools.lru_cache(maxsize=None)
def _bwrap_has(option: str) -> bool:
    """bwrap knows `option` (--disable-userns came with bubblewrap 0.8)."""
    try:
        return option in subprocess.run([shutil.which("bwrap") or "bwrap", "--help"], capture_output=True,
                                        text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        return False


@functools.lru_cache(maxsize=None)
def _interpreter_folders() -> tuple[str, ...]:
    """The folders the interpreter needs outside /usr: its prefix and base prefix (a venv and the
    Python it was made from), and the real folder of `sys.executable`, each once, outermost first."""
    found = []
    for path in (sys.prefix, sys.base_prefix, os.path.dirname(os.path.dirname(os.path.realpath(sys.executable)))):
        for folder in {os.path.abspath(path), os.path.realpath(path)}:
            if folder != "/usr" and not folder.startswith("/usr/"):
                found.append(folder)
    found.sort(key=len)
    kept: list[str] = []
    for folder in found:
        if not any(folder == k or folder.startswith(k + "/") for k in kept):
            kept.append(folder)
    return tuple(kept)


def _pidfd(info: str) -> int | None:
    """A pidfd of the sandbox's init, from bwrap's --info-fd JSON (None before bwrap wrote it)."""
    try:
        return os.pidfd_open(json.loads(info)["child-pid"])
    except (ValueError, KeyError, OSError):
        return None


def _end_sandbox(proc: subprocess.Popen, init: int | None) -> None:
    """Kill the sandbox's init (PID 1 of its namespace): the kernel kills every other process of the
    namespace, and init's exit completes only once they are gone, which its pidfd reports (readable
    then). So when this returns nothing of the call is left, whether bwrap had exited already (as root
    it leaves when the code's process ends, its init still reaping) or not."""
    if init is not None:
        try:
            signal.pidfd_send_signal(init, signal.SIGKILL)
            if not select.select([init], [], [], 10)[0]:
                log.warning("the python sandbox's init (pidfd %d) outlived SIGKILL by 10 s", init)
        except OSError:
            pass  # it had ended
        finally:
            os.close(init)
    else:
        _kill_group(proc.pid)  # bwrap before its init existed (--die-with-parent takes what it started)
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        _kill_group(proc.pid)
        proc.wait()


def check_backend(backend: Backend | str) -> None:
    """Refuse a backend that cannot run here, naming the cause and the fix (bwrap: probed once per
    process; the config check calls this before any model is built, the task again when it builds
    its tools). backend=process is logged, at each of those, as what it is."""
    if Backend(backend) is Backend.PROCESS:
        log.warning("task.options.sandbox.backend=process: the python tool runs model-written code in a plain "
                    "child process with rlimits and Python guards; this is NOT a security boundary (files the "
                    "user can read, programs started around the guards, processes the user can signal)")
    else:
        _check_bwrap()


@functools.lru_cache(maxsize=None)
def _check_bwrap() -> None:
    fix = ("or set task.options.sandbox.backend=process explicitly (a plain child process: not a security "
           "boundary)")
    if shutil.which("bwrap") is None:
        raise SandboxUnavailable("the python tool's sandbox needs bubblewrap (bwrap), which is not installed: install "
                                 f"it (Debian/Ubuntu: apt-get install bubblewrap; Fedora: dnf install bubblewrap), {fix}")
    probe = _run("print(6 * 7)", Limits(wall_s=30, cpu_s=10, backend=Backend.BWRAP))
    if probe.status is not Outcome.OK or probe.output != "42\n":
        if os.geteuid() == 0:
            cause = ("as root, bwrap needs CAP_SYS_ADMIN to make namespaces (a default Docker container lacks it: "
                     "run the container with --cap-add SYS_ADMIN and a seccomp profile that allows unshare, or "
                     "--privileged)")
        else:
            cause = ("as a non-root user, bwrap needs unprivileged user namespaces: allow them (sysctl "
                     "kernel.unprivileged_userns_clone=1 and user.max_user_namespaces > 0; on Ubuntu 23.10+ "
                     "kernel.apparmor_restrict_unprivileged_userns=0)")
        raise SandboxUnavailable(f"bubblewrap cannot start the python tool's sandbox here (a probe ended "
                                 f"{probe.status.value}: {probe.output.strip()[-400:]!r}); {cause}, {fix}")


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
