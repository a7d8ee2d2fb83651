"""Per-job Prometheus series of the operator: conditions, desired rollout replicas, counted restarts."""

from __future__ import annotations

import logging
from datetime import UTC, datetime
from typing import Any

from rljob.operator.metrics import OperatorMetrics
from tests.operator.controller.conftest import (
    CARTPOLE_PODS,
    Cluster,
    cartpole_job,
    eventually,
    operator_running,
    progress_server,
)
from tests.operator.controller.emulator import KubernetesApiEmulator


def _series(metrics: OperatorMetrics, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    """Samples of one metric by their sorted labels."""
    return {
        tuple(sorted(sample.labels.items())): sample.value
        for family in metrics.registry.collect()
        for sample in family.samples
        if sample.name == name
    }


def _conditions(metrics: OperatorMetrics, job: str) -> set[tuple[str, str]]:
    """(type, reason) of the job's condition series."""
    return {
        (labels["type"], labels["reason"])
        for key, value in _series(metrics, "rljob_operator_rljob_condition").items()
        if (labels := dict(key))["rljob"] == job and value == 1
    }


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


async def test_true_conditions_are_series_that_go_when_the_condition_turns_false_or_the_job_is_deleted(
    kube: KubernetesApiEmulator, cluster: Cluster
) -> None:
    progress = {"step": 0, "totalSteps": 150, "updatedAt": _now(), "issue": ""}
    server = await progress_server(progress)
    try:
        async with operator_running(kube, progress_url=lambda pod, port: str(server.make_url("/progress"))) as op:
            cluster.create_job(
                cartpole_job(failurePolicy={"progressDeadlineSeconds": 2}, roles={"rollout": {"replicas": 2}})
            )
            await eventually(lambda: set(cluster.pods("cp")) >= CARTPOLE_PODS)
            cluster.run_all("cp")
            await eventually(lambda: ("Stalled", "ProgressDeadlineExceeded") in _conditions(op.metrics, "cp"))
            true_in_status = {
                (c["type"], c["reason"]) for c in cluster.status("cp")["conditions"] if c["status"] == "True"
            }
            assert _conditions(op.metrics, "cp") <= true_in_status
            key = (("namespace", cluster.namespace), ("rljob", "cp"))
            assert _series(op.metrics, "rljob_operator_rljob_rollout_replicas") == {key: 2.0}
            assert _series(op.metrics, "rljob_operator_rljob_actor_restarts_total") == {key: 0.0}

            progress.update(step=5, updatedAt=_now())
            await eventually(lambda: not any(t == "Stalled" for t, _ in _conditions(op.metrics, "cp")), what="gone")

            cluster.delete_job("cp")
            await eventually(lambda: not _series(op.metrics, "rljob_operator_rljob_condition"), what="no series")
            assert not _series(op.metrics, "rljob_operator_rljob_rollout_replicas")
    finally:
        await server.close()


async def test_a_job_pass_is_traced_from_its_event_to_its_pods_in_the_metrics_and_a_debug_line(
    kube: KubernetesApiEmulator, cluster: Cluster, caplog: Any
) -> None:
    caplog.set_level(logging.DEBUG, logger="rljob.operator.trace")
    async with operator_running(kube) as op:
        cluster.create_job(cartpole_job())
        await eventually(lambda: set(cluster.pods("cp")) == CARTPOLE_PODS, what="pods")
        await eventually(lambda: _series(op.metrics, "rljob_operator_job_pass_seconds_count").get(_stage("done")))
        counts = _series(op.metrics, "rljob_operator_job_pass_seconds_count")
        # One sample per pod created, and the pass that created them reached every stage on its way.
        assert counts[_stage("pod_created")] == len(CARTPOLE_PODS)
        assert counts[_stage("pods_created")] == 1
        for stage in ("slot", "planned", "status_written"):
            assert counts[_stage(stage)] >= 1
        sums = _series(op.metrics, "rljob_operator_job_pass_seconds_sum")
        # Later stages of a pass are later: on average the pods come after the plan.
        mean = {stage: sums[_stage(stage)] / counts[_stage(stage)] for stage in ("slot", "planned")}
        assert 0 <= mean["slot"] <= mean["planned"]
    lines = [r.getMessage() for r in caplog.records if r.name == "rljob.operator.trace"]
    start = f"rljob {cluster.namespace}/cp pass after its event: slot="
    assert any(line.startswith(start) and "pods_created=" in line for line in lines)


def _stage(stage: str) -> tuple[tuple[str, str], ...]:
    return (("stage", stage),)
