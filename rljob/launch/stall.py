"""A job that stops getting on: no training step within `spec.failurePolicy.progressDeadlineSeconds`.

One wording for the operator's Stalled condition and `rljob run`'s line, and the clock `rljob run` keeps.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

STALLED = "Stalled"
"""Condition type, and the reason of a job failed for it (`onStalled: FailJob`)."""
PROGRESS_DEADLINE_EXCEEDED = "ProgressDeadlineExceeded"
"""Reason of a Stalled condition that is True."""
PROGRESSING = "Progressing"
"""Reason of a Stalled condition that went back to False: steps resumed."""


def stalled_message(idle_s: float, deadline_s: int, step: int, total: int, issue: str) -> str:
    """Why a job is Stalled, with what the actor last reported."""
    where = f"at step {step} of {total}" if step else f"before its first step (of {total})"
    said = f"; the actor reports: {issue}" if issue else "; the actor reports no reason (is it answering?)"
    return (
        f"no training step for {idle_s:.0f}s (spec.failurePolicy.progressDeadlineSeconds: {deadline_s}), {where}{said}"
    )


@dataclass
class StallWatch:
    """`rljob run`'s clock: feed it the actor's progress; it says when the job stalls and when it recovers."""

    deadline_s: int
    clock: Callable[[], float] = time.monotonic
    _step: int | None = None
    _since: float | None = None
    stalled: bool = False

    def observe(self, step: int | None, total: int, issue: str) -> tuple[str, str] | None:
        """(STALLED, message) when the job just stalled, (PROGRESSING, message) when it just recovered, else None.

        `step` None: no progress could be read (the actor is not up yet, or not answering): the clock runs on.
        """
        now = self.clock()
        if self._since is None:
            self._since = now
        if step is not None and step != self._step:
            first = self._step is None
            self._step = step
            if not first:  # the first report is where the actor stands, not a step it completed
                self._since = now
                if self.stalled:
                    self.stalled = False
                    return PROGRESSING, f"training resumed at step {step}"
        idle = now - self._since
        if self.deadline_s and not self.stalled and idle >= self.deadline_s:
            self.stalled = True
            return STALLED, stalled_message(idle, self.deadline_s, self._step or 0, total, issue)
        return None
