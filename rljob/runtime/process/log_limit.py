"""Log lines of retry loops, limited: one line per distinct reason per interval, with a count of the rest.

A peer that fails the same way on every attempt must not flood the log (a real cluster once got 157 MB in
8 minutes from one retry loop): the first occurrence of a reason is logged at once, later ones within
`interval_s` are only counted, and the next line logged for that reason says how many were held back.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable
from dataclasses import dataclass

DEFAULT_INTERVAL_S = 30.0
_NUMBERS = re.compile(r"\d+(\.\d+)?")


def reason_of(error: BaseException) -> str:
    """A key for an error that ignores the numbers in it (versions, rounds, ports, seconds)."""
    return f"{type(error).__name__}:{_NUMBERS.sub('#', str(error))[:200]}"


@dataclass
class _Seen:
    logged_at: float
    held_back: int = 0


class LimitedLog:
    """Wraps a logger for a loop that may repeat itself; `warning(reason, message, *args)` as logging's."""

    def __init__(
        self, log: logging.Logger, interval_s: float = DEFAULT_INTERVAL_S, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.log = log
        self.interval_s = interval_s
        self._clock = clock
        self._seen: dict[str, _Seen] = {}

    def warning(self, reason: str, message: str, *args: object) -> bool:
        """Log `message % args` unless `reason` was logged less than `interval_s` ago; True when logged."""
        return self._emit(logging.WARNING, reason, message, args)

    def info(self, reason: str, message: str, *args: object) -> bool:
        return self._emit(logging.INFO, reason, message, args)

    def _emit(self, level: int, reason: str, message: str, args: tuple[object, ...]) -> bool:
        now = self._clock()
        seen = self._seen.get(reason)
        if seen is not None and now - seen.logged_at < self.interval_s:
            seen.held_back += 1
            return False
        if seen is not None and seen.held_back:
            message += f" (and {seen.held_back} more like it in the last {now - seen.logged_at:.0f}s)"
        self._seen[reason] = _Seen(now)
        self.log.log(level, message, *args)
        return True
