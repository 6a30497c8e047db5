"""Escapes from the python tool's sandbox (rl/tasks/sandbox.py), one test per class found by the
attack of issue 51, each contained by backend=bwrap; where the same code gets out with
backend=process (a plain child process: not a security boundary), a control shows it.

Every probe first disarms the Python guards (`DISARM`: the audit hook's refusals made no-ops through
`gc`, the `_posixsubprocess` import guard taken off `sys.meta_path`), so what holds is the kernel's
isolation alone. Each test runs twice: as the caller (root on CI) and as a non-root user (`runuser`,
the user made when missing), whose run imports a copy of the sandbox module (stdlib only) with an
interpreter that user can run. What the code did outside is checked from here, on the host."""

from __future__ import annotations

import json
import os
import pwd
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict
from pathlib import Path

import pytest

import rl.tasks.sandbox as sandbox
from rl.tasks.sandbox import Limits, run_python

pytestmark = pytest.mark.slow  # ~50 s: two or three sandboxes a test, and the non-root run through runuser

USER = "rlsandbox"  # the non-root user the second run of each test is (made by the test, as root, when missing)
LIMITS = dict(wall_s=8.0, cpu_s=4, memory_mb=512, max_processes=4, max_output_bytes=8192)

DISARM = """\
import gc, sys
for _f in gc.get_objects():  # the audit hook's closures: its refusal made a no-op
    if type(_f).__name__ == "function" and getattr(_f, "__qualname__", "").startswith("_install.<locals>"):
        for _name, _cell in zip(_f.__code__.co_freevars, _f.__closure__ or ()):
            if _name == "_refuse":
                _cell.cell_contents = lambda what: None
sys.meta_path[:] = [m for m in sys.meta_path if getattr(m, "__name__", "") != "_NoPrograms"]
del gc, _f
"""

DRIVER = """\
import json, sys, threading, time
from dataclasses import asdict
sys.path.insert(0, sys.argv[1])
from sandbox import Limits, run_python
jobs = json.load(sys.stdin)
results = [None] * len(jobs)
def one(i, job):
    time.sleep(job["delay"])
    results[i] = asdict(run_python(job["code"], Limits(**job["limits"])))
threads = [threading.Thread(target=one, args=(i, job)) for i, job in enumerate(jobs)]
for t in threads:
    t.start()
for t in threads:
    t.join()
print(json.dumps(results))
"""


