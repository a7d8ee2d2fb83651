"""A job that names no checkpoint claim gets one from the operator: owned by the job (kept when asked), and a
condition that says so where the claim cannot bind because the cluster has no default StorageClass."""

from __future__ import annotations

from dataclasses import replace

from tests.operator.controller.conftest import (
    CARTPOLE_PODS,
    CLAIMS,
    FAST,
    NS,
    STORAGE_CLASSES,
    Cluster,
    cartpole_job,
    eventually,
    operator_running,
)
from tests.operator.controller.emulator import KubernetesApiEmulator


def condition(cluster: Cluster, job: str, kind: str) -> dict:
    return next((c for c in cluster.status(job).get("conditions", []) if c["type"] == kind), {})


async def test_the_claim_is_made_and_a_cluster_without_a_default_class_is_named(
    kube: KubernetesApiEmulator, cluster: Cluster
) -> None:
    kube.create_object(STORAGE_CLASSES, None, {"metadata": {"name": "slow"}, "provisioner": "example.com/slow"})
    # The other children are checked at live reads only (a minute here): the claim is looked at every resync.
    async with operator_running(kube, config=replace(FAST, live_read_seconds=60.0)):
        cluster.create_job(cartpole_job())
        await eventually(lambda: set(cluster.pods("cp")) == CARTPOLE_PODS, what="pods")
        claim = kube.read_object(CLAIMS, NS, "cp-checkpoints")
        assert claim["metadata"]["ownerReferences"][0]["uid"] == cluster.job("cp")["metadata"]["uid"]
        actor = cluster.pods("cp")["cp-actor-0"]
        assert {"name": "rljob-checkpoints", "persistentVolumeClaim": {"claimName": "cp-checkpoints"}} in actor["spec"][
            "volumes"
        ]
        storage = await eventually(
            lambda: (c := condition(cluster, "cp", "CheckpointStorage")).get("status") == "False" and c,
            what="CheckpointStorage False",
        )
        assert storage["reason"] == "NoDefaultStorageClass"
        assert "spec.checkpoint.storage.storageClassName" in storage["message"]
        assert "NoDefaultStorageClass" in cluster.reasons("cp")

        # The admin marks a default class: the job says the claim can bind (at the next resync).
        default = {"storageclass.kubernetes.io/is-default-class": "true"}
        kube.patch_object(STORAGE_CLASSES, None, "slow", {"metadata": {"annotations": default}})
        await eventually(lambda: condition(cluster, "cp", "CheckpointStorage").get("status") == "True", what="resolved")
        # Meanwhile each resync read the claim back; the other children were not made again.
        posts = [r for r in list(kube) if r.method.value == "POST" and r.resource is not None]
        assert sum(r.resource.plural == "configmaps" for r in posts) == 1
        assert sum(r.resource.plural == "persistentvolumeclaims" for r in posts) == 1

    cluster.delete_job("cp")
    await eventually(lambda: kube.read_object(CLAIMS, NS, "cp-checkpoints") is None, what="collected with the job")


async def test_a_retained_claim_outlives_its_job_and_the_namesake_mounts_it(
    kube: KubernetesApiEmulator, cluster: Cluster
) -> None:
    default = {"storageclass.kubernetes.io/is-default-class": "true"}
    kube.create_object(STORAGE_CLASSES, None, {"metadata": {"name": "std", "annotations": default}, "provisioner": "x"})
    retained = cartpole_job(checkpoint={"storage": {"retain": True}})
    async with operator_running(kube):
        cluster.create_job(retained)
        await eventually(lambda: set(cluster.pods("cp")) == CARTPOLE_PODS, what="pods")
        uid = kube.read_object(CLAIMS, NS, "cp-checkpoints")["metadata"]["uid"]
        assert not condition(cluster, "cp", "CheckpointStorage")
        cluster.delete_job("cp")
        await eventually(lambda: cluster.pods("cp") == {}, what="pods collected")
        kube.collect_garbage()
        assert kube.read_object(CLAIMS, NS, "cp-checkpoints")["metadata"]["uid"] == uid

        cluster.create_job(retained)
        await eventually(lambda: set(cluster.pods("cp")) == CARTPOLE_PODS, what="the namesake's pods")
        assert kube.read_object(CLAIMS, NS, "cp-checkpoints")["metadata"]["uid"] == uid
