"""Rollout autoscaling against the API emulator: the rollout count follows the trainer's scripted wait for
generations, within the bounds, through the scale subresource, and the actor is never restarted."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from tests.operator.controller.conftest import Cluster, arithmetic_job, eventually, operator_running, progress_server
from tests.operator.controller.emulator import KubernetesApiEmulator


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _rollouts(cluster: Cluster) -> set[str]:
    return {p for p in cluster.pods("ar") if p.startswith("ar-rollout-")}


async def test_rollout_replicas_follow_the_trainers_wait_within_bounds_and_never_restart_the_actor(
    kube: KubernetesApiEmulator, cluster: Cluster
) -> None:
    progress: dict[str, Any] = {"step": 0, "totalSteps": 100, "updatedAt": _now()}
    server = await progress_server(progress)
    job = arithmetic_job()
    job["spec"]["roles"]["rollout"]["autoscale"] = {
        "minReplicas": 1,
        "maxReplicas": 3,
        "targetTrainerWait": 0.2,
        "scaleUpCooldownSeconds": 0,
        "scaleDownCooldownSeconds": 0,
    }

    async def steps(first: int, wait: float, idle: float, count: int = 2) -> None:
        """Training steps reported by actor 0, each read by the operator before the next."""
        for n in range(first, first + count):
            progress.update(step=n, trainerWait=wait, rolloutIdle=idle, updatedAt=_now())
            await eventually(lambda n=n: cluster.status("ar")["progress"]["step"] == n, what=f"step {n} read")

    def replicas() -> int:
        return cluster.job("ar")["spec"]["roles"]["rollout"]["replicas"]

    try:
        async with operator_running(kube, progress_url=lambda pod, port: str(server.make_url("/progress"))):
            cluster.create_job(job)
            await eventually(lambda: _rollouts(cluster) == {"ar-rollout-0"}, what="pods")
            cluster.run_all("ar")
            await eventually(lambda: cluster.phase("ar") == "Running", timeout=30, what="Running")
            actor = cluster.uid("ar-actor-0")

            await steps(1, 0.6, 0.0)  # generation-bound: 3x the target, but at most doubling
            await eventually(lambda: replicas() == 2, what="scaled to 2")
            await eventually(lambda: _rollouts(cluster) == {"ar-rollout-0", "ar-rollout-1"}, what="rollout 1")
            cluster.run("ar-rollout-1")
            await eventually(lambda: "ScaledRollouts" in cluster.reasons("ar"), what="ScaledRollouts event")
            scaled = [e for e in cluster.events("ar") if e["reason"] == "ScaledRollouts"]
            assert scaled[0]["type"] == "Normal" and "1 -> 2 rollouts" in scaled[0]["message"]
            assert "waited 60%" in scaled[0]["message"]

            await steps(3, 0.6, 0.0)
            await eventually(lambda: replicas() == 3, what="scaled to maxReplicas")
            await eventually(lambda: len(_rollouts(cluster)) == 3, what="rollout 2")
            cluster.run("ar-rollout-2")
            status = cluster.status("ar")["autoscale"]
            assert (status["replicas"], status["lastScaleDirection"], status["lastScaleStep"]) == (3, "Up", 4)

            await steps(5, 0.9, 0.0)  # still waiting, but at maxReplicas
            assert replicas() == 3

            # Rollouts idle, the trainer hardly waits: one fewer, once the last 3 steps (averaged) say so.
            await steps(7, 0.01, 0.9, count=3)
            await eventually(lambda: replicas() == 2, what="scaled down to 2")
            await eventually(lambda: len(_rollouts(cluster)) == 2, what="rollout 2 deleted")
            assert _rollouts(cluster) == {"ar-rollout-0", "ar-rollout-1"}
            assert cluster.status("ar")["autoscale"]["lastScaleDirection"] == "Down"
            # Events are posted after the status write that decided the scaling.
            await eventually(lambda: cluster.reasons("ar").count("ScaledRollouts") == 3, what="the third event")
            assert [e["message"].split(": ")[-1] for e in cluster.events("ar") if e["reason"] == "ScaledRollouts"] == [
                "1 -> 2 rollouts",
                "2 -> 3 rollouts",
                "3 -> 2 rollouts",
            ]
            assert cluster.uid("ar-actor-0") == actor and cluster.status("ar")["restarts"] == 0
            assert "SpecChanged" not in cluster.reasons("ar")
    finally:
        await server.close()
