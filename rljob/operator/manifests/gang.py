"""Gang scheduling: every pod of a job starts together or none does.

All pods are created at once and joined to one group; start-up order comes from readiness (each role
waits for its peers' endpoints), never from creation order, which deadlocks under a gang scheduler.

- `volcano`: a `scheduling.volcano.sh/v1beta1` PodGroup (minMember, queue, priorityClassName); pods
  carry the `scheduling.k8s.io/group-name` annotation and `schedulerName: volcano`.
- `scheduler-plugins`: a `scheduling.x-k8s.io/v1alpha1` PodGroup for the coscheduling plugin; pods carry
  the `scheduling.x-k8s.io/pod-group` label and that scheduler's name.
- `kueue`: no PodGroup object. Pods carry Kueue's plain-pod-group metadata (queue-name and
  pod-group-name labels, pod-group-total-count annotation); Kueue's webhook then adds its
  `kueue.x-k8s.io/admission` scheduling gate, so no pod is scheduled until the whole group is admitted.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rljob.api import ROLE_NAMES, RLJob
from rljob.operator.naming import child_metadata, pod_group_name
from rljob.operator.settings import OperatorSettings

VOLCANO_API_VERSION = "scheduling.volcano.sh/v1beta1"
VOLCANO_GROUP_ANNOTATION = "scheduling.k8s.io/group-name"
SCHEDULER_PLUGINS_API_VERSION = "scheduling.x-k8s.io/v1alpha1"
SCHEDULER_PLUGINS_GROUP_LABEL = "scheduling.x-k8s.io/pod-group"
KUEUE_QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
KUEUE_GROUP_LABEL = "kueue.x-k8s.io/pod-group-name"
KUEUE_GROUP_COUNT_ANNOTATION = "kueue.x-k8s.io/pod-group-total-count"


def role_replicas(job: RLJob) -> dict[str, int]:
    """Replicas per role of a resolved job (env/reward replicas are filled by `validate_job`)."""
    return {role: job.spec.roles.get(role).replicas or 0 for role in ROLE_NAMES}


def replica_counts(job: RLJob) -> dict[str, int]:
    """Pods per role of a resolved job: its replicas, except a collocated rollout's, which run in the actor pods."""
    counts = role_replicas(job)
    if job.spec.roles.rollout.collocated:
        counts["rollout"] = 0
    return counts


def gang_size(job: RLJob) -> int:
    """Pods that must start together: all of them. The actor group needs every rank, and the trainer
    step needs the rollout, env and reward endpoints it was configured with."""
    return sum(replica_counts(job).values())


@dataclass
class PodGangMetadata:
    """What a pod of the job carries for its gang scheduler."""

    labels: dict[str, str] = field(default_factory=dict)
    annotations: dict[str, str] = field(default_factory=dict)
    scheduler_name: str | None = None


def pod_gang_metadata(job: RLJob, settings: OperatorSettings) -> PodGangMetadata:
    scheduling = job.spec.scheduling
    group = pod_group_name(job)
    if scheduling.gang == "volcano":
        return PodGangMetadata(
            annotations={VOLCANO_GROUP_ANNOTATION: group},
            scheduler_name=scheduling.scheduler_name or settings.volcano_scheduler_name,
        )
    if scheduling.gang == "scheduler-plugins":
        return PodGangMetadata(
            labels={SCHEDULER_PLUGINS_GROUP_LABEL: group},
            scheduler_name=scheduling.scheduler_name or settings.scheduler_plugins_scheduler_name,
        )
    if scheduling.gang == "kueue":
        return PodGangMetadata(
            labels={KUEUE_QUEUE_LABEL: scheduling.queue or "", KUEUE_GROUP_LABEL: group},
            annotations={KUEUE_GROUP_COUNT_ANNOTATION: str(gang_size(job))},
            scheduler_name=scheduling.scheduler_name,
        )
    return PodGangMetadata(scheduler_name=scheduling.scheduler_name)


def build_pod_group(job: RLJob, settings: OperatorSettings) -> dict[str, Any] | None:
    """The PodGroup object of a volcano or scheduler-plugins job; None for `none` and `kueue`."""
    scheduling = job.spec.scheduling
    if scheduling.gang == "volcano":
        spec: dict[str, Any] = {"minMember": gang_size(job)}
        if scheduling.queue:
            spec["queue"] = scheduling.queue
        priority = job.spec.roles.actor.placement.priority_class_name
        if priority:
            spec["priorityClassName"] = priority
        return {
            "apiVersion": VOLCANO_API_VERSION,
            "kind": "PodGroup",
            "metadata": child_metadata(job, pod_group_name(job), "podgroup"),
            "spec": spec,
        }
    if scheduling.gang == "scheduler-plugins":
        return {
            "apiVersion": SCHEDULER_PLUGINS_API_VERSION,
            "kind": "PodGroup",
            "metadata": child_metadata(job, pod_group_name(job), "podgroup"),
            "spec": {
                "minMember": gang_size(job),
                "scheduleTimeoutSeconds": settings.gang_schedule_timeout_seconds,
            },
        }
    return None
