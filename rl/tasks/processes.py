"""`task.isolation=process`: the user's code in worker processes, killed at its deadline.

    pool = WorkerPool(task)                          # UserCalls.share(task), when the task is built
    value = pool.call(task.reward, (p, r, meta), {}, timeout_s=5.0, what="reward function my:score")
    env = RemoteEnvironment(pool, task.environment, timeout_s=5.0, what="environment my:Env")
    messages = env.reset.call((meta,), {}, 5.0, "Env.reset")   # what UserCalls.run does with env.reset
    env.close()                                      # the episode is over: its worker goes back to the pool

A *zygote* is forked once, when the task is built (before the model and the rollout thread exist):
it holds the task (and the user's module, imported by then) and forks the workers on request, so
a worker starts in milliseconds whatever the trainer's size and holds the task without it ever
being pickled. A call (a reward) runs in an idle worker: the function and its arguments go to it
pickled, the task itself as a reference to the worker's copy (`task.reward` is a bound method of
it; a module-level function pickles by name; a lambda cannot be sent: an error naming it). An
environment lives in a worker of its own for its episode (`RemoteEnvironment`): the worker builds
it (`factory()`) and serves its `reset` and `step`; `close` hands the worker back.

A call past `timeout_s` is killed with its worker's process group (SIGKILL: a GIL-holding regex,
a busy loop, and what the code started all end), raising `CallTimeout`; the next call gets a fresh
worker. Nothing is left running (`UserCalls.hung` stays 0). A worker that dies (a segfault,
`os._exit`) is an error naming the code and its exit status; `SystemExit` / `KeyboardInterrupt` in
it is `UserExit`. Workers ignore SIGINT (a Ctrl-C is the trainer's), each leads its own process
group, and dies with the zygote, which dies with the trainer (PR_SET_PDEATHSIG; and both end when
their pipe to the trainer closes).
"""

from __future__ import annotations

import ctypes
import gc
import inspect
import io
import os
import pickle
import select
import signal
import socket
import struct
import threading
import time
import traceback
from typing import Any, Callable

from rl.tasks.errors import CallTimeout, UserExit

_HEADER = struct.Struct("<Q")
_SHARED = "shared"  # the persistent id of the pool's shared object (the task) in a pickled request


class WorkerPool:
    """Worker processes forked from a zygote that holds `shared` (see the module docstring); thread-safe."""

    def __init__(self, shared: Any = None) -> None:
        self.shared = shared
        self._lock = threading.Lock()
        self._idle: list[_Worker] = []
        self._sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        pid = _fork()
        if pid == 0:  # the zygote
            try:
                gc.freeze()  # the trainer's objects: never collected here or in a worker (no finalizer of theirs runs)
                self._sock.close()
                _child_setup()
                signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # its workers are reaped by the kernel
                _zygote(theirs, shared)
            finally:
                os._exit(0)
        theirs.close()
        self.zygote = pid

    def call(self, fn: Callable, args: tuple, kwargs: dict, timeout_s: float | None, what: str) -> Any:
        """`fn(*args, **kwargs)` in an idle worker; its exception re-raised; `CallTimeout` past `timeout_s`."""
        worker = self.acquire()
        try:
            return worker.ask(("call", fn, args, kwargs), self.shared, timeout_s, what)
        finally:
            self.release(worker)

    def acquire(self) -> "_Worker":
        with self._lock:
            while self._idle:
                worker = self._idle.pop()
                if worker.alive:
                    return worker
            requests_r, requests_w = os.pipe()
            replies_r, replies_w = os.pipe()
            try:
                socket.send_fds(self._sock, [b"w"], [requests_r, replies_w])
                pid = _HEADER.unpack(_recv_exactly(self._sock, _HEADER.size))[0]
            except OSError as e:
                for fd in (requests_r, requests_w, replies_r, replies_w):
                    os.close(fd)
                raise RuntimeError(f"task.isolation=process: the zygote process ({self.zygote}) cannot start a "
                                   f"worker: {e}") from e
            os.close(requests_r)
            os.close(replies_w)
            return _Worker(pid, requests_w, replies_r)

    def release(self, worker: "_Worker") -> None:
        if worker.alive:
            with self._lock:
                self._idle.append(worker)

    def close(self) -> None:
        """End the workers and the zygote."""
        with self._lock:
            for worker in self._idle:
                worker.kill()
            self._idle.clear()
            self._sock.close()
        _kill(self.zygote)
        _reap(self.zygote)


