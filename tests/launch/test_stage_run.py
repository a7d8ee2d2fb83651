"""`rljob run` of the offline stages end to end: the sft and dpo examples learn, resume, and refuse bad rows."""

from __future__ import annotations

import json

import pytest
import torch
import yaml

from rljob.runtime.records.checkpoint import CheckpointManager

SFT = "examples/sft-tiny.yaml"
DPO = "examples/dpo-tiny.yaml"
QUIET = ("--set=spec.logging.tensorboard=false", "--quiet")


def evals(records: list[dict], key: str) -> list[float]:
    return [r[key] for r in records if key in r]


@pytest.mark.slow
def test_the_sft_example_lowers_its_loss_evaluates_checkpoints_and_exports_with_the_actor_alone(repo, start_run):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    run = start_run(
        repo / SFT,
        "--set=spec.trainer.steps=60",
        "--set=spec.evaluation.interval=20",
        "--set=spec.checkpoint.interval=30",
        *QUIET,
    )
    output = run.finish()
    assert run.process.returncode == 0, output
    assert "reached trainer.steps (60)" in output
    records = run.metrics()
    assert [r["step"] for r in records] == list(range(1, 61))
    assert {r["stage"] for r in records} == {"sft"}
    first, last = records[:5], records[-5:]
    assert sum(r["loss"] for r in last) < 0.5 * sum(r["loss"] for r in first)
    held_out_loss = evals(records, "eval_loss")
    assert len(held_out_loss) == 3 and held_out_loss[-1] < held_out_loss[0]
    assert all(0.0 <= x <= 1.0 for x in evals(records, "eval_exact_match"))
    assert evals(records, "eval_examples") == [20, 20, 20]
    assert sorted(p.name for p in (run.out / "logs").iterdir()) == ["actor-0.log"]  # no rollout, env or reward
    steps = [p.name for _, p in CheckpointManager(run.out / "checkpoints").checkpoints()]
    assert steps == ["step-00000030", "step-00000060"]
    assert (run.out / "checkpoints" / "hf-latest" / "config.json").exists()
    model = AutoModelForCausalLM.from_pretrained(run.out / "model").eval()
    tokenizer = AutoTokenizer.from_pretrained(run.out / "model")
    assert model.config.vocab_size == len(tokenizer)


@pytest.mark.slow
def test_the_dpo_example_raises_held_out_preference_accuracy_and_margin(repo, start_run):
    run = start_run(repo / DPO, "--set=spec.trainer.steps=100", "--set=spec.checkpoint.interval=0", *QUIET)
    output = run.finish()
    assert run.process.returncode == 0, output
    records = run.metrics()
    accuracy = evals(records, "eval_preference_accuracy")
    margin = evals(records, "eval_reward_margin")
    assert len(accuracy) == 4  # steps 25, 50, 75, 100, on 45 held-out pairs whose prompts were never trained on
    assert accuracy[-1] >= accuracy[0] + 0.1, accuracy
    assert margin[-1] > margin[0] > 0.0, margin
    for record in records:
        assert 0.0 <= record["preference_accuracy"] <= 1.0
        assert record["reward_margin"] == pytest.approx(record["rewards_chosen"] - record["rewards_rejected"])


@pytest.mark.slow
def test_a_rerun_resumes_the_stage_where_its_checkpoint_left_it(repo, start_run):
    settings = ("--set=spec.checkpoint.interval=3", "--set=spec.evaluation.interval=0", *QUIET)
    straight = start_run(repo / DPO, "--set=spec.trainer.steps=6", *settings, name="straight")
    assert straight.finish() is not None and straight.process.returncode == 0
    first = start_run(repo / DPO, "--set=spec.trainer.steps=3", *settings, name="resumed")
    output = first.finish()
    assert first.process.returncode == 0, output
    again = start_run(repo / DPO, "--set=spec.trainer.steps=6", *settings, name="resumed")
    output = again.finish()
    assert again.process.returncode == 0, output
    assert "step-00000003 (step 3)" in (again.out / "logs" / "actor-0.log").read_text()
    records = again.metrics()
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    # The same rows in the same order from the same weights and optimizer state: the steps of an uninterrupted run.
    expected = [r["loss"] for r in straight.metrics()]
    assert [r["loss"] for r in records] == pytest.approx(expected, rel=1e-5)


