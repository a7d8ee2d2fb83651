"""Role processes of a local run die with their launcher, even when the launcher is SIGKILLed.

The child arranges it itself, first thing in `rljob role`: `PR_SET_PDEATHSIG` (Linux) asks the kernel to
SIGKILL it when its parent dies. Doing this in a `preexec_fn` instead would run Python (ctypes) in the
forked child of a launcher whose reader threads may hold locks: not fork-safe. The launcher may die before
the child gets there; the child then has another parent already, sees it, and dies at once.
"""

from __future__ import annotations

import ctypes
import os
import signal
from collections.abc import Mapping

LAUNCHER_PID_ENV = "RLJOB_LAUNCHER_PID"
"""Set by the local launcher for its role processes, and by an actor replica for the ranks it starts (also in
pods); absent for a pod's own process, whose lifetime the kubelet owns."""
_PR_SET_PDEATHSIG = 1


def die_with_launcher(env: Mapping[str, str] = os.environ) -> None:
    """In a role process the local launcher started: be SIGKILLed when the launcher dies, however it dies."""
    launcher = env.get(LAUNCHER_PID_ENV)
    if not launcher:
        return
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):  # not Linux: no parent-death signal to ask for
        return
    if prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != int(launcher):  # the launcher died before the prctl: no signal will come
        os.kill(os.getpid(), signal.SIGKILL)
