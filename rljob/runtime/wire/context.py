"""What every role process does first: read its identity and the resolved job, set up logging and signals."""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from dataclasses import dataclass, field

from rljob.api import RLJob, load_job_file
from rljob.runtime.process.early_stop import held_stop_request
from rljob.runtime.records.trackers import Trackers, TrackersUnavailable, job_trackers
from rljob.runtime.wire.identity import RoleIdentity
from rljob.runtime.wire.liveness import Heartbeat


class FatalConfigError(RuntimeError):
    """A configuration problem that no restart can fix; the message names the field and the fix.

    `rljob role` prints it (no traceback) and exits with EXIT_FATAL_CONFIG."""


@dataclass
class RoleContext:
    identity: RoleIdentity
    job: RLJob
    log: logging.Logger
    stop: threading.Event = field(default_factory=threading.Event)
    """Set by SIGTERM/SIGINT: finish the current unit of work and exit (0; an actor checkpoints at the step boundary
    every rank agrees on and exits EXIT_PREEMPTED)."""
    heartbeat: Heartbeat = field(default_factory=Heartbeat)
    """Beaten by the role's loops; `/livez` fails once one stops beating (`rljob.runtime.wire.liveness`)."""

    @property
    def name(self) -> str:
        return f"{self.identity.role}-{self.identity.replica}"


def start_role(identity: RoleIdentity | None = None) -> RoleContext:
    identity = identity or RoleIdentity.from_env()
    job = load_job_file(identity.config_path)
    level = getattr(logging, job.spec.logging.level.upper())
    logging.basicConfig(
        stream=sys.stderr,
        level=level,
        format=f"%(asctime)s.%(msecs)03d %(levelname)s {identity.role}[{identity.replica}] %(message)s",
        datefmt="%H:%M:%S",
        force=True,
    )
    context = RoleContext(identity=identity, job=job, log=logging.getLogger(f"rljob.{identity.role}"))

    def request_stop(signum: int, _frame: object) -> None:
        context.log.info("received %s, stopping", signal.Signals(signum).name)
        context.stop.set()

    signal.signal(signal.SIGTERM, request_stop)
    signal.signal(signal.SIGINT, request_stop)
    if (held := held_stop_request()) is not None:  # asked before this handler was there (early_stop)
        request_stop(held, None)
    # Several roles share few cores: one compute thread each unless the user says otherwise.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    return context


def start_trackers(context: RoleContext) -> Trackers:
    """Actor 0's experiment trackers (`spec.logging.trackers`), said in its log; a listed tracker whose library is
    missing here is a FatalConfigError (exit 78), which no restart fixes."""
    identity = context.identity
    try:
        trackers = job_trackers(context.job, identity.namespace, identity.run_dir, context.log.warning)
    except TrackersUnavailable as exc:
        raise FatalConfigError(str(exc)) from None
    if trackers.names:
        context.log.info("logging to %s as run %s", ", ".join(trackers.names), trackers.run_name)
    return trackers
