"""The failures of the user's code that rl/tasks/calls.py (threads) and rl/tasks/processes.py (worker
processes) both raise: here, below both, so that each imports them one way."""


class CallTimeout(TimeoutError):
    """A user call ran past `task.timeout_s`."""


class UserExit(RuntimeError):
    """The user's code raised `SystemExit` or `KeyboardInterrupt` (`sys.exit()` in a reward, say):
    an error of that call, naming it, not an exit of the run (see `UserCalls.run`)."""


class TooManyHung(RuntimeError):
    """`UserCalls.max_hung` abandoned calls are still running: the run stops, whatever `on_error`."""
