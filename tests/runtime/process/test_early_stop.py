"""A SIGTERM that reaches a collocated actor pod's process before the role's program has its handler is kept for
the program, which stops on it, instead of ending the process as killed."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

from tests.conftest import REPO

ROLE_START = """
import os, signal, sys
from rljob.runtime.process.early_stop import hold_stop_requests
from rljob.runtime.wire.identity import local_identities, ports_needed

replicas = {"actor": 1, "rollout": 1, "env": 0, "reward": 0}
ports = list(range(42000, 42000 + ports_needed(replicas)))
ranks = int(sys.argv[2])
(actor,) = [i for i in local_identities("job", replicas, sys.argv[1], ports, actor_ranks_per_replica=ranks)
            if i.role == "actor"]
hold_stop_requests()
os.kill(os.getpid(), signal.SIGTERM)  # what a rollout that gives up at once does (stop_this_process)
print("still running", flush=True)
"""


def run(script: str, tmp_path: Path, ranks: int) -> subprocess.CompletedProcess[str]:
    job_file = tmp_path / "job.yaml"
    job_file.write_text((REPO / "examples" / "grpo-tiny-arithmetic.yaml").read_text())
    command = [sys.executable, "-c", textwrap.dedent(script), str(job_file), str(ranks)]
    return subprocess.run(
        command, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=120
    )


def test_the_actor_s_program_stops_on_a_sigterm_that_came_before_its_handler(tmp_path):
    script = (
        ROLE_START
        + """
from rljob.runtime.wire.context import start_role
context = start_role(actor)
print("stop asked:", context.stop.is_set(), flush=True)
"""
    )
    done = run(script, tmp_path, ranks=1)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["still running", "stop asked: True"]
    assert "received SIGTERM, stopping" in done.stderr


def test_the_ranks_of_a_replica_get_a_sigterm_that_came_before_they_were_started(tmp_path):
    script = (
        ROLE_START
        + '''
from rljob.runtime.wire.ranks import run_rank_group
rank = """import signal, sys, time
signal.signal(signal.SIGTERM, lambda *_: (print("stopping", flush=True), sys.exit(0)))
print("up", flush=True)
time.sleep(60)
print("never stopped", flush=True)
"""
sys.exit(run_rank_group(actor, [sys.executable, "-c", rank]))
'''
    )
    done = run(script, tmp_path, ranks=2)
    lines = done.stdout.splitlines()
    assert lines[0] == "still running", done.stdout + done.stderr
    assert "actor[0] started ranks 0..1 of WORLD_SIZE 2 (2 per replica)" in lines, done.stdout + done.stderr
    # Each rank got the SIGTERM, as soon as it was started: before its handler (killed) or after it (stopping).
    assert done.returncode in (0, 128 + 15), done.stdout + done.stderr
    assert not any(line.endswith("never stopped") for line in lines)
