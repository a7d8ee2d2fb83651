"""`source: job` under `rljob run`: the newest finished local run of that job, beside this run's directory."""

from __future__ import annotations

import os

import pytest

from rljob.api import InvalidRLJob, load_job_file
from rljob.launch.upstream import local_exports, resolve_local_upstream


def export(root, run: str, mtime: float) -> None:
    model = root / run / "model"
    model.mkdir(parents=True)
    (model / "config.json").write_text("{}")
    os.utime(model / "config.json", (mtime, mtime))


def test_the_newest_finished_run_of_exactly_that_job_is_taken(tmp_path):
    export(tmp_path, "sft-20261101-080000", 1_000)
    export(tmp_path, "sft", 2_000)
    export(tmp_path, "sft-20261102-080000", 3_000)
    export(tmp_path, "sft-tiny-20261103-080000", 9_000)  # another job whose name starts the same
    (tmp_path / "sft-20261104-080000" / "model").mkdir(parents=True)  # a run that did not finish: no export
    assert [p.parent.name for p in local_exports(tmp_path, "sft")] == [
        "sft-20261102-080000",
        "sft",
        "sft-20261101-080000",
    ]


def test_the_teacher_becomes_the_local_export_and_a_missing_run_names_the_field(repo, tmp_path):
    job = load_job_file(repo / "examples/distill-tiny.yaml")
    with pytest.raises(InvalidRLJob) as missing:
        resolve_local_upstream(job, tmp_path)
    (problem,) = missing.value.problems
    assert problem.path == "spec.algorithm.distill.teacher.job"
    assert "no finished run of RLJob 'sft-tiny'" in problem.message and "rljob run" in problem.message

    export(tmp_path, "sft-tiny-20261129-050000", 1_000)
    resolved = resolve_local_upstream(job, tmp_path)
    teacher = resolved.spec.algorithm.distill.teacher
    assert (teacher.source, teacher.path, teacher.job) == (
        "local",
        str(tmp_path / "sft-tiny-20261129-050000/model"),
        None,
    )
    assert job.spec.algorithm.distill.teacher.source == "job"  # the loaded job is left as written
