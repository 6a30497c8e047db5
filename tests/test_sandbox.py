"""The `python` tool's sandbox (rl/tasks/sandbox.py), on both backends: each thing model-written code
may try is contained, reported with a status, and the next call runs as if nothing happened; each
test has a control (the same kind of code within the limits works). The escapes that only the
kernel's isolation (backend=bwrap) contains are tests/test_sandbox_escape.py's."""

from __future__ import annotations

import os
import socket
import time

import pytest

from rl.tasks.sandbox import Backend, Limits, Outcome, run_python

TINY_LIMITS = dict(wall_s=4.0, cpu_s=1, memory_mb=256, max_processes=4, max_output_bytes=512)


@pytest.fixture(params=[b.value for b in Backend])
def backend(request) -> str:
    return request.param


@pytest.fixture
def TINY(backend) -> Limits:
    return Limits(**TINY_LIMITS, backend=backend)


def _alive_in_group(pgid: int) -> list[int]:
    """Processes of process group `pgid` that are not zombies (a zombie holds no resources)."""
    alive = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            alive.append(int(pid))
    return alive


def _alive_as(uid: int) -> list[int]:
    """Processes of user id `uid` that are not zombies."""
    alive = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/status") as f:
                status = dict(line.split(":", 1) for line in f)
        except OSError:
            continue
        if int(status["Uid"].split()[0]) == uid and not status["State"].strip().startswith("Z"):
            alive.append(int(pid))
    return alive


def _goes_on(result, limits: Limits) -> None:
    """Nothing of the contained run is left, and the next run works."""
    assert _alive_in_group(result.pid) == []
    if result.user.startswith("uid "):  # bwrap as root: the call's own uid, no process of it left
        assert _alive_as(int(result.user.split()[1])) == []
    after = run_python("print(6 * 7)", limits)
    assert after.status is Outcome.OK and after.output == "42\n"


def test_code_runs_in_a_scratch_directory_and_its_output_is_captured(TINY):
    r = run_python("import os\nopen('note.txt', 'w').write('hi')\nprint(open('note.txt').read(), os.getcwd())", TINY)
    assert r.status is Outcome.OK and r.output.startswith("hi /")
    if TINY.backend is Backend.PROCESS:
        assert "rl-sandbox-" in r.output
        assert not os.path.exists(r.output.split()[1])  # the scratch directory is removed afterwards
    else:
        assert r.output == "hi /tmp\n"  # the private tmpfs, gone with the call
    failed = run_python("1 / 0", TINY)
    assert failed.status is Outcome.ERROR and "ZeroDivisionError" in failed.output


def test_an_infinite_loop_is_stopped_by_the_cpu_limit_and_a_sleeper_by_the_wall_clock(TINY, backend):
    start = time.monotonic()
    spin = run_python("while True:\n    pass", TINY)
    assert spin.status is Outcome.CPU_LIMIT and time.monotonic() - start < TINY.wall_s
    sleeper = run_python("import time\ntime.sleep(60)", Limits(wall_s=1.5, cpu_s=1, backend=backend))
    assert sleeper.status is Outcome.TIMEOUT and 1.5 <= sleeper.seconds < 5
    _goes_on(spin, TINY)
    _goes_on(sleeper, TINY)
    control = run_python("s = 0\nfor i in range(10**5):\n    s += i\nprint(s)", TINY)
    assert control.status is Outcome.OK and control.output == f"{sum(range(10**5))}\n"


def test_a_fork_bomb_hits_the_process_limit_and_the_whole_group_is_killed(TINY, backend):
    counted = run_python(
        "import os, time\nn = 0\ntry:\n    while True:\n        if os.fork() == 0:\n            time.sleep(60)\n"
        "            os._exit(0)\n        n += 1\nexcept OSError as e:\n    print('refused after', n)\n", TINY)
    assert counted.status is Outcome.OK, counted.output
    forks = int(counted.output.split()[-1])
    assert 0 < forks <= TINY.max_processes  # the limit, not the machine, stopped it
    if TINY.backend is Backend.BWRAP:  # counted exactly: the call's PID namespace holds only its processes
        assert forks == TINY.max_processes
    bomb = run_python("import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n",
                      Limits(wall_s=2.0, cpu_s=1, max_processes=4, backend=backend))
    assert bomb.status in (Outcome.TIMEOUT, Outcome.CPU_LIMIT) and bomb.seconds < 6
    _goes_on(counted, TINY)  # the sleeping children of the first run died with their group
    _goes_on(bomb, TINY)


def test_a_memory_hog_hits_the_memory_limit(TINY):
    hog = run_python("x = bytearray(1 << 30)", TINY)  # 1 GiB against 256 MiB
    assert hog.status is Outcome.MEMORY_LIMIT and "MemoryError" in hog.output
    grow = run_python("chunks = []\nwhile True:\n    chunks.append(bytearray(1 << 20))", TINY)
    assert grow.status is Outcome.MEMORY_LIMIT
    _goes_on(hog, TINY)
    control = run_python("x = bytearray(32 << 20)\nprint(len(x))", TINY)
    assert control.status is Outcome.OK and control.output == f"{32 << 20}\n"


