"""The user's code, called so that it cannot stop a run: rewards, environments (and tools), and
what it returns checked: a reward (`check_reward`, `reward_record`, `assign_rewards`, `probe_reward`).

    calls = UserCalls(on_error="skip", timeout_s=60.0)     # task.on_error, task.timeout_s
    guard = calls.guard("reward function my_rewards:score")
    with guard:                                            # an exception in here ends the sample
        value = calls.run(fn, prompt_ids, response_ids)    # fn(...) with a wall-clock deadline
        value = check_reward(value, ...)
    if guard.status is not None: ...                       # Status.ERROR or Status.TIMEOUT

`on_error=skip` (the config's default): an exception raised by the user's code, or by the checks
of what it returned (a NaN reward, an observation of None that does not end the episode), or a
call past its deadline ends that one sample: the caller gives it reward 0 and the status, the
run goes on. The first failure of each kind (the code's name and the exception's type) is
logged with its traceback, later ones at debug level; each step counts them
(`episodes_error`, `episodes_timeout`). `on_error=raise`: the exception stops the run as it
always did (a call past its deadline raises `CallTimeout`, a `TimeoutError`): for debugging.
`SystemExit` or `KeyboardInterrupt` raised by the code (`sys.exit()` in a reward) is an exception of
that call like any other: `run` raises it as `UserExit` (naming the code), never as an exit of the
run, which would end a rollout thread silently or the run without a word in train.log. The one
exception: a `KeyboardInterrupt` inline on the main thread (`timeout_s=None`) may be the user's
Ctrl-C, and propagates as it is.

The deadline (`timeout_s`, wall clock; None: none, the call runs inline) works on any thread:
the call runs on a worker thread (one per calling thread, reused from call to call) and the
caller waits for it at most `timeout_s`. No signal is used, so it works on the rollout thread
of `rollout.max_staleness` >= 1 (a signal-based timeout, such as math-verify's
`parsing_timeout`, only works on the main thread: there it fails, and is counted as an error;
turn it off and let `task.timeout_s` bound the call). Python cannot kill a thread: a call past
its deadline is *abandoned*: its worker is let go (a daemon thread, which never blocks the
interpreter's exit, and which ends once the call returns; its result is dropped) and the next
call gets a fresh worker. `hung` counts the abandoned calls still running (logged each step as
`calls_hung`). They cost memory and, if they spin, CPU time taken from the run, so at
`max_hung` (64) abandoned calls still running the run stops with an error naming the code:
a function that hangs that often needs fixing, not more threads.

An environment whose `step` timed out may still be running in its abandoned thread: the
caller never touches that environment again.

`isolation=process` (`task.isolation`; the default is `thread`, all of the above): rewards and
environments run in worker processes instead (rl/tasks/processes.py): a call past `timeout_s` is
killed, not abandoned (a busy loop or a GIL-holding regex included), `hung` stays 0. `share(task)`
starts the pool when the task is built; `environment(factory)` builds an environment in a worker
of its own, `release(env)` ends its episode. Tools call `run_on_thread` (in this process either way).
"""

from __future__ import annotations

import enum
import logging
import math
import numbers
import queue
import threading
from typing import Any, Callable, Sequence

import torch

from rl.choice import Choice
from rl.tasks.base import is_multi_turn, reward_name
from rl.tasks.errors import CallTimeout, TooManyHung, UserExit

log = logging.getLogger(__name__)


class OnError(Choice):
    """`task.on_error`: what an exception (or a timeout) of the user's code does."""

    SKIP = "skip"  # that sample ends with reward 0 and the status `error` (or `timeout`); the run goes on
    RAISE = "raise"  # the run stops with it (today's behaviour, for debugging)


class Isolation(Choice):
    """`task.isolation`: where the user's code runs."""

    THREAD = "thread"  # in the trainer's process, on a worker thread; a call past its deadline is abandoned
    PROCESS = "process"  # in a forked child (rl/tasks/processes.py); a call past its deadline is killed


class Status(enum.IntEnum):
    """How an episode ended (the record's `status`; counted per step as `episodes_<name>`)."""

    DONE = 0  # the environment (or the single-turn reward) ended it
    MAX_TURNS = 1  # task.options.max_turns replies given and the environment not done
    TRUNCATED = 2  # an environment answer was cut to task.options.max_observation_len (rl/rollout/episode.py)
    ERROR = 3  # the user's code raised, or returned something unusable
    TIMEOUT = 4  # the user's code ran past task.timeout_s

    @property
    def label(self) -> str:
        return self.name.lower()