class Runner:
    """Runs jobs (code, backend, delay before it starts) at once, as the caller or as `USER`."""

    def __init__(self, who: str, folder: str | None = None, python: str | None = None) -> None:
        self.who, self.folder, self.python = who, folder, python
        self.returncode = 0  # the user's driver: its exit status (a negative one: it was killed)

    def __call__(self, *jobs: tuple[str, str, float]) -> list[dict | None]:
        """The results, in order (None for each where the user's driver was killed). A disarmed run
        must have had nothing refused by the Python guards: what held was the kernel."""
        results = self._run(jobs)
        for (code, _, _), r in zip(jobs, results):
            assert r is None or not code.startswith(DISARM) or r["refused"] == [], r
        return results

    def _run(self, jobs: tuple[tuple[str, str, float], ...]) -> list[dict | None]:
        payload = [{"code": code, "limits": LIMITS | {"backend": backend}, "delay": delay}
                   for code, backend, delay in jobs]
        if self.who == "caller":
            results: list[dict | None] = [None] * len(jobs)

            def one(i: int, job: dict) -> None:
                time.sleep(job["delay"])
                results[i] = json.loads(json.dumps(asdict(run_python(job["code"], Limits(**job["limits"])))))

            threads = [threading.Thread(target=one, args=(i, job)) for i, job in enumerate(payload)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            return results
        proc = subprocess.run(["runuser", "-u", USER, "--", self.python, "-I", f"{self.folder}/driver.py", self.folder],
                              input=json.dumps(payload), capture_output=True, text=True, timeout=120)
        self.returncode = proc.returncode
        if proc.returncode != 0:
            return [None] * len(jobs)
        return json.loads(proc.stdout)


@pytest.fixture(scope="module")
def as_user():
    if os.geteuid() != 0:
        pytest.skip("the non-root run switches to another user, which needs root (CI runs as root)")
    for tool in ("runuser", "useradd"):
        if shutil.which(tool) is None:
            pytest.skip(f"the non-root run needs {tool} (util-linux / passwd), not installed here")
    try:
        pwd.getpwnam(USER)
    except KeyError:
        subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", USER], check=True)
    folder = tempfile.mkdtemp(prefix="rl-sandbox-user-")
    os.chmod(folder, 0o755)
    shutil.copy(sandbox.__file__, f"{folder}/sandbox.py")
    Path(f"{folder}/driver.py").write_text(DRIVER)
    for name in ("sandbox.py", "driver.py"):
        os.chmod(f"{folder}/{name}", 0o644)
    python = next((p for p in (os.path.realpath(sys.executable), "/usr/bin/python3", "/usr/local/bin/python3")
                   if os.path.exists(p) and subprocess.run(["runuser", "-u", USER, "--", p, "-I", "-c", "import sys; "
                                                            "assert sys.version_info >= (3, 9)"],
                                                           capture_output=True).returncode == 0), None)
    if python is None:
        shutil.rmtree(folder)
        pytest.skip(f"no Python 3.9+ that {USER} can run (the project's is under a folder only root reads): "
                    "install python3 (.ci/run does)")
    yield Runner("user", folder, python)
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(params=["caller", "user"])
def run(request) -> Runner:
    return Runner("caller") if request.param == "caller" else request.getfixturevalue("as_user")


@pytest.fixture
def open_dir():
    """A folder anyone may write (the worst case: the code's user could write there)."""
    folder = tempfile.mkdtemp(prefix="rl-escape-")
    os.chmod(folder, 0o777)
    yield Path(folder)
    shutil.rmtree(folder, ignore_errors=True)


def _pid_namespace_members(ns: str) -> list[int]:
    """Live processes of the machine in PID namespace `ns` (as /proc/<pid>/ns/pid reads)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.readlink(f"/proc/{pid}/ns/pid") == ns and not _zombie(int(pid)):
                found.append(int(pid))
        except OSError:
            pass
    return found


def _zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in "ZX"
    except OSError:
        return True


def test_writes_through_dir_fd_sqlite_a_symlink_and_dev_shm_stay_in_the_sandbox(run, open_dir):
    shm = f"rl-escape-{secrets.token_hex(4)}"
    code = DISARM + f"""
import os, sqlite3
D = {str(open_dir)!r}
def dir_fd():
    fd = os.open(D, os.O_RDONLY | os.O_DIRECTORY)
    os.close(os.open("dir_fd", os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=fd))
def sqlite():
    sqlite3.connect(os.path.join(D, "sqlite.db")).execute("create table t (a)")
def symlink():
    os.symlink(os.path.join(D, "symlink"), "link")
    with open("link", "w") as f:
        f.write("x")
def dev_shm():
    fd = os.open("/dev/shm", os.O_RDONLY | os.O_DIRECTORY)
    os.close(os.open({shm!r}, os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=fd))
def prefix():  # the interpreter's own folder: read-only
    fd = os.open(sys.prefix, os.O_RDONLY | os.O_DIRECTORY)
    os.close(os.open({shm!r}, os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=fd))
for f in (dir_fd, sqlite, symlink, dev_shm, prefix):
    try:
        f()
        print(f.__name__, "written")
    except Exception as e:
        print(f.__name__, type(e).__name__)
"""
    outside = {"dir_fd": open_dir / "dir_fd", "sqlite": open_dir / "sqlite.db", "symlink": open_dir / "symlink",
               "dev_shm": Path("/dev/shm") / shm, "prefix": Path(sys.prefix) / shm}
    try:
        (r,) = run((code, "bwrap", 0))
        assert r["status"] == "ok", r["output"]
        assert [name for name, path in outside.items() if path.exists()] == []
        assert "dev_shm written" in r["output"]  # into the call's own /dev/shm, gone with it
        assert "prefix written" not in r["output"]
        (control,) = run((code, "process", 0))  # the same code escapes without the kernel's isolation
        assert control["status"] == "ok", control["output"]
        assert sorted(name for name, path in outside.items() if path.exists()) == ["dev_shm", "dir_fd", "sqlite",
                                                                                  "symlink"], control["output"]
    finally:
        Path("/dev/shm", shm).unlink(missing_ok=True)


def test_a_program_started_around_the_import_guard_cannot_write_outside(run, open_dir):
    code = DISARM + f"""
import subprocess
p = subprocess.run(["/bin/sh", "-c", "id -u; echo pwned > {open_dir}/program"], capture_output=True, text=True)
print("ran", p.returncode, p.stdout.strip(), p.stderr.strip())
"""
    (r,) = run((code, "bwrap", 0))
    assert r["output"].startswith("ran "), r["output"]  # the program did start: the kernel contains it
    assert not (open_dir / "program").exists()
    (control,) = run((code, "process", 0))
    assert control["output"].startswith("ran 0"), control["output"]
    assert (open_dir / "program").read_text() == "pwned\n"


def test_a_double_forked_daemon_does_not_outlive_the_call(run):
    code = DISARM + """
import os, posix, time
if os.fork() == 0:
    posix.setsid()  # out of the process group (os.setsid is deleted, posix.setsid is not)
    if os.fork() == 0:
        print("daemon", os.readlink("/proc/self/ns/pid"), os.getpid(), flush=True)
        time.sleep(120)
    os._exit(0)
time.sleep(0.5)
"""
    host_ns = os.readlink("/proc/self/ns/pid")
    (r,) = run((code, "bwrap", 0))
    _, ns, _ = r["output"].split()
    assert ns != host_ns  # the call had its own PID namespace ...
    assert _pid_namespace_members(ns) == []  # ... and nothing of it is alive once the call returned
    (control,) = run((code, "process", 0))
    _, ns, pid = control["output"].split()
    try:
        assert ns == host_ns and not _zombie(int(pid))  # the daemon lives on
    finally:
        try:
            os.kill(int(pid), 9)
        except ProcessLookupError:
            pass


SECRET_HOLDER = """\
import os, time
open("secret-{token}", "w").write("the answer is 42")
print("ready", flush=True)
time.sleep(4)
print("survived")
"""


def test_a_call_cannot_read_a_concurrent_calls_scratch(run):
    token = secrets.token_hex(4)
    reader = DISARM + f"""
import glob
for path in glob.glob("/tmp/rl-sandbox-*/secret-{token}") + glob.glob("/proc/*/cwd/secret-{token}"):
    try:
        print("read", open(path).read())
    except OSError as e:
        print("denied", type(e).__name__)
"""
    holder, r = run((SECRET_HOLDER.format(token=token), "bwrap", 0), (reader, "bwrap", 1.5))
    assert holder["status"] == "ok" and "survived" in holder["output"]
    assert r["status"] == "ok" and "the answer is 42" not in r["output"], r["output"]
    holder, control = run((SECRET_HOLDER.format(token=token), "process", 0), (reader, "process", 1.0))
    assert "read the answer is 42" in control["output"], control["output"]


def test_a_call_cannot_signal_its_parent_or_a_concurrent_call(run):
    token = secrets.token_hex(4)
    killer = DISARM + f"""
import glob, os
targets = [os.getppid()]
for path in glob.glob("/tmp/rl-sandbox-*/secret-{token}"):  # the other call, by its scratch folder
    folder = os.path.dirname(path)
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if folder.encode() in open(f"/proc/{{pid}}/cmdline", "rb").read() and int(pid) != os.getpid():
                targets.append(int(pid))
        except OSError:
            pass
for pid in targets:
    try:
        os.kill(pid, 9)
        print("signalled", pid)
    except OSError as e:
        print("denied", pid, type(e).__name__)
"""
    holder, r = run((SECRET_HOLDER.format(token=token), "bwrap", 0), (killer, "bwrap", 1.5))
    assert run.returncode == 0  # the trainer (here the driver of the non-root run) is alive
    assert holder["status"] == "ok" and "survived" in holder["output"], holder
    assert r["status"] == "ok", r["output"]
    holder, control = run((SECRET_HOLDER.format(token=token), "process", 0), (killer, "process", 1.0))
    if run.who == "user":  # the code's parent is the user's own trainer: killed
        assert run.returncode in (-9, 128 + 9), run.returncode  # runuser reports the signal as 128 + n
    else:  # root's parent is out of reach of `nobody`; the concurrent call, also `nobody`, is not
        assert holder["status"] == "killed" and "survived" not in holder["output"], holder


def _on_the_way(folder: str, run: Runner) -> set[str]:
    """The names in `folder` that lead to the interpreter's folders the sandbox binds (those of the
    run's interpreter: the caller's, or the system python3 of the non-root run, under /usr)."""
    if run.who == "user":
        return set()
    return {os.path.relpath(f, folder).split("/")[0] for f in sandbox._interpreter_folders()
            if f.startswith(folder.rstrip("/") + "/")}


def test_root_only_files_the_rest_of_root_and_the_checkout_are_invisible(run):
    checkout = str(Path(__file__).resolve().parent.parent)
    code = DISARM + f"""
