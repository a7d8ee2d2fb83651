"""`rljob run` of the tiny coding example end to end with code_exec, and its bad input refused before start."""

from __future__ import annotations

import pytest
import yaml

from rljob.runtime.wire.identity import EXIT_FATAL_CONFIG

EXAMPLE = "examples/grpo-tiny-code.yaml"
SHORT = ("--set=spec.trainer.batchSize=4", "--set=spec.logging.tensorboard=false", "--quiet")


@pytest.mark.slow
def test_grpo_tiny_code_runs_its_programs_in_the_sandbox_end_to_end(repo, start_run):
    run = start_run(repo / EXAMPLE, "--set=spec.trainer.steps=2", *SHORT)
    output = run.finish()
    assert run.process.returncode == 0, output
    assert "reached trainer.steps (2)" in output
    records = run.metrics()
    assert [r["step"] for r in records] == [1, 2]
    for record in records:
        assert 0.0 <= record["reward/code_exec"] <= 1.0
        assert record["reward_errors/code_exec"] == 0  # short one-liners: nothing for the sandbox to stop
    assert not run.roles()


def write_code_job(repo, tmp_path, **reward_args) -> str:
    job = yaml.safe_load((repo / EXAMPLE).read_text())
    job["spec"]["task"]["llm"]["dataset"]["path"] = str(repo / "examples" / "data" / "tiny-code.jsonl")
    job["spec"]["reward"]["functions"][0]["args"] = reward_args
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    return path


@pytest.mark.slow
def test_a_tests_column_missing_from_the_dataset_is_refused_before_any_role_starts(repo, tmp_path, start_run):
    run = start_run(write_code_job(repo, tmp_path, tests="unit_tests"), "--set=spec.trainer.steps=2", "--quiet")
    output = run.finish(timeout=120)
    assert run.process.returncode != 0
    assert "spec.reward.functions[0].args.tests: row 0 of the dataset has no column 'unit_tests'" in output, output
    assert "Traceback" not in output, output
    assert not run.roles()


def test_reward_columns_are_checked_against_every_row_as_the_rollout_does_at_start():
    # The same check makes the rollout role exit EXIT_FATAL_CONFIG when a pod reads such a dataset.
    from rljob.api.spec import RewardSpec
    from rljob.runtime.llm.episodes.rewards import check_reward_columns

    spec = RewardSpec.model_validate({"functions": [{"builtin": "exact_match"}, {"builtin": "code_exec"}]})
    rows = [{"prompt": "p", "answer": "1", "tests": "assert True"}, {"prompt": "p", "answer": "1", "tests": "x = 1"}]
    assert check_reward_columns(spec, rows) == [
        ("spec.reward.functions[1].args.tests", "row 1: the tests hold no assert statement")
    ]
    assert check_reward_columns(spec, rows[:1]) == []
    assert EXIT_FATAL_CONFIG == 78
