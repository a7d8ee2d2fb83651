"""Ending what a role process leaves in its process group, and waiting until it has exited.

Role processes run in sessions of their own (the group id is the leader's pid). vLLM's EngineCore and
tensor-parallel workers outlive a front end killed by SIGKILL, holding GPU memory that the next start of the
replica needs. SIGKILL takes effect only when the kernel next runs the process, which on a busy node can be
after that next start: so the group is killed and then waited for. A zombie counts as exited: it holds no
memory and no device.
"""

from __future__ import annotations

import os
import signal
import time

GROUP_EXIT_WAIT_S = 10.0
"""How long the processes of a killed group get to exit before the caller goes on anyway."""


def kill_group(pgid: int) -> bool:
    """SIGKILL every process of group `pgid`; False when the group is empty (or not this user's)."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def _state_and_group(pid: int | str) -> tuple[str, int] | None:
    """The process's state letter and group id, from /proc; None once it is gone (reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            state, _ppid, group = stat.read().rsplit(")", 1)[1].split()[:3]  # the name may hold ")" or spaces
    except (FileNotFoundError, ProcessLookupError, IndexError, ValueError):
        return None
    return state, int(group)


def exited(pid: int) -> bool:
    """True once process `pid` has exited: it is gone, or a zombie (what it held is freed). Linux (/proc)."""
    found = _state_and_group(pid)
    return found is None or found[0] in ("Z", "X")


def living_members(pgid: int) -> list[int]:
    """The processes of group `pgid` that have not exited yet; [] where there is no /proc to look in."""
    if not os.path.isdir("/proc"):
        return []
    living = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            found = _state_and_group(entry.name)
            if found is not None and found[1] == pgid and found[0] not in ("Z", "X"):
                living.append(int(entry.name))
    return living


def wait_for_group_exit(pgid: int, wait_s: float = GROUP_EXIT_WAIT_S) -> list[int]:
    """Wait until every process of the killed group `pgid` has exited, reaping those that are this process's
    children (in a pod this process is PID 1 and adopts the group's orphans, which would otherwise stay
    zombies). Returns the pids still running after `wait_s` (stuck in the kernel, as in a device driver), or []
    once none is."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            while os.waitpid(-pgid, os.WNOHANG)[0] != 0:
                pass
            children_left = True  # killed, not exited yet
        except ChildProcessError:  # none of the group's processes is (any more) a child of this one
            children_left = False
        living = living_members(pgid)
        if not (living or children_left) or time.monotonic() >= deadline:
            return living
        time.sleep(0.02)


def still_running(living: list[int], wait_s: float) -> str:
    """The line that names the processes `wait_for_group_exit` left running."""
    return (
        f"{len(living)} process(es) of its group did not exit within {wait_s:g}s of SIGKILL "
        f"(pids {', '.join(map(str, living))}); what they hold may be held a while longer"
    )