import os
def look(what, fn):
    try:
        print(what, repr(fn()))
    except OSError as e:
        print(what, type(e).__name__)
look("shadow", lambda: open("/etc/shadow").read()[:5])
look("root", lambda: sorted(os.listdir("/root")))
look("home", lambda: sorted(os.listdir("/home")))
look("checkout", lambda: sorted(os.listdir({checkout!r}))[:3])
"""
    (r,) = run((code, "bwrap", 0))
    seen = dict(line.split(" ", 1) for line in r["output"].splitlines())
    assert seen["shadow"] == "FileNotFoundError" and seen["home"] == "FileNotFoundError"
    # /root and the checkout hold at most the folders down to the interpreter's own (pyenv's install under
    # /root, a venv inside the checkout, as in a CI clone), nothing else of them
    for name, folder in (("root", "/root"), ("checkout", checkout)):
        assert seen[name] == "FileNotFoundError" or set(eval(seen[name])) <= _on_the_way(folder, run), seen
    assert len(os.listdir(checkout)) > 3  # the host's checkout holds more
    (control,) = run((code, "process", 0))
    seen = dict(line.split(" ", 1) for line in control["output"].splitlines())
    assert seen["checkout"] != "FileNotFoundError"  # the process backend reads whatever its user may
    if run.who == "caller" and os.geteuid() == 0:  # as `nobody` with CAP_DAC_READ_SEARCH: any file
        assert seen["shadow"].startswith("'root:"), seen


def test_a_unix_socket_in_tmp_and_an_abstract_one_are_out_of_reach(run, open_dir):
    path, abstract = str(open_dir / "sock"), f"\0rl-escape-{secrets.token_hex(4)}"
    code = DISARM + f"""
