"""`source: job` on this machine: an upstream RLJob's model is the `model/` export of its newest finished local run.

`rljob run` writes each run to `runs/<job>-<timestamp>/` (or `--out`) and exports the trained model to `model/`
only when the run completes, so a finished run of job `sft` is a directory beside this run's named `sft` or
`sft-<timestamp>` holding `model/config.json`. The newest one wins, as the operator uses the job's latest export.
"""

from __future__ import annotations

import re
from pathlib import Path

from rljob.api import InvalidRLJob, Problem, RLJob
from rljob.api.upstream import JobReference, job_references, resolve_job_references

_RUN_SUFFIX = re.compile(r"-\d{8}-\d{6}")


def local_exports(runs_root: Path, job: str) -> list[Path]:
    """The `model/` exports of `job`'s finished runs under `runs_root`, newest first."""
    if not runs_root.is_dir():
        return []
    found = []
    for run in runs_root.iterdir():
        named = run.name == job or (run.name.startswith(job) and _RUN_SUFFIX.fullmatch(run.name[len(job) :]))
        model = run / "model"
        if named and (model / "config.json").is_file():
            found.append(model)
    return sorted(found, key=lambda model: (model / "config.json").stat().st_mtime, reverse=True)


def resolve_local_upstream(job: RLJob, runs_root: Path) -> RLJob:
    """`job` with every job-sourced model replaced by the newest local export; InvalidRLJob naming each field
    whose job has no finished run under `runs_root`."""
    refs = job_references(job.spec)
    if not refs:
        return job
    exports = {ref.job: local_exports(runs_root, ref.job) for ref in refs}
    problems = [
        Problem(
            ref.field,
            f"no finished run of RLJob {ref.job!r} under {runs_root} (a {ref.job}/ or {ref.job}-<timestamp>/ "
            "directory with an exported model/): run it first with `rljob run` (its default --out is there), or "
            "name the model's directory with source local and path",
        )
        for ref in refs
        if not exports[ref.job]
    ]
    if problems:
        raise InvalidRLJob(problems)

    def newest(ref: JobReference) -> str:
        return str(exports[ref.job][0].resolve())

    return resolve_job_references(job, newest)
