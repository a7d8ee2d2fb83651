"""The operator keeps each job's ingress NetworkPolicy (made before the pods, gone when the spec switches it off)
and its Secret (the transport key every pod mounts, made once)."""

from __future__ import annotations

import base64

from tests.operator.controller.conftest import (
    CARTPOLE_PODS,
    NETWORK_POLICIES,
    NS,
    SECRETS,
    Cluster,
    cartpole_job,
    eventually,
    operator_running,
)
from tests.operator.controller.emulator import KubernetesApiEmulator


async def test_the_policy_is_made_with_the_job_and_deleted_when_switched_off(
    kube: KubernetesApiEmulator, cluster: Cluster
) -> None:
    async with operator_running(kube):
        cluster.create_job(cartpole_job())
        await eventually(lambda: set(cluster.pods("cp")) == CARTPOLE_PODS, what="pods")
        policy = kube.read_object(NETWORK_POLICIES, NS, "cp-isolation")
        assert policy["spec"]["podSelector"] == {"matchLabels": {"rljob.io/job": "cp"}}
        assert policy["metadata"]["ownerReferences"][0]["uid"] == cluster.job("cp")["metadata"]["uid"]
        # Made before any pod: no pod of the job is ever open to other jobs.
        assert int(policy["metadata"]["resourceVersion"]) < min(
            int(p["metadata"]["resourceVersion"]) for p in cluster.pods("cp").values()
        )
        cluster.patch_job("cp", {"spec": {"isolation": {"networkPolicy": False}}})
        await eventually(lambda: kube.read_object(NETWORK_POLICIES, NS, "cp-isolation") is None, what="deleted")


async def test_every_pod_mounts_the_jobs_secret_which_is_made_once(
    kube: KubernetesApiEmulator, cluster: Cluster
) -> None:
    async with operator_running(kube):
        cluster.create_job(cartpole_job())
        await eventually(lambda: set(cluster.pods("cp")) == CARTPOLE_PODS, what="pods")
        secret = kube.read_object(SECRETS, NS, "cp-secret")
        assert secret["metadata"]["ownerReferences"][0]["uid"] == cluster.job("cp")["metadata"]["uid"]
        key = base64.b64decode(secret["data"]["transport-key"])
        assert len(key) == 64
        for pod in cluster.pods("cp").values():
            volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
            assert volumes["rljob-secret"]["secret"]["secretName"] == "cp-secret"
            env = {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}
            assert env["RLJOB_TRANSPORT_KEY_FILE"] == "/var/run/rljob/secret/transport-key"

        # A new generation builds its children again: the key stays, or running pods would stop hearing each other.
        cluster.patch_job("cp", {"spec": {"failurePolicy": {"maxRestarts": 7}}})
        await eventually(lambda: cluster.status("cp").get("observedGeneration") == 2, what="generation 2")
        assert base64.b64decode(kube.read_object(SECRETS, NS, "cp-secret")["data"]["transport-key"]) == key
