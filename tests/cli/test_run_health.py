"""`rljob run` says when the policy's entropy collapses, once, from the actor's own /progress, and keeps training."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

JOB = """\
apiVersion: rljob.io/v1alpha1
kind: RLJob
metadata:
  name: collapse
spec:
  task:
    type: gym
    gym: {envId: CartPole-v1, numEnvs: 2}
  algorithm: {name: ppo, minibatches: 1, epochs: 1}
  trainer: {steps: 40, batchSize: 32}
  checkpoint: {interval: 0}
  health: {entropyFloor: 1.0, windowSteps: 2}
  roles:
    actor: {replicas: 1}
    rollout: {replicas: 1}
    env: {replicas: 1}
"""


@pytest.mark.slow
def test_an_entropy_floor_above_the_policys_entropy_is_reported_once_and_training_goes_on(tmp_path):
    # Two CartPole actions: the entropy never exceeds ln 2 = 0.69 nats, so a floor of 1.0 is crossed at once.
    job = tmp_path / "job.yaml"
    job.write_text(JOB)
    result = subprocess.run(
        [sys.executable, "-m", "rljob.cli.main", "run", str(job), "--out", str(tmp_path / "run"), "--quiet"],
        capture_output=True,
        text=True,
        timeout=300,  # a safety net; 40 tiny steps take seconds
        env={**os.environ, "COLUMNS": "400"},
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    lines = [line for line in output.splitlines() if line.startswith("EntropyCollapsed: ")]
    assert len(lines) == 1, output  # one line per transition, never one per step
    assert lines[0].startswith("EntropyCollapsed: policy entropy 0.")
    assert "below spec.health.entropyFloor (1) for " in lines[0]
