"""Helpers for end-to-end runs of `rljob run`: a small CartPole job, the run's processes, its metrics."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

SMALL_CARTPOLE = """\
apiVersion: rljob.io/v1alpha1
kind: RLJob
metadata:
  name: {name}
spec:
  task:
    type: gym
    gym: {{envId: CartPole-v1, numEnvs: 8}}
  algorithm: {{name: ppo, gamma: 0.98, gaeLambda: 0.8, epochs: 10, minibatches: 1}}
  trainer: {{steps: {steps}, batchSize: 256, learningRate: 1e-3, optimizerEps: 1e-5, gradClip: 0.5, seed: 1}}
  rollout:
    async: {{maxStaleness: 1}}
  checkpoint: {{interval: {interval}, keep: 2}}
  failurePolicy: {{maxRestarts: {max_restarts}, maxReplacements: {max_replacements}}}
  logging: {{tensorboard: true}}
  roles:
    actor: {{replicas: {actors}}}
    rollout: {{replicas: 1}}
    env: {{replicas: {envs}}}
"""


@pytest.fixture
def cartpole_manifest(tmp_path):
    def write(
        name="cartpole-test", steps=30, interval=10, max_restarts=3, max_replacements=10, actors=1, envs=2
    ) -> Path:
        path = tmp_path / f"{name}.yaml"
        path.write_text(
            SMALL_CARTPOLE.format(
                name=name,
                steps=steps,
                interval=interval,
                max_restarts=max_restarts,
                max_replacements=max_replacements,
                actors=actors,
                envs=envs,
            )
        )
        return path

    return write


def _interruptible() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


class Run:
    """`rljob run` in a subprocess, with access to the role processes it started."""

    def __init__(self, manifest: Path, out: Path, *extra: str, split_streams: bool = False) -> None:
        self.out = out.resolve()
        self.process = subprocess.Popen(
            [sys.executable, "-m", "rljob.cli.main", "run", str(manifest), "--out", str(out), *extra],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE if split_streams else subprocess.STDOUT,
            text=True,
            # Ctrl-C as at a terminal, even when the suite itself was started in the background by a shell
            # without job control (`make test &`), whose children inherit SIGINT ignored.
            preexec_fn=_interruptible,
        )
        self.output = ""
        self.errors = ""
        """stderr, when the streams are split; `output` is stdout (and stderr when they are not)."""

    def roles(self) -> list[psutil.Process]:
        """Every live process (on this machine) that belongs to this run, found by its RLJOB_RUN_DIR."""
        found = []
        for process in psutil.process_iter():
            try:
                if process.environ().get("RLJOB_RUN_DIR") == str(self.out) and process.status() != "zombie":
                    found.append(process)
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue
        return found

    def role(self, role: str, replica: int = 0) -> psutil.Process:
        for process in self.roles():
            try:
                env = process.environ()
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue  # exited since `roles` found it (a killed replica, say)
            if env.get("RLJOB_ROLE") == role and env.get("RLJOB_REPLICA") == str(replica):
                return process
        raise LookupError(f"no live {role}-{replica} process")

    def metrics(self) -> list[dict]:
        path = self.out / "metrics.jsonl"
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

    def wait_for_step(self, step: int, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            records = self.metrics()
            if records and records[-1]["step"] >= step:
                return
            assert self.process.poll() is None, f"run ended early:\n{self.finish()}"
            time.sleep(0.2)
        raise TimeoutError(f"step {step} not reached in {timeout}s")

    def kill(self, role: str, replica: int = 0) -> int:
        process = self.role(role, replica)
        os.kill(process.pid, signal.SIGKILL)
        return process.pid

    def finish(self, timeout: float = 240) -> str:
        try:
            out, err = self.process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            out, err = self.process.communicate()
            self.output += out or ""
            raise
        self.output += out or ""
        self.errors += err or ""
        return self.output


@pytest.fixture
def start_run(tmp_path):
    runs: list[Run] = []

    def start(manifest: Path, *extra: str, name: str = "run", split_streams: bool = False) -> Run:
        run = Run(manifest, tmp_path / name, *extra, split_streams=split_streams)
        runs.append(run)
        return run

    yield start
    for run in runs:  # never leave a run behind, whatever the test did
        if run.process.poll() is None:
            run.process.send_signal(signal.SIGINT)
            try:
                run.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                run.process.kill()
        for leftover in run.roles():
            leftover.kill()
