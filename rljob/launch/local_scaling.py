"""`rljob run`'s rollout autoscaler: spec.roles.rollout.autoscale applied to rollout processes.

The same decision as the operator's (`rljob.launch.autoscale.decide`), on the same signal (actor 0's
`/progress`), acted on with processes: the launcher gives the job identities for maxReplicas rollouts and starts
the first count of them; scaling up starts the next ones, scaling down stops the highest. The actor follows a
membership file (RLJOB_ROLLOUT_MEMBERS_FILE, the document the operator keeps in a ConfigMap) that lists the
started rollouts: a new one joins it once its `/healthz` answers (as a pod joins once Ready), one being stopped
leaves it before it is stopped (the actor re-sends its chunks in flight to the others). The actor never restarts.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from rljob.api.spec import AutoscaleSpec
from rljob.launch.autoscale import Sample, decide, record, rewind
from rljob.runtime.llm.replicas.membership import members_document

MEMBERS_FILE = "rollouts.json"
"""The membership file's name in the run directory."""


def initial_count(spec: AutoscaleSpec, replicas: int) -> int:
    """The rollouts a run starts with: spec.roles.rollout.replicas within the bounds."""
    return min(max(replicas, spec.min_replicas), spec.max_replicas)


class RolloutScaler:
    """Decides on each actor report and starts or stops rollout replicas through the given callables."""

    def __init__(
        self,
        spec: AutoscaleSpec,
        replicas: int,
        endpoints: Mapping[int, str],
        members_path: Path,
        start: Callable[[int], None],
        stop: Callable[[int], None],
        ready: Callable[[int], bool],
        say: Callable[[str], None],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.spec = spec
        self.count = initial_count(spec, replicas)
        """Rollout replicas started (0 .. count-1)."""
        self.endpoints = dict(endpoints)
        self.members_path = members_path
        self._start, self._stop, self._ready, self._say = start, stop, ready, say
        self.clock = clock
        self.members: list[int] = list(range(self.count))
        """The replicas the membership file lists."""
        self.samples: list[Sample] = []
        self.last_scale_at: float | None = None
        self.last_scale_step = 0
        self.history: list[int] = [self.count]
        """Every count the run had, in order (the first is the count it started with)."""

    def write_members(self) -> None:
        """Write the membership file in one step (a rename): the actor never reads half a file."""
        text = members_document({r: self.endpoints[r] for r in self.members})
        tmp = self.members_path.with_suffix(".tmp")
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, self.members_path)

    def observe(self, report: Mapping[str, Any] | None) -> None:
        """One look: admit started rollouts that answer, then decide on the actor's latest report (if any)."""
        joined = [r for r in range(self.count) if r not in self.members and self._ready(r)]
        if joined:
            self.members = sorted(self.members + joined)
            self.write_members()
        if report is not None:
            step = int(report.get("step") or 0)
            self.samples, self.last_scale_step = rewind(self.samples, step, self.last_scale_step)
            self.samples = record(self.samples, step, report.get("trainerWait"), report.get("rolloutIdle"))
        decision = decide(self.spec, self.count, self.samples, self.last_scale_at, self.last_scale_step, self.clock())
        if decision.direction is None:
            return
        self._say(f"autoscale: {decision.reason}")
        self.last_scale_at = self.clock()
        self.last_scale_step = self.samples[-1].step if self.samples else self.last_scale_step
        if decision.replicas > self.count:
            for replica in range(self.count, decision.replicas):
                self._start(replica)  # joins the membership once its /healthz answers
        else:
            leaving = set(range(decision.replicas, self.count))
            self.members = [r for r in self.members if r not in leaving]
            self.write_members()  # out of the membership first: the actor stops sending to them
            for replica in sorted(leaving, reverse=True):
                self._stop(replica)
        self.count = decision.replicas
        self.history.append(self.count)
