"""`rljob run` end to end: a reward model trained by a `reward_model` job is the reward of a GRPO job."""

from __future__ import annotations

import itertools
import statistics

import pytest
import yaml

QUIET = ("--set=spec.logging.tensorboard=false", "--quiet")


@pytest.mark.slow
def test_a_reward_model_from_a_reward_model_job_drives_grpo_and_its_reward_rises(repo, tmp_path, start_run):
    from rljob.api import load_job_file
    from rljob.api.spec import RewardModelRef
    from rljob.runtime.llm.data.rows import load_rows
    from rljob.runtime.llm.episodes.reward_model import RewardModel

    trained = start_run(
        repo / "examples/reward-model-tiny.yaml",
        "--set=spec.trainer.steps=100",
        "--set=spec.evaluation.interval=0",
        "--set=spec.checkpoint.interval=0",
        *QUIET,
        name="reward-model",
    )
    output = trained.finish()
    assert trained.process.returncode == 0, output
    export = trained.out / "model"

    manifest = yaml.safe_load((repo / "examples/grpo-tiny-arithmetic.yaml").read_text())
    spec = manifest["spec"]
    # The model is the whole reward; exact_match rides along at weight 0, reported but not trained on.
    spec["reward"]["functions"] = [
        {"model": {"path": str(export), "batchSize": 64}},
        {"builtin": "exact_match", "weight": 0.0},
    ]
    spec["trainer"].update(steps=20, batchSize=16)  # 128 responses a step
    spec["evaluation"] = {"interval": 0}
    spec["checkpoint"] = {"interval": 0}
    job = tmp_path / "grpo-reward-model.yaml"
    job.write_text(yaml.safe_dump(manifest))
    run = start_run(job, *QUIET, name="grpo")
    output = run.finish()
    assert run.process.returncode == 0, output
    steps = [r for r in run.metrics() if "reward_mean" in r]
    assert [r["step"] for r in steps] == list(range(1, 21))

    # The reward is the model's score: the only weighted term, different per sample and per step ...
    means = [r["reward/reward_model"] for r in steps]
    assert [r["reward_mean"] for r in steps] == pytest.approx(means, abs=1e-5)
    assert all(r["reward_std"] > 0 for r in steps)
    assert len(set(means)) > 10
    # ... within what the model scores any response the policy can write (up to 2 characters of its vocabulary) ...
    task = load_job_file(job).spec.task.llm
    assert task is not None
    prompts = sorted({row["prompt"] for row in load_rows(task, seed=0)})
    alphabet = "0123456789+="
    responses = ["", *alphabet, *("".join(pair) for pair in itertools.product(alphabet, repeat=2))]
    model = RewardModel(RewardModelRef(path=str(export), batch_size=512), None, "cpu")
    scores = model.score([(p, r) for p in prompts for r in responses])
    assert all(min(scores) <= m <= max(scores) for m in means), (min(scores), max(scores), means)
    # ... and GRPO raises it: the mean of the last 5 steps is well above that of the first 3 (measured on 2 shared
    # cores, seed 0: -0.73 -> 0.54, in a score range of -3.0 to 3.0 over those responses).
    assert statistics.mean(means[-5:]) > statistics.mean(means[:3]) + 0.5, means