@pytest.mark.slow
def test_a_preference_row_missing_a_side_stops_the_job_before_training_naming_row_and_field(repo, tmp_path, start_run):
    rows = [json.loads(line) for line in (repo / "examples/data/tiny-sums-dpo.jsonl").read_text().splitlines()]
    del rows[7]["rejected"]
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    job = yaml.safe_load((repo / DPO).read_text())
    job["spec"]["task"]["llm"]["dataset"]["path"] = str(data)
    manifest = tmp_path / "job.yaml"
    manifest.write_text(yaml.safe_dump(job))
    run = start_run(manifest, *QUIET)
    output = run.finish()
    assert run.process.returncode != 0, output
    assert "spec.task.llm.dataset: 1 of 225 rows are not dpo rows: row 7 has no 'rejected'" in output, output
    assert run.metrics() == []  # nothing trained


@pytest.mark.slow
def test_the_reward_model_example_ranks_held_out_pairs_and_its_export_scores_them_the_same(repo, start_run):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from rljob.api import load_job_file
    from rljob.runtime.llm.data.offline_rows import encode_offline_row
    from rljob.runtime.llm.data.rows import load_rows, split_off

    example = repo / "examples/reward-model-tiny.yaml"
    run = start_run(example, "--set=spec.trainer.steps=50", "--set=spec.checkpoint.interval=0", *QUIET)
    output = run.finish()
    assert run.process.returncode == 0, output
    records = run.metrics()
    accuracy = evals(records, "eval_preference_accuracy")
    assert accuracy[-1] > 0.55, accuracy  # 45 held-out pairs whose prompts were never trained on; chance is 0.5
    assert evals(records, "eval_reward_margin")[-1] > 0.0

    # The export is a sequence classifier a reward role can load: its scores rank the held-out pairs as the job did.
    model = AutoModelForSequenceClassification.from_pretrained(run.out / "model").eval()
    tokenizer = AutoTokenizer.from_pretrained(run.out / "model")
    spec = load_job_file(example).spec
    assert spec.task.llm is not None
    _, held_out = split_off(load_rows(spec.task.llm, columns=False), spec.evaluation.size, spec.trainer.seed)
    right = 0
    for row in held_out:
        encoded = encode_offline_row("reward_model", spec.task.llm, row, tokenizer)
        scores = [
            float(model(input_ids=torch.tensor([encoded.prompt + response])).logits[0, 0])
            for response in encoded.responses
        ]
        right += scores[0] > scores[1]
    assert right / len(held_out) == pytest.approx(accuracy[-1])


@pytest.mark.slow
def test_two_actor_ranks_train_the_dpo_stage_as_one_does(repo, start_run):
    settings = ("--set=spec.trainer.steps=8", "--set=spec.checkpoint.interval=0", "--set=spec.evaluation.interval=0")
    one = start_run(repo / DPO, *settings, *QUIET, name="one")
    two = start_run(repo / DPO, *settings, "--set=spec.roles.actor.replicas=2", *QUIET, name="two")
    for run in (one, two):
        output = run.finish()
        assert run.process.returncode == 0, output
    assert sorted(p.name for p in (two.out / "logs").iterdir()) == ["actor-0.log", "actor-1.log"]
    # Each rank trains half of each batch; the loss is normalised by the global pair count and gradients are summed.
    for key in ("loss", "preference_accuracy", "reward_margin"):
        assert [r[key] for r in two.metrics()] == pytest.approx([r[key] for r in one.metrics()], rel=1e-4, abs=1e-6)
