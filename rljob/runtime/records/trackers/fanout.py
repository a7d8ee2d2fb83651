"""Feeds every listed tracker from a thread of its own: training only appends to a queue (microseconds), so a
tracker that is slow, down or refusing its key never holds up a step.

A tracker that raises (at start or at any call) gets one warning naming it, then its call is retried with
exponential back-off (`BACKOFF_S` doubling up to `MAX_BACKOFF_S`), records queued meanwhile (up to `MAX_QUEUED`;
the oldest go first past that, metrics.jsonl keeps them all). At the end of training each tracker has
`CLOSE_TIMEOUT_S` to deliver what is queued and finish; past that, or at its first failure while closing, it is
given up with a warning saying how many records it missed.
"""

from __future__ import annotations

import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from rljob.api import Problem, RLJob
from rljob.api.spec import TrackerSpec
from rljob.runtime.records.trackers.base import (
    RunInfo,
    Tracker,
    build_tracker,
    restart_number,
    scalars,
    tracker_problems,
)

BACKOFF_S = 1.0
MAX_BACKOFF_S = 60.0
MAX_QUEUED = 10_000
"""Records kept for a tracker that is down (a few KB each): hours of steps, tens of MB at most."""
CLOSE_TIMEOUT_S = 30.0

Warn = Callable[[str], None]
Event = tuple[str, Any, Any]
"""("log", step, metrics) or ("model", path, None)."""


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


class _Feed:
    """One tracker and the thread that delivers its queue."""

    def __init__(
        self,
        name: str,
        make: Callable[[], Tracker],
        warn: Warn,
        backoff_s: float,
        max_backoff_s: float,
        max_queued: int,
    ) -> None:
        self.name = name
        self._make = make
        self._warn = warn
        self._backoff_s = backoff_s
        self._max_backoff_s = max_backoff_s
        self._queue: deque[Event] = deque(maxlen=max_queued)
        self._wake = threading.Condition()
        self._closing = False
        self.failures = 0
        """Calls that raised so far (start included)."""
        self.delivered = 0
        self.dropped = 0
        """Records pushed out of a full queue (the oldest first)."""
        self._pending: Event | None = None
        """The record being delivered (or retried): out of the queue, not yet delivered."""
        self._thread = threading.Thread(target=self._run, name=f"rljob-tracker-{name}", daemon=True)
        self._thread.start()

    def put(self, event: Event) -> None:
        with self._wake:
            if len(self._queue) == self._queue.maxlen:
                self.dropped += 1
            self._queue.append(event)
            self._wake.notify()

    def close(self, timeout_s: float) -> int:
        """Deliver what is queued and finish within `timeout_s`; returns the records not delivered."""
        with self._wake:
            self._closing = True
            self._wake.notify()
        self._thread.join(timeout_s)
        with self._wake:
            return len(self._queue) + self.dropped + (self._pending is not None)

    def _run(self) -> None:
        tracker: Tracker | None = None
        delay = self._backoff_s
        while True:
            with self._wake:
                if self._pending is None:  # the next record; a failed one stays pending and is retried
                    while not self._queue and not self._closing:
                        self._wake.wait()
                    if not self._queue:  # closing with nothing left
                        break
                    self._pending = self._queue.popleft()
                kind, first, second = self._pending
            try:
                if tracker is None:
                    candidate = self._make()
                    candidate.start()
                    tracker = candidate
                if kind == "log":
                    tracker.log(first, second)
                else:
                    tracker.log_model(first)
            except Exception as exc:  # any failure of a tracker is its own: training goes on
                self.failures += 1
                if self.failures == 1:
                    self._warn(
                        f"rljob: tracker {self.name} failed ({type(exc).__name__}: {_short(exc)}); training goes on "
                        f"and metrics.jsonl keeps every step; retrying with back-off up to {self._max_backoff_s:.0f}s"
                    )
                with self._wake:
                    if self._closing:  # no back-off at the end: give up what is left
                        break
                    self._wake.wait_for(lambda: self._closing, timeout=delay)
                delay = min(delay * 2, self._max_backoff_s)
                continue
            delay = self._backoff_s
            with self._wake:
                self._pending = None
                self.delivered += 1
        if tracker is not None:
            try:
                tracker.finish()
            except Exception as exc:
                self._warn(f"rljob: tracker {self.name} failed to finish its run ({type(exc).__name__}: {_short(exc)})")


