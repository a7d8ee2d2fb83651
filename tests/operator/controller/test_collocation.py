"""A collocated RLJob through the real operator: the rollout runs in the actor pod, so the job has no rollout pod;
the rollout counts as ready with its actor pod, and a failed actor pod (whichever of its processes failed) restarts
the group as usual."""

from __future__ import annotations

from typing import Any

from tests.operator.controller.conftest import (
    CONFIGMAPS,
    NS,
    Cluster,
    arithmetic_job,
    eventually,
    operator_running,
)
from tests.operator.controller.emulator import KubernetesApiEmulator

PODS = {"co-actor-0", "co-reward-0"}


def collocated_job(**failure_policy: Any) -> dict[str, Any]:
    manifest = arithmetic_job("co")
    manifest["spec"]["roles"]["rollout"]["collocated"] = True
    manifest["spec"]["rollout"]["weightSync"] = {"method": "ipc"}
    if failure_policy:
        manifest["spec"]["failurePolicy"] = failure_policy
    return manifest


async def start_running(cluster: Cluster, **failure_policy: Any) -> dict[str, str]:
    cluster.create_job(collocated_job(**failure_policy))
    await eventually(lambda: set(cluster.pods("co")) == PODS, what="the actor and reward pods")
    cluster.run_all("co")
    await eventually(lambda: cluster.phase("co") == "Running", what="Running")
    return {pod: cluster.uid(pod) for pod in PODS}


async def test_a_collocated_job_gets_no_rollout_pod_and_its_rollout_is_ready_with_the_actor_pod(
    kube: KubernetesApiEmulator, cluster: Cluster
) -> None:
    async with operator_running(kube) as op:
        cluster.create_job(collocated_job())
        await eventually(lambda: set(cluster.pods("co")) == PODS, what="the actor and reward pods")
        actor = cluster.pods("co")["co-actor-0"]
        ports = {p["name"] for p in actor["spec"]["containers"][0]["ports"]}
        assert {"rollout-data", "rollout-metrics"} <= ports
        cluster.run("co-reward-0")
        status = await eventually(lambda: cluster.status("co").get("roles", {}).get("reward", {}).get("ready") == 1
                                  and cluster.status("co"))  # fmt: skip
        assert status["roles"]["rollout"] == {"desired": 1, "ready": 0, "failed": 0}
        cluster.run("co-actor-0")
        await eventually(lambda: cluster.phase("co") == "Running", what="Running")
        status = cluster.status("co")
        assert status["roles"]["actor"]["ready"] == 1 and status["roles"]["rollout"]["ready"] == 1
        ready = next(c for c in status["conditions"] if c["type"] == "Ready")
        assert (ready["status"], ready["message"]) == ("True", "2 pods ready")
        # The scale subresource's selector: the pods that run the rollout replicas, not rollout pods that never exist.
        selector = dict(term.split("=") for term in status["rolloutSelector"].split(","))
        selected = [
            name for name, pod in cluster.pods("co").items() if selector.items() <= pod["metadata"]["labels"].items()
        ]
        assert selected == ["co-actor-0"]
        # No membership to keep: the actor pod's process keeps its rollout.
        assert kube.read_object(CONFIGMAPS, NS, "co-rollouts") is None
        assert set(cluster.pods("co")) == PODS
        assert not op.task.done()


async def test_a_failed_collocated_actor_pod_restarts_the_group_and_the_rest_keeps_running(
    kube: KubernetesApiEmulator, cluster: Cluster
) -> None:
    async with operator_running(kube):
        uids = await start_running(cluster)
        cluster.exit("co-actor-0", 1)
        await eventually(lambda: cluster.status("co").get("restarts") == 1, what="restarts+1")
        await eventually(
            lambda: (
                (cluster.pods("co").get("co-actor-0") or {}).get("metadata", {}).get("uid")
                not in (None, uids["co-actor-0"])
            ),
            what="a new actor pod",
        )
        assert cluster.uid("co-reward-0") == uids["co-reward-0"]
        assert set(cluster.pods("co")) == PODS  # still no rollout pod
        cluster.run_all("co")
        await eventually(lambda: cluster.phase("co") == "Running", what="Running again")
        assert "ActorFailed" in cluster.reasons("co")


