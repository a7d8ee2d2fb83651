"""Pipelines by name: a job whose model comes from another RLJob (`source: job`) waits for that job to succeed.

`kubectl apply -f pipeline.yaml` can post an `sft` job and the `grpo` job that starts from it together: the
downstream job's children are built at once (its config reads the upstream's export at `/rljob/jobs/<name>/model`,
rljob/operator/manifests/upstream.py), but its pods are held, as a job over its quota is, until every upstream job
has succeeded, with `Ready=False WaitingForJob` saying which job it waits for and why. The upstream's status
comes from this operator's own view of it (no API request).
"""

from __future__ import annotations

from dataclasses import dataclass

from rljob.api import RLJob
from rljob.api.upstream import job_references
from rljob.operator.manifests.checks import checkpoint_claim
from rljob.operator.manifests.upstream import default_upstream_claim

WAITING_FOR_JOB = "WaitingForJob"
UPSTREAM_RETRY_SECONDS = 10.0
"""How soon a waiting job looks again; an upstream's own events wake it sooner."""


@dataclass(frozen=True)
class Upstream:
    """What this operator knows of one upstream RLJob."""

    name: str
    field: str
    """The first field naming it, e.g. `spec.model.job`."""
    phase: str | None
    """Its phase; None: no RLJob of that name in the namespace."""
    claim: str | None
    """Its checkpoint claim, where its model is exported; None: it keeps no persistent one."""


def upstream_claim(upstream: RLJob | None, name: str) -> str | None:
    """The claim an upstream job exports to: its own or the operator's; the operator's default name while the job
    is unknown (its pods are held until it is known and succeeded anyway)."""
    return default_upstream_claim(name) if upstream is None else checkpoint_claim(upstream)


def first_fields(job: RLJob) -> dict[str, str]:
    """Each upstream job's name and the first field naming it, in spec order."""
    fields: dict[str, str] = {}
    for ref in job_references(job.spec):
        fields.setdefault(ref.job, ref.field)
    return fields


def upstream_wait(namespace: str, upstreams: list[Upstream]) -> tuple[str, str] | None:
    """(WaitingForJob, why) while some upstream job has not succeeded or keeps its model nowhere reachable; None
    when the pods may start."""
    for up in upstreams:
        named = f"RLJob {up.name!r} ({up.field})"
        if up.phase is None:
            why = (
                f"{named} does not exist in namespace {namespace}: this job's pods start from its exported model "
                "once it has succeeded; create it, or fix the name"
            )
        elif up.phase == "Failed":
            why = (
                f"{named} Failed, so it exported no model: this job waits until it succeeds (fix and re-apply "
                "it), or name another model"
            )
        elif up.phase != "Succeeded":
            why = f"{named} is {up.phase}: this job's pods start from its exported model once it has succeeded"
        elif up.claim is None:
            why = (
                f"{named} kept its checkpoints on no persistent claim (checkpoint.storage.persistent false, or a "
                "volume of its own), so its exported model is not reachable by name: give it a claim "
                "(checkpoint.volumeClaim) or name the model's directory with source local and path"
            )
        else:
            continue
        return WAITING_FOR_JOB, why
    return None
