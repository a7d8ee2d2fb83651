"""A stop asked for before a role's program has its own SIGTERM/SIGINT handler is kept for it, not fatal.

A collocated actor pod's process starts the rollout first (`rljob.runtime.roles.collocated`), then the actor's
program. A rollout that gives up at once (a configuration error) asks the actor to stop with SIGTERM, which can
land before the program installed its handler: without this, the default action would end the process as killed
by SIGTERM (or, as a container's PID 1, the signal would be dropped and the pod would wait out the give-up grace),
not with the status the operator reads. `hold_stop_requests` records such signals; the program's handler, once
installed, acts on what `held_stop_request` returns.
"""

from __future__ import annotations

import signal

_held: list[int] = []


def hold_stop_requests() -> None:
    """From now until a program installs its own handlers, SIGTERM and SIGINT are recorded instead."""

    def record(signum: int, _frame: object) -> None:
        _held.append(signum)

    signal.signal(signal.SIGTERM, record)
    signal.signal(signal.SIGINT, record)


def held_stop_request() -> int | None:
    """The first SIGTERM or SIGINT recorded since `hold_stop_requests`, or None."""
    return _held[0] if _held else None
