"""The PersistentVolumeClaim the operator makes for a job's checkpoints, so they outlive the actor pod.

Made when the job names no claim of its own (`checkpoint.volumeClaim`) and mounts no volume of its own at the
checkpoint directory in actor pods (`rljob.operator.manifests.checks.operator_checkpoint_claim`). Size and storage
class come from `spec.checkpoint.storage`, else from the operator's settings (the chart's values), else the
cluster's default StorageClass. ReadWriteMany when several pods mount it (several actor pods, or rollouts that
read weight files from it), ReadWriteOnce otherwise, unless `storage.accessMode` says (a later job's pods on
several nodes mount the exported model, rljob/operator/manifests/upstream.py). The RLJob owns it (deleting the job
deletes it) unless `storage.retain`: then it has no owner and the job applied again under the same name mounts it
again.
"""

from __future__ import annotations

from typing import Any

from rljob.api import RLJob
from rljob.operator.manifests.checks import operator_checkpoint_claim, weights_through_files
from rljob.operator.manifests.gang import replica_counts
from rljob.operator.naming import child_metadata
from rljob.operator.settings import OperatorSettings


def checkpoint_access_mode(job: RLJob) -> str:
    chosen = job.spec.checkpoint.storage.access_mode
    if chosen is not None:
        return chosen
    several = replica_counts(job)["actor"] > 1 or weights_through_files(job)
    return "ReadWriteMany" if several else "ReadWriteOnce"


def checkpoint_storage_class(job: RLJob, settings: OperatorSettings) -> str | None:
    """The StorageClass the claim names; None: the cluster's default one."""
    return job.spec.checkpoint.storage.storage_class_name or settings.checkpoint_storage_class or None


def build_checkpoint_claim(job: RLJob, settings: OperatorSettings) -> dict[str, Any] | None:
    """The job's checkpoint claim, or None when the job brings its own storage or writes no checkpoints."""
    name = operator_checkpoint_claim(job)
    if name is None:
        return None
    storage = job.spec.checkpoint.storage
    metadata = child_metadata(job, name, "checkpoints")
    if storage.retain:
        metadata.pop("ownerReferences", None)  # kept after the job: the garbage collector must not take it
    spec: dict[str, Any] = {
        "accessModes": [checkpoint_access_mode(job)],
        "resources": {"requests": {"storage": str(storage.size or settings.checkpoint_volume_size)}},
    }
    storage_class = checkpoint_storage_class(job, settings)
    if storage_class:
        spec["storageClassName"] = storage_class
    return {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": metadata, "spec": spec}
