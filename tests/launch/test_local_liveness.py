"""`rljob run` replaces a hung replica, as the kubelet's liveness probe has it replaced in a pod."""

from __future__ import annotations

import os

import pytest

from tests.conftest import REPO
from tests.runtime.wire.hanging_env import HUNG_ENV_JOB


@pytest.mark.slow
def test_a_replica_whose_loop_hangs_is_killed_and_replaced_until_the_failure_policy_gives_up(
    tmp_path, start_run, monkeypatch
):
    """The env's step never returns: the env replica stays alive but its serving loop stops beating. The launcher
    kills it once its /livez says so, replaces it (it hangs again at the next step), and the job fails under
    maxReplacements, each kill said with the loop that was stuck."""
    monkeypatch.setenv("COLUMNS", "400")
    monkeypatch.setenv("PYTHONPATH", f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    manifest = tmp_path / "hung.yaml"
    manifest.write_text(HUNG_ENV_JOB)
    run = start_run(manifest, "--quiet")
    output = run.finish(timeout=180)
    assert run.process.returncode == 1, output
    assert output.count("env-0 is hung (loop main has not beaten for ") == 2, output
    assert "(limit 2s)): killing it" in output
    assert "env-0 exited with code -9: replacing it in 1s (failure 1 in a row" in output
    assert "it failed 2 times in a row: spec.failurePolicy.maxReplacements (1) exhausted" in output
    assert not run.roles()
