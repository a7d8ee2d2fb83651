"""The collocated rollout of an actor pod: a child process of the actor's process, restarted and stopped by it."""

from __future__ import annotations

import dataclasses
import io
import os
import subprocess
import sys
import textwrap
import threading
import time

import yaml

from rljob.runtime.process.group_exit import exited
from rljob.runtime.process.retry import Backoff
from rljob.runtime.roles.collocated import CollocatedRollout, collocated_rollout
from rljob.runtime.wire.identity import EXIT_FATAL_CONFIG, EXIT_ROLLOUT_GAVE_UP, pod_identity
from tests.conftest import REPO

REPLICAS = {"actor": 1, "rollout": 1, "env": 0, "reward": 0}


class Output(io.BytesIO):
    """The container's stdout, read while the supervisor writes to it."""

    def __init__(self) -> None:
        super().__init__()
        self.guard = threading.Lock()

    def write(self, data: bytes) -> int:  # type: ignore[override]
        with self.guard:
            return super().write(data)

    def lines(self) -> list[str]:
        with self.guard:
            return self.getvalue().decode().splitlines()


def child(body: str) -> list[str]:
    return [sys.executable, "-c", "import os, sys, time\n" + textwrap.dedent(body)]


def supervised(body: str, **options) -> tuple[CollocatedRollout, Output, list[str]]:
    actor = pod_identity("job", "ns", "actor", 0, REPLICAS, 9090, collocated_rollout=True)
    out, asked_to_stop = Output(), []
    options.setdefault("max_replacements", 10)
    rollout = CollocatedRollout(
        actor.collocated_rollout(),
        {"PATH": os.environ.get("PATH", ""), "MARK": os.environ.get("MARK", "x")},
        out,
        command=child(body),
        on_give_up=lambda: asked_to_stop.append("stop"),
        backoff=Backoff(0.05, 0.2),
        grace_s=5.0,
        **options,
    )
    return rollout.start(), out, asked_to_stop


