"""A hot standby does nothing: while kopf's peering pauses the operator, its job workers stay still too."""

from __future__ import annotations

import dataclasses
import datetime
import time

import kmock

from rljob.operator.metrics import OperatorMetrics
from tests.operator.controller.conftest import (
    CARTPOLE_PODS,
    FAST,
    NS,
    RLJOBS,
    Cluster,
    cartpole_job,
    eventually,
    operator_running,
)
from tests.operator.controller.emulator import KubernetesApiEmulator

PEERINGS = kmock.resource("kopf.dev", "v1", "kopfpeerings")


def sample(metrics: OperatorMetrics, name: str) -> float:
    return sum(s.value for f in metrics.registry.collect() for s in f.samples if s.name == name)


def peer(priority: int, lifetime: int = 60) -> dict:
    now = datetime.datetime.now(tz=datetime.UTC).isoformat()
    return {"priority": priority, "lifetime": lifetime, "lastseen": now}


async def test_a_paused_operator_leaves_the_jobs_to_the_active_one_and_resumes_after_it(
    kube: KubernetesApiEmulator, cluster: Cluster
) -> None:
    kube.create_object(
        PEERINGS, NS, {"apiVersion": "kopf.dev/v1", "kind": "KopfPeering", "metadata": {"name": "rljob"}}
    )
    async with operator_running(kube, peering="rljob", priority=10) as op:
        cluster.create_job(cartpole_job(ttlSecondsAfterFinished=4))
        await eventually(lambda: set(cluster.pods("cp")) == CARTPOLE_PODS, what="pods")
        cluster.run_all("cp")
        cluster.exit("cp-actor-0", 0)
        await eventually(lambda: cluster.phase("cp") == "Succeeded", what="Succeeded")
        # The worker now waits for the TTL on its own timer, not on a watch event.
        finished = time.time()

        # Two peering records: this operator's own (kopf's keep-alive) and a new one with a higher priority.
        await eventually(lambda: (kube.read_object(PEERINGS, NS, "rljob") or {}).get("status"), what="own record")
        kube.patch_object(PEERINGS, NS, "rljob", {"status": {"active-replica": peer(100)}})
        await eventually(lambda: sample(op.metrics, "rljob_operator_standby") == 1, what="standing by")

        # Evidence before the negative assertion: a worker pass ran after the TTL was due, and did nothing.
        due = finished + 4
        passes_after_due: list[float] = []

        def passed_after_due() -> bool:
            count = sample(op.metrics, "rljob_operator_standby_passes_total")
            if time.time() > due + 0.5 and not passes_after_due:
                passes_after_due.append(count)
            return bool(passes_after_due) and count > passes_after_due[0]

        await eventually(passed_after_due, timeout=20, what="a worker pass after the TTL, while standing by")
        assert cluster.job("cp") is not None  # the standby did not delete the job

        # The active replica goes away (its record expires): this one takes over and does what was due.
        kube.patch_object(PEERINGS, NS, "rljob", {"status": {"active-replica": peer(100, lifetime=0)}})
        await eventually(lambda: sample(op.metrics, "rljob_operator_standby") == 0, what="active again")
        await eventually(lambda: cluster.job("cp") is None, what="the TTL deletion, by the active operator")


async def test_an_operator_active_again_never_writes_the_status_it_had_before_standing_by(
    kube: KubernetesApiEmulator, cluster: Cluster
) -> None:
    """While this replica stood by, the active one moved the job on (here: failed it, after 3 restarts).
    Back in charge, this replica must start from the job as the server has it, not from its own memory."""
    kube.create_object(
        PEERINGS, NS, {"apiVersion": "kopf.dev/v1", "kind": "KopfPeering", "metadata": {"name": "rljob"}}
    )
    async with operator_running(kube, peering="rljob", priority=10) as op:
        cluster.create_job(cartpole_job())
        await eventually(lambda: set(cluster.pods("cp")) == CARTPOLE_PODS, what="pods")
        cluster.run_all("cp")
        await eventually(lambda: cluster.phase("cp") == "Running", what="Running")
        await eventually(lambda: (kube.read_object(PEERINGS, NS, "rljob") or {}).get("status"), what="own record")
        kube.patch_object(PEERINGS, NS, "rljob", {"status": {"active-replica": peer(100)}})
        await eventually(lambda: sample(op.metrics, "rljob_operator_standby") == 1, what="standing by")

        # The active replica's work, written as it would write it.
        failed = {
            "type": "Failed",
            "status": "True",
            "reason": "BackoffLimitExceeded",
            "message": "the actor group already restarted 3 times",
            "lastTransitionTime": "2026-01-01T00:00:00Z",
        }
        status = dict(cluster.status("cp"), phase="Failed", restarts=3, completionTime="2026-01-01T00:00:00Z")
        status["conditions"] = [c for c in status.get("conditions", []) if c["type"] != "Failed"] + [failed]
        kube.patch_status(RLJOBS, NS, "cp", status)

        kube.patch_object(PEERINGS, NS, "rljob", {"status": {"active-replica": peer(100, lifetime=0)}})
        await eventually(lambda: sample(op.metrics, "rljob_operator_standby") == 0, what="active again")
        cluster.exit("cp-actor-0", 1)  # something for a stale worker to act on: it would restart the group
        passes = sample(op.metrics, "rljob_operator_reconcile_duration_seconds_count")
        await eventually(
            lambda: sample(op.metrics, "rljob_operator_reconcile_duration_seconds_count") >= passes + 2,
            what="two passes after the actor failed",
        )
        assert cluster.phase("cp") == "Failed" and cluster.status("cp")["restarts"] == 3
        assert cluster.status("cp")["completionTime"] == "2026-01-01T00:00:00Z"


