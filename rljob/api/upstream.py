"""Jobs that start from another job's model: which fields name an upstream RLJob, and the spec with them resolved.

A pipeline (`sft` -> `reward_model` -> `grpo`) chains by name: `model.source: job`, `model.reference.source: job`,
`algorithm.distill.teacher.source: job`, `reward.functions[i].model.job` and `reward.functions[i].judge.job` name
an RLJob whose exported model they load. The launchers resolve those names to directories (the operator to the
upstream job's checkpoint volume mounted read-only, `rljob run` to a finished local run), and the roles only ever
see `source: local` (or a path) there.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from rljob.api.job import RLJob
from rljob.api.spec import RLJobSpec, RoleName

EXPORT_DIR_NAME = "model"
"""The trained model's Hugging Face export: in the run directory locally, beside the checkpoints in a pod (the
root of the job's checkpoint volume), where a downstream job's `source: job` finds it."""


@dataclass(frozen=True)
class JobReference:
    """One field naming an upstream RLJob."""

    field: str
    """The field, e.g. `spec.model.job`."""
    job: str
    """The upstream RLJob's name."""
    roles: tuple[RoleName, ...]
    """The roles whose processes load that model."""


def job_references(spec: RLJobSpec) -> list[JobReference]:
    """Every field of `spec` that names an upstream RLJob, in spec order."""
    refs: list[JobReference] = []
    model = spec.model
    if model.source == "job" and model.job:
        # The rollouts (and a VLA policy's rollout) load the starting weights as the actor does.
        refs.append(JobReference("spec.model.job", model.job, ("actor", "rollout")))
    reference = model.reference
    if reference is not None and reference.source == "job" and reference.job:
        refs.append(JobReference("spec.model.reference.job", reference.job, ("actor",)))
    distill = spec.algorithm.distill
    if distill is not None and distill.teacher.source == "job" and distill.teacher.job:
        refs.append(JobReference("spec.algorithm.distill.teacher.job", distill.teacher.job, ("actor",)))
    for i, function in enumerate(spec.reward.functions):
        if function.model is not None and function.model.job:
            refs.append(JobReference(f"spec.reward.functions[{i}].model.job", function.model.job, ("reward",)))
        if function.judge is not None and function.judge.job:
            refs.append(JobReference(f"spec.reward.functions[{i}].judge.job", function.judge.job, ("reward",)))
    return refs


def upstream_jobs(spec: RLJobSpec) -> list[str]:
    """The distinct upstream RLJob names, in spec order."""
    return list(dict.fromkeys(ref.job for ref in job_references(spec)))


def resolve_job_references(job: RLJob, model_dir: Callable[[JobReference], str]) -> RLJob:
    """A copy of `job` whose job-sourced models are `source: local` at `model_dir(reference)`; `job` is unchanged."""
    refs = job_references(job.spec)
    if not refs:
        return job
    resolved = job.model_copy(deep=True)
    spec = resolved.spec
    for ref in refs:
        path = model_dir(ref)
        if ref.field == "spec.model.job":
            spec.model.source, spec.model.path, spec.model.job = "local", path, None
        elif ref.field == "spec.model.reference.job":
            assert spec.model.reference is not None
            spec.model.reference.source, spec.model.reference.path = "local", path
            spec.model.reference.job = None
        elif ref.field == "spec.algorithm.distill.teacher.job":
            assert spec.algorithm.distill is not None
            teacher = spec.algorithm.distill.teacher
            teacher.source, teacher.path, teacher.job = "local", path, None
        else:
            index = int(ref.field.split("[", 1)[1].split("]", 1)[0])
            function = spec.reward.functions[index]
            named = function.judge if ref.field.endswith(".judge.job") else function.model
            assert named is not None
            named.path, named.job = path, None
    return resolved
