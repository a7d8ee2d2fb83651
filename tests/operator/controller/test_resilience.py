"""The operator survives API errors, expired watches and its own restarts without doing anything twice."""

from __future__ import annotations

import asyncio

import aiohttp
import kmock

from tests.operator.controller.conftest import (
    CARTPOLE_PODS,
    CONFIGMAPS,
    NS,
    PODS,
    RLJOBS,
    Cluster,
    cartpole_job,
    eventually,
    free_port,
    operator_running,
    start_cartpole,
)
from tests.operator.controller.emulator import KubernetesApiEmulator


def creations(kube: KubernetesApiEmulator, resource: kmock.resource, name: str) -> int:
    """How many times an object was created (a deletion in its history would precede a re-creation)."""
    history = kube.objects[resource, NS, name].history
    return 1 + sum(1 for version in history if version is None)


async def test_operator_restarted_mid_reconcile_creates_no_duplicates(
    kube: KubernetesApiEmulator, cluster: Cluster
) -> None:
    # The first operator dies with one pod still uncreated (the server keeps refusing it).
    refusing = [True]
    error = kmock.KubernetesError(500, "InternalError", "injected: etcd timeout")
    # While refusing, the reaction answers with the error; afterwards it steps aside (NotImplemented).
    kube["create", PODS, {"metadata": {"name": "cp-env-1"}}] << (lambda: error if refusing[0] else NotImplemented)
    async with operator_running(kube):
        cluster.create_job(cartpole_job())
        await eventually(lambda: set(cluster.pods("cp")) == CARTPOLE_PODS - {"cp-env-1"}, what="partial children")
    refusing[0] = False
    uids = {pod: cluster.uid(pod) for pod in cluster.pods("cp")}

    async with operator_running(kube):
        await eventually(lambda: set(cluster.pods("cp")) == CARTPOLE_PODS, what="completed by the new operator")
        cluster.run_all("cp")
        await eventually(lambda: cluster.phase("cp") == "Running")
    assert all(cluster.uid(pod) == uid for pod, uid in uids.items())

    # Restarted again while the job runs: nothing is recreated, nothing is charged.
    async with operator_running(kube):
        cluster.patch_job("cp", {"metadata": {"labels": {"touched": "yes"}}})
        await eventually(lambda: cluster.status("cp").get("observedGeneration") == 1)
        cluster.exit("cp-rollout-0", 1)
        await eventually(lambda: cluster.status("cp")["roles"]["rollout"]["failed"] == 1, what="still reconciling")
    for pod in CARTPOLE_PODS - {"cp-rollout-0"}:
        assert creations(kube, PODS, pod) == 1, pod
    assert creations(kube, CONFIGMAPS, "cp-config") == 1
    assert cluster.status("cp")["restarts"] == 0


async def test_injected_api_errors_and_an_expired_watch_are_survived(
    kube: KubernetesApiEmulator, cluster: Cluster
) -> None:
    status_writes = kube["patch", RLJOBS, kmock.subresource("status")]
    status_writes[:2] << kmock.KubernetesError(500, "InternalError", "injected")
    status_writes[2:3] << kmock.KubernetesError(409, "Conflict", "injected: the object has been modified")
    kube["create", PODS][:1] << kmock.KubernetesError(500, "InternalError", "injected")
    async with operator_running(kube) as op:
        cluster.create_job(cartpole_job())
        await eventually(lambda: set(cluster.pods("cp")) == CARTPOLE_PODS, what="children despite errors")
        await eventually(lambda: cluster.phase("cp") == "Pending", what="status despite errors")

        lists_before = sum(1 for r in list(kube) if r.action == kmock.action.LIST)
        kube.compact()  # every live watch ends with 410 Gone; kopf must list again and carry on
        await eventually(
            lambda: sum(1 for r in list(kube) if r.action == kmock.action.LIST) > lists_before, what="re-list"
        )
        cluster.create_job(cartpole_job("after"))
        await eventually(lambda: len(cluster.pods("after")) == 4, what="a job created after the 410")
        cluster.run_all("cp")
        await eventually(lambda: cluster.phase("cp") == "Running")
        assert not op.task.done()
        errors = {
            (s.labels["verb"], s.labels["code"])
            for m in op.metrics.registry.collect()
            if m.name == "rljob_operator_api_errors"
            for s in m.samples
            if s.value > 0 and s.name.endswith("_total")
        }
        assert {("patch", "500"), ("patch", "409"), ("create", "500")} <= errors


async def test_liveness_and_prometheus_endpoints(kube: KubernetesApiEmulator, cluster: Cluster) -> None:
    metrics_port, liveness_port = free_port(), free_port()
    async with operator_running(kube, metrics_port=metrics_port, liveness_port=liveness_port):
        await start_cartpole(cluster)
        async with aiohttp.ClientSession() as session:

            async def scrape() -> str:
                async with session.get(f"http://127.0.0.1:{metrics_port}/metrics") as response:
                    return await response.text()

            running = 'rljob_operator_rljobs{phase="Running"} 1.0'
            for _ in range(100):
                text = await scrape()
                if running in text:
                    break
                await asyncio.sleep(0.05)
            assert running in text
            assert 'rljob_operator_child_pods{phase="Running",role="env"} 2.0' in text
            assert "rljob_operator_reconcile_duration_seconds_count" in text
            assert 'rljob_operator_api_requests_total{code="200",verb="create"}' in text
            async with session.get(f"http://127.0.0.1:{liveness_port}/healthz") as response:
                assert response.status == 200


