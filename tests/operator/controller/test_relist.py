"""What happens in the gap of a re-list: a watch ended with 410 Gone, and kopf lists again.

kopf drops an index entry only on a DELETED event, and a re-list yields no DELETED event for what vanished
in the gap. The operator must not trust its pod index (or its job workers) past such a gap.
"""

from __future__ import annotations

import asyncio

import kmock

from rljob.operator.metrics import OperatorMetrics
from tests.operator.controller.conftest import (
    CARTPOLE_PODS,
    NS,
    PODS,
    RLJOBS,
    Cluster,
    eventually,
    operator_running,
    start_cartpole,
)
from tests.operator.controller.emulator import KubernetesApiEmulator


def _lists(kube: KubernetesApiEmulator) -> int:
    return sum(1 for r in list(kube) if r.action == kmock.action.LIST)


def _jobs_served(metrics: OperatorMetrics) -> float:
    return sum(s.value for f in metrics.registry.collect() for s in f.samples if s.name == "rljob_operator_rljobs")


async def test_a_pod_deleted_while_the_watch_was_gone_is_recreated(
    kube: KubernetesApiEmulator, cluster: Cluster
) -> None:
    async with operator_running(kube):
        await start_cartpole(cluster)
        before = cluster.uid("cp-env-1")
        lists = _lists(kube)
        kube.compact()  # every watch ends with 410 Gone...
        kube.delete_object(PODS, NS, "cp-env-1", grace_period_seconds=0)  # ...and this DELETED event is lost
        await eventually(lambda: _lists(kube) > lists, what="re-list")
        await eventually(
            lambda: "cp-env-1" in cluster.pods("cp") and cluster.uid("cp-env-1") != before, what="env 1 recreated"
        )
        assert cluster.status("cp")["roles"]["env"]["ready"] == 1  # the new pod does not run yet
        assert set(cluster.pods("cp")) == CARTPOLE_PODS


async def test_a_job_deleted_while_the_watch_was_gone_stops_its_worker(
    kube: KubernetesApiEmulator, cluster: Cluster
) -> None:
    async with operator_running(kube) as op:
        await start_cartpole(cluster)
        lists = _lists(kube)
        kube.compact()
        kube.delete_object(RLJOBS, NS, "cp")  # its DELETED event is lost with the watch
        await eventually(lambda: _lists(kube) > lists, what="re-list")
        await eventually(lambda: cluster.pods("cp") == {}, what="children collected")
        await eventually(lambda: _jobs_served(op.metrics) == 0, what="the worker stopped")
        creates = sum(1 for r in list(kube) if r.action == kmock.action.CREATE and r.resource == PODS)
        await asyncio.sleep(4.5)  # two resyncs (FAST: 2 s): a worker still alive would have recreated the pods
        assert sum(1 for r in list(kube) if r.action == kmock.action.CREATE and r.resource == PODS) == creates
        assert cluster.pods("cp") == {}
