"""Quota-aware admission: a job whose pods do not all fit the namespace's ResourceQuotas creates none of them,
says which quota and how much in Ready (QuotaExceeded), and starts by itself once the quota allows it. A create
the server refuses anyway (another job took the quota meanwhile) deletes the pods made with it: never a partial
gang holding its nodes."""

from __future__ import annotations

import kmock

from tests.operator.controller.conftest import (
    CARTPOLE_PODS,
    NS,
    PODS,
    Cluster,
    cartpole_job,
    eventually,
    operator_running,
)
from tests.operator.controller.emulator import LIMIT_RANGES, RESOURCE_QUOTAS, KubernetesApiEmulator


def quota(name: str, **hard: str) -> dict:
    return {"apiVersion": "v1", "kind": "ResourceQuota", "metadata": {"name": name}, "spec": {"hard": hard}}


def ready(cluster: Cluster, job: str) -> dict:
    return next((c for c in cluster.status(job).get("conditions", []) if c["type"] == "Ready"), {})


async def test_a_job_over_quota_creates_no_pod_names_the_quota_and_starts_once_raised(
    kube: KubernetesApiEmulator, cluster: Cluster
) -> None:
    kube.create_object(RESOURCE_QUOTAS, NS, quota("pod-q", pods="3"))
    async with operator_running(kube):
        cluster.create_job(cartpole_job())
        condition = await eventually(
            lambda: (c := ready(cluster, "cp")).get("reason") == "QuotaExceeded" and c, what="QuotaExceeded"
        )
        assert "needs pods 4, quota pod-q allows 3 more" in condition["message"], condition
        assert cluster.pods("cp") == {}
        assert cluster.phase("cp") == "Pending"
        # The Event follows the status write that it explains.
        warning = await eventually(
            lambda: next((e for e in cluster.events("cp") if e["reason"] == "QuotaExceeded"), None), what="Event"
        )
        assert warning["type"] == "Warning" and "pod-q" in warning["message"]

        # Another team's pod takes one more: the message follows the quota's usage.
        kube.create_object(PODS, NS, {"metadata": {"name": "other"}, "spec": {"containers": [{"name": "c"}]}})
        await eventually(lambda: "allows 2 more" in ready(cluster, "cp").get("message", ""), what="usage followed")

        kube.patch_object(RESOURCE_QUOTAS, NS, "pod-q", {"spec": {"hard": {"pods": "5"}}})
        await eventually(lambda: set(cluster.pods("cp")) == CARTPOLE_PODS, what="created once the quota allows")
        await eventually(lambda: "Admitted" in cluster.reasons("cp"), what="Admitted Event")
        cluster.run_all("cp")
        await eventually(lambda: cluster.phase("cp") == "Running", what="Running")


async def test_limit_range_defaults_count_against_a_cpu_quota(kube: KubernetesApiEmulator, cluster: Cluster) -> None:
    # The CartPole pods name no cpu request: the namespace's LimitRange gives each container 500m.
    kube.create_object(
        LIMIT_RANGES,
        NS,
        {
            "metadata": {"name": "defaults"},
            "spec": {"limits": [{"type": "Container", "defaultRequest": {"cpu": "500m"}, "default": {"cpu": "1"}}]},
        },
    )
    kube.create_object(RESOURCE_QUOTAS, NS, quota("cpu-q", **{"requests.cpu": "1500m"}))
    async with operator_running(kube):
        cluster.create_job(cartpole_job())
        await eventually(
            lambda: "needs requests.cpu 2, quota cpu-q allows 1500m more" in ready(cluster, "cp").get("message", ""),
            what="QuotaExceeded on cpu",
        )
        assert cluster.pods("cp") == {}
        kube.patch_object(RESOURCE_QUOTAS, NS, "cpu-q", {"spec": {"hard": {"requests.cpu": "2"}}})
        await eventually(lambda: set(cluster.pods("cp")) == CARTPOLE_PODS, what="created once the quota allows")


async def test_a_create_refused_for_quota_anyway_deletes_the_pods_made_with_it(
    kube: KubernetesApiEmulator, cluster: Cluster
) -> None:
    # The check passed, then another job took the quota: the server refuses one pod of the four.
    refused = kmock.KubernetesError(
        403,
        "Forbidden",
        'pods "cp-env-1" is forbidden: exceeded quota: gpu-q, requested: pods=1, used: pods=8, limited: pods=8',
    )
    refusing = [True]
    kube["create", PODS, {"metadata": {"name": "cp-env-1"}}] << (lambda: refused if refusing[0] else NotImplemented)
    async with operator_running(kube):
        cluster.create_job(cartpole_job())
        condition = await eventually(
            lambda: (c := ready(cluster, "cp")).get("reason") == "QuotaExceeded" and c, what="QuotaExceeded"
        )
        assert "exceeded quota: gpu-q" in condition["message"] and "deleted again" in condition["message"]
        await eventually(lambda: cluster.pods("cp") == {}, what="the partial gang deleted")
        assert kube.objects[PODS, NS, "cp-actor-0"].history  # it was created, and is gone again

        refusing[0] = False
        await eventually(lambda: set(cluster.pods("cp")) == CARTPOLE_PODS, timeout=15, what="created after back-off")