def wait_until(condition, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "the condition did not come true"
        time.sleep(0.05)


def test_the_rollout_runs_with_its_own_identity_and_its_lines_are_prefixed():
    rollout, out, _ = supervised(
        """
        e = os.environ
        print(e["RLJOB_ROLE"], e["RLJOB_REPLICA"], e["RLJOB_METRICS_PORT"], e["RLJOB_ROLLOUT_ENDPOINTS"], flush=True)
        print("to stderr", file=sys.stderr, flush=True)
        time.sleep(60)
        """
    )
    try:
        wait_until(lambda: sum("|" in line for line in out.lines()) == 2)
    finally:
        rollout.stop()
    lines = out.lines()
    assert "rollout[0] | rollout 0 29603 job-actor-0.job:29602" in lines
    assert "rollout[0] | to stderr" in lines
    assert lines[0].startswith("rollout[0] started beside the actor (pid ")


def test_a_failed_rollout_is_started_again_after_a_back_off_and_the_actor_goes_on():
    rollout, out, asked_to_stop = supervised("print('up', flush=True); time.sleep(0.2); sys.exit(3)")
    try:
        wait_until(lambda: rollout.starts >= 3)
    finally:
        rollout.stop()
    lines = out.lines()
    assert lines.count("rollout[0] | up") >= 2
    assert any(line.startswith("rollout[0] exited with code 3: starting it again in ") for line in lines)
    assert "failure 2 in a row; spec.failurePolicy.maxReplacements 10" in "\n".join(lines)
    assert asked_to_stop == [] and rollout.gave_up is None


def test_a_rollout_killed_by_a_signal_is_started_again():
    rollout, out, _ = supervised("print('up', flush=True); time.sleep(60)")
    try:
        wait_until(lambda: "rollout[0] | up" in out.lines())
        first = rollout.pid
        assert first is not None
        os.kill(first, 9)
        wait_until(lambda: rollout.starts == 2 and rollout.pid not in (None, first))
    finally:
        rollout.stop()
    assert any(line.startswith("rollout[0] exited with code 137: starting it again") for line in out.lines())


def test_past_max_replacements_the_actor_is_asked_to_stop_and_ends_with_the_code_that_fails_the_job(tmp_path):
    """Not the rollout's own code: 65 would read as the actor's divergence, 1 as an actor failure (a group
    restart whose new pod would count the rollout's failures from zero)."""
    log = tmp_path / "termination-log"
    log.write_text("")  # as the kubelet provides it in a pod
    rollout, out, asked_to_stop = supervised("sys.exit(65)", max_replacements=2, termination_log=log)
    try:
        wait_until(lambda: asked_to_stop)
    finally:
        rollout.stop()
    assert rollout.starts == 3 and rollout.gave_up == EXIT_ROLLOUT_GAVE_UP
    why = "failed 3 times in a row; spec.failurePolicy.maxReplacements is 2"
    assert f"rollout[0] exited with code 65: {why}; stopping the actor, which exits with code 79" in out.lines()
    assert log.read_text() == f"rollout[0] exited with code 65: {why}"


def test_a_configuration_error_or_failjob_stops_the_actor_at_the_first_failure():
    rollout, _, asked_to_stop = supervised(f"sys.exit({EXIT_FATAL_CONFIG})")
    try:
        wait_until(lambda: asked_to_stop)
    finally:
        rollout.stop()
    assert (rollout.starts, rollout.gave_up) == (1, EXIT_FATAL_CONFIG)
    rollout, out, asked_to_stop = supervised("sys.exit(1)", fail_job=True)
    try:
        wait_until(lambda: asked_to_stop)
    finally:
        rollout.stop()
    assert (rollout.starts, rollout.gave_up) == (1, EXIT_ROLLOUT_GAVE_UP)
    assert "failurePolicy.rollout is FailJob" in out.lines()[-1]


def test_stopping_ends_a_rollout_that_ignores_sigterm_with_sigkill():
    rollout, out, _ = supervised(
        """
        import signal
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        print("up", flush=True)
        time.sleep(60)
        """
    )
    wait_until(lambda: "rollout[0] | up" in out.lines())
    rollout.grace_s = 0.5
    process = rollout._process
    rollout.stop()
    assert process is not None and process.returncode == -9
    assert rollout.pid is None and rollout.starts == 1
    assert "rollout[0] did not stop within 0.5s of SIGTERM: killing it" in out.lines()


def test_what_a_failed_rollout_left_behind_is_killed_before_it_starts_again(tmp_path):
    """vLLM's engine processes outlive a front end killed by SIGKILL, holding the GPU the next start needs."""
    pids = tmp_path / "grandchildren"
    rollout, out, _ = supervised(
        f"""
        import subprocess
        from pathlib import Path

        def alive(pid):
            try:
                return open(f"/proc/{{pid}}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"
            except FileNotFoundError:
                return False

        pids = Path({str(pids)!r})
        before = [int(p) for p in pids.read_text().split()] if pids.exists() else []
        print("left behind alive:", [p for p in before if alive(p)], flush=True)
        engine = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        with pids.open("a") as f:
            f.write(f"{{engine.pid}}\\n")
        os.kill(os.getpid(), 9)
        """
    )
    try:
        wait_until(lambda: out.lines().count("rollout[0] | left behind alive: []") >= 3)
    finally:
        rollout.stop()
    lines = out.lines()
    assert not any(line.startswith("rollout[0] | left behind alive: [") and line[-2] != "[" for line in lines)
    assert "rollout[0] sent SIGKILL to what is left of its process group" in "\n".join(lines)
    assert all(exited(int(pid)) for pid in pids.read_text().split())


def test_stopping_the_rollout_also_ends_the_processes_it_started():
    rollout, out, _ = supervised(
        """
        import subprocess
        engine = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        print("engine", engine.pid, flush=True)
        time.sleep(60)
        """
    )
    wait_until(lambda: any(line.startswith("rollout[0] | engine ") for line in out.lines()))
    engine = int(next(line for line in out.lines() if line.startswith("rollout[0] | engine ")).split()[-1])
    rollout.stop()
    wait_until(lambda: exited(engine))


ACTOR = """
import os, sys, time
from rljob.runtime.roles.collocated import CollocatedRollout, collocated_rollout
from rljob.runtime.wire.identity import pod_identity

actor = pod_identity("job", "ns", "actor", 0, {"actor": 1, "rollout": 1}, 9090, collocated_rollout=True)
body = "from rljob.runtime.process.parent_death import die_with_launcher\\n"
body += "die_with_launcher(); print('armed', flush=True); import time; time.sleep(60)"
command = [sys.executable, "-c", body]
rollout = CollocatedRollout(
    actor.collocated_rollout(), dict(os.environ), sys.stdout.buffer, max_replacements=1, command=command
).start()
time.sleep(60)
"""


def test_the_rollout_in_its_own_session_still_dies_with_the_actors_process():
    """A process of a session of its own gets no signal with its parent's group: `parent_death` must end it."""
    actor = subprocess.Popen([sys.executable, "-c", ACTOR], stdout=subprocess.PIPE)
    try:
        assert actor.stdout is not None
        started = actor.stdout.readline().decode()
        assert started.startswith("rollout[0] started beside the actor (pid "), started
        child = int(started.rsplit("pid ", 1)[1].rstrip(")\n"))
        assert actor.stdout.readline().decode() == "rollout[0] | armed\n"
        actor.kill()
        actor.wait()
        wait_until(lambda: exited(child))
    finally:
        actor.kill()


STUCK_ACTOR = """
import os, signal, sys, time
from rljob.runtime.roles.collocated import CollocatedRollout, collocated_rollout
from rljob.runtime.wire.identity import pod_identity

signal.signal(signal.SIGTERM, signal.SIG_IGN)  # an actor that does not get out of its step
actor = pod_identity("job", "ns", "actor", 0, {"actor": 1, "rollout": 1}, 9090, collocated_rollout=True)
CollocatedRollout(
    actor.collocated_rollout(), dict(os.environ), sys.stdout.buffer, max_replacements=1, fail_job=True,
    command=[sys.executable, "-c", "import sys; sys.exit(1)"], give_up_grace_s=0.5,
).start()
time.sleep(120)  # past the test's timeout: only the supervisor's exit ends it in time
print("still running", flush=True)
"""


def test_an_actor_that_does_not_stop_after_the_give_up_is_ended_with_its_code():
    done = subprocess.run([sys.executable, "-c", STUCK_ACTOR], capture_output=True, text=True, timeout=60)
    assert done.returncode == EXIT_ROLLOUT_GAVE_UP, done.stdout + done.stderr
    assert "rollout[0] the actor did not stop within 0.5s: exiting with code 79" in done.stdout.splitlines()
    assert "still running" not in done.stdout


def test_a_failure_policy_edited_under_the_running_pod_applies_at_the_next_failure():
    """`failurePolicy` is restart-free: the operator rewrites the job file in place, and the supervisor reads it
    again at each failure (here from a list; `collocated_rollout` reads the mounted job file)."""
    policies = [(10, False), (10, True)]
    rollout, out, asked_to_stop = supervised("sys.exit(1)", read_policy=lambda: policies.pop(0))
    try:
        wait_until(lambda: asked_to_stop)
    finally:
        rollout.stop()
    assert (rollout.starts, rollout.gave_up) == (2, EXIT_ROLLOUT_GAVE_UP)
    lines = out.lines()
    assert "rollout[0] spec.failurePolicy is now maxReplacements 10, rollout FailJob" in lines
    assert "failed and spec.failurePolicy.rollout is FailJob" in lines[-1]


def test_a_failure_policy_that_does_not_read_keeps_the_last_one():
    def unreadable() -> tuple[int, bool]:
        raise OSError("the job file is being replaced")

    rollout, out, asked_to_stop = supervised("sys.exit(1)", max_replacements=1, read_policy=unreadable)
    try:
        wait_until(lambda: asked_to_stop)
    finally:
        rollout.stop()
    assert (rollout.starts, rollout.gave_up) == (2, EXIT_ROLLOUT_GAVE_UP)
    assert (
        "rollout[0] could not read spec.failurePolicy again (the job file is being replaced); keeping what was "
        "read before" in out.lines()
    )


def test_the_actor_pods_supervisor_reads_the_failure_policy_from_the_mounted_job_file(tmp_path):
    job = yaml.safe_load((REPO / "examples" / "grpo-tiny-arithmetic.yaml").read_text())
    job["spec"]["roles"]["rollout"]["collocated"] = True
    job["spec"]["rollout"]["weightSync"] = {"method": "ipc"}
    job_file = tmp_path / "job.yaml"
    job_file.write_text(yaml.safe_dump(job))
    actor = pod_identity("job", "ns", "actor", 0, REPLICAS, 9090, collocated_rollout=True)
    rollout = collocated_rollout(dataclasses.replace(actor, config_path=str(job_file)), Output())
    assert rollout.read_policy is not None and rollout.read_policy() == (10, False)
    job["spec"]["failurePolicy"] = {"maxReplacements": 3, "rollout": "FailJob"}
    job_file.write_text(yaml.safe_dump(job))  # what the kubelet does to the ConfigMap volume after an edit
    assert rollout.read_policy() == (3, True)


def test_the_pod_ends_with_the_rollout_s_status_only_when_the_actor_stopped_for_it():
    from rljob.runtime.roles.collocated import pod_exit_code

    assert pod_exit_code(1, EXIT_ROLLOUT_GAVE_UP) == EXIT_ROLLOUT_GAVE_UP  # stopped because of the rollout
    assert pod_exit_code(1, EXIT_FATAL_CONFIG) == EXIT_FATAL_CONFIG
    assert pod_exit_code(1, None) == 1  # the actor's own failure
    # Every step trained: the rollout lost while the actor exported the policy does not fail the finished job.
    assert pod_exit_code(0, EXIT_ROLLOUT_GAVE_UP) == 0


ADOPTING_ACTOR = """
import ctypes, os, sys, time
from pathlib import Path
from rljob.runtime.roles.collocated import CollocatedRollout
from rljob.runtime.wire.identity import pod_identity

ctypes.CDLL(None).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER: orphans come to this process, as to PID 1 in a pod
actor = pod_identity("job", "ns", "actor", 0, {"actor": 1, "rollout": 1}, 9090, collocated_rollout=True)
body = "import os, subprocess, sys; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])"
body += "; os.kill(os.getpid(), 9)"  # a front end killed, its engine process left behind
rollout = CollocatedRollout(
    actor.collocated_rollout(), dict(os.environ), sys.stdout.buffer, max_replacements=0,
    command=[sys.executable, "-c", body], on_give_up=lambda: None, give_up_grace_s=60,
).start()
for _ in range(500):
    if rollout.gave_up is not None:
        break
    time.sleep(0.02)
zombies = []
for stat in Path("/proc").glob("[0-9]*/stat"):
    try:
        state, ppid = stat.read_text().rsplit(")", 1)[1].split()[:2]
    except (FileNotFoundError, ProcessLookupError):
        continue
    if int(ppid) == os.getpid() and state == "Z":
        zombies.append(stat.parent.name)
print("gave up", rollout.gave_up, "zombies", zombies, flush=True)
os._exit(0)
"""


def test_an_actor_process_that_adopts_the_rollout_s_orphans_leaves_no_zombie():
    """In a pod the actor's process is PID 1: the engine processes a killed rollout leaves become its children."""
    done = subprocess.run([sys.executable, "-c", ADOPTING_ACTOR], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"gave up {EXIT_ROLLOUT_GAVE_UP} zombies []" in done.stdout.splitlines(), done.stdout


def test_a_rollout_whose_livez_names_a_stuck_loop_is_killed_and_started_again():
    """The container's liveness probe asks the actor's /livez only: the rollout beside it is watched by the actor
    pod's process, through the rollout's own /livez (here a real RoleHTTPServer whose loop beats once, then
    never again)."""
    from rljob.launch.local import free_ports

    (port,) = free_ports(1)
    actor = pod_identity("job", "ns", "actor", 0, REPLICAS, 9090, collocated_rollout=True)
    identity = dataclasses.replace(actor.collocated_rollout(), metrics_port=port)
    body = """
        from prometheus_client import CollectorRegistry
        from rljob.runtime.wire.liveness import Heartbeat
        from rljob.runtime.wire.role_http import RoleHTTPServer

        heartbeat = Heartbeat()
        server = RoleHTTPServer(int(os.environ["RLJOB_METRICS_PORT"]), CollectorRegistry(), host="127.0.0.1")
        server.watch_liveness(heartbeat, 0.5)
        server.start()
        heartbeat.beat()
        print("up", flush=True)
        time.sleep(600)  # the main loop never comes round again
        """
    out = Output()
    rollout = CollocatedRollout(
        identity,
        {"PATH": os.environ.get("PATH", ""), "PYTHONPATH": str(REPO)},
        out,
        command=child(body),
        max_replacements=10,
        on_give_up=lambda: None,
        backoff=Backoff(0.05, 0.2),
        grace_s=5.0,
        liveness_look_s=0.2,
    ).start()
    try:
        wait_until(lambda: rollout.starts >= 2 and out.lines().count("rollout[0] | up") >= 2)
    finally:
        rollout.stop()
    text = "\n".join(out.lines())
    assert "rollout[0] is hung (loop main has not beaten for " in text
    assert "s (limit 0.5s)): killing it" in text
    assert "rollout[0] exited with code 137: starting it again in " in text
    assert rollout.gave_up is None


def test_a_rollout_that_beats_or_is_still_starting_is_left_alone():
    from rljob.launch.local import free_ports

    (port,) = free_ports(1)
    actor = pod_identity("job", "ns", "actor", 0, REPLICAS, 9090, collocated_rollout=True)
    identity = dataclasses.replace(actor.collocated_rollout(), metrics_port=port)
    body = """
        import threading
        from prometheus_client import CollectorRegistry
        from rljob.runtime.wire.liveness import Heartbeat
        from rljob.runtime.wire.role_http import RoleHTTPServer

        heartbeat = Heartbeat()
        server = RoleHTTPServer(int(os.environ["RLJOB_METRICS_PORT"]), CollectorRegistry(), host="127.0.0.1")
        server.watch_liveness(heartbeat, 0.5)
        server.start()
        print("up", flush=True)
        time.sleep(1.5)  # starting (no beat yet) for longer than the limit
        while True:  # then idle, beating
            heartbeat.beat()
            time.sleep(0.05)
        """
    out = Output()
    rollout = CollocatedRollout(
        identity,
        {"PATH": os.environ.get("PATH", ""), "PYTHONPATH": str(REPO)},
        out,
        command=child(body),
        max_replacements=10,
        on_give_up=lambda: None,
        grace_s=5.0,
        liveness_look_s=0.2,
    ).start()
    try:
        wait_until(lambda: "rollout[0] | up" in out.lines())
        time.sleep(3)
        assert rollout.starts == 1 and rollout.pid is not None
    finally:
        rollout.stop()
    assert not any("is hung" in line for line in out.lines())