class _Job:
    __slots__ = ("fn", "args", "kwargs", "value", "error", "done")

    def __init__(self, fn: Callable, args: tuple, kwargs: dict) -> None:
        self.fn, self.args, self.kwargs = fn, args, kwargs
        self.value: Any = None
        self.error: BaseException | None = None
        self.done = threading.Event()

    def run(self) -> None:
        try:
            self.value = self.fn(*self.args, **self.kwargs)
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            self.error = e
        finally:
            self.done.set()


class _Worker:
    """A daemon thread that runs jobs one by one; abandoned, it ends after its current job."""

    def __init__(self) -> None:
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._loop, name="user-code", daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while (job := self.jobs.get()) is not None:
            job.run()
            del job  # the arguments of a finished call are not kept alive by an idle worker


class UserCalls:
    """How the user's code is called (see the module docstring): `on_error` (skip | raise) and
    `timeout_s` (None: no deadline). Thread-safe: the trainer's rollout thread and its main
    thread (the held-out evaluation) may call at the same time, each with its own worker."""

    max_hung = 64

    def __init__(self, on_error: OnError | str = OnError.SKIP, timeout_s: float | None = None,
                 isolation: Isolation | str = Isolation.THREAD) -> None:
        self.on_error = OnError.parse(on_error, "task.on_error")
        self.isolation = Isolation.parse(isolation, "task.isolation")
        if timeout_s is not None and not timeout_s > 0:
            raise ValueError(f"task.timeout_s={timeout_s!r}: expected a positive number of seconds or null")
        self.timeout_s = timeout_s
        self._local = threading.local()
        self._lock = threading.Lock()
        self._hung: list[tuple[_Worker, str]] = []
        self._logged: set[tuple[str, str]] = set()
        self._pool = None  # isolation=process: rl/tasks/processes.py WorkerPool

    @classmethod
    def strict(cls) -> "UserCalls":
        """Exceptions raised, no deadline: how a task is called outside the trainer unless told otherwise."""
        return cls(OnError.RAISE, None)

    @property
    def hung(self) -> int:
        """Abandoned calls (past their deadline) still running."""
        with self._lock:
            self._hung = [(w, what) for w, what in self._hung if w.thread.is_alive()]
            return len(self._hung)

    def run(self, fn: Callable, *args: Any, what: str = "", **kwargs: Any) -> Any:
        """`fn(*args, **kwargs)`, its exception re-raised; past `timeout_s` a `CallTimeout`
        (the call abandoned, see the module docstring; with isolation=process, killed)."""
        if self.isolation is Isolation.PROCESS:
            from rl.tasks.processes import RemoteMethod

            if isinstance(fn, RemoteMethod):  # an environment's method: in its episode's worker
                return fn.call(args, kwargs, self.timeout_s, _name(fn, what))
            return self.pool().call(fn, args, kwargs, self.timeout_s, _name(fn, what))
        return self.run_on_thread(fn, *args, what=what, **kwargs)

    def run_on_thread(self, fn: Callable, *args: Any, what: str = "", **kwargs: Any) -> Any:
        """`run` in this process whatever `isolation` says (tools: the python tool's code runs in its
        own sandboxed process already)."""
        if self.timeout_s is None:
            try:
                return fn(*args, **kwargs)
            except Exception:
                raise
            except BaseException as e:  # SystemExit, GeneratorExit: the code's, never the run's
                if isinstance(e, KeyboardInterrupt) and threading.current_thread() is threading.main_thread():
                    raise  # inline on the main thread it may be the user's Ctrl-C: it stops the run
                raise _exit(fn, what, e) from e
        worker = getattr(self._local, "worker", None)
        if worker is None:
            worker = self._local.worker = _Worker()
        job = _Job(fn, args, kwargs)
        worker.jobs.put(job)
        if not job.done.wait(self.timeout_s):
            self._local.worker = None
            worker.jobs.put(None)  # it ends once the call returns
            with self._lock:
                self._hung.append((worker, what))
            if self.hung >= self.max_hung:
                names = sorted({w for _, w in self._hung})
                raise TooManyHung(f"{self.hung} calls past task.timeout_s={self.timeout_s} are still running "
                                   f"({', '.join(names)}): Python cannot stop a thread, so the run stops before "
                                   f"it holds more; fix the hang, or raise task.timeout_s")
            raise CallTimeout(f"{_name(fn, what)} ran past task.timeout_s={self.timeout_s} s "
                              f"(abandoned on its thread)")
        if job.error is not None:
            if not isinstance(job.error, Exception):  # SystemExit, KeyboardInterrupt on the worker: the code's own
                raise _exit(fn, what, job.error) from job.error
            raise job.error
        return job.value

    def share(self, task: Any) -> None:
        """isolation=process: start the worker pool now, holding `task` (rl/tasks/registry.py
        `build_task` calls it before any model is built: the pool's zygote is forked while the
        process is small); its methods are then sent to the workers by reference. Nothing otherwise."""
        if self.isolation is Isolation.PROCESS and self._pool is None:
            from rl.tasks.processes import WorkerPool

            self._pool = WorkerPool(task)

    def pool(self) -> Any:
        """The worker pool (isolation=process), started on first use if `share` was not called."""
        with self._lock:
            if self._pool is None:
                from rl.tasks.processes import WorkerPool

                self._pool = WorkerPool(None)
            return self._pool

    def close(self) -> None:
        """End the worker pool's processes (isolation=process); nothing otherwise."""
        if self._pool is not None:
            self._pool.close()
            self._pool = None

    def environment(self, factory: Callable[[], Any], what: str = "") -> Any:
        """A new environment, `factory()`: built through `run` (isolation=thread), or in a process
        of its own that serves its `reset` and `step` (isolation=process: rl/tasks/processes.py
        `RemoteEnvironment`, ended by `release`)."""
        if self.isolation is not Isolation.PROCESS:
            return self.run(factory, what=what)
        from rl.tasks.processes import RemoteEnvironment

        return RemoteEnvironment(self.pool(), factory, self.timeout_s, _name(factory, what))

    @staticmethod
    def release(env: Any) -> None:
        """The episode of `env` is over: its process (isolation=process) ends; nothing otherwise."""
        from rl.tasks.processes import RemoteEnvironment

        if isinstance(env, RemoteEnvironment):
            env.close()

    def guard(self, what: str, where: str = "") -> "Guard":
        """A context for one sample's calls: see `Guard`."""
        return Guard(self, what, where)

    def _failed(self, what: str, where: str, error: BaseException) -> Status:
        status = Status.TIMEOUT if isinstance(error, CallTimeout) else Status.ERROR
        key = (what, type(error).__name__)
        with self._lock:
            first = key not in self._logged
            self._logged.add(key)
        message = "%s%s %s: %s (task.on_error=skip: the sample ends with reward 0, status %s; the run goes on)"
        args = (f"{where}: " if where else "", what, "timed out" if status is Status.TIMEOUT else f"raised {type(error).__name__}", error,
                status.label)
        if first:  # the traceback once per kind of failure; the step's counts say how often
            log.warning(message + "; later ones of this kind are logged at debug level", *args,
                        exc_info=status is Status.ERROR)
        else:
            log.debug(message, *args)
        return status


