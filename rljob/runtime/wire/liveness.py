"""A role's heartbeat: its loops beat it, `/livez` (the container's liveness and startup probes) reads it.

Each loop of a role beats under its own name (the main thread's loop as `main`, a rollout's generating thread
as `generate`, ...), every time round, waiting for work included: a role idle because nobody sends it work is
alive. A loop that stops beating is stuck inside one round (a deadlock, a native call that never returns) and
the process is hung: once its last beat is older than the limit, `/livez` answers 503 and the kubelet restarts
the container. Before any loop has beaten the role is starting (the startup probe's time).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

MAIN_LOOP = "main"


class Heartbeat:
    """The last beat of each of a process's loops (thread-safe, monotonic clock)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._beats: dict[str, float] = {}

    def beat(self, loop: str = MAIN_LOOP) -> None:
        """`loop` is getting on: a round of it began (or it is waiting for work)."""
        now = self._clock()
        with self._lock:
            self._beats[loop] = now

    def forget(self, loop: str) -> None:
        """`loop` has ended by design (not stuck): stop checking it."""
        with self._lock:
            self._beats.pop(loop, None)

    @property
    def started(self) -> bool:
        """Whether any loop has beaten yet."""
        with self._lock:
            return bool(self._beats)

    def ages(self) -> dict[str, float]:
        """Seconds since each loop's last beat."""
        now = self._clock()
        with self._lock:
            return {loop: now - last for loop, last in self._beats.items()}

    def stuck(self, limit_s: float) -> str:
        """Why the process counts as hung ("" while it does not): a loop's last beat older than `limit_s`.
        A limit of 0 or less checks nothing."""
        if limit_s <= 0:
            return ""
        stale = sorted((age, loop) for loop, age in self.ages().items() if age > limit_s)
        if not stale:
            return ""
        age, loop = stale[-1]
        return f"loop {loop} has not beaten for {age:.0f}s (limit {limit_s:g}s)"