def test_a_write_outside_the_scratch_directory_is_refused(tmp_path, TINY):
    target = tmp_path / "outside.txt"
    os.chmod(tmp_path, 0o777)  # writable by anyone, the child's user included: only the sandbox stands in the way
    for code in (f"open({str(target)!r}, 'w').write('x')",
                 f"import os\nos.close(os.open({str(target)!r}, os.O_CREAT | os.O_WRONLY))",
                 f"import os\nos.symlink({str(target)!r}, 'link')\nopen('link', 'w').write('x')",
                 f"import shutil\nopen('a', 'w').write('x')\nshutil.copy('a', {str(target)!r})"):
        r = run_python(code, TINY)
        if TINY.backend is Backend.PROCESS:  # the audit hook refuses it
            assert r.status is Outcome.REFUSED and r.refused and "outside the scratch directory" in r.refused[0], code
        else:  # the hook, or the kernel: the host's /tmp is not in the sandbox (its /tmp is the scratch tmpfs)
            assert r.status in (Outcome.REFUSED, Outcome.ERROR), code
        assert not target.exists()
        _goes_on(r, TINY)
    caught = run_python(f"try:\n    open({str(target)!r}, 'w')\nexcept PermissionError as e:\n    print('no')", TINY)
    if TINY.backend is Backend.PROCESS:
        assert caught.status is Outcome.REFUSED and caught.output == "no\n"  # caught by the code, still reported
    for code in ("import os\nos.system('touch /tmp/x')", "import subprocess", "import ctypes"):
        assert run_python(code, TINY).status in (Outcome.REFUSED, Outcome.ERROR), code  # no way around it
    target.write_text("mine")  # the control: the same path is writable from outside
    assert target.read_text() == "mine"


def test_a_network_call_fails_in_the_sandbox_and_succeeds_outside(TINY):
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        code = (f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=2)\n"
                "print('connected')")
        r = run_python(code, TINY)
        assert r.status is Outcome.REFUSED and "connected" not in r.output
        assert any("network" in what for what in r.refused)
        assert r.network == "namespace" if TINY.backend is Backend.BWRAP else r.network in ("namespace", "audit hook")
        with socket.create_connection(("127.0.0.1", port), timeout=2):  # the control: the port is open
            conn, _ = server.accept()
            conn.close()
    _goes_on(r, TINY)


def test_output_is_cut_to_the_byte_limit_and_a_chatty_loop_does_not_block(TINY, backend):
    r = run_python("print('x' * 100000)", TINY)
    assert r.status is Outcome.OK and r.truncated and len(r.output.encode()) == TINY.max_output_bytes
    chatty = run_python("while True:\n    print('y' * 1000)", Limits(wall_s=1.0, cpu_s=5, max_output_bytes=100, backend=backend))
    assert chatty.status is Outcome.TIMEOUT and chatty.truncated and len(chatty.output) == 100
    short = run_python("print('ok')", TINY)
    assert not short.truncated and short.output == "ok\n"


def test_limits_are_checked():
    with pytest.raises(ValueError, match="wall_s"):
        Limits(wall_s=0)
    with pytest.raises(ValueError, match="backend='docker'"):
        Limits(backend="docker")
    assert Limits().backend is Backend.BWRAP and Limits(backend="process").backend is Backend.PROCESS


def test_a_tool_task_without_a_working_bwrap_refuses_to_start_naming_the_fix(monkeypatch, caplog):
    import rl.tasks.sandbox as sandbox
    from rl.config import check_command_line
    from rl.tasks.tools import build_tools

    sandbox._check_bwrap.cache_clear()
    monkeypatch.setattr(sandbox.shutil, "which", lambda name: None)  # bubblewrap not installed
    with pytest.raises(ValueError, match=r"task.options.sandbox.backend=bwrap: .*apt-get install bubblewrap.*"
                                         r"backend=process"):
        check_command_line(["task=python_tool"])  # the config check, before any model or tokenizer
    with pytest.raises(sandbox.SandboxUnavailable, match="not installed"):
        run_python("print(1)")
    monkeypatch.undo()
    sandbox._check_bwrap.cache_clear()
    real = sandbox._bwrap_command
    monkeypatch.setattr(sandbox, "_bwrap_command", lambda *a: real(*a)[:1] + ["--userns", "999"] + real(*a)[1:])
    with pytest.raises(sandbox.SandboxUnavailable, match="cannot start .*namespaces"):  # bwrap fails to start
        sandbox.check_backend("bwrap")
    monkeypatch.undo()
    sandbox._check_bwrap.cache_clear()
    with caplog.at_level("WARNING", logger="rl.tasks.sandbox"):
        check_command_line(["task=python_tool", "task.options.sandbox.backend=process"])  # explicit: it starts
        (tool,) = build_tools(["python"], {"backend": "process"})  # the task's tools, in the run (train.log)
    assert caplog.text.count("NOT a security boundary") == 2
    assert tool.fn("print(1)").text == "1"
    with pytest.raises(ValueError, match="task.options.sandbox.backend='docker': expected one of bwrap, process"):
        check_command_line(["task=python_tool", "task.options.sandbox.backend=docker"])
    assert check_command_line(["task=python_tool"]) is not None  # bwrap works here


def test_an_interpreter_below_tmp_runs_in_the_bwrap_sandbox():
    """A venv under /tmp (CI's clone may live there): its folder is bound on top of the sandbox's
    private /tmp, not hidden by it, and the scratch /tmp stays writable (mode 1777). Before the fix
    bwrap failed with 'execvp /tmp/.../bin/python: No such file or directory'."""
    import subprocess
    import sys
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory(dir="/tmp") as where:
        venv = Path(where) / "clone" / ".venv"
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", "--system-site-packages", str(venv)],
                       check=True)
        code = "import os, sys; print(sys.prefix); open('/tmp/x', 'w').write('1'); print(oct(os.stat('/tmp').st_mode))"
        probe = (f"import sys; sys.path.insert(0, {str(Path(__file__).parents[1])!r}); "
                 "from rl.tasks.sandbox import Limits, run_python; "
                 f"r = run_python({code!r}, Limits()); print(r.status.value); print(r.output, end='')")
        out = subprocess.run([str(venv / "bin" / "python"), "-c", probe], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr[-2000:]
        assert out.stdout.splitlines() == ["ok", str(venv), "0o41777"], out.stdout