async def test_a_collocated_rollout_stopped_on_its_configuration_fails_the_job_without_a_restart(
    kube: KubernetesApiEmulator, cluster: Cluster
) -> None:
    """The actor pod ends with the rollout's EXIT_FATAL_CONFIG (rljob/runtime/roles/collocated.py): InvalidConfig."""
    async with operator_running(kube):
        await start_running(cluster)
        cluster.exit("co-actor-0", 78)
        await eventually(lambda: cluster.phase("co") == "Failed", what="Failed")
        failed = next(c for c in cluster.status("co")["conditions"] if c["type"] == "Failed")
        assert failed["reason"] == "InvalidConfig" and cluster.status("co").get("restarts", 0) == 0


def failed_condition(cluster: Cluster) -> dict[str, Any]:
    return next(c for c in cluster.status("co")["conditions"] if c["type"] == "Failed")


async def test_a_collocated_rollout_past_max_replacements_fails_the_job_without_a_group_restart(
    kube: KubernetesApiEmulator, cluster: Cluster
) -> None:
    """The actor pod ends with EXIT_ROLLOUT_GAVE_UP (rljob/runtime/roles/collocated.py): as for a rollout pod of its
    own, BackoffLimitExceeded, and no new actor pod that would count the rollout's failures from zero."""
    async with operator_running(kube):
        uids = await start_running(cluster, maxReplacements=2)
        why = "rollout[0] exited with code 65: failed 3 times in a row; spec.failurePolicy.maxReplacements is 2"
        cluster.exit("co-actor-0", 79, message=why)
        await eventually(lambda: cluster.phase("co") == "Failed", what="Failed")
        failed = failed_condition(cluster)
        assert failed["reason"] == "BackoffLimitExceeded"
        assert f"rollout replica 0 (in actor pod co-actor-0): {why}" in failed["message"]
        status = cluster.status("co")
        assert status.get("restarts", 0) == 0 and status["roles"]["rollout"]["failed"] == 1
        assert "ActorFailed" not in cluster.reasons("co") and cluster.uid("co-actor-0") == uids["co-actor-0"]


async def test_a_collocated_rollout_that_fails_under_failjob_fails_the_job_with_podfailed(
    kube: KubernetesApiEmulator, cluster: Cluster
) -> None:
    async with operator_running(kube):
        await start_running(cluster, rollout="FailJob")
        cluster.exit(
            "co-actor-0", 79, message="rollout[0] exited with code 1: failed and spec.failurePolicy.rollout is FailJob"
        )
        await eventually(lambda: cluster.phase("co") == "Failed", what="Failed")
        failed = failed_condition(cluster)
        assert failed["reason"] == "PodFailed" and "failurePolicy.rollout is FailJob" in failed["message"]
        assert cluster.status("co").get("restarts", 0) == 0 and "ActorFailed" not in cluster.reasons("co")


async def test_a_running_collocated_job_stays_running_while_its_rollout_restarts_in_the_actor_pod(
    kube: KubernetesApiEmulator, cluster: Cluster
) -> None:
    async with operator_running(kube) as op:
        await start_running(cluster)
        # The actor pod's readiness covers the rollout beside it: while that restarts, the pod runs but is not Ready.
        cluster.run("co-actor-0", ready=False)
        await eventually(
            lambda: next(c for c in cluster.status("co")["conditions"] if c["type"] == "Ready")["status"] == "False",
            what="Ready False",
        )
        assert cluster.phase("co") == "Running"  # still training: Stalled keeps watching its progress
        assert cluster.status("co")["roles"]["rollout"]["ready"] == 0
        assert not op.task.done()
