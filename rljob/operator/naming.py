"""Names and labels of an RLJob's children: deterministic, so the operator finds them again after a restart."""

from __future__ import annotations

import posixpath

from rljob.api import API_VERSION, KIND, RLJob, RoleName
from rljob.runtime.wire.identity import CONFIG_PATH_IN_POD, pod_hostname

LABEL_JOB = "rljob.io/job"
LABEL_ROLE = "rljob.io/role"
LABEL_REPLICA = "rljob.io/replica"
LABEL_NAME = "app.kubernetes.io/name"
LABEL_COMPONENT = "app.kubernetes.io/component"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
MANAGED_BY = "rljob-operator"

ANNOTATION_CONFIG_HASH = "rljob.io/config-hash"
"""On pods: hash of the resolved job they were built from; a pod whose hash differs is out of date."""

CONFIG_KEY = posixpath.basename(CONFIG_PATH_IN_POD)
"""Key of the resolved job in the ConfigMap: mounted as a directory, it appears at CONFIG_PATH_IN_POD."""


def config_map_name(job: RLJob) -> str:
    return f"{job.name}-config"


def rollout_members_name(job: RLJob) -> str:
    """The ConfigMap listing an llm job's ready rollout replicas (rljob/operator/manifests/members.py)."""
    return f"{job.name}-rollouts"


def service_name(job: RLJob) -> str:
    """The headless Service is named after the job: pods are `<pod>.<job>` in DNS (`pod_dns_name`)."""
    return job.name


def reward_egress_policy_name(job: RLJob) -> str:
    """The NetworkPolicy limiting the egress of a job's reward pods (rljob/operator/manifests/network.py)."""
    return f"{job.name}-reward-egress"


def job_secret_name(job: RLJob) -> str:
    """The Secret holding the job's transport key (rljob/operator/manifests/secret.py)."""
    return f"{job.name}-secret"


def isolation_policy_name(job: RLJob) -> str:
    """The NetworkPolicy admitting into a job's pods only its own pods, the operator and monitoring."""
    return f"{job.name}-isolation"


def pod_group_name(job: RLJob) -> str:
    return job.name


def pod_name(job: RLJob, role: RoleName, replica: int) -> str:
    return pod_hostname(job.name, role, replica)


def job_selector(job: RLJob) -> dict[str, str]:
    """Selects every child pod of the job (the Service selector; the operator's pod list filter)."""
    return {LABEL_JOB: job.name}


def child_labels(job: RLJob, component: str) -> dict[str, str]:
    """Labels every child carries; `component` is the role for pods, the kind of object otherwise."""
    return {
        LABEL_NAME: "rljob",
        LABEL_COMPONENT: component,
        LABEL_MANAGED_BY: MANAGED_BY,
        LABEL_JOB: job.name,
    }


def owner_references(job: RLJob) -> list[dict[str, object]]:
    """A controller reference to the RLJob, so deleting the job garbage-collects its children.

    Empty when the job has no uid yet (`rljob render` on a file): the reference needs the server's uid.
    """
    if not job.metadata.uid:
        return []
    return [
        {
            "apiVersion": API_VERSION,
            "kind": KIND,
            "name": job.name,
            "uid": job.metadata.uid,
            "controller": True,
            "blockOwnerDeletion": True,
        }
    ]


def child_metadata(job: RLJob, name: str, component: str) -> dict[str, object]:
    metadata: dict[str, object] = {"name": name}
    if job.metadata.namespace:
        metadata["namespace"] = job.metadata.namespace
    metadata["labels"] = child_labels(job, component)
    owners = owner_references(job)
    if owners:
        metadata["ownerReferences"] = owners
    return metadata
