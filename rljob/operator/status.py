"""Status bookkeeping: conditions with stable transition times, per-role counts, why a job waits. Pure."""

from __future__ import annotations

import datetime
from collections.abc import Iterable

from rljob.api import ROLE_NAMES
from rljob.api.status import Condition, RLJobStatus, RoleCounts
from rljob.operator.podstate import PodState

# Condition types an RLJob carries.
SCHEDULED = "Scheduled"
"""False with reason Unschedulable and the scheduler's message while a pod cannot be placed."""
READY = "Ready"
"""True when every pod is ready; False names why not (image pull failure, crash loop, starting)."""
RESTARTING = "Restarting"
SUSPENDED = "Suspended"
SUCCEEDED = "Succeeded"
FAILED = "Failed"

MAX_LISTED_PODS = 3
"""Messages name at most this many pods, then say how many more."""


def rfc3339(moment: datetime.datetime) -> str:
    return moment.astimezone(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_rfc3339(value: str | None) -> datetime.datetime | None:
    if not value:
        return None
    try:
        return datetime.datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return None


def get_condition(status: RLJobStatus, kind: str) -> Condition | None:
    return next((c for c in status.conditions if c.type == kind), None)


def set_condition(
    status: RLJobStatus,
    kind: str,
    value: bool,
    reason: str,
    message: str,
    now: datetime.datetime,
    generation: int | None = None,
) -> bool:
    """Set a condition in place; the transition time moves only when the value flips. True if it flipped."""
    new_status = "True" if value else "False"
    current = get_condition(status, kind)
    if current is None:
        status.conditions.append(
            Condition(
                type=kind,
                status=new_status,
                reason=reason,
                message=message,
                last_transition_time=rfc3339(now),
                observed_generation=generation,
            )
        )
        return True
    flipped = current.status != new_status
    current.status = new_status
    current.reason = reason
    current.message = message
    current.observed_generation = generation
    if flipped:
        current.last_transition_time = rfc3339(now)
    return flipped


def clear_condition(status: RLJobStatus, kind: str, reason: str, message: str, now: datetime.datetime) -> bool:
    """Set a condition False only if it is present (absent and False read the same)."""
    if get_condition(status, kind) is None:
        return False
    return set_condition(status, kind, False, reason, message, now)


def describe_pods(items: list[str]) -> str:
    listed = "; ".join(items[:MAX_LISTED_PODS])
    more = len(items) - MAX_LISTED_PODS
    return f"{listed}; and {more} more" if more > 0 else listed


def role_counts(
    status: RLJobStatus,
    desired: dict[str, int],
    pods: Iterable[PodState],
    failed: dict[str, int] | None = None,
    collocated: bool = False,
) -> None:
    """Refresh desired and ready per role; `failed` adds newly replaced failures to the running totals.

    `collocated`: the rollout replicas run in the actor pods (one each), so they count as those pods do: desired
    and ready with them. The operator sees no rollout process; the actor pod's process restarts a failed one
    (rljob/runtime/roles/collocated.py), and the actor's steps show it generates."""
    live = [p for p in pods if not p.terminating]
    for role in ROLE_NAMES:
        counts: RoleCounts = getattr(status.roles, role)
        counts.desired = desired.get(role, 0)
        counts.ready = sum(1 for p in live if p.role == role and p.ready and p.replica < counts.desired)
        counts.failed += (failed or {}).get(role, 0)
    if collocated:
        status.roles.rollout.desired = status.roles.actor.desired
        status.roles.rollout.ready = status.roles.actor.ready


def scheduling_problems(pods: Iterable[PodState]) -> list[str]:
    return [f"{p.name}: {p.unschedulable}" for p in pods if p.unschedulable and not p.terminating]


def container_problems(pods: Iterable[PodState]) -> tuple[str, list[str]]:
    """(reason, messages) of the most telling container problem: image pull failures first, then crash loops."""
    pulling = [f"{p.name}: {p.waiting_message}" for p in pods if p.image_pull_failing and not p.terminating]
    if pulling:
        reason = next(p.waiting_reason for p in pods if p.image_pull_failing and not p.terminating)
        return reason or "ImagePullBackOff", pulling
    looping = [f"{p.name}: {p.waiting_message}" for p in pods if p.crash_looping and not p.terminating]
    if looping:
        return "CrashLoopBackOff", looping
    return "", []
