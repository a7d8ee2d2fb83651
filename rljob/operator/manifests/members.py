"""The rollout membership of an llm job: a ConfigMap listing its ready rollout replicas, read by actor rank 0.

llm rollouts are interchangeable generation servers, so their count changes while training goes on
(`kubectl scale rljob/NAME --replicas=N`). The operator keeps `<job>-rollouts` (key `rollouts.json`, the
document of rljob/runtime/llm/replicas/membership.py) equal to the rollout pods that are Ready and wanted; the actor
pods mount it as a directory, which the kubelet refreshes on its next sync of the pod (about a minute at
most with default kubelet settings), and actor rank 0 looks at the file between polls. The volume is
optional: an actor pod started before the ConfigMap exists (or applied from `rljob render` without the
operator) feeds the rollouts of its environment, as a local run does.

gym jobs have no membership: each gym rollout steps a fixed share of the env replicas, so a new rollout
count is a controlled restart (see `RESTART_FREE_FIELDS`). Nor do collocated jobs: their one rollout runs in
the actor pod, kept by the actor's process (rljob/runtime/roles/collocated.py), at a fixed endpoint.
"""

from __future__ import annotations

import posixpath
from collections.abc import Iterable
from typing import Any

from rljob.api import RLJob
from rljob.operator.manifests.checks import MEMBERS_DIR_IN_POD, MEMBERS_VOLUME
from rljob.operator.naming import child_metadata, rollout_members_name
from rljob.runtime.llm.replicas.membership import MEMBERS_KEY, members_document
from rljob.runtime.wire.identity import DATA_PORT, pod_dns_name

Manifest = dict[str, Any]

MEMBERS_FILE_IN_POD = posixpath.join(MEMBERS_DIR_IN_POD, MEMBERS_KEY)


def elastic_rollouts(job: RLJob) -> bool:
    """Whether the job's rollout replicas come and go while it trains (llm jobs). Not a collocated rollout: it
    has no pod of its own; the actor pod's process keeps it (rljob/runtime/roles/collocated.py) at a fixed endpoint."""
    return job.spec.task.type == "llm" and not job.spec.roles.rollout.collocated


def rollout_endpoint(job: RLJob, replica: int) -> str:
    """The data-plane endpoint of a rollout replica, as its pod serves it."""
    return f"{pod_dns_name(job.name, 'rollout', replica)}:{DATA_PORT}"


def build_rollout_members(job: RLJob, replicas: Iterable[int]) -> Manifest:
    """The membership ConfigMap listing rollout `replicas` (indices)."""
    members = {replica: rollout_endpoint(job, replica) for replica in replicas}
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": child_metadata(job, rollout_members_name(job), "rollout-members"),
        "data": {MEMBERS_KEY: members_document(members)},
    }


def members_volume(job: RLJob) -> tuple[dict[str, Any], dict[str, Any]]:
    """(volume, mount) of the membership in an actor pod: optional, so the pod never waits for it."""
    volume = {"name": MEMBERS_VOLUME, "configMap": {"name": rollout_members_name(job), "optional": True}}
    mount = {"name": MEMBERS_VOLUME, "mountPath": MEMBERS_DIR_IN_POD, "readOnly": True}
    return volume, mount
