"""`rljob run` with experiment trackers: each actor-group start is a run of its own, and trackers that fail (a
server out of reach, a key the server would refuse) cost the training nothing."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import yaml
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from rljob.api.loading import read_yaml_value
from tests.launch.test_local_run import assert_every_step_once
from tests.runtime.records.tracker_files import swanlab_runs, wandb_runs


def with_trackers(manifest: Path, trackers: list[dict]) -> Path:
    job = read_yaml_value(manifest.read_text())  # as rljob reads it: `1e-3` is a number
    job["spec"]["logging"]["trackers"] = trackers
    manifest.write_text(yaml.safe_dump(job))
    return manifest


@pytest.mark.slow
def test_a_restarted_actor_group_logs_a_second_run_to_every_tracker(
    cartpole_manifest, start_run, tmp_path, monkeypatch
):
    manifest = with_trackers(
        cartpole_manifest(name="tracked", steps=40, interval=5),
        [
            {"name": "tensorboard", "dir": str(tmp_path / "tb")},
            {"name": "wandb", "offline": True},
            {"name": "swanlab", "offline": True, "dir": str(tmp_path / "swanlab")},
            {"name": "mlflow", "uri": (tmp_path / "mlruns").as_uri()},
        ],
    )
    run = start_run(manifest, "--quiet")
    run.wait_for_step(6)

    # The first group's runs exist in every tracker (their threads start them beside training) before it dies.
    def first_runs() -> bool:
        return all(
            any(folder.glob(pattern))
            for folder, pattern in (
                (tmp_path / "tb", "*-r0/*"),
                (run.out / "wandb", "wandb/offline-run-*"),
                (tmp_path / "swanlab", "run-*"),
                (tmp_path / "mlruns", "*/*/tags/rljob.restart"),
            )
        )

    deadline = time.monotonic() + 120
    while not first_runs() and time.monotonic() < deadline:
        assert run.process.poll() is None, run.finish()
        time.sleep(0.2)
    assert first_runs(), "the first actor group's tracker runs did not appear"
    run.kill("actor", 0)
    output = run.finish()
    assert run.process.returncode == 0, output
    records = run.metrics()
    assert_every_step_once(records, 40)
    log = (run.out / "logs" / "actor-0.log").read_text()
    assert "rljob: tracker" not in log, log  # no tracker failed or missed a record
    assert "logging to tensorboard, wandb, swanlab, mlflow as run local-tracked-r1" in log

    # The second actor group resumed from a checkpoint: its run starts after it and ends at step 40.
    first = EventAccumulator(str(tmp_path / "tb" / "local-tracked-r0"))
    second = EventAccumulator(str(tmp_path / "tb" / "local-tracked-r1"))
    first.Reload()
    second.Reload()
    losses = second.Scalars("policy_loss")
    resumed_at = losses[0].step - 1
    assert resumed_at % 5 == 0 and 5 <= resumed_at < 40
    assert first.Scalars("policy_loss")[0].step == 1
    final = {r["step"]: r for r in records}
    assert [e.step for e in losses] == list(range(resumed_at + 1, 41))
    assert [e.value for e in losses] == pytest.approx([final[e.step]["policy_loss"] for e in losses], rel=1e-5)

    # A SIGKILL takes W&B's unsent records with it (metrics.jsonl has them): its first run may be empty.
    runs = {r["name"]: r for r in wandb_runs(run.out / "wandb")}
    assert set(runs) <= {"local-tracked-r0", "local-tracked-r1"}
    second_run = runs["local-tracked-r1"]
    assert second_run["config"]["trainer"]["steps"] == 40
    assert sorted(second_run["history"]) == list(range(resumed_at + 1, 41))
    assert second_run["history"][40]["env_steps"] == 40 * 256

    swan = swanlab_runs(tmp_path / "swanlab")
    assert [r["name"] for r in swan] == ["local-tracked-r0", "local-tracked-r1"]
    assert max(swan[1]["scalars"]["env_steps"]) == 40

    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # what the tracker sets for its file store
    client = MlflowClient(tracking_uri=(tmp_path / "mlruns").as_uri())
    found = client.search_runs([client.get_experiment_by_name("rljob").experiment_id])
    assert sorted(r.info.run_name for r in found) == ["local-tracked-r0", "local-tracked-r1"]


@pytest.mark.slow
def test_trackers_out_of_reach_never_stop_training(cartpole_manifest, start_run, monkeypatch):
    """MLflow at a port that refuses connections; W&B online with a well-formed key nobody issued and its server out
    of reach: the run finishes, metrics.jsonl holds every step, and each tracker is named in one warning."""
    monkeypatch.setenv("WANDB_API_KEY", "0" * 40)
    monkeypatch.setenv("WANDB_INIT_TIMEOUT", "5")
    monkeypatch.setenv("WANDB_SILENT", "true")
    manifest = with_trackers(
        cartpole_manifest(name="unreachable", steps=10),
        [{"name": "mlflow", "uri": "http://127.0.0.1:9"}, {"name": "wandb", "uri": "http://127.0.0.1:9"}],
    )
    run = start_run(manifest, "--quiet")
    output = run.finish()
    assert run.process.returncode == 0, output
    assert_every_step_once(run.metrics(), 10)
    log = (run.out / "logs" / "actor-0.log").read_text()
    assert log.count("tracker mlflow failed") == 1, log
    assert log.count("tracker wandb failed") == 1, log
    assert "reached trainer.steps (10)" in log
    assert os.environ["WANDB_API_KEY"] not in log


@pytest.mark.slow
def the_mlflow_run(store: Path, monkeypatch):
    """(client, run) of the one run a job logged to the MLflow file store `store`."""
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    client = MlflowClient(tracking_uri=store.as_uri())
    (found,) = client.search_runs([client.get_experiment_by_name("rljob").experiment_id])
    return client, found


def test_an_llm_run_logs_its_evaluations_and_its_exported_model(repo, start_run, tmp_path, monkeypatch):
    trackers = f"[{{name: mlflow, uri: '{(tmp_path / 'mlruns').as_uri()}'}}, {{name: wandb, offline: true}}]"
    run = start_run(
        repo / "examples/grpo-tiny-arithmetic.yaml",
        "--set=spec.trainer.steps=4",
        "--set=spec.trainer.batchSize=16",
        "--set=spec.evaluation.interval=2",
        "--set=spec.evaluation.size=32",
        "--set=spec.checkpoint.interval=2",
        "--set=spec.logging.tensorboard=false",
        f"--set=spec.logging.trackers={trackers}",
        "--quiet",
    )
    output = run.finish()
    assert run.process.returncode == 0, output
    records = {r["step"]: r for r in run.metrics()}
    client, found = the_mlflow_run(tmp_path / "mlruns", monkeypatch)
    assert found.info.run_name == "local-grpo-tiny-arithmetic-r0"
    evaluations = client.get_metric_history(found.info.run_id, "eval_accuracy")
    assert [(m.step, m.value) for m in evaluations] == [(s, records[s]["eval_accuracy"]) for s in (2, 4)]
    assert found.data.tags["rljob.model_path"] == str(run.out / "model")
    assert found.data.params["task.llm.maxResponseLength"]

    (wandb,) = wandb_runs(run.out / "wandb")
    assert sorted(wandb["history"]) == [1, 2, 3, 4]
    exported = [a for a in wandb["artifacts"] if any("/model/" in ref for ref in a["refs"])]
    hf_latest = [a for a in wandb["artifacts"] if any("/hf-latest/" in ref for ref in a["refs"])]
    assert exported and hf_latest, wandb["artifacts"]
    assert all(ref.startswith("file://") for a in wandb["artifacts"] for ref in a["refs"])


def test_an_offline_stage_logs_its_steps_evaluations_and_export_to_its_trackers(repo, start_run, tmp_path, monkeypatch):
    run = start_run(
        repo / "examples/dpo-tiny.yaml",
        "--set=spec.trainer.steps=4",
        "--set=spec.evaluation.interval=2",
        "--set=spec.checkpoint.interval=0",
        "--set=spec.logging.tensorboard=false",
        f"--set=spec.logging.trackers=[{{name: mlflow, uri: '{(tmp_path / 'mlruns').as_uri()}'}}]",
        "--quiet",
    )
    output = run.finish()
    assert run.process.returncode == 0, output
    records = {r["step"]: r for r in run.metrics()}
    client, found = the_mlflow_run(tmp_path / "mlruns", monkeypatch)
    assert found.info.run_name == "local-dpo-tiny-r0"
    losses = client.get_metric_history(found.info.run_id, "loss")
    assert [(m.step, m.value) for m in losses] == [(s, records[s]["loss"]) for s in (1, 2, 3, 4)]
    accuracy = client.get_metric_history(found.info.run_id, "eval_preference_accuracy")
    assert [m.step for m in accuracy] == [2, 4]
    assert found.data.tags["rljob.model_path"] == str(run.out / "model")
