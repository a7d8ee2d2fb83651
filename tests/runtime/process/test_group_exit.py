"""A killed role's process group is waited for until every process of it has exited, orphans included."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator

import pytest

from rljob.runtime.process.group_exit import exited, kill_group, living_members, still_running, wait_for_group_exit

ENGINE = "import time; time.sleep(600)"


@contextlib.contextmanager
def front_end(*, orphan_its_engine: bool) -> Iterator[tuple[subprocess.Popen[bytes], int]]:
    """A session of its own: a front end and the engine it started (as vLLM's), the engine's pid read back. With
    `orphan_its_engine` the front end exits at once, leaving its engine to whoever adopts orphans."""
    body = f"import subprocess, sys; engine = subprocess.Popen([sys.executable, '-c', {ENGINE!r}])"
    body += "; print(engine.pid, flush=True)"
    body += "" if orphan_its_engine else f"; {ENGINE}"
    leader = subprocess.Popen([sys.executable, "-c", body], start_new_session=True, stdout=subprocess.PIPE)
    assert leader.stdout is not None
    try:
        yield leader, int(leader.stdout.readline())
    finally:
        kill_group(leader.pid)
        leader.stdout.close()
        leader.poll()


def test_the_wait_names_what_still_runs_and_ends_once_the_killed_group_has_exited():
    with front_end(orphan_its_engine=False) as (leader, engine):
        running = wait_for_group_exit(leader.pid, wait_s=0.1)  # not killed: both named after the wait
        assert sorted(running) == sorted([leader.pid, engine])
        assert still_running(running, 0.1).startswith("2 process(es) of its group did not exit within 0.1s")
        assert kill_group(leader.pid)
        assert wait_for_group_exit(leader.pid, wait_s=10) == []
        assert exited(leader.pid) and exited(engine)
        with pytest.raises(ChildProcessError):  # the front end, a child of this process, was reaped by the wait
            os.waitpid(leader.pid, os.WNOHANG)


def test_an_orphaned_engine_of_the_group_is_waited_for_though_this_process_cannot_reap_it():
    with front_end(orphan_its_engine=True) as (leader, engine):
        leader.wait()
        assert living_members(leader.pid) == [engine]  # the group outlives its leader
        assert kill_group(leader.pid)
        assert wait_for_group_exit(leader.pid, wait_s=10) == []
        assert exited(engine)


def test_a_group_no_process_has_is_neither_signalled_nor_waited_for():
    unused = 2**22 + 12345  # above the kernel's largest pid (pid_max is at most 2**22)
    assert not kill_group(unused)
    assert wait_for_group_exit(unused, wait_s=10) == []
