"""A role's heartbeat and its `/livez`: idle-but-beating is alive, a loop stuck inside one round is hung."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import numpy as np
from prometheus_client import CollectorRegistry

from rljob.api import load_job_file
from rljob.launch.local import free_ports
from rljob.runtime.wire.context import RoleContext
from rljob.runtime.wire.identity import local_identities, ports_needed
from rljob.runtime.wire.liveness import Heartbeat
from rljob.runtime.wire.role_http import RoleHTTPServer
from rljob.runtime.wire.transport import RequestClient, RequestServer
from tests.conftest import REPO


def livez(port: int) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/livez", timeout=5) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()
    except (urllib.error.URLError, OSError):
        return 0, ""


def wait_for(port: int, status: int, within_s: float) -> tuple[int, str]:
    deadline = time.monotonic() + within_s
    answer = livez(port)
    while answer[0] != status and time.monotonic() < deadline:
        time.sleep(0.1)
        answer = livez(port)
    return answer


def test_heartbeat_names_the_stalest_loop_past_the_limit_and_checks_nothing_at_limit_zero():
    now = [100.0]
    heartbeat = Heartbeat(clock=lambda: now[0])
    assert not heartbeat.started and heartbeat.stuck(5) == ""
    heartbeat.beat()
    heartbeat.beat("generate")
    now[0] = 104.0
    heartbeat.beat()
    assert heartbeat.started and heartbeat.stuck(5) == ""
    now[0] = 107.0
    assert heartbeat.stuck(5) == "loop generate has not beaten for 7s (limit 5s)"
    assert heartbeat.stuck(0) == ""
    heartbeat.forget("generate")  # a loop that ended by design is not hung
    assert heartbeat.stuck(5) == ""


def test_livez_starts_503_answers_200_while_a_waiting_loop_beats_and_503_once_it_is_stuck(tmp_path):
    """A real server and a real loop thread: idle for longer than the limit but beating is alive; the same loop
    blocked inside one round (no beat) fails `/livez` after the limit, and recovers when it beats again. While
    it fails, the container's termination message says which loop hung (the pod the kubelet kills tells why)."""
    termination_log = tmp_path / "termination-log"
    termination_log.write_text("")
    heartbeat = Heartbeat()
    stop, stuck, released = threading.Event(), threading.Event(), threading.Event()

    def loop() -> None:
        while not stop.is_set():
            heartbeat.beat()
            if stuck.is_set():
                released.wait()  # one round that does not return (a deadlock) until the test releases it
                stuck.clear()
            stop.wait(0.05)  # waiting for work that does not come

    with RoleHTTPServer(0, CollectorRegistry(), host="127.0.0.1") as server:
        server.watch_liveness(heartbeat, 0.6, termination_log)
        assert livez(server.port) == (503, "starting\n")
        thread = threading.Thread(target=loop, daemon=True)
        thread.start()
        try:
            assert wait_for(server.port, 200, 5) == (200, "ok\n")
            idle_until = time.monotonic() + 1.5  # idle well past the limit: still alive
            while time.monotonic() < idle_until:
                assert livez(server.port) == (200, "ok\n")
                time.sleep(0.1)
            stuck.set()
            time.sleep(0.3)
            assert livez(server.port)[0] == 200  # within the limit: not yet
            status, body = wait_for(server.port, 503, 5)
            assert status == 503 and body.startswith("loop main has not beaten for "), body
            assert body.endswith("s (limit 0.6s)\n")
            assert termination_log.read_text().startswith("hung: loop main has not beaten for ")
            released.set()
            assert wait_for(server.port, 200, 5) == (200, "ok\n")
            assert termination_log.read_text() == ""
        finally:
            stop.set()
            released.set()
            thread.join(timeout=5)


def test_a_server_without_a_heartbeat_to_watch_is_always_live():
    with RoleHTTPServer(0, CollectorRegistry(), host="127.0.0.1") as server:
        assert livez(server.port) == (200, "ok\n")


def test_a_request_server_beats_while_idle_and_not_while_a_handler_hangs(tmp_path):
    """The env, reward and rollout roles' serving loop: no requests for longer than the limit is alive; a request
    whose handler never returns stops the beats. RoleHealth takes the limit from the role's probes spec."""
    from rljob.runtime.wire.health import RoleHealth

    job = load_job_file(str(REPO / "examples" / "grpo-tiny-arithmetic.yaml"))
    job.spec.roles.reward.probes.liveness_timeout_seconds = 1
    replicas = {"actor": 1, "rollout": 1, "env": 0, "reward": 1}
    identities = local_identities("live", replicas, str(tmp_path / "job.yaml"), free_ports(ports_needed(replicas)))
    identity = next(i for i in identities if i.role == "reward")
    context = RoleContext(identity=identity, job=job, log=logging.getLogger("test"))
    released = threading.Event()

    def hang(_: object) -> dict[str, object]:
        released.wait()
        return {"ok": True}

    server = RequestServer(identity.endpoints["reward"][0], {"hang": hang})
    health = RoleHealth(context, counters={})
    serving = threading.Thread(
        target=server.serve, args=(context.stop.is_set,), kwargs={"beat": context.heartbeat.beat}, daemon=True
    )
    client = RequestClient(identity.endpoints["reward"][0], timeout=30, retries=0)
    try:
        port = identity.metrics_port
        assert livez(port) == (503, "starting\n")
        health.ready()
        serving.start()
        time.sleep(1.6)  # idle past the limit
        assert livez(port) == (200, "ok\n")
        request = client.send("hang", {})
        status, body = wait_for(port, 503, 5)
        assert status == 503 and body.startswith("loop main has not beaten for "), body
        released.set()
        assert client.receive(request) == {"ok": True}
        assert wait_for(port, 200, 5) == (200, "ok\n")
    finally:
        released.set()
        context.stop.set()
        serving.join(timeout=5)
        client.close()
        server.close()
        health.close()