class _Worker:
    """The trainer's end of a worker: its pid and pipes."""

    def __init__(self, pid: int, requests: int, replies: int) -> None:
        self.pid, self.requests, self.replies = pid, requests, replies

    @property
    def alive(self) -> bool:
        return self.pid is not None

    def ask(self, request: tuple, shared: Any, timeout_s: float | None, what: str) -> Any:
        """Send `request`, wait for the reply; past `timeout_s` the worker is killed (`CallTimeout`)."""
        buffer = io.BytesIO()
        pickler = pickle.Pickler(buffer, pickle.HIGHEST_PROTOCOL)
        pickler.persistent_id = lambda obj: _SHARED if obj is shared and shared is not None else None
        try:
            pickler.dump(request)
        except Exception as e:  # noqa: BLE001 - the caller's error, not the worker's
            raise TypeError(f"{what}: cannot be sent to a worker process (task.isolation=process): {e}; a reward or "
                            f"environment must be a module-level function or class, or a method of the task") from e
        deadline = time.monotonic() + timeout_s if timeout_s is not None else None
        try:
            _write(self.requests, buffer.getvalue())
            header = _read_exactly(self.replies, _HEADER.size, deadline)
            data = None if header is None else _read_exactly(self.replies, _HEADER.unpack(header)[0], deadline)
        except TimeoutError:
            self.kill()
            raise CallTimeout(f"{what} ran past task.timeout_s={timeout_s} s (its process killed)") from None
        except OSError:  # a broken pipe: the worker is gone
            data = None
        if data is None:
            self.kill()
            raise RuntimeError(f"{what}: its worker process (task.isolation=process) ended without an answer (the "
                               f"code crashed the interpreter or called os._exit)")
        kind, payload = pickle.loads(data)
        if kind == "ok":
            return payload
        if kind == "exit":
            raise UserExit(f"{what} raised {payload}: user code cannot end the run; it is an error of this call")
        raise payload

    def kill(self) -> None:
        """Kill the worker and its process group (the zygote reaps it)."""
        if self.pid is None:
            return
        pid, self.pid = self.pid, None
        _kill(pid)
        for fd in (self.requests, self.replies):
            os.close(fd)


class RemoteMethod:
    """`env.reset` / `env.step` of a `RemoteEnvironment`: `UserCalls.run` calls it in the env's worker."""

    def __init__(self, env: "RemoteEnvironment", name: str, parameters: list[str]) -> None:
        self.env, self.name = env, name
        self.__signature__ = inspect.Signature(
            [inspect.Parameter(p, inspect.Parameter.POSITIONAL_OR_KEYWORD) for p in parameters])

    def call(self, args: tuple, kwargs: dict, timeout_s: float | None, what: str) -> Any:
        return self.env.ask(("env", self.name, args, kwargs), timeout_s, what)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:  # outside UserCalls.run: no deadline
        return self.call(args, kwargs, None, f"{self.env.class_name}.{self.name}")


class RemoteEnvironment:
    """An environment built by `factory()` in a worker of its own (see the module docstring);
    `close()` hands the worker back (a killed one is not)."""

    def __init__(self, pool: WorkerPool, factory: Callable[[], Any], timeout_s: float | None, what: str) -> None:
        self.pool, self.worker, self.class_name = pool, pool.acquire(), "environment"
        try:
            info = self.ask(("new", factory), timeout_s, what)
        except BaseException:
            self.close()  # a worker that built nothing goes back (a killed one does not)
            raise
        self.class_name = info["class"]
        self.reset = RemoteMethod(self, "reset", info["reset"])
        self.step = RemoteMethod(self, "step", info["step"])

    def ask(self, request: tuple, timeout_s: float | None, what: str) -> Any:
        if self.worker is None or not self.worker.alive:
            raise RuntimeError(f"{what}: the environment's worker process was stopped; it is not called again")
        return self.worker.ask(request, self.pool.shared, timeout_s, what)

    def close(self) -> None:
        worker, self.worker = self.worker, None
        if worker is None or not worker.alive:
            return
        try:
            worker.ask(("drop",), None, 10.0, f"{self.class_name}: dropping it")
        except Exception:  # noqa: BLE001 - a worker that cannot drop its environment is not reused
            worker.kill()
        self.pool.release(worker)

    def __del__(self) -> None:
        if getattr(self, "worker", None) is not None:
            self.close()


# ------------------------------------------------------------- the processes
def _fork() -> int:
    """os.fork, the child in its own process group from the start (set on both sides: whichever
    runs first, a kill finds the group)."""
    pid = os.fork()
    if pid:
        try:
            os.setpgid(pid, pid)
        except OSError:
            pass
    return pid