async def test_a_pod_the_server_refuses_is_reported_and_retried(kube: KubernetesApiEmulator, cluster: Cluster) -> None:
    # An admission webhook's refusal (a quota's rolls the whole pass back instead: test_quota.py).
    webhook = kmock.KubernetesError(
        403, "Forbidden", 'admission webhook "policy.example.com" denied the request: pods "cp-env-1" lack a label'
    )
    refusing = [True]
    kube["create", PODS, {"metadata": {"name": "cp-env-1"}}] << (lambda: webhook if refusing[0] else NotImplemented)
    async with operator_running(kube):
        cluster.create_job(cartpole_job())
        await eventually(lambda: "FailedCreate" in cluster.reasons("cp"), what="FailedCreate event")
        event = next(e for e in cluster.events("cp") if e["reason"] == "FailedCreate")
        assert "denied the request" in event["message"] and event["type"] == "Warning"
        assert set(cluster.pods("cp")) == CARTPOLE_PODS - {"cp-env-1"}
        refusing[0] = False
        await eventually(lambda: set(cluster.pods("cp")) == CARTPOLE_PODS, timeout=10, what="created once allowed")


async def test_a_failed_delete_after_the_restarting_status_does_not_leave_the_restart_stuck(
    kube: KubernetesApiEmulator, cluster: Cluster
) -> None:
    """The Restarting status is written before the old actor is deleted; that DELETE fails once."""
    kube["delete", PODS, kmock.name("cp-actor-0")][:1] << kmock.KubernetesError(500, "InternalError", "injected")
    async with operator_running(kube):
        await start_cartpole(cluster)
        old = cluster.uid("cp-actor-0")
        cluster.exit("cp-actor-0", 1)
        await eventually(lambda: cluster.uid("cp-actor-0") != old, what="the next pass deleted and recreated it")
        await eventually(lambda: cluster.phase("cp") == "Starting", what="the restart finished")
        assert cluster.status("cp")["restarts"] == 1


async def test_an_operator_killed_between_the_restarting_status_and_the_deletes_finishes_the_restart(
    kube: KubernetesApiEmulator, cluster: Cluster
) -> None:
    refusing = [True]
    error = kmock.KubernetesError(500, "InternalError", "injected: the operator dies before this DELETE")
    kube["delete", PODS] << (lambda: error if refusing[0] else NotImplemented)
    async with operator_running(kube):
        await start_cartpole(cluster)
        uids = {pod: cluster.uid(pod) for pod in CARTPOLE_PODS}
        cluster.exit("cp-actor-0", 1)
        await eventually(lambda: cluster.phase("cp") == "Restarting", what="Restarting written")
    assert cluster.uid("cp-actor-0") == uids["cp-actor-0"]  # the failed actor was never deleted
    refusing[0] = False
    async with operator_running(kube):
        await eventually(lambda: cluster.uid("cp-actor-0") != uids["cp-actor-0"], what="restart finished")
        await eventually(lambda: cluster.phase("cp") == "Starting", what="Starting")
    assert cluster.status("cp")["restarts"] == 1  # the replay charged nothing twice
    assert all(cluster.uid(pod) == uids[pod] for pod in CARTPOLE_PODS - {"cp-actor-0"})


async def test_an_operator_killed_during_a_spec_change_restart_replaces_every_old_spec_pod(
    kube: KubernetesApiEmulator, cluster: Cluster
) -> None:
    """The ConfigMap already holds the new spec when the operator dies: only the pods' config hash
    still says which pods run the old one."""
    refusing = [True]
    error = kmock.KubernetesError(500, "InternalError", "injected: the operator dies before this DELETE")
    kube["delete", PODS] << (lambda: error if refusing[0] else NotImplemented)
    async with operator_running(kube):
        await start_cartpole(cluster)
        uids = {pod: cluster.uid(pod) for pod in CARTPOLE_PODS}
        cluster.patch_job("cp", {"spec": {"trainer": {"steps": 7}}})
        await eventually(lambda: cluster.phase("cp") == "Restarting", what="Restarting written")
        await eventually(
            lambda: "steps: 7" in kube.read_object(CONFIGMAPS, NS, "cp-config")["data"]["job.yaml"],
            what="ConfigMap patched",
        )
    refusing[0] = False
    async with operator_running(kube):
        await eventually(
            lambda: (
                set(cluster.pods("cp")) == CARTPOLE_PODS and all(cluster.uid(pod) != uids[pod] for pod in CARTPOLE_PODS)
            ),
            what="every pod recreated from the new spec",
        )
    hashes = {p["metadata"]["annotations"]["rljob.io/config-hash"] for p in cluster.pods("cp").values()}
    assert len(hashes) == 1 and cluster.status("cp")["restarts"] == 0