async def test_the_job_workers_stand_by_as_soon_as_the_peering_object_says_so_not_a_poll_later(
    kube: KubernetesApiEmulator, cluster: Cluster
) -> None:
    """kopf pauses the moment a peer with a higher priority shows up in the peering object; the job workers
    must stop with it, not after the gate's next poll (30 s here), or two replicas act meanwhile."""
    kube.create_object(
        PEERINGS, NS, {"apiVersion": "kopf.dev/v1", "kind": "KopfPeering", "metadata": {"name": "rljob"}}
    )
    config = dataclasses.replace(FAST, peering_poll_seconds=30)
    async with operator_running(kube, peering="rljob", priority=10, config=config) as op:
        await eventually(lambda: sample(op.metrics, "rljob_operator_standby") == 0, what="active")
        await eventually(lambda: (kube.read_object(PEERINGS, NS, "rljob") or {}).get("status"), what="own record")
        kube.patch_object(PEERINGS, NS, "rljob", {"status": {"active-replica": peer(100)}})
        await eventually(lambda: sample(op.metrics, "rljob_operator_standby") == 1, timeout=3, what="standing by")
        kube.patch_object(PEERINGS, NS, "rljob", {"status": {"active-replica": None}})
        await eventually(lambda: sample(op.metrics, "rljob_operator_standby") == 0, timeout=3, what="active again")


async def test_a_peer_in_any_served_namespace_puts_the_gate_on_standby(kube: KubernetesApiEmulator) -> None:
    from kubernetes_asyncio.client import Configuration

    from rljob.operator.client import KubeClient
    from rljob.operator.peering import PeeringGate

    for namespace in ("a", "b"):
        body = {"apiVersion": "kopf.dev/v1", "kind": "KopfPeering", "metadata": {"name": "rljob"}}
        kube.create_object(PEERINGS, namespace, body)
    kube.patch_object(PEERINGS, "a", "rljob", {"status": {"active-replica": peer(100)}})
    client = KubeClient(Configuration(host=str(kube.url).rstrip("/")))
    try:
        gate = PeeringGate(client, "rljob", "me", 10, clusterwide=False)
        await gate.refresh(["a", "b"])  # b, read after a, has no rival: a's still counts
        assert gate.paused and "active-replica" in (gate.reason or "")
    finally:
        await client.close()


async def test_a_standby_takes_over_when_the_dead_active_replicas_record_runs_out(
    kube: KubernetesApiEmulator, cluster: Cluster
) -> None:
    """The active replica was killed (no clean exit): its record stays until lastseen + lifetime. The standby
    must leave a job posted meanwhile alone until then, and create its pods as soon as the record runs out,
    without any other change to the peering object (kopf wakes itself at the deadline)."""
    kube.create_object(
        PEERINGS, NS, {"apiVersion": "kopf.dev/v1", "kind": "KopfPeering", "metadata": {"name": "rljob"}}
    )
    async with operator_running(kube, peering="rljob", priority=10) as op:
        await eventually(lambda: (kube.read_object(PEERINGS, NS, "rljob") or {}).get("status"), what="own record")
        lifetime = 6
        killed_at = time.time()  # the active replica's last renewal, right before it was killed
        kube.patch_object(PEERINGS, NS, "rljob", {"status": {"killed-replica": peer(100, lifetime=lifetime)}})
        await eventually(lambda: sample(op.metrics, "rljob_operator_standby") == 1, what="standing by")
        cluster.create_job(cartpole_job())
        await eventually(lambda: time.time() > killed_at + lifetime - 1, timeout=lifetime + 1, what="near the end")
        assert not cluster.pods("cp"), "the standby acted while the dead replica's record was live"
        await eventually(lambda: set(cluster.pods("cp")) == CARTPOLE_PODS, what="pods, by the new active replica")
        assert time.time() >= killed_at + lifetime
        assert sample(op.metrics, "rljob_operator_standby") == 0
