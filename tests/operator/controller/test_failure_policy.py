"""Failure policy: which pod failure leads to which reaction, and what is charged to maxRestarts."""

from __future__ import annotations

import kmock

from rljob.operator.metrics import OperatorMetrics
from tests.operator.controller.conftest import (
    NS,
    PODS,
    Cluster,
    cartpole_job,
    eventually,
    new_emulator,
    operator_running,
)
from tests.operator.controller.emulator import KubernetesApiEmulator


async def start_running(cluster: Cluster, manifest: dict) -> dict[str, str]:
    cluster.create_job(manifest)
    name = manifest["metadata"]["name"]
    await eventually(lambda: len(cluster.pods(name)) == sum(_replicas(manifest).values()), what="all pods")
    cluster.run_all(name)
    await eventually(lambda: cluster.phase(name) == "Running", what="Running")
    return {pod: cluster.uid(pod) for pod in cluster.pods(name)}


def _replicas(manifest: dict) -> dict[str, int]:
    roles = manifest["spec"]["roles"]
    return {role: roles.get(role, {}).get("replicas", 1 if role in ("actor", "rollout") else 0) for role in roles}


async def test_rollout_and_env_failures_replace_only_that_pod_and_training_continues(
    kube: KubernetesApiEmulator, cluster: Cluster
) -> None:
    async with operator_running(kube):
        uids = await start_running(cluster, cartpole_job())
        cluster.exit("cp-rollout-0", 137, "OOMKilled")
        cluster.exit("cp-env-1", 1)
        await eventually(
            lambda: cluster.uid("cp-rollout-0") != uids["cp-rollout-0"] and cluster.uid("cp-env-1") != uids["cp-env-1"],
            what="replacements",
        )
        assert cluster.uid("cp-actor-0") == uids["cp-actor-0"] and cluster.uid("cp-env-0") == uids["cp-env-0"]
        status = await eventually(lambda: cluster.status("cp")["roles"]["env"]["failed"] == 1 and cluster.status("cp"))
        assert status["roles"]["rollout"]["failed"] == 1
        assert status["restarts"] == 0 and status["phase"] == "Running"
        await eventually(lambda: cluster.reasons("cp").count("PodFailed") == 2, what="events")


async def test_a_replica_that_keeps_failing_is_replaced_with_backoff_then_fails_the_job(
    kube: KubernetesApiEmulator, cluster: Cluster
) -> None:
    """The env id is wrong, say: env replica 0 fails every time. Replaced twice (after 1 s, then 2 s),
    reported as a crash loop, and the third failure fails the job instead of looping forever."""

    def ready_condition() -> dict:
        return next(c for c in cluster.status("cp")["conditions"] if c["type"] == "Ready")

    async with operator_running(kube):
        uids = await start_running(cluster, cartpole_job(failurePolicy={"maxReplacements": 2}))
        seen = [uids["cp-env-0"]]
        for attempt in (1, 2):
            cluster.exit("cp-env-0", 1)
            await eventually(
                lambda: "cp-env-0" in cluster.pods("cp") and cluster.uid("cp-env-0") not in seen,
                what=f"replacement {attempt}",
            )
            seen.append(cluster.uid("cp-env-0"))
        await eventually(lambda: ready_condition()["reason"] == "CrashLoopBackOff", what="crash loop reported")
        assert "env replica 0 (cp-env-0) failed 2 times in a row" in ready_condition()["message"]
        assert cluster.status("cp")["replicaFailures"]["env-0"]["count"] == 2
        cluster.exit("cp-env-0", 1)
        await eventually(lambda: cluster.phase("cp") == "Failed", what="Failed")
        status = cluster.status("cp")
        failed = next(c for c in status["conditions"] if c["type"] == "Failed")
        assert failed["reason"] == "BackoffLimitExceeded"
        assert "env replica 0" in failed["message"] and "spec.failurePolicy.maxReplacements is 2" in failed["message"]
        assert status["roles"]["env"]["failed"] == 3 and status["restarts"] == 0
        assert cluster.uid("cp-env-0") == seen[-1]  # no fourth env pod: the failed one stays for its logs
        reasons = cluster.reasons("cp")
        assert reasons.count("PodFailed") == 2 and "CrashLoopBackOff" in reasons


