"""The multi-host layer: each role replica in a network namespace of its own (tests/multihost/lab.py).

It needs root on Linux, which CI has: there a missing capability fails the run instead of skipping it, so the
layer can never silently stop running.
"""

from __future__ import annotations

import os
import shutil
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from rljob.api import RLJob, validate_job
from rljob.api.loading import parse_documents
from rljob.launch.local import LocalRun
from rljob.launch.overrides import apply_overrides
from rljob.launch.supervisor import RunResult
from tests.multihost.lab import DnsMode, NetnsLab, unavailable_reason

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _needs_namespaces() -> None:
    reason = unavailable_reason()
    if reason is None:
        return
    if os.environ.get("CI"):
        pytest.fail(f"the multi-host layer must run in CI: {reason}")
    pytest.skip(reason)


def load_example(name: str, overrides: list[str] | None = None) -> RLJob:
    document = parse_documents((REPO / "examples" / name).read_text())[0]
    return validate_job(apply_overrides(document.data, overrides or []))


@dataclass
class LabRun:
    """A finished run of a job in a lab: its result, every line its roles printed, and how long it took."""

    result: RunResult
    lines: list[str] = field(default_factory=list)
    seconds: float = 0.0
    dns_queries: int = 0

    def lines_per_minute(self) -> float:
        return len(self.lines) / max(self.seconds / 60, 1.0)

    def count(self, text: str) -> int:
        return sum(text in line for line in self.lines)


def run_in_lab(job: RLJob, out: Path, dns: DnsMode, during=None, limit_s: float = 600) -> LabRun:
    """Run `job` with every replica on a host of its own; `during(run, lab)` is called at every supervisor tick."""
    replicas = {r: job.spec.roles.get(r).replicas or 0 for r in ("actor", "rollout", "env", "reward")}
    lines: list[str] = []
    shutil.rmtree(out, ignore_errors=True)
    with NetnsLab(job.name, replicas, dns=dns) as lab:
        run = LocalRun(job, out, lambda name, line: lines.append(f"{name} | {line}"), hosts=lab.host)
        started = time.monotonic()
        timer = threading.Timer(limit_s, lambda: os.kill(os.getpid(), signal.SIGINT))  # never hang the suite
        timer.start()
        try:
            run.start()
            result = run.supervise(on_tick=(lambda: during(run, lab)) if during else None)
        finally:
            timer.cancel()
        done = LabRun(result, lines, time.monotonic() - started, lab.dns_queries)
    # Shown with `pytest -s` (or on failure): the figures the issue notes quote.
    print(f"{job.name} dns={dns}: exit {result.exit_code} in {done.seconds:.0f}s, {len(lines)} log lines")
    return done
