"""The operator keeps each job's ingress NetworkPolicy: made before the pods, gone when the spec switches it off."""

from __future__ import annotations

from tests.operator.controller.conftest import (
    CARTPOLE_PODS,
    NETWORK_POLICIES,
    NS,
    Cluster,
    cartpole_job,
    eventually,
    operator_running,
)
from tests.operator.controller.emulator import KubernetesApiEmulator


async def test_the_policy_is_made_with_the_job_and_deleted_when_switched_off(
    kube: KubernetesApiEmulator, cluster: Cluster
) -> None:
    async with operator_running(kube):
        cluster.create_job(cartpole_job())
        await eventually(lambda: set(cluster.pods("cp")) == CARTPOLE_PODS, what="pods")
        policy = kube.read_object(NETWORK_POLICIES, NS, "cp-isolation")
        assert policy["spec"]["podSelector"] == {"matchLabels": {"rljob.io/job": "cp"}}
        assert policy["metadata"]["ownerReferences"][0]["uid"] == cluster.job("cp")["metadata"]["uid"]
        # Made before any pod: no pod of the job is ever open to other jobs.
        assert int(policy["metadata"]["resourceVersion"]) < min(
            int(p["metadata"]["resourceVersion"]) for p in cluster.pods("cp").values()
        )
        cluster.patch_job("cp", {"spec": {"isolation": {"networkPolicy": False}}})
        await eventually(lambda: kube.read_object(NETWORK_POLICIES, NS, "cp-isolation") is None, what="deleted")
