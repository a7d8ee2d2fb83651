"""Each experiment tracker, run for real and offline, holds what a user looks for on their dashboard: the run named
after the job and its restart, the resolved spec as config, every step's metrics with the evaluations, and where
the exported model is. A tracker that fails never holds up training."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

from rljob.api import validate_job
from rljob.api.spec import TrackerSpec
from rljob.runtime.records.trackers import RunInfo, Trackers, job_trackers, open_trackers, tracker_problems
from tests.conftest import REPO
from tests.runtime.records.tracker_files import swanlab_runs, wandb_runs

CONFIG = {"algorithm": {"name": "grpo", "groupSize": 4}, "trainer": {"steps": 3, "lr": 1e-5}}
RECORDS = [
    {"step": 1, "timestamp": 1.0, "reward_mean": 0.25, "policy_loss": 0.5, "episode_returns": [1.0], "accuracy": None},
    {"step": 2, "timestamp": 2.0, "reward_mean": 0.5, "policy_loss": 0.25, "eval_accuracy": 0.75},
    {"step": 3, "timestamp": 3.0, "reward_mean": 0.75, "policy_loss": 0.125, "done": True},
]


def run_info(tmp_path: Path) -> RunInfo:
    return RunInfo(namespace="team-a", job="tiny-grpo", restart=2, config=CONFIG, run_dir=str(tmp_path / "run"))


def log_a_run(specs: list[TrackerSpec], run: RunInfo, model: Path) -> dict[str, int]:
    warnings: list[str] = []
    trackers = open_trackers(specs, run, warn=warnings.append)
    for record in RECORDS:
        trackers.log(record["step"], record)
    trackers.log_model(str(model))
    missed = trackers.close(timeout_s=120)
    assert warnings == []
    return missed


def test_tensorboard_holds_the_steps_the_config_and_the_model(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = run_info(tmp_path)
    assert log_a_run([TrackerSpec(name="tensorboard", dir=str(tmp_path / "tb"))], run, tmp_path / "model") == {}
    events = EventAccumulator(str(tmp_path / "tb" / "team-a-tiny-grpo-r2"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("reward_mean")] == [(1, 0.25), (2, 0.5), (3, 0.75)]
    assert [(e.step, e.value) for e in events.Scalars("eval_accuracy")] == [(2, 0.75)]
    assert "timestamp" not in events.Tags()["scalars"] and "done" not in events.Tags()["scalars"]
    text = {tag: events.Tensors(tag)[0].tensor_proto.string_val[0].decode() for tag in events.Tags()["tensors"]}
    assert '"groupSize": 4' in text["config/text_summary"]
    assert text["exported_model/text_summary"] == str(tmp_path / "model")


def test_mlflow_file_store_holds_the_run_params_metrics_and_model_path(tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # what the tracker sets for its file store
    uri = (tmp_path / "mlruns").as_uri()
    spec = TrackerSpec(name="mlflow", uri=uri, project="rl-experiments")
    assert log_a_run([spec], run_info(tmp_path), tmp_path / "model") == {}
    client = MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name("rl-experiments")
    (found,) = client.search_runs([experiment.experiment_id])
    assert found.info.run_name == "team-a-tiny-grpo-r2"
    assert found.info.status == "FINISHED"
    assert found.data.params["algorithm.groupSize"] == "4" and found.data.params["algorithm.name"] == "grpo"
    assert found.data.tags["rljob.model_path"] == str(tmp_path / "model")
    assert found.data.tags["rljob.restart"] == "2"
    history = client.get_metric_history(found.info.run_id, "reward_mean")
    assert [(m.step, m.value) for m in history] == [(1, 0.25), (2, 0.5), (3, 0.75)]
    assert [(m.step, m.value) for m in client.get_metric_history(found.info.run_id, "eval_accuracy")] == [(2, 0.75)]
    assert Path(client.download_artifacts(found.info.run_id, "rljob-spec.json", str(tmp_path))).read_text()


def test_wandb_offline_run_holds_the_config_steps_and_a_model_reference(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_SILENT", "true")
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    spec = TrackerSpec(name="wandb", offline=True, dir=str(tmp_path / "wandb-files"))
    assert log_a_run([spec], run_info(tmp_path), model) == {}
    (run,) = wandb_runs(tmp_path / "wandb-files")
    assert run["name"] == "team-a-tiny-grpo-r2" and run["group"] == "team-a-tiny-grpo"
    assert run["config"] == CONFIG
    assert {step: row["reward_mean"] for step, row in run["history"].items()} == {1: 0.25, 2: 0.5, 3: 0.75}
    assert run["history"][2]["eval_accuracy"] == 0.75
    (artifact,) = run["artifacts"]
    assert artifact["type"] == "model" and artifact["refs"] == [(model / "config.json").as_uri()]  # not uploaded


def test_swanlab_offline_run_holds_the_config_steps_and_the_model_path(tmp_path):
    spec = TrackerSpec(name="swanlab", offline=True, dir=str(tmp_path / "swanlab-files"))
    assert log_a_run([spec], run_info(tmp_path), tmp_path / "model") == {}
    (run,) = swanlab_runs(tmp_path / "swanlab-files")
    assert run["name"] == "team-a-tiny-grpo-r2" and run["group"] == "team-a-tiny-grpo"
    assert run["config"] == CONFIG
    assert run["scalars"]["reward_mean"] == {1: 0.25, 2: 0.5, 3: 0.75}
    assert run["scalars"]["eval_accuracy"] == {2: 0.75}
    assert run["texts"]["exported_model"] == [str(tmp_path / "model")]


def test_without_dir_the_files_go_under_the_run_directory(tmp_path):
    run = run_info(tmp_path)
    assert log_a_run([TrackerSpec(name="swanlab", offline=True)], run, tmp_path / "model") == {}
    (found,) = swanlab_runs(Path(run.run_dir) / "swanlab")
    assert found["scalars"]["reward_mean"][3] == 0.75


class FlakyTracker:
    """A tracker whose server answers only from its third call on (a network blip at start)."""

    def __init__(self, calls: list[str]) -> None:
        self.calls = calls

    def start(self) -> None:
        self.calls.append("start")
        if self.calls.count("start") < 3:
            raise ConnectionError("connection refused")

    def log(self, step, metrics) -> None:
        self.calls.append(f"log {step}")

    def log_model(self, path) -> None:
        self.calls.append(f"model {path}")

    def finish(self) -> None:
        self.calls.append("finish")


def test_a_failing_tracker_warns_once_backs_off_and_catches_up():
    calls: list[str] = []
    warnings: list[str] = []
    tracker = FlakyTracker(calls)
    trackers = Trackers({"flaky": lambda: tracker}, warn=warnings.append, backoff_s=0.05, max_backoff_s=0.2)
    started = time.perf_counter()
    for record in RECORDS:
        trackers.log(record["step"], record)
    queued_in = time.perf_counter() - started
    deadline = time.monotonic() + 30
    while "log 3" not in calls and time.monotonic() < deadline:
        time.sleep(0.02)
    assert trackers.close(timeout_s=10) == {}
    assert calls == ["start", "start", "start", "log 1", "log 2", "log 3", "finish"]
    assert len(warnings) == 1 and "tracker flaky failed (ConnectionError: connection refused)" in warnings[0]
    assert queued_in < 1.0, "logging waited for the tracker"


class StuckTracker:
    """A tracker whose start hangs until released (a server that accepts the connection and answers late)."""

    def __init__(self, calls: list[str]) -> None:
        self.calls = calls
        self.started = threading.Event()
        self.release = threading.Event()

    def start(self) -> None:
        self.started.set()
        assert self.release.wait(30)

    def log(self, step, metrics) -> None:
        self.calls.append(f"log {step}")

    def log_model(self, path) -> None:
        self.calls.append(f"model {path}")

    def finish(self) -> None:
        self.calls.append("finish")


def test_a_tracker_that_falls_behind_keeps_the_newest_records_and_says_how_many_it_missed():
    calls: list[str] = []
    warnings: list[str] = []
    tracker = StuckTracker(calls)
    trackers = Trackers({"stuck": lambda: tracker}, warn=warnings.append, max_queued=2)
    trackers.log(1, {"reward_mean": 0.1})
    assert tracker.started.wait(30)
    for step in range(2, 6):  # steps 2 and 3 are pushed out by 4 and 5
        trackers.log(step, {"reward_mean": step / 10})
    tracker.release.set()
    assert trackers.close(timeout_s=30) == {"stuck": 2}
    assert calls == ["log 1", "log 4", "log 5", "finish"]
    assert warnings == ["rljob: tracker stuck missed 2 record(s); metrics.jsonl has every step"]


def test_an_unreachable_mlflow_server_never_holds_up_the_steps(tmp_path):
    """Port 9 (discard) refuses connections: every call fails; the steps still go on, one warning says why, and
    closing gives the run up, saying how many records it missed."""
    warnings: list[str] = []
    spec = TrackerSpec(name="mlflow", uri="http://127.0.0.1:9")
    trackers = open_trackers([spec], run_info(tmp_path), warn=warnings.append)
    for record in RECORDS:
        trackers.log(record["step"], record)
        time.sleep(0.2)  # training's step: the tracker fails and backs off meanwhile
    assert trackers.close(timeout_s=30) == {"mlflow": 3}
    assert warnings[0].startswith("rljob: tracker mlflow failed")
    assert "training goes on" in warnings[0]
    assert warnings[1:] == ["rljob: tracker mlflow missed 3 record(s); metrics.jsonl has every step"]


def test_a_tracker_not_installed_is_named_with_the_pip_extra(monkeypatch):
    import importlib.util

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "swanlab" else real_find_spec(n, *a))
    job = validate_job(yaml.safe_load((REPO / "examples" / "cartpole-ppo.yaml").read_text()))
    job.spec.logging.trackers = [TrackerSpec(name="mlflow"), TrackerSpec(name="swanlab", offline=True)]
    (problem,) = tracker_problems(job.spec)
    assert problem.path == "spec.logging.trackers[1].name"
    assert "pip install 'rljob[trackers]'" in problem.message
    with pytest.raises(Exception, match=r"trackers\[1\]"):
        job_trackers(job, "default")


def test_a_job_without_trackers_starts_no_thread_and_imports_no_tracker_library():
    code = (
        "import sys, threading\n"
        "from rljob.runtime.records.trackers import RunInfo, open_trackers\n"
        "import rljob.runtime.gym.actor, rljob.runtime.llm.actor\n"
        "with open_trackers([], RunInfo('ns', 'job', 0, {})) as trackers:\n"
        "    trackers.log(1, {'reward_mean': 1.0})\n"
        "print(threading.active_count(), sorted({'wandb', 'mlflow', 'swanlab'} & set(sys.modules)))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO)
    assert out.stdout.split("\n")[-2] == "1 []"