import socket
for address in ({path!r}, {abstract!r}):
    s = socket.socket(socket.AF_UNIX)
    try:
        s.connect(address)
        s.sendall(b"pwned")
        print("connected")
    except OSError as e:
        print("refused", type(e).__name__)
"""
    servers = []
    for address in (path, abstract):
        server = socket.socket(socket.AF_UNIX)
        server.bind(address)
        server.listen(4)
        server.settimeout(0.5)
        servers.append(server)
    os.chmod(path, 0o777)

    def reached(server: socket.socket) -> bool:
        try:
            server.accept()[0].close()
            return True
        except socket.timeout:
            return False

    try:
        (r,) = run((code, "bwrap", 0))
        assert "connected" not in r["output"] and not any(reached(s) for s in servers), r["output"]
        (control,) = run((code, "process", 0))  # a socket file is reached through the filesystem
        assert reached(servers[0]) and control["output"].startswith("connected"), control["output"]
    finally:
        for server in servers:
            server.close()


def test_the_process_limit_is_exact(run):
    code = DISARM + """
import os, time
n = 0
try:
    while n < 200:
        if os.fork() == 0:
            time.sleep(60)
            os._exit(0)
        n += 1
except OSError:
    pass
print("forks", n)
"""
    (r,) = run((code, "bwrap", 0))
    assert r["output"] == f"forks {LIMITS['max_processes']}\n", r["output"]
    if run.who == "user":  # the control: unshare(CLONE_NEWUSER) makes every process of the machine look
        (control,) = run((code, "process", 0))  # the user's, so the process backend's count is too high
        assert int(control["output"].split()[1]) > LIMITS["max_processes"], control["output"]


def test_a_closed_report_pipe_does_not_hide_a_refusal(run):
    code = """