def _child_setup() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C in the terminal is the trainer's, not the code's
    try:
        os.setpgid(0, 0)
    except OSError:
        pass
    try:  # dies with its parent (the trainer for the zygote, the zygote for a worker)
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _zygote(sock: socket.socket, shared: Any) -> None:
    """Fork a worker per request (its pipes come with it), answer its pid; end when the trainer's end closes."""
    while True:
        try:
            message, fds, _, _ = socket.recv_fds(sock, 16, 2)
        except OSError:
            return
        if not message:
            return
        pid = _fork()
        if pid == 0:  # a worker
            try:
                sock.close()
                _child_setup()
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # the code's own subprocesses are waited for as usual
                _serve(shared, fds[0], fds[1])
            finally:
                os._exit(0)
        for fd in fds:
            os.close(fd)
        sock.sendall(_HEADER.pack(pid))


def _serve(shared: Any, requests: int, replies: int) -> None:
    """A worker: requests in, replies out, until the trainer's end closes."""
    env = None
    while True:
        header = _read_exactly(requests, _HEADER.size, None)
        if header is None:
            return
        unpickler = pickle.Unpickler(io.BytesIO(_read_exactly(requests, _HEADER.unpack(header)[0], None)))
        unpickler.persistent_load = lambda pid: shared
        try:
            request = unpickler.load()
        except Exception as e:  # noqa: BLE001 - e.g. a module the worker cannot import
            reply = ("error", RuntimeError(f"the worker process cannot read the call: {type(e).__name__}: {e}"))
        else:
            if request[0] == "call":
                reply = _outcome(request[1], request[2], request[3])
            elif request[0] == "new":
                reply = _outcome(request[1], (), {})
                if reply[0] == "ok":
                    env = reply[1]
                    reply = ("ok", {"class": type(env).__name__, "reset": _parameters(env.reset),
                                    "step": _parameters(env.step)})
            elif request[0] == "env":
                reply = _outcome(getattr(env, request[1]), request[2], request[3])
            else:  # "drop"
                env, reply = None, ("ok", None)
        _write(replies, _dumps(reply))


def _parameters(method: Any) -> list[str]:
    try:
        return list(inspect.signature(method).parameters)
    except (TypeError, ValueError):
        return []


def _outcome(fn: Callable, args: tuple, kwargs: dict) -> tuple:
    """("ok", value) | ("error", exception) | ("exit", what was raised): what goes back."""
    try:
        value = fn(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 - handed to the trainer
        e.add_note("(in the user-code worker process, task.isolation=process:)\n"
                   + "".join(traceback.format_exception(e)))
        return ("error", e)
    except BaseException as e:  # noqa: BLE001 - SystemExit, KeyboardInterrupt: the code's, not the run's
        return ("exit", f"{type(e).__name__}({', '.join(map(repr, e.args))})")
    return ("ok", value)


def _dumps(reply: tuple) -> bytes:
    """The reply pickled; a value or an exception that cannot be pickled (or unpickled) as text."""
    try:
        data = pickle.dumps(reply, pickle.HIGHEST_PROTOCOL)
        if reply[0] == "error":
            pickle.loads(data)
        return data
    except Exception as e:  # noqa: BLE001
        kind, payload = reply
        text = (f"{type(payload).__name__}: {payload}\n{''.join(getattr(payload, '__notes__', []))}"
                if kind == "error" else
                f"returned a {type(payload).__name__}, which cannot be sent back from the worker process "
                f"(task.isolation=process): {e}")
        return pickle.dumps(("error", RuntimeError(text)), pickle.HIGHEST_PROTOCOL)


def _write(fd: int, data: bytes) -> None:
    view = memoryview(_HEADER.pack(len(data)) + data)
    while view:
        view = view[os.write(fd, view):]


def _read_exactly(fd: int, n: int, deadline: float | None) -> bytes | None:
    """n bytes from a pipe (None: it closed first); a TimeoutError past `deadline`."""
    chunks, left = [], n
    while left:
        if deadline is not None:
            wait = deadline - time.monotonic()
            if wait <= 0 or not select.select([fd], [], [], wait)[0]:
                raise TimeoutError
        chunk = os.read(fd, min(left, 1 << 20))
        if not chunk:
            return None
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise OSError("the zygote process ended")
        data += chunk
    return data


def _kill(pid: int) -> None:
    for kill in (os.killpg, os.kill):
        try:
            kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def _reap(pid: int) -> None:
    try:
        os.waitpid(pid, 0)
    except ChildProcessError:
        pass
