"""Kill a filesystem operation at every point in turn: the harness of the crash-safety tests.

Run from a fresh single-threaded process (the tests start one with `python -c`), since it forks.
"""

from __future__ import annotations

import os
import shutil
import signal
from collections.abc import Callable
from typing import Any


def _die_at_call(n: int, also_rmtree: bool) -> None:
    """In this process, SIGKILL just before the n-th fsync / replace / rename (/ rmtree) call."""
    calls = 0

    def deadly(real: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            nonlocal calls
            calls += 1
            if calls == n:
                os.kill(os.getpid(), signal.SIGKILL)
            return real(*args, **kwargs)

        return call

    os.fsync, os.replace, os.rename = deadly(os.fsync), deadly(os.replace), deadly(os.rename)
    if also_rmtree:
        shutil.rmtree = deadly(shutil.rmtree)


def kill_at_each_point(
    prepare: Callable[[int], Any], act: Callable[[Any], None], also_rmtree: bool = False
) -> list[int]:
    """For n = 1, 2, ...: `prepare(n)`, then `act(prepared)` in a child killed at its n-th filesystem step,
    until one child gets through. Returns the wait statuses (every one killed, the last 0)."""
    statuses: list[int] = []
    n = 0
    while not statuses or statuses[-1] != 0:
        n += 1
        prepared = prepare(n)
        pid = os.fork()
        if pid == 0:
            _die_at_call(n, also_rmtree)
            act(prepared)
            os._exit(0)
        statuses.append(os.waitpid(pid, 0)[1])
    return statuses