def _name(fn: Callable, what: str) -> str:
    """How errors name a call: `what`, else the function's qualified name."""
    return what or getattr(fn, "__qualname__", repr(fn))


def _exit(fn: Callable, what: str, error: BaseException) -> UserExit:
    return UserExit(f"{_name(fn, what)} raised {type(error).__name__}({', '.join(map(repr, error.args))}): user "
                    f"code cannot end the run; it is an error of this call")


class Guard:
    """`with calls.guard(what):` an `Exception` inside ends the sample: with on_error=skip it is
    logged and swallowed and `status` says ERROR or TIMEOUT (None: nothing failed); with
    on_error=raise it propagates. A `BaseException` (KeyboardInterrupt, SystemExit) raised in the
    block itself, not by user code run through `UserCalls.run` (there it is a `UserExit`), always does.
    `TooManyHung` (too many abandoned calls still running) always propagates."""

    def __init__(self, calls: UserCalls, what: str, where: str) -> None:
        self.calls, self.what, self.where = calls, what, where
        self.status: Status | None = None
        self.error: BaseException | None = None

    def __enter__(self) -> "Guard":
        return self

    def __exit__(self, kind, error, tb) -> bool:
        if error is None or not isinstance(error, Exception) or self.calls.on_error is OnError.RAISE:
            return False
        if isinstance(error, TooManyHung):
            return False
        self.error = error
        self.status = self.calls._failed(self.what, self.where, error)
        return True



# ------------------------------------------------------------- rewards
FP32_MAX = torch.finfo(torch.float32).max  # a reward (or an episode's sum of them) beyond it is inf in fp32


def reward_record(task: Any, rec: Any, meta: dict, calls: UserCalls, i: int) -> None:
    """Set `rec.rewards` (0-d fp32) and `rec.status` of record `i` from `task.reward` (a single-turn
    task's), called through `calls` and checked by `check_reward`: with on_error=skip a failure gives
    reward 0 and its status (`error`, `timeout`)."""
    n_prompt = rec.sequences.numel() - int(rec.response_length)
    guard = calls.guard(f"reward function {reward_name(task)}", f"sample {i} (prompt index {_index(rec)})")
    value = 0.0
    with guard:
        value = calls.run(task.reward, rec.sequences[:n_prompt], rec.sequences[n_prompt:], meta,
                          what=f"reward function {reward_name(task)}")
        value = check_reward(value, f"assign_rewards: reward function {reward_name(task)}", i, rec.prompt_index)
    rec.rewards = torch.tensor(value if guard.status is None else 0.0, dtype=torch.float32)
    rec.status = torch.tensor(int(guard.status if guard.status is not None else Status.DONE))


