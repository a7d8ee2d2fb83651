"""Role processes die with their launcher, even a SIGKILLed one, without a preexec_fn (not fork-safe)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

from rljob.runtime.process.parent_death import LAUNCHER_PID_ENV

ROLE = "from rljob.runtime.process.parent_death import die_with_launcher; die_with_launcher(); "
ROLE += "print('ready', flush=True); "
ROLE += "import time; time.sleep(600)"


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def wait_until_gone(pid: int, timeout: float = 60) -> bool:
    deadline = time.monotonic() + timeout  # a safety net only: the kernel kills it as the launcher dies
    while time.monotonic() < deadline:
        if gone(pid):
            return True
        time.sleep(0.05)
    return False


def test_a_role_process_dies_when_its_launcher_is_sigkilled():
    launcher_code = textwrap.dedent(
        f"""
        import os, subprocess, sys
        env = {{**os.environ, {LAUNCHER_PID_ENV!r}: str(os.getpid())}}
        child = subprocess.Popen([sys.executable, "-c", {ROLE!r}], env=env, stdout=subprocess.PIPE, text=True)
        assert child.stdout.readline() == "ready\\n"
        print(child.pid, flush=True)
        child.wait()
        """
    )
    launcher = subprocess.Popen([sys.executable, "-c", launcher_code], stdout=subprocess.PIPE, text=True)
    try:
        role_pid = int(launcher.stdout.readline())
        assert not gone(role_pid)
        launcher.send_signal(signal.SIGKILL)
        launcher.wait()
        assert wait_until_gone(role_pid), "the role process outlived its SIGKILLed launcher"
    finally:
        launcher.kill()
        launcher.wait()


def test_a_role_process_whose_launcher_died_before_it_asked_kills_itself():
    """The launcher died between starting the child and the child's prctl: the child's parent is another."""
    not_our_parent = os.getpid() + 1_000_000  # no such process: the "launcher" named here is gone
    env = {**os.environ, LAUNCHER_PID_ENV: str(not_our_parent)}
    done = subprocess.run([sys.executable, "-c", ROLE], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == -signal.SIGKILL and "ready" not in done.stdout


def test_outside_a_local_run_nothing_is_asked():
    """In a pod (no launcher variable) the process keeps running whatever its parent does."""
    env = {k: v for k, v in os.environ.items() if k != LAUNCHER_PID_ENV}
    code = "from rljob.runtime.process.parent_death import die_with_launcher; die_with_launcher(); print('ready')"
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout == "ready\n"


@pytest.mark.slow
def test_sigkilling_rljob_run_takes_every_role_process_with_it(cartpole_manifest, start_run):
    run = start_run(cartpole_manifest(steps=500, actors=2), "--quiet")
    run.wait_for_step(1)
    roles = run.roles()
    assert len(roles) == 5
    for role in roles:
        assert role.environ()[LAUNCHER_PID_ENV] == str(run.process.pid)
    run.process.send_signal(signal.SIGKILL)
    run.process.wait()
    assert all(wait_until_gone(role.pid) for role in roles), [r.pid for r in roles if not gone(r.pid)]
