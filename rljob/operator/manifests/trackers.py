"""What the actor pods need for the job's experiment trackers (`spec.logging.trackers`): each credential from its
Secret by reference (the value never passes through the spec, the status or the operator), and the restart count
that names the run."""

from __future__ import annotations

from typing import Any

from rljob.api import RLJob
from rljob.runtime.records.trackers import BACKENDS, RESTART_ENV


def tracker_env(job: RLJob) -> list[dict[str, Any]]:
    """The actor container's tracker variables: none for a job without trackers."""
    trackers = job.spec.logging.trackers
    if not trackers:
        return []
    restarts = job.status.restarts if job.status is not None else 0
    env: list[dict[str, Any]] = [{"name": RESTART_ENV, "value": str(restarts)}]
    for tracker in trackers:
        key_env = BACKENDS[tracker.name].key_env
        if tracker.api_key_secret is not None and key_env is not None:
            ref = tracker.api_key_secret
            env.append({"name": key_env, "valueFrom": {"secretKeyRef": {"name": ref.name, "key": ref.key}}})
    return env


def tracker_env_names(job: RLJob) -> dict[str, int]:
    """The variables the operator sets from `logging.trackers[i]`, by the entry's index."""
    names = {RESTART_ENV: -1} if job.spec.logging.trackers else {}
    for i, tracker in enumerate(job.spec.logging.trackers):
        key_env = BACKENDS[tracker.name].key_env
        if tracker.api_key_secret is not None and key_env is not None:
            names[key_env] = i
    return names
