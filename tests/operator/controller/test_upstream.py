"""A pipeline applied at once: a job whose teacher is another RLJob's model (`source: job`) holds its pods until that
job has succeeded, saying why, then mounts the upstream's checkpoint claim read-only where its config looks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from tests.operator.controller.conftest import CONFIGMAPS, NS, Cluster, eventually, operator_running
from tests.operator.controller.emulator import KubernetesApiEmulator

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"


def example(name: str) -> dict[str, Any]:
    job = yaml.safe_load((EXAMPLES / f"{name}.yaml").read_text())
    job["metadata"] = {"name": name, "namespace": NS}
    return job


def ready(cluster: Cluster, job: str) -> dict[str, Any]:
    return next((c for c in cluster.status(job).get("conditions", []) if c["type"] == "Ready"), {})


async def test_a_student_waits_for_its_teacher_job_to_succeed_then_mounts_its_export(
    kube: KubernetesApiEmulator, cluster: Cluster
) -> None:
    async with operator_running(kube):
        cluster.create_job(example("distill-tiny"))  # teacher: {source: job, job: sft-tiny}, not posted yet
        missing = await eventually(
            lambda: (c := ready(cluster, "distill-tiny")).get("reason") == "WaitingForJob" and c, what="waiting"
        )
        assert "RLJob 'sft-tiny' (spec.algorithm.distill.teacher.job) does not exist" in missing["message"]
        assert cluster.phase("distill-tiny") == "Pending" and cluster.pods("distill-tiny") == {}
        config = yaml.safe_load(kube.read_object(CONFIGMAPS, NS, "distill-tiny-config")["data"]["job.yaml"])
        teacher = config["spec"]["algorithm"]["distill"]["teacher"]
        assert teacher["source"] == "local" and teacher["path"] == "/rljob/jobs/sft-tiny/model"

        cluster.create_job(example("sft-tiny"))
        await eventually(lambda: set(cluster.pods("sft-tiny")) == {"sft-tiny-actor-0"}, what="the teacher's pod")
        await eventually(lambda: "is Pending" in ready(cluster, "distill-tiny").get("message", ""), what="pending")
        cluster.run_all("sft-tiny")
        await eventually(lambda: "is Running" in ready(cluster, "distill-tiny").get("message", ""), what="running")
        assert cluster.pods("distill-tiny") == {}

        cluster.exit("sft-tiny-actor-0", 0)
        await eventually(lambda: cluster.phase("sft-tiny") == "Succeeded", what="the teacher succeeded")
        pods = await eventually(lambda: cluster.pods("distill-tiny"), what="the student's pods")
        actor = pods["distill-tiny-actor-0"]["spec"]
        claim = {"claimName": "sft-tiny-checkpoints", "readOnly": True}
        assert {"name": "upstream-0", "persistentVolumeClaim": claim} in actor["volumes"]
        mounts = actor["containers"][0]["volumeMounts"]
        assert {"name": "upstream-0", "mountPath": "/rljob/jobs/sft-tiny", "readOnly": True} in mounts
        # Only the actor loads the teacher: the rollout and reward pods do not mount it.
        others = [p for name, p in pods.items() if name != "distill-tiny-actor-0"]
        assert others and all("upstream-0" not in str(p["spec"]["volumes"]) for p in others)
