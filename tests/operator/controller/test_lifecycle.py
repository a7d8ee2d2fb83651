"""An RLJob from creation to success, driven through the real operator against the API emulator."""

from __future__ import annotations

from tests.operator.controller.conftest import (
    CONFIGMAPS,
    NS,
    SERVICES,
    Cluster,
    cartpole_job,
    eventually,
    operator_running,
)
from tests.operator.controller.emulator import KubernetesApiEmulator

CHILD_PODS = {"cp-actor-0", "cp-rollout-0", "cp-env-0", "cp-env-1"}


async def test_create_makes_every_child_at_once_then_succeeds_and_cleans_up(
    kube: KubernetesApiEmulator, cluster: Cluster
) -> None:
    async with operator_running(kube):
        job = cluster.create_job(cartpole_job())
        pods = await eventually(lambda: set(cluster.pods("cp")) == CHILD_PODS and cluster.pods("cp"))
        for pod in pods.values():
            owner = pod["metadata"]["ownerReferences"][0]
            assert owner["uid"] == job["metadata"]["uid"] and owner["controller"] is True
        assert kube.read_object(CONFIGMAPS, NS, "cp-config") and kube.read_object(SERVICES, NS, "cp")
        await eventually(lambda: cluster.phase("cp") == "Pending", what="Pending")

        cluster.run_all("cp")
        await eventually(lambda: cluster.phase("cp") == "Running", what="Running")
        status = cluster.status("cp")
        assert status["roles"]["env"] == {"desired": 2, "ready": 2, "failed": 0}
        assert status["startTime"]

        cluster.exit("cp-actor-0", 0)
        await eventually(lambda: cluster.phase("cp") == "Succeeded", what="Succeeded")
        await eventually(lambda: set(cluster.pods("cp")) == {"cp-actor-0"}, what="cleanup")
        status = cluster.status("cp")
        assert status["completionTime"] and status["progress"]["step"] == 150
        assert {"Running", "TrainingCompleted"} <= set(cluster.reasons("cp"))