def assign_rewards(task: Any, records: Sequence[Any], metas: Sequence[dict],
                   calls: UserCalls | None = None) -> list[Any]:
    """Set `rec.rewards` (0-d fp32) and `rec.status` on each record from `task.reward`; returns
    the records.

    A reward that is not a finite real number (NaN, inf, None, a bool, a string such as
    "0.5") is a ValueError naming the reward function, the record, its prompt index and
    the value. A 0-d real tensor is taken as its value. `calls` (None: `UserCalls.strict()`,
    every error raised) says what an exception or a timeout does: with `on_error=skip` that
    record gets reward 0 and status `error` (or `timeout`), the others go on.
    """
    if len(records) != len(metas):
        raise ValueError(f"assign_rewards: {len(records)} records but {len(metas)} metas (one per record)")
    calls = calls or UserCalls.strict()
    for i, (rec, meta) in enumerate(zip(records, metas)):
        reward_record(task, rec, meta, calls, i)
    return list(records)


def _index(rec: Any) -> str:
    return "?" if rec.prompt_index is None else str(int(rec.prompt_index))


def check_reward(value: Any, who: str, i: int, prompt_index: Any) -> float:
    """`value` as a float; a ValueError naming `who` (the reward function), the record, its
    prompt index and the value unless it is a finite real number within fp32's range (a 0-d real
    tensor counts)."""
    if isinstance(value, torch.Tensor) and value.numel() == 1 and value.dtype != torch.bool and not value.is_complex():
        value = value.item()
    prompt = "?" if prompt_index is None else int(prompt_index)
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or (
            not isinstance(value, numbers.Integral) and not math.isfinite(value)):
        raise ValueError(
            f"{who} returned {value!r} ({type(value).__name__}) for record {i} (prompt index {prompt}); a reward "
            f"must be a finite real number (float or int), not NaN, inf, None, a bool or a string")
    try:
        fits = abs(float(value)) <= FP32_MAX
    except OverflowError:  # an int past float64's range
        fits = False
    if not fits:
        raise ValueError(f"{who} returned {value!r} for record {i} (prompt index {prompt}); a reward must fit in "
                         f"fp32 (|reward| <= {FP32_MAX:.4g}): the trainer holds rewards in fp32, where it is inf")
    return float(value)


def task_calls(task: Any) -> UserCalls:
    """How the task's user code is called: the trainer's `task.calls` (task.on_error,
    task.timeout_s), else every error raised (`UserCalls.strict()`)."""
    return task.calls or UserCalls.strict()


def probe_reward(task: Any, calls: UserCalls | None = None) -> None:
    """Call the task's reward once, at start-up, on a probe sample (its first prompt and a
    one-token response: the stop token, else the prompt's first token), so a reward function
    that raises or returns no number stops the run before a model is built, not after the first
    rollout. With `calls.on_error=skip` (the trainer's default) an exception (or a timeout) is a
    warning instead: a function that fails on some samples (the probe's one-token response is an
    odd one) must not keep the run from starting, and the steps count its failures; a value that
    is not a number is always an error (a type mistake fails on every sample). A multi-turn task's
    reward is its environment's (played in the rollout): not probed."""
    if is_multi_turn(task):
        return
    calls = calls or UserCalls.strict()
    (prompt_ids, meta), = task.prompts(1, seed=0)
    response = [task.stop_token_id if task.stop_token_id is not None else int(prompt_ids[0])]
    who = f"the reward function {reward_name(task)}"
    try:  # with task.timeout_s: a reward that hangs on the probe is a timeout, not a start-up that never ends
        value = calls.run(task.reward, prompt_ids, torch.tensor(response), dict(meta), what=who)
    except Exception as e:
        message = (f"{who} raised {type(e).__name__}: {e} on a probe sample at start-up (a prompt of the task, "
                   f"response ids {response}, keywords {sorted(meta)})")
        if calls.on_error is OnError.RAISE:
            raise ValueError(message) from e
        log.warning("%s; task.on_error=skip: the run starts, and each step counts the samples whose reward fails "
                    "(episodes_error, episodes_timeout)", message)
        return
    check_reward(value, f"{who} (called once at start-up on a probe sample)", 0, None)  # a wrong type: always an error
