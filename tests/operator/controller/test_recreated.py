"""A job deleted and created again under the same name (`kubectl delete && kubectl apply`, `replace --force`).

With background propagation the RLJob goes at once and the garbage collector removes its children later,
so the new job's first creates of its ConfigMap, Service, NetworkPolicy and membership ConfigMap meet the
old job's objects (409). The new job must not adopt them: they are gone a moment later.
"""

from __future__ import annotations

import kmock

from tests.operator.controller.conftest import (
    CONFIGMAPS,
    NETWORK_POLICIES,
    NS,
    SERVICES,
    Cluster,
    cartpole_job,
    code_job,
    eventually,
    new_emulator,
    operator_running,
)


def _owner_uid(raw: dict | None) -> str | None:
    if raw is None:
        return None
    return next((o["uid"] for o in raw["metadata"].get("ownerReferences") or [] if o.get("controller")), None)


async def test_a_job_recreated_under_its_name_gets_its_own_config_service_and_pods() -> None:
    kube = new_emulator(gc_seconds=None)  # the test plays the garbage collector, late as a real one may be
    cluster = Cluster(kube)
    async with kube, kmock.Server(kube), operator_running(kube):
        cluster.create_job(cartpole_job())
        await eventually(lambda: len(cluster.pods("cp")) == 4, what="the first job's pods")
        cluster.delete_job("cp")
        new = cluster.create_job(cartpole_job())
        uid = new["metadata"]["uid"]
        await eventually(lambda: cluster.phase("cp") == "Pending", what="the new job reconciled")
        assert _owner_uid(kube.read_object(CONFIGMAPS, NS, "cp-config")) != uid  # the old job's, still there
        kube.collect_garbage()  # now the old job's children go
        await eventually(lambda: _owner_uid(kube.read_object(CONFIGMAPS, NS, "cp-config")) == uid, what="new config")
        await eventually(lambda: _owner_uid(kube.read_object(SERVICES, NS, "cp")) == uid, what="new service")
        await eventually(
            lambda: len(cluster.pods("cp")) == 4 and all(_owner_uid(p) == uid for p in cluster.pods("cp").values()),
            what="the new job's pods",
        )
    kube.stop_timers()


async def test_a_recreated_llm_job_gets_its_own_membership_and_egress_policy() -> None:
    kube = new_emulator(gc_seconds=None)
    cluster = Cluster(kube)
    async with kube, kmock.Server(kube), operator_running(kube):
        cluster.create_job(code_job())
        await eventually(lambda: len(cluster.pods("gc")) == 3, what="the first job's pods")
        cluster.run_all("gc")
        await eventually(lambda: kube.read_object(CONFIGMAPS, NS, "gc-rollouts"), what="membership")
        assert kube.read_object(NETWORK_POLICIES, NS, "gc-reward-egress")
        cluster.delete_job("gc")
        new = cluster.create_job(code_job())
        uid = new["metadata"]["uid"]
        await eventually(lambda: cluster.status("gc").get("phase"), what="the new job reconciled")
        cluster.run_all("gc")  # the old pods, Ready: the new job must not list them
        await eventually(
            lambda: cluster.status("gc").get("observedGeneration") and cluster.status("gc")["roles"]["actor"],
            what="status",
        )
        kube.collect_garbage()
        await eventually(
            lambda: _owner_uid(kube.read_object(NETWORK_POLICIES, NS, "gc-reward-egress")) == uid, what="policy"
        )
        await eventually(lambda: len(cluster.pods("gc")) == 3, what="the new job's pods")
        cluster.run_all("gc")
        await eventually(
            lambda: _owner_uid(kube.read_object(CONFIGMAPS, NS, "gc-rollouts")) == uid, what="new membership"
        )
    kube.stop_timers()