import os
for fd in map(int, os.listdir("/proc/self/fd")):
    if fd > 2:
        try:
            os.close(fd)  # the report pipe among them
        except OSError:
            pass
try:
    open("/usr/x", "w")
except OSError:
    print("hidden")
"""
    for backend in ("bwrap", "process"):
        (r,) = run((code, backend, 0))
        assert r["output"] == "hidden\n" and r["status"] == "refused", r
        assert any("report channel was closed" in what for what in r["refused"]), r
        (control,) = run((code.replace("os.close(fd)", "pass"), backend, 0))  # the channel left open
        assert control["status"] == "refused" and "outside the scratch directory" in control["refused"][0], control


def test_a_program_cannot_reach_the_host_over_tcp(run):
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        code = DISARM + f"""
import subprocess, sys
probe = "import socket; socket.create_connection(('127.0.0.1', {port}), timeout=2); print('connected')"
p = subprocess.run([sys.executable, "-I", "-c", probe], capture_output=True, text=True)
print(p.stdout.strip() or p.stderr.strip().splitlines()[-1])
"""
        (r,) = run((code, "bwrap", 0))
        assert "connected" not in r["output"] and "Error" in r["output"], r["output"]  # a program, outside the hook
        server.settimeout(0.2)
        with pytest.raises(socket.timeout):
            server.accept()
        with socket.create_connection(("127.0.0.1", port), timeout=2):  # the control: the port is open
            server.accept()[0].close()


def test_the_code_has_no_capabilities_no_new_privileges_and_cannot_raise_its_limits(run):
    code = DISARM + """
import resource
status = dict(line.split(":", 1) for line in open("/proc/self/status"))
print(" ".join(status[k].strip() for k in ("CapPrm", "CapEff", "CapAmb", "NoNewPrivs")))
soft, hard = resource.getrlimit(resource.RLIMIT_NPROC)
try:
    resource.setrlimit(resource.RLIMIT_NPROC, (hard + 100, hard + 100))
    print("raised")
except (ValueError, OSError):
    print("kept", hard)
"""
    (r,) = run((code, "bwrap", 0))
    caps, limit = r["output"].splitlines()
    assert caps == "0000000000000000 0000000000000000 0000000000000000 1", caps
    assert limit.startswith("kept"), limit


def test_the_sandboxs_own_root_is_read_only(run):
    # as a non-root user bwrap makes / (and /etc, the folders above the binds) on a tmpfs of its own,
    # owned by the code's user and of no size: writable, it held memory past every bound of the call
    code = DISARM + """
import os
for folder in ("/", "/etc", "/proc/.."):
    try:
        with open(os.path.join(folder, "x"), "wb") as f:
            f.write(bytes(1 << 20))
        print(folder, "written")
    except OSError as e:
        print(folder, type(e).__name__)
"""
    (r,) = run((code, "bwrap", 0))
    assert r["status"] == "ok" and "written" not in r["output"], r["output"]


def test_the_sandboxs_init_cannot_be_used_to_get_around_the_limits(run):
    # bwrap's init (PID 1 of the call) runs as the code's own user when the trainer is not root: the
    # code may ptrace it (or write its /proc/1/mem) and make it start processes, so init has the call's
    # limits too; as root init is another user's, out of the code's reach
    code = DISARM + """
import os
names = ("Max cpu time", "Max file size", "Max processes", "Max open files", "Max address space")
def limits(pid):
    return [" ".join(line.split()) for line in open(f"/proc/{pid}/limits") if line.startswith(names)]
print(os.stat("/proc/1").st_uid == os.getuid(), limits(1) == limits("self"), limits(1))
"""
    (r,) = run((code, "bwrap", 0))
    same_user, same_limits, init = r["output"].split(" ", 2)
    assert same_user == ("True" if run.who == "user" else "False"), r["output"]
    assert run.who == "caller" or same_limits == "True", r["output"]
