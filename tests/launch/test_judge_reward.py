"""`rljob run` end to end: a generative judge trained by an `sft` job is the reward of a GRPO job."""

from __future__ import annotations

import statistics

import pytest
import yaml

QUIET = ("--set=spec.logging.tensorboard=false", "--quiet")


@pytest.mark.slow
def test_a_judge_from_an_sft_job_scores_grpo_responses_its_verdicts_reach_the_metrics_and_its_reward_rises(
    repo, tmp_path, start_run
):
    trained = start_run(repo / "examples/judge-tiny.yaml", "--set=spec.evaluation.interval=0", *QUIET, name="judge")
    output = trained.finish()
    assert trained.process.returncode == 0, output

    manifest = yaml.safe_load((repo / "examples/grpo-tiny-judge.yaml").read_text())
    spec = manifest["spec"]
    judge = spec["reward"]["functions"][0]
    assert judge["name"] == "judge" and judge["weight"] == 1.0
    judge["judge"]["path"] = str(trained.out / "model")
    # The rule the judge was taught (a one-digit answer), computed beside it at weight 0: reported, not trained on.
    spec["reward"]["functions"].append({"builtin": "format", "weight": 0.0, "args": {"pattern": "^[0-9]$"}})
    spec["trainer"]["steps"] = 20
    job = tmp_path / "grpo-judge.yaml"
    job.write_text(yaml.safe_dump(manifest))
    run = start_run(job, *QUIET, name="grpo")
    output = run.finish()
    assert run.process.returncode == 0, output
    steps = [r for r in run.metrics() if "reward_mean" in r]
    assert [r["step"] for r in steps] == list(range(1, 21))

    # Every verdict was parsed (none fell back to onUnparsed), none failed, and the reward is the judge's term alone.
    assert all(r["reward_unparsed/judge"] == 0.0 and r["reward_errors/judge"] == 0 for r in steps)
    verdicts = [r["reward/judge"] for r in steps]
    assert [r["reward_mean"] for r in steps] == pytest.approx(verdicts, abs=1e-5)
    # The verdicts are the judge's reading of each response: they agree with the rule it learned, step by step
    # (measured on 2 shared cores, seed 0: equal at every step).
    rule = [r["reward/format"] for r in steps]
    assert statistics.mean(abs(v - f) for v, f in zip(verdicts, rule, strict=True)) < 0.03, (verdicts, rule)
    # GRPO on the verdicts teaches the policy to answer with one digit (measured: 0.33 -> 0.79 over these steps).
    assert statistics.mean(verdicts[-5:]) > statistics.mean(verdicts[:3]) + 0.25, verdicts
