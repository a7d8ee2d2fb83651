"""`rljob run` end to end: a model exported by an `sft` job is the teacher of a `distill` job (full or LoRA student)."""

from __future__ import annotations

import statistics

import pytest
import torch
import yaml

from rljob.runtime.records.checkpoint import CheckpointManager

QUIET = ("--set=spec.logging.tensorboard=false", "--quiet")


@pytest.mark.slow
def test_a_student_distilled_from_an_sft_teacher_moves_towards_it_with_or_without_lora_and_another_tokenizer_is_refused(
    repo, tmp_path, start_run
):
    teacher = start_run(
        repo / "examples/sft-tiny.yaml",
        "--set=spec.trainer.steps=80",
        "--set=spec.evaluation.interval=0",
        "--set=spec.checkpoint.interval=0",
        *QUIET,
        name="sft-tiny",  # the job's name: the student's `teacher: {source: job, job: sft-tiny}` finds this run
    )
    output = teacher.finish()
    assert teacher.process.returncode == 0, output

    settings = (
        "--set=spec.trainer.steps=40",
        "--set=spec.trainer.learningRate=0.002",
        "--set=spec.evaluation.interval=0",
        "--set=spec.checkpoint.interval=0",
    )
    run = start_run(repo / "examples/distill-tiny.yaml", *settings, *QUIET, name="student")
    output = run.finish()
    assert run.process.returncode == 0, output
    # `teacher: {source: job, job: sft-tiny}` became the export of the finished run of that name beside this one.
    teacher_spec = yaml.safe_load((run.out / "job.yaml").read_text())["spec"]["algorithm"]["distill"]["teacher"]
    assert teacher_spec["source"] == "local" and teacher_spec["path"] == str((teacher.out / "model").resolve())
    steps = [r for r in run.metrics() if "distill_kl" in r]
    assert [r["step"] for r in steps] == list(range(1, 41))
    kl = [r["distill_kl"] for r in steps]
    # The student starts from random weights: its samples are far from what the teacher would write.
    assert statistics.mean(kl[:5]) > 2.0, kl
    assert statistics.mean(kl[-10:]) < 0.8 * statistics.mean(kl[:5]), kl
    assert all(r["kl"] == 0.0 for r in steps)  # no reference model: distill's preset has no KL penalty

    # With model.lora the same student trains only its adapters against the same teacher; the rollout samples from
    # the merged weights it receives, and checkpoints hold the adapters.
    lora = start_run(
        repo / "examples/distill-tiny.yaml",
        *settings,
        "--set=spec.trainer.steps=4",
        "--set=spec.checkpoint.interval=2",
        "--set=spec.model.lora.rank=4",
        *QUIET,
        name="lora-student",
    )
    output = lora.finish()
    assert lora.process.returncode == 0, output
    records = lora.metrics()
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert all(r["distill_kl"] > 0.0 and r["mismatch_kl"] < 1e-6 for r in records), records
    assert "adapter parameters train" in (lora.out / "logs" / "actor-0.log").read_text()
    latest = CheckpointManager(lora.out / "checkpoints").latest_valid()
    assert latest is not None and all(".lora_" in k for k in latest[1]["learner"]["model"])

    # A student whose tokenizer reads other characters (its system prompt adds some) cannot be scored by it: the
    # actor refuses the teacher before the first step (FatalConfigError: the role exits with the config code).
    from rljob.api import load_job_file
    from rljob.runtime.llm.actor import load_teacher
    from rljob.runtime.llm.data.rows import load_rows
    from rljob.runtime.llm.models.policy import build_char_tokenizer, tokenizer_texts
    from rljob.runtime.wire.context import FatalConfigError

    spec = load_job_file(repo / "examples/distill-tiny.yaml").spec
    spec.algorithm.distill.teacher.source, spec.algorithm.distill.teacher.path = "local", str(teacher.out / "model")
    task = spec.task.llm
    task.system_prompt = "Sum"
    rows = load_rows(task, seed=0, base_dir=repo)
    student_tokenizer = build_char_tokenizer(tokenizer_texts(task, rows))
    with pytest.raises(FatalConfigError, match=r"spec\.algorithm\.distill\.teacher: the teacher's tokenizer differs"):
        load_teacher(spec, task, rows, torch.device("cpu"), student_tokenizer)
