import json
import logging
import math
import urllib.error
import urllib.request

import pytest
import torch

from rljob.runtime.records.metrics import RoleMetrics, RunMetrics, read_metrics
from rljob.runtime.wire.role_http import ProgressTracker, RoleHTTPServer


def get(port: int, path: str) -> tuple[int, str, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as response:
            return response.status, response.headers["Content-Type"], response.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.headers["Content-Type"], e.read().decode()


def test_run_metrics_write_jsonl_tensorboard_and_a_png_curve(tmp_path):
    metrics = RunMetrics(tmp_path, tensorboard=True)
    started = metrics.start_time
    for step in range(1, 4):
        metrics.log(
            step,
            {
                "env_steps": step * 256,
                "return_mean": 10.0 * step if step != 2 else None,
                "policy_loss": torch.tensor(-0.01 * step),
                "value_loss": 1.0 / step,
                "explained_variance": math.nan,
            },
        )
    curve = metrics.close()
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]  # strict JSON: NaN became null
    assert [r["step"] for r in records] == [1, 2, 3]
    assert records[0]["env_steps"] == 256 and records[2]["return_mean"] == 30.0
    assert records[1]["return_mean"] is None and records[0]["explained_variance"] is None
    assert records[0]["policy_loss"] == pytest.approx(-0.01)
    assert all(r["wall_time"] >= 0 for r in records)
    # Unix time of each record: training started at timestamp - wall_time, the same for every record.
    assert all(abs(r["timestamp"] - r["wall_time"] - started) < 0.002 for r in records)
    assert curve == tmp_path / "curve.png"
    assert curve.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert list((tmp_path / "tb").glob("events.out.tfevents.*"))


