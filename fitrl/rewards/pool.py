"""Reward calls in worker processes, each under a wall-clock limit (``reward.num_workers``,
``reward.timeout``): the process pool of fitrl/core/process_pool.py (why processes, and how a
hung or dead worker is replaced, is said there) serving a :class:`RewardFunction`.

Score from threads that live as long as the scorer (the main thread, or a long-lived executor
thread): the kernel's kill of the workers on the driver's death follows the thread that started them.
"""

from __future__ import annotations

from typing import Any

from fitrl.core.process_pool import Call, Outcome, ProcessPool, serve  # noqa: F401  (Outcome: what run() returns)
from fitrl.rewards.functions import RewardError, user_traceback

_WORKER_CODE = "import sys; from fitrl.rewards.pool import worker_main; worker_main(*map(int, sys.argv[1:]))"


class RewardPool(ProcessPool):
    """``num_workers`` processes calling ``RewardFunction.load(spec, kwargs, batched=batched)``."""

    worker_code = _WORKER_CODE
    what = "reward"
    error = RewardError

    def __init__(self, spec: str, kwargs: dict[str, Any], *, batched: bool, num_workers: int, timeout: float):
        super().__init__(spec, (spec, dict(kwargs), batched), num_workers=num_workers, timeout=timeout)


def worker_main(fd: int, driver_pid: int) -> None:
    """A reward worker process: load the function, then answer ``(i, args, kw)`` calls until EOF."""
    serve(fd, driver_pid, _load)


def _load(spec: str, kwargs: dict[str, Any], batched: bool) -> tuple[Call, None]:
    from fitrl.rewards.answers import warm_up
    from fitrl.rewards.functions import RewardFunction

    fn = RewardFunction.load(spec, kwargs, batched=batched)
    warm_up()                                  # sympy imported now, not inside the first call's limit

    def call(args: tuple, kw: dict[str, Any]) -> tuple[str, Any, str]:
        try:
            return "ok", fn(*args, **kw), ""
        except BaseException as e:  # noqa: BLE001 -- a user function's sys.exit() is an error too
            return "error", None, f"{type(e).__name__}: {e}\n{user_traceback(e)}"

    return call, None
