"""`rljob run` end to end: a model exported by an `sft` job is the teacher of a `distill` job."""

from __future__ import annotations

import statistics

import pytest

QUIET = ("--set=spec.logging.tensorboard=false", "--quiet")


@pytest.mark.slow
def test_a_student_distilled_from_an_sft_teacher_moves_towards_it_and_another_tokenizer_is_refused(
    repo, tmp_path, start_run
):
    teacher = start_run(
        repo / "examples/sft-tiny.yaml",
        "--set=spec.trainer.steps=80",
        "--set=spec.evaluation.interval=0",
        "--set=spec.checkpoint.interval=0",
        *QUIET,
        name="teacher",
    )
    output = teacher.finish()
    assert teacher.process.returncode == 0, output

    settings = (
        f"--set=spec.algorithm.distill.teacher.path={teacher.out / 'model'}",
        "--set=spec.trainer.steps=40",
        "--set=spec.trainer.learningRate=0.002",
        "--set=spec.evaluation.interval=0",
        "--set=spec.checkpoint.interval=0",
    )
    run = start_run(repo / "examples/distill-tiny.yaml", *settings, *QUIET, name="student")
    output = run.finish()
    assert run.process.returncode == 0, output
    steps = [r for r in run.metrics() if "distill_kl" in r]
    assert [r["step"] for r in steps] == list(range(1, 41))
    kl = [r["distill_kl"] for r in steps]
    # The student starts from random weights: its samples are far from what the teacher would write.
    assert statistics.mean(kl[:5]) > 2.0, kl
    assert statistics.mean(kl[-10:]) < 0.8 * statistics.mean(kl[:5]), kl
    assert all(r["kl"] == 0.0 for r in steps)  # no reference model: distill's preset has no KL penalty

    # A student whose tokenizer reads other characters (its system prompt adds some) cannot be scored by it.
    other = start_run(
        repo / "examples/distill-tiny.yaml",
        *settings,
        "--set=spec.task.llm.systemPrompt=Sum",
        *QUIET,
        name="other-tokenizer",
    )
    output = other.finish(timeout=180)
    assert other.process.returncode != 0
    assert "spec.algorithm.distill.teacher: the teacher's tokenizer differs from the student's" in output, output
    assert not [r for r in other.metrics() if "distill_kl" in r]