async def test_actor_failure_restarts_whole_group(kube: KubernetesApiEmulator, cluster: Cluster) -> None:
    async with operator_running(kube):
        manifest = cartpole_job(roles={"actor": {"replicas": 2}, "rollout": {"replicas": 1}, "env": {"replicas": 1}})
        uids = await start_running(cluster, manifest)
        cluster.exit("cp-actor-1", 1)
        await eventually(lambda: cluster.status("cp").get("restarts") == 1, what="restarts+1")
        await eventually(
            lambda: all(cluster.uid(f"cp-actor-{i}") != uids[f"cp-actor-{i}"] for i in (0, 1)), what="new actor group"
        )
        assert cluster.uid("cp-rollout-0") == uids["cp-rollout-0"]  # the rest of the job keeps running
        assert cluster.uid("cp-env-0") == uids["cp-env-0"]
        await eventually(lambda: cluster.phase("cp") == "Starting", what="Starting")
        cluster.run_all("cp")
        await eventually(lambda: cluster.phase("cp") == "Running", what="Running again")
        await eventually(lambda: "ActorFailed" in cluster.reasons("cp"), what="events")
        assert cluster.status("cp")["restarts"] == 1


async def test_evictions_are_replaced_without_charging_the_budget(
    kube: KubernetesApiEmulator, cluster: Cluster
) -> None:
    async with operator_running(kube):
        uids = await start_running(cluster, cartpole_job(failurePolicy={"maxRestarts": 0}))
        cluster.evict("cp-actor-0")
        cluster.evict("cp-env-0")
        await eventually(
            lambda: cluster.uid("cp-actor-0") != uids["cp-actor-0"] and cluster.uid("cp-env-0") != uids["cp-env-0"],
            what="replaced after eviction",
        )
        status = cluster.status("cp")
        assert status["restarts"] == 0 and status["phase"] != "Failed"
        assert status["roles"]["env"]["failed"] == 0
        await eventually(lambda: {"ActorDisrupted", "PodDisrupted"} <= set(cluster.reasons("cp")), what="events")


async def test_failures_beyond_max_restarts_fail_the_job(kube: KubernetesApiEmulator, cluster: Cluster) -> None:
    async with operator_running(kube):
        uids = await start_running(cluster, cartpole_job(failurePolicy={"maxRestarts": 1}))
        cluster.exit("cp-actor-0", 1)
        await eventually(lambda: cluster.uid("cp-actor-0") != uids["cp-actor-0"], what="first restart")
        cluster.run("cp-actor-0")
        cluster.exit("cp-actor-0", 2)
        await eventually(lambda: cluster.phase("cp") == "Failed", what="Failed")
        status = cluster.status("cp")
        failed = next(c for c in status["conditions"] if c["type"] == "Failed")
        assert failed["reason"] == "BackoffLimitExceeded" and "exit code 2" in failed["message"]
        assert status["restarts"] == 1 and status["completionTime"]
        # Running pods are deleted; the failed actor stays for `kubectl logs`.
        await eventually(lambda: set(cluster.pods("cp")) == {"cp-actor-0"}, what="cleanup")
        await eventually(lambda: "BackoffLimitExceeded" in cluster.reasons("cp"), what="events")


async def test_actor_fail_job_policy_fails_at_the_first_actor_failure_without_a_restart(
    kube: KubernetesApiEmulator, cluster: Cluster
) -> None:
    async with operator_running(kube):
        manifest = cartpole_job(
            roles={"actor": {"replicas": 2}, "rollout": {"replicas": 1}, "env": {"replicas": 1}},
            failurePolicy={"actor": "FailJob", "maxRestarts": 3},
        )
        uids = await start_running(cluster, manifest)
        cluster.exit("cp-actor-1", 1)
        await eventually(lambda: cluster.phase("cp") == "Failed", what="Failed")
        status = cluster.status("cp")
        failed = next(c for c in status["conditions"] if c["type"] == "Failed")
        assert failed["reason"] == "PodFailed" and "failurePolicy.actor is FailJob" in failed["message"]
        assert status["restarts"] == 0  # maxRestarts is not consulted: FailJob means no restart at all
        # The failed actor stays for its logs, never replaced; every running pod is cleaned up.
        await eventually(lambda: set(cluster.pods("cp")) == {"cp-actor-1"}, what="cleanup")
        assert cluster.uid("cp-actor-1") == uids["cp-actor-1"]
        assert "ActorFailed" not in cluster.reasons("cp")


