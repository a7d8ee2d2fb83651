"""What the operator reads from a pod: its role and replica, and whether it is scheduled, ready, failed,
disrupted or finished, with the kubelet's or scheduler's own words for why. Pure: raw pod dict in.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rljob.operator.naming import ANNOTATION_CONFIG_HASH, LABEL_REPLICA, LABEL_ROLE

DISRUPTION_REASONS = frozenset({"Evicted", "Preempted", "Preempting", "NodeLost", "Shutdown", "Terminated"})
"""`status.reason` of pods lost to the cluster rather than to their own code (evictions, preemption, node
loss, graceful node shutdown). The `DisruptionTarget` condition says the same on Kubernetes >= 1.26."""
IMAGE_PULL_REASONS = frozenset({"ErrImagePull", "ImagePullBackOff", "InvalidImageName", "ErrImageNeverPull"})
CRASH_LOOP_REASON = "CrashLoopBackOff"


SCHEDULING_GATED = "SchedulingGated"
"""PodScheduled's reason while a pod has scheduling gates (Kueue's admission gate)."""


@dataclass(frozen=True)
class PodState:
    """One observed pod of a job."""

    name: str
    uid: str
    role: str
    replica: int
    phase: str
    """Pending, Running, Succeeded, Failed or Unknown."""
    ready: bool
    terminating: bool
    scheduled: bool
    unschedulable: str | None
    """The scheduler's message when the pod cannot be placed."""
    waiting_reason: str | None
    """A container's waiting reason worth reporting (image pull failure, crash loop)."""
    waiting_message: str
    disrupted: bool
    """Lost to eviction, preemption or node loss: replaced without counting against maxRestarts."""
    exit_code: int | None
    """Exit code of the first terminated container, when one has terminated."""
    reason: str
    """`status.reason` and, failing that, a terminated container's reason."""
    message: str
    config_hash: str
    finished_at: str | None = None
    """`finishedAt` (RFC 3339) of the container whose exit code is reported."""
    ready_since: str | None = None
    """When the pod last became Ready (the Ready condition's lastTransitionTime), while it is Ready."""
    deleted_at: str | None = None
    """`metadata.deletionTimestamp` (RFC 3339) while the pod terminates."""
    grace_seconds: int | None = None
    """`metadata.deletionGracePeriodSeconds` while the pod terminates."""
    node: str = ""
    gated: str | None = None
    """The API server's message while the pod waits behind scheduling gates (Kueue holds a group's pods so until it
    admits the whole group)."""

    @property
    def failed(self) -> bool:
        return self.phase == "Failed"

    @property
    def succeeded(self) -> bool:
        return self.phase == "Succeeded"

    @property
    def finished(self) -> bool:
        return self.phase in ("Succeeded", "Failed")

    @property
    def image_pull_failing(self) -> bool:
        return self.waiting_reason in IMAGE_PULL_REASONS

    @property
    def crash_looping(self) -> bool:
        return self.waiting_reason == CRASH_LOOP_REASON


def _condition(status: dict[str, Any], kind: str) -> dict[str, Any] | None:
    return next((c for c in status.get("conditions") or [] if c.get("type") == kind), None)


def observe_pod(raw: dict[str, Any]) -> PodState | None:
    """The pod as the reconciler sees it; None for a pod without valid rljob role labels."""
    meta = raw.get("metadata") or {}
    labels = meta.get("labels") or {}
    try:
        replica = int(labels.get(LABEL_REPLICA, ""))
    except ValueError:
        return None
    role = labels.get(LABEL_ROLE)
    if not role:
        return None
    status = raw.get("status") or {}
    phase = status.get("phase") or "Pending"
    scheduled_cond = _condition(status, "PodScheduled")
    ready_cond = _condition(status, "Ready")
    disruption = _condition(status, "DisruptionTarget")
    unschedulable = None
    if scheduled_cond and scheduled_cond.get("status") == "False" and scheduled_cond.get("reason") == "Unschedulable":
        unschedulable = scheduled_cond.get("message") or "the scheduler found no node for the pod"
    gated = None
    if scheduled_cond and scheduled_cond.get("status") == "False" and scheduled_cond.get("reason") == SCHEDULING_GATED:
        gated = scheduled_cond.get("message") or "Scheduling is blocked due to non-empty scheduling gates"
    scheduled = bool(
        (raw.get("spec") or {}).get("nodeName") or (scheduled_cond and scheduled_cond.get("status") == "True")
    )

    waiting_reason, waiting_message = None, ""
    exit_code, container_reason, container_message, finished_at = None, "", "", None
    statuses = list(status.get("initContainerStatuses") or []) + list(status.get("containerStatuses") or [])
    for cs in statuses:
        state = cs.get("state") or {}
        waiting = state.get("waiting") or {}
        if waiting_reason is None and waiting.get("reason") in IMAGE_PULL_REASONS | {CRASH_LOOP_REASON}:
            waiting_reason = waiting["reason"]
            image = f" ({cs.get('image')})" if cs.get("image") else ""
            waiting_message = f"container {cs.get('name')}{image}: {waiting.get('message') or waiting['reason']}"
        terminated = state.get("terminated") or {}
        if exit_code is None and "exitCode" in terminated and cs in (status.get("containerStatuses") or []):
            exit_code = int(terminated["exitCode"])
            container_reason = terminated.get("reason") or ""
            container_message = terminated.get("message") or ""
            finished_at = terminated.get("finishedAt")

    reason = status.get("reason") or container_reason
    ready = bool(ready_cond and ready_cond.get("status") == "True")
    disrupted = bool(disruption and disruption.get("status") == "True") or status.get("reason") in DISRUPTION_REASONS
    return PodState(
        name=meta.get("name", ""),
        uid=meta.get("uid", ""),
        role=role,
        replica=replica,
        phase=phase,
        ready=ready,
        terminating=bool(meta.get("deletionTimestamp")),
        scheduled=scheduled,
        unschedulable=unschedulable,
        waiting_reason=waiting_reason,
        waiting_message=waiting_message,
        disrupted=disrupted,
        exit_code=exit_code,
        reason=reason,
        message=status.get("message") or container_message,
        config_hash=(meta.get("annotations") or {}).get(ANNOTATION_CONFIG_HASH, ""),
        finished_at=finished_at,
        ready_since=(ready_cond or {}).get("lastTransitionTime") if ready else None,
        deleted_at=meta.get("deletionTimestamp"),
        grace_seconds=meta.get("deletionGracePeriodSeconds"),
        node=(raw.get("spec") or {}).get("nodeName") or "",
        gated=gated,
    )
