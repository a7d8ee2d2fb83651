"""`rljob run` end to end: real role processes, real gymnasium, real torch.distributed and pyzmq."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from typer.testing import CliRunner

from rljob.cli.main import app


def assert_every_step_once(records: list[dict], steps: int, batch: int = 256) -> None:
    assert [r["step"] for r in records] == list(range(1, steps + 1))
    assert [r["env_steps"] for r in records] == [batch * s for s in range(1, steps + 1)]


@pytest.mark.slow
def test_cartpole_return_improves_with_two_actor_replicas(cartpole_manifest, start_run):
    run = start_run(cartpole_manifest(steps=30, actors=2), split_streams=True)
    output = run.finish()
    assert run.process.returncode == 0, output + run.errors
    # stdout holds the results and nothing else: `rljob run job.yaml > run.log` keeps them, the progress and the
    # role logs stay on the terminal.
    lines = output.splitlines()
    assert lines[0].startswith("done: reached trainer.steps (30)"), output
    assert [line.split(":")[0] for line in lines[1:]] == [
        "mean return over the last 20 episodes",
        "metrics",
        "curve",
        "tensorboard",
        "logs",
    ], output
    tensorboard = Path(sys.executable).parent / "tensorboard"
    assert f"tensorboard: {tensorboard} --logdir {run.out / 'tb'}" in output
    assert "rljob run" in run.errors and "actor-0 |" in run.errors and "done:" not in run.errors
    records = run.metrics()
    assert_every_step_once(records, 30)
    for key in (
        "wall_time",
        "return_mean",
        "policy_loss",
        "value_loss",
        "entropy",
        "approx_kl",
        "clip_fraction",
        "explained_variance",
        "env_steps_per_s",
        "staleness_mean",
        "time_train_s",
        "time_rollout_s",
    ):
        assert key in records[-1], key
    assert max(r["staleness_max"] for r in records) <= 1
    episodes = [ret for r in records for ret in r["episode_returns"]]
    first, last = sum(episodes[:10]) / 10, sum(episodes[-10:]) / 10
    assert last >= 3 * first, (first, last)
    assert (run.out / "curve.png").stat().st_size > 0
    assert list((run.out / "tb").iterdir())
    assert (run.out / "job.yaml").exists() and (run.out / "checkpoints").is_dir()
    assert not run.roles()


@pytest.mark.slow
def test_killed_env_and_rollout_are_replaced_and_no_step_is_lost_or_repeated(cartpole_manifest, start_run):
    run = start_run(cartpole_manifest(steps=60), "--quiet")
    run.wait_for_step(5)
    run.kill("env", 1)
    run.wait_for_step(12)
    run.kill("rollout", 0)
    output = run.finish()
    assert run.process.returncode == 0, output
    assert "env-1 exited with code -9: replacing it" in output
    assert "rollout-0 exited with code -9: replacing it" in output
    assert_every_step_once(run.metrics(), 60)


@pytest.mark.slow
def test_killed_actor_group_resumes_from_the_latest_checkpoint(cartpole_manifest, start_run):
    run = start_run(cartpole_manifest(steps=40, interval=5), "--quiet")
    run.wait_for_step(12)
    run.kill("actor", 0)
    output = run.finish()
    assert run.process.returncode == 0, output
    assert "restarting the actor group from the latest checkpoint (1/3)" in output
    log = (run.out / "logs" / "actor-0.log").read_text()
    resumed = re.search(r"resumed from .*step-(\d+) \(step (\d+)", log)
    assert resumed, log
    assert int(resumed.group(2)) % 5 == 0 and 10 <= int(resumed.group(2)) < 40
    # Steps after the checkpoint were redone by the new actor and recorded once.
    assert_every_step_once(run.metrics(), 40)


@pytest.mark.slow
def test_actor_failures_beyond_max_restarts_fail_the_job(cartpole_manifest, start_run):
    run = start_run(cartpole_manifest(steps=200, max_restarts=0), "--quiet")
    run.wait_for_step(2)
    run.kill("actor", 0)
    output = run.finish()
    assert run.process.returncode == 1
    assert "failurePolicy.maxRestarts (0) exhausted" in output
    assert not run.roles()


@pytest.mark.slow
def test_ctrl_c_stops_every_role_process(cartpole_manifest, start_run):
    run = start_run(cartpole_manifest(steps=500, actors=2), "--quiet")
    run.wait_for_step(1)
    children = run.roles()
    assert len(children) == 5  # 2 actors, 1 rollout, 2 envs
    # Every role serves the operator's HTTP contract; actor 0 also reports progress.
    for child in children:
        env = child.environ()
        base = f"http://127.0.0.1:{env['RLJOB_METRICS_PORT']}"
        with urllib.request.urlopen(f"{base}/healthz", timeout=5) as response:
            assert response.status == 200
        with urllib.request.urlopen(f"{base}/metrics", timeout=5) as response:
            assert f'role="{env["RLJOB_ROLE"]}"' in response.read().decode()
        if env["RLJOB_ROLE"] == "actor" and env["RLJOB_REPLICA"] == "0":
            with urllib.request.urlopen(f"{base}/progress", timeout=5) as response:
                progress = json.loads(response.read())
            assert progress["totalSteps"] == 500 and progress["step"] >= 1
    run.process.send_signal(signal.SIGINT)
    output = run.finish(timeout=60)
    assert run.process.returncode == 130, output
    assert "interrupted" in output
    time.sleep(0.5)
    assert not run.roles(), [p.pid for p in run.roles()]
    assert not [p for p in children if p.is_running() and p.status() != "zombie"]


def rljob_run(manifest: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """`rljob run` in a subprocess, as a user runs it (a traceback would show in its output)."""
    return subprocess.run(
        [sys.executable, "-m", "rljob.cli.main", "run", str(manifest), "--quiet", *args],
        capture_output=True,
        text=True,
        timeout=120,  # a safety net: these fail before any role process starts
    )


@pytest.mark.parametrize(
    ("override", "named"),
    [
        ("spec.task.gym.envId=CartPol-v9", "spec.task.gym.envId 'CartPol-v9'"),
        ("spec.task.gym.envKwargs={foo: 1}", "spec.task.gym.envKwargs {'foo': 1} do not fit 'CartPole-v1'"),
        ("spec.task.gym.envId=Blackjack-v1", "the builtin mlp needs vector observations"),
    ],
)
def test_a_bad_env_id_kwargs_or_space_fails_before_any_process_starts(cartpole_manifest, tmp_path, override, named):
    out = tmp_path / "out"
    result = rljob_run(cartpole_manifest(), "--out", str(out), "--set", override)
    output = result.stdout + result.stderr
    assert result.returncode == 1, output
    assert named in output
    assert "Traceback" not in output
    assert not out.exists()  # refused before the run directory or any role process


def test_out_that_is_a_file_is_named_without_a_traceback(cartpole_manifest, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    for out in (blocker, blocker / "run"):
        result = rljob_run(cartpole_manifest(), "--out", str(out))
        output = result.stdout + result.stderr
        assert result.returncode == 1, output
        assert f"--out {out}" in output and f"{blocker} is a file, not a directory" in output
        assert "Traceback" not in output


def test_set_on_a_manifest_that_is_not_a_mapping_is_named(tmp_path):
    manifest = tmp_path / "list.yaml"
    manifest.write_text("- apiVersion: rljob.io/v1alpha1\n- kind: RLJob\n")
    result = CliRunner().invoke(app, ["run", str(manifest), "--set", "spec.trainer.steps=3"])
    assert result.exit_code == 1
    assert isinstance(result.exception, SystemExit)  # a handled error, not a crash
    assert "--set 'spec.trainer.steps=3': the manifest is a YAML list, not a mapping" in result.output


@pytest.mark.slow
def test_a_replica_that_keeps_failing_fails_the_job_after_max_replacements(cartpole_manifest, start_run, monkeypatch):
    monkeypatch.setenv("COLUMNS", "400")  # rich wraps the summary at the terminal width
    run = start_run(cartpole_manifest(steps=500, max_replacements=1), "--quiet")
    run.wait_for_step(2)
    first = run.kill("env", 1)
    deadline = time.monotonic() + 60
    replacement = None
    while replacement is None and time.monotonic() < deadline:
        try:
            pid = run.role("env", 1).pid
            replacement = pid if pid != first else None
        except LookupError:
            pass
        time.sleep(0.1)
    assert replacement is not None, "env-1 was not replaced"
    run.kill("env", 1)
    output = run.finish()
    assert run.process.returncode == 1, output
    # The operator's rules: failures in a row, each replacement after its back-off.
    assert "env-1 exited with code -9: replacing it in 1s (failure 1 in a row" in output
    assert "it failed 2 times in a row: spec.failurePolicy.maxReplacements (1) exhausted" in output
    assert not run.roles()


@pytest.mark.slow
def test_resuming_a_checkpoint_of_another_model_fails_at_once_with_the_fix(cartpole_manifest, start_run, monkeypatch):
    monkeypatch.setenv("COLUMNS", "400")  # rich wraps the summary at the terminal width
    manifest = cartpole_manifest(steps=3, interval=3)
    first = start_run(manifest, "--quiet", name="same")
    assert first.process.wait(timeout=240) == 0, first.finish()
    again = start_run(manifest, "--quiet", "--set", "spec.model.builtin.hiddenSizes=[32, 32]", name="same")
    output = again.finish()
    assert again.process.returncode == 1, output
    assert "actor-0 stopped on a configuration error that no restart can fix" in output
    checkpoint = again.out / "checkpoints" / "step-00000003"
    assert f"checkpoint {checkpoint} was written for a different model (size mismatch" in output
    assert "use a new --out" in output and "spec.checkpoint.resume: never" in output
    assert "restarting the actor group" not in output
    assert "Traceback" not in output + (again.out / "logs" / "actor-0.log").read_text()
    assert not again.roles()


def test_set_overrides_a_field_and_bad_keys_are_named(cartpole_manifest, tmp_path):
    manifest = cartpole_manifest()
    runner = CliRunner()
    result = runner.invoke(app, ["run", str(manifest), "--set", "spec.trainer.stepz=3"])
    assert result.exit_code == 1
    assert "spec.trainer.stepz" in result.output
    result = runner.invoke(app, ["run", str(manifest), "--set", "spec.trainer.steps.max=3"])
    assert result.exit_code == 1
    assert "spec.trainer.steps is a int, not a mapping" in result.output
    result = runner.invoke(app, ["run", str(manifest), "--set", "spec.trainer.steps"])
    assert result.exit_code == 1 and "path.to.key=value" in result.output
    result = runner.invoke(app, ["run", str(manifest), "--set", "spec.roles.rollout.replicas=3"])
    assert result.exit_code == 1
    assert "spec.roles.rollout.replicas: each rollout replica drives its own env replicas" in result.output


@pytest.mark.slow
def test_rerun_resumes_from_the_newest_valid_checkpoint_skipping_a_corrupted_one(cartpole_manifest, start_run):
    manifest = cartpole_manifest(steps=6, interval=3)
    first = start_run(manifest, "--quiet", name="same")
    assert first.process.wait(timeout=240) == 0, first.finish()
    state = first.out / "checkpoints" / "step-00000006" / "state.pt"
    state.write_bytes(state.read_bytes()[:-100] + bytes(100))  # flip the tail: the checksum no longer matches
    again = start_run(manifest, "--quiet", "--set", "spec.trainer.steps=8", name="same")
    output = again.finish()
    assert again.process.returncode == 0, output
    log = (again.out / "logs" / "actor-0.log").read_text()
    assert "skipping checkpoint" in log and "step-00000006" in log
    assert "resumed from" in log and "step-00000003" in log
    assert_every_step_once(again.metrics(), 8)


FLAKY_ENV_MODULE = '''\
"""CartPole whose first creation in an env role process fails the way an env that downloads assets can."""

import os
from pathlib import Path

import gymnasium
from gymnasium.envs.classic_control import CartPoleEnv


class FlakyCartPole(CartPoleEnv):
    def __init__(self, marker: str, **kwargs):
        if os.environ.get("RLJOB_ROLE") == "env" and not Path(marker).exists():
            Path(marker).touch()
            raise ConnectionResetError("connection reset by peer while fetching the env's assets")
        super().__init__(**kwargs)


gymnasium.register("FlakyCartPole-v0", entry_point=FlakyCartPole, max_episode_steps=500)
'''


@pytest.mark.slow
def test_an_env_that_fails_to_start_for_a_transient_reason_is_replaced_and_the_job_continues(
    cartpole_manifest, start_run, tmp_path, monkeypatch
):
    (tmp_path / "flaky_env.py").write_text(FLAKY_ENV_MODULE)
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    manifest = cartpole_manifest(steps=3, envs=1)
    marker = tmp_path / "first-creation-failed"
    manifest.write_text(
        manifest.read_text().replace(
            "envId: CartPole-v1", f"envId: 'flaky_env:FlakyCartPole-v0', envKwargs: {{marker: '{marker}'}}"
        )
    )
    run = start_run(manifest, "--quiet")
    output = run.finish()
    assert marker.exists(), output  # the env role did fail once
    assert run.process.returncode == 0, output
    assert "env-0 exited with code 1: replacing it" in output
    assert [r["step"] for r in run.metrics()] == [1, 2, 3]
