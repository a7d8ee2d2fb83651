"""How long the actor waits for one replica's answer, and which replicas are past it.

`LatencyDeadline` derives a role's request deadline from the latencies it observed: a high percentile of the
recent ones times a factor, never under a floor; `spec.roles.<role>.requestTimeoutSeconds` replaces it. Until
enough answers were seen, a generous first deadline holds (a first request may wait for compilation, a cold
cache, a slow first connection).

`LateReplicas` is the actor's list of replicas past their deadline: each is named in the log (once, then at
most every `LOG_INTERVAL_S`), in `/progress` (`lateReplicas`, and the `issue` the operator quotes in a
Stalled condition) until it answers again and rejoins.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from rljob.runtime.process.log_limit import LimitedLog

FACTOR = 5.0
"""A replica is late once it took this many times the role's usual (95th percentile) latency."""
PERCENTILE = 0.95
WINDOW = 64
"""Latencies remembered per role: the deadline follows the job's current pace, not its start."""
MIN_SAMPLES = 5
"""Answers seen before the observed latency sets the deadline; `first_s` holds until then."""
FLOOR_S: dict[str, float] = {"rollout": 5.0, "env": 10.0, "reward": 10.0}
"""Shortest derived deadline per role: a replica a few hundred ms slower than usual is not late. A rollout answers
the actor's `status` and `results` from its server thread whatever it generates: 5 s of silence is not work."""
FIRST_S = 120.0
"""The deadline before `MIN_SAMPLES` answers (a first request may pay compilation and slow connections)."""
LOG_INTERVAL_S = 30.0
"""How often the log names a replica that stays late."""


class LatencyDeadline:
    """A role's request deadline in seconds: `override`, else max(floor, FACTOR * p95 of recent latencies)."""

    def __init__(
        self,
        role: str,
        override: float | None = None,
        floor_s: float | None = None,
        first_s: float = FIRST_S,
        factor: float = FACTOR,
        window: int = WINDOW,
    ) -> None:
        self.role = role
        self.override = override
        self.floor_s = FLOOR_S.get(role, 10.0) if floor_s is None else floor_s
        self.first_s = max(first_s, self.floor_s)
        self.factor = factor
        self._latencies: deque[float] = deque(maxlen=window)

    def observe(self, seconds: float) -> None:
        """One answered request took `seconds`."""
        if seconds >= 0 and math.isfinite(seconds):
            self._latencies.append(seconds)

    def seconds(self) -> float:
        if self.override is not None:
            return self.override
        if len(self._latencies) < MIN_SAMPLES:
            return self.first_s
        ordered = sorted(self._latencies)
        high = ordered[min(len(ordered) - 1, math.ceil(PERCENTILE * len(ordered)) - 1)]
        return max(self.floor_s, self.factor * high)


@dataclass
class _Late:
    since: float
    """When the request it has not answered was sent (monotonic)."""
    moved_to: str


class LateReplicas:
    """Replicas (named `role-i`) past their deadline; thread-safe: `/progress` reads it from the HTTP thread."""

    def __init__(
        self,
        log: logging.Logger,
        clock: Callable[[], float] = time.monotonic,
        log_interval_s: float = LOG_INTERVAL_S,
    ) -> None:
        self._clock = clock
        self._limited = LimitedLog(log, log_interval_s, clock)
        self._log = log
        self._lock = threading.Lock()
        self._late: dict[str, _Late] = {}

    def late(self, name: str, since: float, moved_to: list[str]) -> None:
        """`name` has not answered a request sent at `since`; its work goes to `moved_to` (none: it is waited
        for). Named in the log at once, then every `LOG_INTERVAL_S` while it stays late."""
        where = f"its work goes to {', '.join(moved_to)}" if moved_to else "no other replica can take its work: waiting"
        with self._lock:
            entry = self._late.setdefault(name, _Late(since, where))
            entry.moved_to = where
            seconds = self._clock() - entry.since
        # Keyed by the silence, not only the name: a replica late again after rejoining is named at once.
        key = f"late:{name}:{entry.since}"
        self._limited.warning(key, "%s has not answered for %.0f s; %s", name, seconds, where)

    def answered(self, name: str) -> bool:
        """`name` answered again: it rejoins. True when it had been late."""
        with self._lock:
            entry = self._late.pop(name, None)
        if entry is not None:
            self._log.info("%s answers again after %.0f s; it takes work again", name, self._clock() - entry.since)
        return entry is not None

    def is_late(self, name: str) -> bool:
        with self._lock:
            return name in self._late

    def forget(self, name: str) -> None:
        """`name` left the job (scaled away): not late, just gone."""
        with self._lock:
            self._late.pop(name, None)

    def snapshot(self) -> list[tuple[str, float]]:
        """(name, seconds without an answer) of every late replica, longest first."""
        now = self._clock()
        with self._lock:
            late = [(name, now - entry.since) for name, entry in self._late.items()]
        return sorted(late, key=lambda item: -item[1])

    def issue(self) -> str:
        """What `/progress` says (and a Stalled condition quotes): "reward-0 has not answered for 45 s (...)"."""
        with self._lock:
            now = self._clock()
            parts = [
                f"{name} has not answered for {now - entry.since:.0f} s ({entry.moved_to})"
                for name, entry in sorted(self._late.items(), key=lambda item: item[1].since)
            ]
        return "; ".join(parts)