JOB = """\
apiVersion: rljob.io/v1alpha1
kind: RLJob
metadata:
  name: hung
spec:
  task:
    type: gym
    gym: {envId: "tests.runtime.wire.hanging_env:Hanging-v0", numEnvs: 2}
  algorithm: {name: ppo, minibatches: 1}
  trainer: {steps: 1, batchSize: 64}
  roles:
    actor: {replicas: 1}
    rollout: {replicas: 1}
    env: {replicas: 1, probes: {livenessTimeoutSeconds: 2}}
"""


def test_a_role_process_whose_main_loop_hangs_fails_liveness(tmp_path):
    """`rljob role env` in its own process, serving an environment whose step never returns: idle, it stays live;
    once a step request hangs its serving loop, `/livez` answers 503 (the kubelet would restart the container)."""
    config = tmp_path / "job.yaml"
    config.write_text(JOB)
    replicas = {"actor": 1, "rollout": 1, "env": 1, "reward": 0}
    identities = local_identities("hung", replicas, str(config), free_ports(ports_needed(replicas)), str(tmp_path))
    identity = next(i for i in identities if i.role == "env")
    process = subprocess.Popen(
        [sys.executable, "-m", "rljob.cli.main", "role", "env"],
        env={**os.environ, **identity.to_env(), "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    client = RequestClient(identity.endpoints["env"][0], timeout=60, retries=0)
    try:
        port = identity.metrics_port
        assert wait_for(port, 200, 60) == (200, "ok\n"), process.poll()
        assert client.call("reset", {"seed": 1})["obs"].shape == (2, 2)
        time.sleep(3)  # idle past the 2 s limit: alive
        assert livez(port) == (200, "ok\n")
        client.send("step", {"actions": np.zeros(2, np.int64)})
        status, body = wait_for(port, 503, 10)
        assert status == 503 and body.startswith("loop main has not beaten for "), body
        assert body.endswith("s (limit 2s)\n")
        assert process.poll() is None  # hung, not dead: only a liveness probe gets it restarted
    finally:
        client.close()
        process.kill()
        output = process.communicate(timeout=30)[0].decode()
    assert "serving 2 tests.runtime.wire.hanging_env:Hanging-v0 environments" in output, output
    # The role says so once, with every thread's stack: the stuck one is inside the environment's step.
    assert output.count("liveness fails (loop main has not beaten for ") == 1, output
    assert 'hanging_env.py", line' in output and "in step" in output, output


def start_roles(job: dict, roles: list[str], tmp_path, replicas: dict[str, int]) -> dict[str, tuple[int, object]]:
    import yaml

    config = tmp_path / f"{job['metadata']['name']}.yaml"
    config.write_text(yaml.safe_dump(job))
    identities = local_identities(
        job["metadata"]["name"], replicas, str(config), free_ports(ports_needed(replicas)), str(tmp_path)
    )
    started = {}
    for role in roles:
        identity = next(i for i in identities if i.role == role)
        process = subprocess.Popen(
            [sys.executable, "-m", "rljob.cli.main", "role", role],
            env={**os.environ, **identity.to_env()},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        started[f"{job['metadata']['name']}/{role}"] = (identity.metrics_port, process)
    return started


def test_every_role_left_idle_past_its_limit_stays_live(tmp_path):
    """Idle is alive: with no actor sending work, the env, gym rollout, llm rollout (generating and weight threads)
    and reward processes beat while they wait, and `/livez` answers 200 well past a 1 s limit."""
    import yaml

    probes = {"probes": {"livenessTimeoutSeconds": 1}}
    gym = yaml.safe_load((REPO / "examples" / "cartpole-ppo.yaml").read_text())
    gym["spec"]["roles"]["env"] |= probes
    gym["spec"]["roles"]["rollout"] |= probes
    llm = yaml.safe_load((REPO / "examples" / "grpo-tiny-arithmetic.yaml").read_text())
    llm["spec"].setdefault("roles", {})
    llm["spec"]["roles"]["rollout"] = {**llm["spec"]["roles"].get("rollout", {}), **probes}
    llm["spec"]["roles"]["reward"] = {**llm["spec"]["roles"].get("reward", {}), **probes}
    started = {
        **start_roles(gym, ["env", "rollout"], tmp_path, {"actor": 1, "rollout": 1, "env": 1, "reward": 0}),
        **start_roles(llm, ["rollout", "reward"], tmp_path, {"actor": 1, "rollout": 1, "env": 0, "reward": 1}),
    }
    try:
        for name, (port, process) in started.items():
            assert wait_for(port, 200, 120) == (200, "ok\n"), (name, process.poll())
        until = time.monotonic() + 3.0
        while time.monotonic() < until:
            for name, (port, _) in started.items():
                assert livez(port) == (200, "ok\n"), name
            time.sleep(0.2)
    finally:
        for _, process in started.values():
            process.kill()
            process.wait(timeout=30)
