"""A running job whose actor completes no step within progressDeadlineSeconds is Stalled, and says why."""

from __future__ import annotations

import logging
from datetime import UTC, datetime

from rljob.runtime.wire.deadlines import LateReplicas
from tests.operator.controller.conftest import (
    CARTPOLE_PODS,
    Cluster,
    cartpole_job,
    eventually,
    operator_running,
    progress_server,
)
from tests.operator.controller.emulator import KubernetesApiEmulator

ISSUE = "step 1: weight sync: rollout(s) [0] did not accept weights version 0 (waited 20s)"


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


async def test_a_job_without_steps_is_stalled_with_the_actors_reason_and_recovers_when_steps_resume(
    kube: KubernetesApiEmulator, cluster: Cluster
) -> None:
    progress = {"step": 0, "totalSteps": 150, "updatedAt": _now(), "issue": ISSUE}
    server = await progress_server(progress)

    def stalled() -> dict:
        return next((c for c in cluster.status("cp").get("conditions", []) if c["type"] == "Stalled"), {})

    try:
        async with operator_running(kube, progress_url=lambda pod, port: str(server.make_url("/progress"))):
            cluster.create_job(cartpole_job(failurePolicy={"progressDeadlineSeconds": 2}))
            await eventually(lambda: set(cluster.pods("cp")) == CARTPOLE_PODS)
            cluster.run_all("cp")
            await eventually(lambda: stalled().get("status") == "True", what="Stalled")
            condition = stalled()
            assert condition["reason"] == "ProgressDeadlineExceeded"
            assert "progressDeadlineSeconds: 2" in condition["message"]
            assert f"the actor reports: {ISSUE}" in condition["message"]
            assert cluster.status("cp")["progress"]["issue"] == ISSUE
            assert cluster.phase("cp") == "Running"  # onStalled: Report keeps it running
            # The Event is posted after the status write that set the condition: wait for it too.
            await eventually(lambda: "Stalled" in cluster.reasons("cp"), what="Stalled event")
            stalled_events = [e for e in cluster.events("cp") if e["reason"] == "Stalled"]
            assert stalled_events and stalled_events[0]["type"] == "Warning"
            assert ISSUE in stalled_events[0]["message"]

            progress.update(step=5, updatedAt=_now(), issue="")
            await eventually(lambda: stalled().get("status") == "False", what="recovered")
            assert stalled()["reason"] == "Progressing"
            await eventually(lambda: "Progressing" in cluster.reasons("cp"), what="recovery event")
    finally:
        await server.close()


async def test_on_stalled_fail_job_fails_it_with_reason_stalled(kube: KubernetesApiEmulator, cluster: Cluster) -> None:
    server = await progress_server({"step": 3, "totalSteps": 150, "updatedAt": _now(), "issue": ISSUE})
    try:
        async with operator_running(kube, progress_url=lambda pod, port: str(server.make_url("/progress"))):
            cluster.create_job(cartpole_job(failurePolicy={"progressDeadlineSeconds": 2, "onStalled": "FailJob"}))
            await eventually(lambda: set(cluster.pods("cp")) == CARTPOLE_PODS)
            cluster.run_all("cp")
            await eventually(lambda: cluster.phase("cp") == "Failed", what="Failed")
            failed = next(c for c in cluster.status("cp")["conditions"] if c["type"] == "Failed")
            assert failed["reason"] == "Stalled" and "onStalled: FailJob" in failed["message"]
            assert "at step 3 of 150" in failed["message"]
    finally:
        await server.close()


async def test_a_stalled_job_names_the_replica_that_does_not_answer(
    kube: KubernetesApiEmulator, cluster: Cluster
) -> None:
    # What the actor's /progress says while its only reward replica is frozen: the issue and lateReplicas.
    clock = [100.0]
    late = LateReplicas(logging.getLogger("test.stalled"), clock=lambda: clock[0])
    late.late("reward-0", since=55.0, moved_to=[])
    progress = {"step": 7, "totalSteps": 150, "updatedAt": _now(), "issue": late.issue()}
    progress["lateReplicas"] = [{"replica": name, "seconds": s} for name, s in late.snapshot()]
    server = await progress_server(progress)

    def stalled() -> dict:
        return next((c for c in cluster.status("cp").get("conditions", []) if c["type"] == "Stalled"), {})

    try:
        async with operator_running(kube, progress_url=lambda pod, port: str(server.make_url("/progress"))):
            cluster.create_job(cartpole_job(failurePolicy={"progressDeadlineSeconds": 2}))
            await eventually(lambda: set(cluster.pods("cp")) == CARTPOLE_PODS)
            cluster.run_all("cp")
            await eventually(lambda: stalled().get("status") == "True", what="Stalled")
            message = stalled()["message"]
            assert "at step 7 of 150" in message and "no reason" not in message
            assert message.endswith(
                "the actor reports: reward-0 has not answered for 45 s (no other replica can take its work: waiting)"
            ), message
    finally:
        await server.close()
