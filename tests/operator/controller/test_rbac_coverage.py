"""The chart's RBAC (checked equal to rljob/operator/rbac.py) grants every request the operator makes.

A job's whole life runs through the real operator against the emulator, with the gang PodGroup,
rollout scaling, a replaced pod, success and TTL deletion, then a code job's egress NetworkPolicy; every
request the emulator served is then mapped to its RBAC (group, resource, verb). Test-side writes go straight
to the emulator's store, so the request log holds the operator's calls only (kopf's included).
"""

from __future__ import annotations

from rljob.operator.rbac import required_access
from tests.operator.controller.conftest import (
    CARTPOLE_PODS,
    NETWORK_POLICIES,
    NS,
    Cluster,
    cartpole_job,
    code_job,
    eventually,
    operator_running,
)
from tests.operator.controller.emulator import KubernetesApiEmulator


def rbac_verb(request) -> str:
    action = str(getattr(request.action, "value", request.action)).lower()
    method = str(getattr(request.method, "value", request.method)).upper()
    if method == "PATCH":
        return "patch"
    if method == "PUT":
        return "update"
    return {"fetch": "get"}.get(action, action)


async def test_every_request_of_a_job_lifecycle_is_granted_by_rbac(kube: KubernetesApiEmulator, cluster: Cluster):
    async with operator_running(kube):
        cluster.create_job(cartpole_job(scheduling={"gang": "volcano", "queue": "q"}, ttlSecondsAfterFinished=1))
        await eventually(lambda: set(cluster.pods("cp")) == CARTPOLE_PODS, what="pods")
        cluster.run_all("cp")
        await eventually(lambda: cluster.phase("cp") == "Running", what="Running")
        env_uid = cluster.uid("cp-env-1")
        cluster.patch_job("cp", {"spec": {"roles": {"rollout": {"replicas": 2}}}})
        # A gym job takes a new rollout count through a controlled restart of every pod.
        await eventually(
            lambda: (
                "cp-rollout-1" in cluster.pods("cp")
                and (cluster.pods("cp").get("cp-env-1") or {}).get("metadata", {}).get("uid") not in (None, env_uid)
            ),
            what="restarted with two rollouts",
        )
        cluster.run_all("cp")
        cluster.exit("cp-env-1", 1)
        await eventually(
            lambda: (cluster.pods("cp").get("cp-env-1") or {}).get("status", {}).get("phase") not in ("Failed",),
            what="env replaced",
        )
        cluster.run_all("cp")
        cluster.exit("cp-actor-0", 0)
        await eventually(lambda: cluster.job("cp") is None, timeout=15, what="deleted after its TTL")
        # A job whose reward pods run code without network: its egress NetworkPolicy, gone when network is on.
        cluster.create_job(code_job())
        await eventually(lambda: kube.read_object(NETWORK_POLICIES, NS, "gc-reward-egress"), what="policy")
        cluster.patch_job("gc", {"spec": {"reward": {"sandbox": {"network": True}}}})
        await eventually(lambda: kube.read_object(NETWORK_POLICIES, NS, "gc-reward-egress") is None, what="deleted")

    requested = {
        (r.resource.group, r.resource.plural + (f"/{r.subresource}" if r.subresource else ""), rbac_verb(r))
        for r in kube
        if r.resource is not None and r.resource.plural
    }
    granted = {(a.group, a.resource, verb) for a in required_access(peering=False) for verb in a.verbs}
    assert {("", "pods", "create"), ("rljob.io", "rljobs/status", "patch"), ("rljob.io", "rljobs", "delete")} <= (
        requested
    )
    assert requested - granted == set(), f"add these to rljob/operator/rbac.py and the chart: {requested - granted}"
