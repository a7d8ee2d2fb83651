"""An actor rank taken away by the cluster (drain, preemption, `kubectl delete pod`) while it runs.

A real server keeps the pod through its grace period (deletionTimestamp set, no longer Ready) and removes
it only when the kubelet is done. The whole actor group must restart, uncharged: a rank recreated alone
would join a broken group, its survivors would fail, and that failure would be charged to maxRestarts.
"""

from __future__ import annotations

import kmock

from tests.operator.controller.conftest import (
    NS,
    PODS,
    Cluster,
    cartpole_job,
    eventually,
    new_emulator,
    operator_running,
)
from tests.operator.controller.test_failure_policy import start_running

TWO_ACTORS = {"actor": {"replicas": 2}, "rollout": {"replicas": 1}, "env": {"replicas": 1}}


def _restarting(cluster: Cluster) -> dict:
    return next((c for c in cluster.status("cp").get("conditions", []) if c["type"] == "Restarting"), {})


async def test_a_drained_actor_rank_restarts_the_whole_group_uncharged() -> None:
    kube = new_emulator(kubelet_seconds=None)  # the test plays the kubelet: the rank terminates until told
    cluster = Cluster(kube)
    async with kube, kmock.Server(kube), operator_running(kube):
        uids = await start_running(cluster, cartpole_job(roles=TWO_ACTORS))
        kube.delete_object(PODS, NS, "cp-actor-1")  # the eviction API, a preemption, a hand delete
        cluster.run("cp-actor-1", ready=False)  # the kubelet stops its containers: not Ready any more
        await eventually(lambda: _restarting(cluster).get("reason") == "ActorDisrupted", what="ActorDisrupted")
        assert cluster.status("cp")["restarts"] == 0
        # The survivor goes too (the operator deletes it), and no rank starts beside a terminating one.
        await eventually(lambda: cluster.pods("cp")["cp-actor-0"]["metadata"].get("deletionTimestamp"), what="rank 0")
        kube.finish_termination(NS, "cp-actor-1")
        assert "cp-actor-1" not in cluster.pods("cp")
        kube.finish_termination(NS, "cp-actor-0")
        await eventually(
            lambda: all(cluster.uid(f"cp-actor-{i}") != uids[f"cp-actor-{i}"] for i in (0, 1)), what="new group"
        )
        cluster.run_all("cp")
        await eventually(lambda: cluster.phase("cp") == "Running", what="Running again")
        assert cluster.status("cp")["restarts"] == 0
        # Rollout and env pods were not touched.
        assert cluster.uid("cp-rollout-0") == uids["cp-rollout-0"] and cluster.uid("cp-env-0") == uids["cp-env-0"]


async def test_a_running_job_stays_running_while_an_actor_is_not_ready() -> None:
    kube = new_emulator()
    cluster = Cluster(kube)
    async with kube, kmock.Server(kube), operator_running(kube) as op:
        await start_running(cluster, cartpole_job(roles=TWO_ACTORS))
        cluster.run("cp-actor-1", ready=False)  # a readiness probe failing for a moment
        await eventually(
            lambda: next(c for c in cluster.status("cp")["conditions"] if c["type"] == "Ready")["status"] == "False",
            what="Ready False",
        )
        assert cluster.phase("cp") == "Running"
        assert op.task is not None


async def test_an_actor_stuck_terminating_on_a_lost_node_is_reported_and_the_job_is_watched_for_stalls() -> None:
    """The node is gone: its pods are not Ready, then evicted (deletionTimestamp) but never removed, since no
    kubelet confirms. The rest of the group is restarted, the stuck pod is reported, and Stalled still fires."""
    kube = new_emulator(lost_nodes={"lost"})
    cluster = Cluster(kube)
    async with kube, kmock.Server(kube), operator_running(kube):
        manifest = cartpole_job(roles=TWO_ACTORS, failurePolicy={"progressDeadlineSeconds": 3})
        await start_running(cluster, manifest)
        cluster.run("cp-actor-1", ready=False, node="lost")  # the node controller: NotReady
        kube.delete_object(PODS, NS, "cp-actor-1", grace_period_seconds=1)  # taint-based eviction
        await eventually(lambda: _restarting(cluster).get("reason") == "ActorDisrupted", what="ActorDisrupted")
        await eventually(lambda: "cp-actor-0" not in cluster.pods("cp"), what="the rest of the group deleted")

        def condition(kind: str) -> dict:
            return next((c for c in cluster.status("cp").get("conditions", []) if c["type"] == kind), {})

        await eventually(lambda: condition("Ready").get("reason") == "PodStuckTerminating", what="reported")
        assert "cp-actor-1" in condition("Ready")["message"] and "lost" in condition("Ready")["message"]
        await eventually(lambda: "PodStuckTerminating" in cluster.reasons("cp"), what="the Event")
        await eventually(lambda: condition("Stalled").get("status") == "True", what="Stalled while Restarting")
        assert cluster.phase("cp") == "Restarting" and cluster.status("cp")["restarts"] == 0
        # Someone confirms the node is gone for good and force-deletes the pod: the new group starts.
        kube.delete_object(PODS, NS, "cp-actor-1", grace_period_seconds=0)
        await eventually(lambda: {"cp-actor-0", "cp-actor-1"} <= set(cluster.pods("cp")), what="new group")
    kube.stop_timers()
