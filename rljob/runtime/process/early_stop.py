"""A stop asked for before a role's program has its own SIGTERM/SIGINT handler is kept for it, not fatal.

`rljob role` holds these signals first thing; the program installs its handler only after the imports and the
job file (`rljob.runtime.wire.context.start_role`), or the rank group's (`rljob.runtime.wire.ranks`). A SIGTERM
in between would otherwise end the process as killed by it, not with the status the operator reads; as a
container's PID 1 the kernel would drop it instead. The case that needs it most: a collocated actor pod's
process starts the rollout first (`rljob.runtime.roles.collocated`), and a rollout that gives up at once (a
configuration error) asks the actor to stop while the actor's program is still starting. The program's handler,
once installed, acts on what `held_stop_request` returns."""

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
