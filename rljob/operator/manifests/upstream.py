"""A job that starts from another RLJob's model (`source: job`): that job's checkpoint volume, read-only.

An llm job's pods export the trained model to `<checkpoint.dir>/model`, the root of its checkpoint claim
(rljob/operator/manifests/storage.py). A downstream job gets the upstream's claim as a read-only volume at
`/rljob/jobs/<upstream>` in each role that loads the model (rljob/api/upstream.py says which), and its config reads
`source: local` at `/rljob/jobs/<upstream>/model`. The controller creates the downstream pods only once the
upstream job has succeeded (rljob/operator/controller.py); this module is the pure part.
"""

from __future__ import annotations

import posixpath
from collections.abc import Mapping

from rljob.api import RLJob
from rljob.api.kubernetes import Volume, VolumeMount
from rljob.api.upstream import EXPORT_DIR_NAME, JobReference, job_references, resolve_job_references

UPSTREAM_ROOT = "/rljob/jobs"


def upstream_mount_path(job: str) -> str:
    return posixpath.join(UPSTREAM_ROOT, job)


def default_upstream_claim(job: str) -> str:
    """The claim the operator makes for an upstream job that brings no storage of its own."""
    return f"{job}-checkpoints"


def mount_upstream(job: RLJob, claims: Mapping[str, str]) -> RLJob:
    """A copy of `job` whose job-sourced models read `/rljob/jobs/<upstream>/model`, with each upstream's claim
    (`claims[name]`) mounted read-only there in the roles that load it; `job` itself is unchanged."""
    refs = job_references(job.spec)
    if not refs:
        return job

    def model_dir(ref: JobReference) -> str:
        return posixpath.join(upstream_mount_path(ref.job), EXPORT_DIR_NAME)

    resolved = resolve_job_references(job, model_dir)
    upstreams = list(dict.fromkeys(ref.job for ref in refs))
    for index, upstream in enumerate(upstreams):
        volume_name = f"upstream-{index}"  # an upstream's own name may be 63 characters: no room for a prefix
        roles = {role for ref in refs if ref.job == upstream for role in ref.roles}
        for role in sorted(roles):
            spec = resolved.spec.roles.get(role)
            spec.volumes.append(
                Volume(name=volume_name, persistentVolumeClaim={"claimName": claims[upstream], "readOnly": True})
            )
            spec.volume_mounts.append(
                VolumeMount(name=volume_name, mountPath=upstream_mount_path(upstream), readOnly=True)
            )
    return resolved