def test_read_metrics_ignores_a_torn_last_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n{"step": 2, "ret')
    assert read_metrics(path) == [{"step": 1}]


def test_role_http_server_serves_healthz_metrics_and_progress():
    role_metrics = RoleMetrics(job="cartpole", role="actor", replica=0)
    tracker = ProgressTracker(total_steps=150)
    with RoleHTTPServer(0, role_metrics.registry, host="127.0.0.1") as server:
        assert get(server.port, "/healthz")[0] == 503
        server.mark_ready()
        assert get(server.port, "/healthz")[0] == 200

        assert get(server.port, "/progress")[0] == 404  # no provider: not the progress-reporting replica
        server.set_progress_provider(tracker.snapshot)
        tracker.update(step=7, reward_mean=42.5)
        tracker.update(step=8, reward_mean=None, entropy=0.21)  # no finished episode: keep the last reward
        status, content_type, body = get(server.port, "/progress")
        progress = json.loads(body)
        assert status == 200 and content_type == "application/json"
        assert set(progress) == {"step", "totalSteps", "rewardMean", "updatedAt", "entropy", "mismatchKl"}
        assert (progress["step"], progress["totalSteps"], progress["rewardMean"]) == (8, 150, 42.5)
        assert (progress["entropy"], progress["mismatchKl"]) == (0.21, None)  # a gym actor has no mismatch
        assert progress["updatedAt"].endswith("Z") and "T" in progress["updatedAt"]

        role_metrics.observe(
            {
                "step": 8,
                "policy_loss": -0.02,
                "return_mean": 42.5,
                "env_steps_per_s": 5000.0,
                "staleness_mean": 1.0,
                "mismatch_kl": 0.003,
                "episodes": 3,
                "time_rollout_s": 0.25,
                "time_train_s": 0.5,
            }
        )
        status, content_type, text = get(server.port, "/metrics")
        assert status == 200 and content_type.startswith("text/plain")
        assert 'rljob_role_info{job="cartpole",replica="0",role="actor"} 1.0' in text
        assert "rljob_train_step 8.0" in text
        assert "rljob_policy_loss -0.02" in text
        assert "rljob_episodic_return 42.5" in text
        assert "rljob_env_steps_per_second 5000.0" in text
        assert "rljob_policy_staleness 1.0" in text
        assert "rljob_mismatch_kl 0.003" in text
        assert "rljob_episodes_total 3.0" in text
        assert 'rljob_step_phase_seconds{phase="train"} 0.5' in text
        assert 'rljob_phase_seconds_total{phase="rollout"} 0.25' in text

        assert get(server.port, "/nope")[0] == 404


def test_llm_actor_serves_the_autoscaling_signal_in_progress_and_as_gauges():
    role_metrics = RoleMetrics(job="grpo", role="actor", replica=0)
    tracker = ProgressTracker(total_steps=20)
    with RoleHTTPServer(0, role_metrics.registry, host="127.0.0.1") as server:
        server.set_progress_provider(tracker.snapshot)
        tracker.update(step=3, reward_mean=0.5, accuracy=0.25, trainer_wait=0.6, rollout_idle=0.05)
        progress = json.loads(get(server.port, "/progress")[2])
        assert (progress["trainerWait"], progress["rolloutIdle"]) == (0.6, 0.05)
        role_metrics.observe({"step": 3, "trainer_wait": 0.6, "rollout_idle": 0.05})
        text = get(server.port, "/metrics")[2]
        assert "rljob_trainer_wait_ratio 0.6" in text
        assert "rljob_rollout_idle_ratio 0.05" in text


def test_load_shares_are_the_trainers_wait_and_the_rollouts_unused_time():
    from rljob.runtime.llm.actor import load_shares

    # A 10 s step: the trainer waited 4 s; two rollouts generated 5 s between them out of 20 s.
    assert load_shares(4.0, 5.0, 2, 10.0) == {"trainer_wait": 0.4, "rollout_idle": 0.75}
    # Chunks generated partly during the previous step can add up past the step: never below 0 idle.
    assert load_shares(12.0, 30.0, 2, 10.0) == {"trainer_wait": 1.0, "rollout_idle": 0.0}


def test_a_collocated_actors_healthz_is_ready_only_while_the_rollout_beside_it_answers(monkeypatch):
    """The pod's readiness probe asks the actor: it must not say Ready while the rollout loads or restarts."""
    from prometheus_client import CollectorRegistry

    from rljob.api import load_job_file
    from rljob.launch.local import free_ports
    from rljob.runtime.wire.context import RoleContext
    from rljob.runtime.wire.health import RoleHealth
    from rljob.runtime.wire.identity import COLLOCATED_ROLLOUT_HEALTH_ENV, pod_identity
    from tests.conftest import REPO

    rollout = RoleHTTPServer(0, CollectorRegistry(), host="127.0.0.1").start()
    url = f"http://127.0.0.1:{rollout.port}/healthz"
    monkeypatch.setenv(COLLOCATED_ROLLOUT_HEALTH_ENV, url)
    (port,) = free_ports(1)
    identity = pod_identity("co", "ns", "actor", 0, {"actor": 1, "rollout": 1}, port, collocated_rollout=True)
    job = load_job_file(str(REPO / "examples" / "grpo-tiny-arithmetic.yaml"))
    health = RoleHealth(RoleContext(identity=identity, job=job, log=logging.getLogger("test")), counters={})
    try:
        health.ready()
        assert get(port, "/healthz")[::2] == (503, f"waiting for the rollout beside it ({url})\n")
        rollout.mark_ready()
        assert get(port, "/healthz")[::2] == (200, "ok\n")
        rollout.stop()  # the rollout died: the pod is not ready until its successor serves
        assert get(port, "/healthz")[0] == 503
    finally:
        health.close()


def test_a_healthz_with_no_other_process_to_wait_for_is_ready_once_marked():
    with RoleHTTPServer(0, RoleMetrics(job="j", role="reward", replica=0).registry, host="127.0.0.1") as server:
        assert get(server.port, "/healthz")[::2] == (503, "starting\n")
        server.also_ready_when(lambda: True, "nothing")
        server.mark_ready()
        assert get(server.port, "/healthz")[::2] == (200, "ok\n")


def test_rollout_restarts_are_a_gauge_where_no_metrics_file_is_written():
    """In a pod the step records reach no file: a collocated rollout restarted in place shows on /metrics."""
    role_metrics = RoleMetrics(job="co", role="actor", replica=0)
    role_metrics.observe({"step": 3, "rollout_restarts": 2})
    with RoleHTTPServer(0, role_metrics.registry, host="127.0.0.1") as server:
        body = get(server.port, "/metrics")[2]
    assert "\nrljob_rollout_restarts 2.0\n" in body


def test_a_collocated_actor_on_a_gpu_waits_for_the_rollouts_engine_before_it_takes_gpu_memory(monkeypatch):
    """vLLM sizes its share from the free memory it measures while it starts: the actor loads after, not during."""
    import threading

    from prometheus_client import CollectorRegistry

    from rljob.api import load_job_file
    from rljob.runtime.wire.context import RoleContext
    from rljob.runtime.wire.health import wait_for_collocated_rollout
    from rljob.runtime.wire.identity import COLLOCATED_ROLLOUT_HEALTH_ENV, pod_identity
    from tests.conftest import REPO

    identity = pod_identity("co", "ns", "actor", 0, {"actor": 1, "rollout": 1}, 0, collocated_rollout=True)
    job = load_job_file(str(REPO / "examples" / "grpo-tiny-arithmetic.yaml"))
    context = RoleContext(identity=identity, job=job, log=logging.getLogger("test"))
    monkeypatch.delenv(COLLOCATED_ROLLOUT_HEALTH_ENV, raising=False)
    wait_for_collocated_rollout(context)  # no rollout beside it: nothing to wait for

    rollout = RoleHTTPServer(0, CollectorRegistry(), host="127.0.0.1").start()
    monkeypatch.setenv(COLLOCATED_ROLLOUT_HEALTH_ENV, f"http://127.0.0.1:{rollout.port}/healthz")
    try:
        ended: list[BaseException | None] = []

        def wait() -> None:
            try:
                wait_for_collocated_rollout(context, 0.05)
                ended.append(None)
            except BaseException as exc:
                ended.append(exc)

        waiting = threading.Thread(target=wait)
        waiting.start()
        waiting.join(timeout=0.5)
        assert waiting.is_alive()  # its engine is still starting
        rollout.mark_ready()
        waiting.join(timeout=10)
        assert ended == [None]  # returned, as the engine answered ready
    finally:
        rollout.stop()

    context.stop.set()  # told to stop while the rollout is down (it may never start): no wait for ever
    with pytest.raises(InterruptedError, match="waiting for the collocated rollout"):
        wait_for_collocated_rollout(context, 0.05)