def _short(exc: BaseException, limit: int = 300) -> str:
    text = " ".join(str(exc).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


class Trackers:
    """Every tracker of a job, fed by actor 0's loop: `log` each record, `log_model` the export, `close` at the end."""

    def __init__(
        self,
        makers: Mapping[str, Callable[[], Tracker]],
        warn: Warn = _stderr,
        run_name: str = "",
        backoff_s: float = BACKOFF_S,
        max_backoff_s: float = MAX_BACKOFF_S,
        max_queued: int = MAX_QUEUED,
    ) -> None:
        self._warn = warn
        self._feeds = [_Feed(name, make, warn, backoff_s, max_backoff_s, max_queued) for name, make in makers.items()]
        self._closed = False
        self.run_name = run_name
        """The name of the run in every tracker (`<namespace>-<job>-r<restart>`)."""

    @property
    def names(self) -> list[str]:
        return [feed.name for feed in self._feeds]

    def log(self, step: int, record: Mapping[str, Any]) -> None:
        """Queue a record's finite numbers (a metrics.jsonl line) for every tracker; never blocks on them."""
        metrics = scalars(record)
        if metrics:
            for feed in self._feeds:
                feed.put(("log", int(step), metrics))

    def log_model(self, path: str) -> None:
        for feed in self._feeds:
            feed.put(("model", str(path), None))

    def close(self, timeout_s: float = CLOSE_TIMEOUT_S) -> dict[str, int]:
        """Deliver, finish, and say which trackers missed records: {tracker: records not delivered}."""
        if self._closed:
            return {}
        self._closed = True
        deadline = time.monotonic() + timeout_s
        missed = {}
        for feed in self._feeds:
            left = feed.close(max(0.0, deadline - time.monotonic()))
            if left:
                missed[feed.name] = left
                self._warn(f"rljob: tracker {feed.name} missed {left} record(s); metrics.jsonl has every step")
        return missed

    def __enter__(self) -> Trackers:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_trackers(specs: Sequence[TrackerSpec], run: RunInfo, warn: Warn = _stderr) -> Trackers:
    """The trackers of `logging.trackers` (none listed: an empty fan-out, no thread, no import)."""

    def maker(spec: TrackerSpec) -> Callable[[], Tracker]:
        return lambda: build_tracker(spec, run)

    return Trackers({spec.name: maker(spec) for spec in specs}, warn=warn, run_name=run.name)


class TrackersUnavailable(Exception):
    """A listed tracker's library is not installed here: a configuration problem no restart fixes."""

    def __init__(self, problems: Sequence[Problem]) -> None:
        self.problems = list(problems)
        super().__init__("; ".join(problem.render() for problem in self.problems))


def job_trackers(
    job: RLJob, namespace: str, run_dir: str = "", warn: Warn = _stderr, env: Mapping[str, str] | None = None
) -> Trackers:
    """Actor 0's trackers for `job`: run `<namespace>-<job>-r<RLJOB_RESTART>`, the resolved spec as config.
    Raises TrackersUnavailable when a listed tracker's library is missing."""
    problems = tracker_problems(job.spec)
    if problems:
        raise TrackersUnavailable(problems)
    config = job.spec.model_dump(mode="json", by_alias=True, exclude_none=True)
    run = RunInfo(namespace, job.name, restart_number(env), config, run_dir)
    return open_trackers(job.spec.logging.trackers, run, warn)
