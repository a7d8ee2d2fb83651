"""The ConfigMap holding the resolved job, read by every role at `CONFIG_PATH_IN_POD`."""

from __future__ import annotations

import hashlib
import json
from typing import Any

from rljob.api import RLJob
from rljob.operator.manifests.yamltext import dump as dump_yaml
from rljob.operator.naming import CONFIG_KEY, child_metadata, config_map_name
from rljob.operator.settings import OperatorSettings

Manifest = dict[str, Any]


def resolved_job_document(job: RLJob) -> dict[str, Any]:
    """The resolved job as roles read it: spec with every default, and only the stable metadata.

    Server-set metadata (uid, resourceVersion, managedFields) and annotations (kopf writes its
    progress there) change on every reconcile; leaving them out keeps the config and its hash stable.
    """
    document = job.model_dump(mode="json", by_alias=True, exclude_none=True, exclude={"status"})
    metadata = {"name": job.name}
    if job.metadata.namespace:
        metadata["namespace"] = job.metadata.namespace
    if job.metadata.labels:
        metadata["labels"] = dict(job.metadata.labels)
    document["metadata"] = metadata
    return document


def resolved_job_yaml(job: RLJob) -> str:
    return dump_yaml(resolved_job_document(job))


RESTART_FREE_FIELDS: tuple[tuple[str, ...], ...] = (
    ("roles", "rollout", "replicas"),
    ("roles", "rollout", "autoscale"),  # read by the operator (and `rljob run`), never by a pod
    ("health",),  # thresholds the operator (and `rljob run`) checks the actor's reports against
    ("suspend",),
    ("failurePolicy",),
    ("activeDeadlineSeconds",),
    ("ttlSecondsAfterFinished",),
    ("isolation",),  # the job's NetworkPolicy, which the operator keeps; no pod reads it
)
"""Spec fields whose edits never recreate running pods; any other spec edit is a controlled restart.

Rollout replicas are restart-free only for llm tasks, where rollouts are interchangeable generation
servers. In a gym task each rollout replica steps a fixed share of the env replicas, fixed when the
actor group starts, so a new count takes effect through a controlled restart (no restart budget used).
"""


def restart_relevant(spec: dict[str, Any]) -> dict[str, Any]:
    """The spec without the fields that can change under running pods. `spec` is left as it is; the result shares
    what it keeps with it (only the mappings on the way to a removed field are copied), so read it, never change it."""
    trimmed: dict[str, Any] = dict(spec)
    gym = (spec.get("task") or {}).get("type") == "gym"
    for path in RESTART_FREE_FIELDS:
        if gym and path == ("roles", "rollout", "replicas"):
            continue
        node: dict[str, Any] | None = trimmed
        for part in path[:-1]:
            child = node.get(part)
            if not isinstance(child, dict):
                node = None  # nothing there to remove
                break
            child = node[part] = dict(child)
            node = child
        if node is not None:
            node.pop(path[-1], None)
    return trimmed


def config_hash(job: RLJob) -> str:
    """A short digest of what the pods run: pods carry it, so the reconciler tells old-spec pods from new.

    Only the restart-relevant spec counts (`restart_relevant`): an edit that applies in place (failure
    policy, llm rollout replicas, deadlines) keeps the hash, so running pods are not mistaken for stale
    ones. Taken over canonical JSON, so it does not depend on the YAML emitter at hand."""
    spec = restart_relevant(resolved_job_document(job)["spec"])
    canonical = json.dumps(spec, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


def build_config_map(job: RLJob, settings: OperatorSettings) -> Manifest:
    del settings  # the config is the job itself; the signature matches the other builders
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": child_metadata(job, config_map_name(job), "config"),
        "data": {CONFIG_KEY: resolved_job_yaml(job)},
    }
