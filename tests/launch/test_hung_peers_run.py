"""Hung peers are named: `rljob run` of the tiny GRPO example with two reward (or rollout) replicas, one frozen
(SIGSTOP) for longer than its deadline. The actor names it (log, `/progress`), training goes on with the other
replica, and after SIGCONT it answers again and takes work again. Real processes, real transport, real roles."""

from __future__ import annotations

import json
import re
import time
import urllib.request

import pytest

from rljob.runtime.weights.nccl_env import GROUP_TIMEOUT_S

GRPO = "examples/grpo-tiny-arithmetic.yaml"
BATCH = 8
SETTINGS = (
    f"--set=spec.trainer.batchSize={BATCH}",
    "--set=spec.checkpoint.interval=1000",
    "--set=spec.evaluation.interval=0",
    "--set=spec.logging.tensorboard=false",
)


def progress(run) -> dict:
    port = run.role("actor").environ()["RLJOB_METRICS_PORT"]
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/progress", timeout=5) as response:
        return json.loads(response.read())


def wait_for_log(run, text: str, timeout: float = 60) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        log = (run.out / "logs" / "actor-0.log").read_text()
        if text in log:
            return log
        assert run.process.poll() is None, f"run ended early:\n{run.finish()}"
        time.sleep(0.2)
    raise TimeoutError(f"{text!r} not in the actor's log within {timeout}s")


@pytest.mark.slow
@pytest.mark.parametrize("role", ["reward", "rollout"])
def test_a_frozen_replica_is_named_training_goes_on_with_the_other_and_it_rejoins(repo, start_run, role):
    run = start_run(
        repo / GRPO,
        "--set=spec.trainer.steps=200",
        f"--set=spec.roles.{role}.replicas=2",
        f"--set=spec.roles.{role}.requestTimeoutSeconds=3",
        *SETTINGS,
    )
    run.wait_for_step(3)
    frozen = run.role(role, 1)
    frozen.suspend()
    try:
        log = wait_for_log(run, f"{role}-1 has not answered for ")
        assert re.search(rf"{role}-1 has not answered for \d+ s; its work goes to {role}-0", log), log
        named_at = run.metrics()[-1]["step"]
        run.wait_for_step(named_at + 5)  # training goes on with reward-0 alone
        late = progress(run)
        assert [entry["replica"] for entry in late["lateReplicas"]] == [f"{role}-1"], late
        assert late["issue"].startswith(f"{role}-1 has not answered for"), late
    finally:
        frozen.resume()
    wait_for_log(run, f"{role}-1 answers again")
    if role == "rollout":  # chunks go to it again once it holds the latest weights
        wait_for_log(run, "rollout-1 has weights version")
    output = run.finish()
    assert run.process.returncode == 0, output
    records = run.metrics()
    # Every step once, every sample scored once (no part of a batch lost or counted twice).
    assert [r["step"] for r in records] == list(range(1, 201))
    assert [r["samples"] for r in records] == [BATCH * 8 * s for s in range(1, 201)]
    assert f"{role}-1 exited" not in output  # it was never restarted: it was waited out and taken back


@pytest.mark.slow
def test_with_one_reward_replica_frozen_the_run_waits_names_it_in_its_stalled_line_and_goes_on(repo, start_run):
    run = start_run(
        repo / GRPO,
        "--set=spec.trainer.steps=150",
        "--set=spec.roles.reward.requestTimeoutSeconds=2",
        "--set=spec.failurePolicy.progressDeadlineSeconds=6",
        *SETTINGS,
    )
    run.wait_for_step(3)
    # `rljob run` reads /progress every 0.5 s: let it see steps go by, so a stall said while the roles started
    # (slow under load) has been followed by "progressing" before the freeze.
    time.sleep(2)
    frozen = run.role("reward", 0)
    frozen.suspend()
    try:
        log = wait_for_log(run, "reward-0 has not answered for")
        assert "no other replica can take its work: waiting" in log
        time.sleep(10)  # past progressDeadlineSeconds: `rljob run` says Stalled, with the replica's name
    finally:
        frozen.resume()
    wait_for_log(run, "reward-0 answers again")
    output = " ".join(run.finish().split())  # the console wraps long lines
    assert run.process.returncode == 0, output
    assert re.search(r"stalled: no training step for \d+s .* the actor reports: reward-0 has not answered for", output)
    assert "progressing: training resumed" in output
    assert [r["step"] for r in run.metrics()] == list(range(1, 151))


@pytest.mark.slow
def test_a_frozen_gym_rollout_is_named_while_the_step_waits_for_its_environments(start_run, cartpole_manifest):
    run = start_run(cartpole_manifest(steps=60, interval=1000), "--quiet")
    run.wait_for_step(5)
    frozen = run.role("rollout", 0)
    frozen.suspend()
    try:
        # Its environments live in it: nothing can take its share of the batch, so the step waits and names it.
        # A freeze that lands during a weight push holds the actor in that broadcast until it times out first
        # (GROUP_TIMEOUT_S); the fetch after it names the replica.
        log = wait_for_log(run, "rollout-0 has not answered for", timeout=GROUP_TIMEOUT_S + 60)
        assert "no other replica can take its work: waiting" in log
        late = progress(run)
        assert [entry["replica"] for entry in late["lateReplicas"]] == ["rollout-0"], late
        assert late["issue"].startswith("rollout-0 has not answered for"), late
    finally:
        frozen.resume()
    wait_for_log(run, "rollout-0 answers again")
    output = run.finish()
    assert run.process.returncode == 0, output
    assert [r["step"] for r in run.metrics()] == list(range(1, 61))