async def test_invalid_spec_fails_that_job_and_the_operator_serves_the_others(
    kube: KubernetesApiEmulator, cluster: Cluster
) -> None:
    async with operator_running(kube) as op:
        cluster.create_job(cartpole_job("bad", rollout={"engine": "vllm"}))
        cluster.create_job(cartpole_job("good"))
        await eventually(lambda: cluster.phase("bad") == "Failed", what="bad Failed")
        failed = next(c for c in cluster.status("bad")["conditions"] if c["type"] == "Failed")
        assert failed["reason"] == "InvalidSpec" and "spec.rollout.engine" in failed["message"]
        await eventually(lambda: "InvalidSpec" in cluster.reasons("bad"), what="events")
        assert cluster.pods("bad") == {}
        await eventually(lambda: len(cluster.pods("good")) == 4, what="the good job's pods")
        # Fixing the spec gives the job another chance.
        cluster.patch_job("bad", {"spec": {"rollout": {"engine": "torch"}}})
        await eventually(lambda: len(cluster.pods("bad")) == 4, what="pods after the fix")
        assert not op.task.done()


async def test_new_actor_group_waits_until_every_old_actor_has_terminated() -> None:
    kube = new_emulator(kubelet_seconds=None)  # the test plays the kubelet
    cluster = Cluster(kube)
    async with kube, kmock.Server(kube), operator_running(kube) as op:
        manifest = cartpole_job(roles={"actor": {"replicas": 2}, "rollout": {"replicas": 1}, "env": {"replicas": 1}})
        uids = await start_running(cluster, manifest)
        cluster.exit("cp-actor-0", 1)
        await eventually(lambda: cluster.status("cp").get("phase") == "Restarting", what="Restarting")
        # A finished pod has no containers left to stop: the server deletes it at once. The running rank
        # terminates through its grace period.
        await eventually(
            lambda: (
                "cp-actor-0" not in cluster.pods("cp")
                and cluster.pods("cp")["cp-actor-1"]["metadata"].get("deletionTimestamp")
            ),
            what="actor 0 gone, actor 1 terminating",
        )
        # Evidence before the negative assertion: the operator's pod index has dropped actor 0, and a
        # whole reconcile ran after that (reconciles of one job are serial, so the second one to finish
        # from now started after the index changed).
        await eventually(lambda: _sample_sum(op.metrics, "rljob_operator_child_pods", role="actor") == 1)
        done = _sample_sum(op.metrics, "rljob_operator_reconcile_duration_seconds_count")
        await eventually(
            lambda: _sample_sum(op.metrics, "rljob_operator_reconcile_duration_seconds_count") >= done + 2,
            what="two reconciles after actor 0 was gone",
        )
        # Actor 1 still terminates: no new actor may start beside it.
        assert "cp-actor-0" not in cluster.pods("cp") and cluster.phase("cp") == "Restarting"
        kube.finish_termination(NS, "cp-actor-1")
        await eventually(
            lambda: all(cluster.uid(f"cp-actor-{i}") != uids[f"cp-actor-{i}"] for i in (0, 1)), what="new group"
        )
        assert cluster.status("cp")["restarts"] == 1


def _sample_sum(metrics: OperatorMetrics, name: str, **labels: str) -> float:
    """The sum of a metric's samples whose labels include `labels`."""
    return sum(
        sample.value
        for family in metrics.registry.collect()
        for sample in family.samples
        if sample.name == name and labels.items() <= sample.labels.items()
    )


async def test_pods_the_job_does_not_control_are_left_alone(kube: KubernetesApiEmulator, cluster: Cluster) -> None:
    stranger = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": "cp-rollout-7",
            "labels": {"rljob.io/job": "cp", "rljob.io/role": "rollout", "rljob.io/replica": "7"},
        },
        "spec": {"containers": [{"name": "main", "image": "busybox"}]},
    }
    kube.create_object(PODS, NS, stranger)
    async with operator_running(kube):
        cluster.create_job(cartpole_job())
        await eventually(lambda: len(cluster.pods("cp")) == 5, what="the job's own pods")
        cluster.run_all("cp")
        await eventually(lambda: cluster.phase("cp") == "Running")
        assert cluster.status("cp")["roles"]["rollout"]["desired"] == 1
    assert kube.read_object(PODS, NS, "cp-rollout-7") is not None
