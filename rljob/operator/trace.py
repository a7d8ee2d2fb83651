"""Where one reconcile pass spends its time, from the watch event that woke it.

Each pass of a job worker gets a `PassTrace` that starts when the event arrived (kopf called the handler),
not when the pass began: waiting for a reconcile slot is part of what a user waits for. Every stage the
pass reaches goes into the `rljob_operator_job_pass_seconds{stage}` histogram and, at debug level, into
one log line per pass, so a slow job can be told apart from a slow operator.
"""

from __future__ import annotations

import logging
import time

from prometheus_client import Histogram

logger = logging.getLogger(__name__)

STAGES = ("slot", "planned", "status_written", "pod_created", "pods_created", "done")
"""slot: a reconcile slot was granted; planned: the job validated, its children built and the plan made;
status_written: the status patch answered; pod_created: each pod create answered (one sample per pod);
pods_created: the pass's last pod create answered; done: the pass ended."""


class PassTrace:
    """Marks the stages of one pass against `woken` (a `time.perf_counter()` reading)."""

    def __init__(self, histogram: Histogram, job: tuple[str, str], woken: float) -> None:
        self.histogram = histogram
        self.job = job
        self.woken = woken
        self.marks: list[tuple[str, float]] = []

    def mark(self, stage: str, log: bool = True) -> float:
        """Record that the pass reached `stage` now; the seconds since the event. `log=False` leaves it out of
        the debug line (a stage met once per pod)."""
        elapsed = time.perf_counter() - self.woken
        self.histogram.labels(stage).observe(elapsed)
        if log:
            self.marks.append((stage, elapsed))
        return elapsed

    def finish(self) -> None:
        self.mark("done")
        if logger.isEnabledFor(logging.DEBUG):
            spans = " ".join(f"{stage}={elapsed * 1000:.1f}ms" for stage, elapsed in self.marks)
            logger.debug("rljob %s/%s pass after its event: %s", *self.job, spans)
