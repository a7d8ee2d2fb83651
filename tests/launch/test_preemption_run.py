"""Preemption loses nothing: a SIGTERM to the actor mid-run (as a drain, a preemption or a suspend sends it) stops
every rank at one step boundary, rank 0 checkpoints that step and the actor exits EXIT_PREEMPTED; `rljob run`
starts the actor group again from that checkpoint without charging maxRestarts, and it goes on at the next step.
Ctrl-C checkpoints too, and a rerun resumes at the next step. Real processes, real gloo, the tiny examples."""

from __future__ import annotations

import os
import re
import signal
import time

import pytest

from rljob.launch.local import TEST_RANKS_PER_REPLICA_ENV
from rljob.runtime.records.checkpoint import CheckpointManager

CARTPOLE = "examples/cartpole-ppo.yaml"
GRPO = "examples/grpo-tiny-arithmetic.yaml"
# No interval checkpoint before the end: the one the new group resumes from can only be the preemption's.
CARTPOLE_SETTINGS = ("--set=spec.checkpoint.interval=1000", "--set=spec.logging.tensorboard=false", "--quiet")
GRPO_BATCH = 8
GRPO_SETTINGS = (
    f"--set=spec.trainer.batchSize={GRPO_BATCH}",
    "--set=spec.checkpoint.interval=1000",
    "--set=spec.evaluation.interval=0",
    "--set=spec.logging.tensorboard=false",
    "--quiet",
)


def steps_of(records: list[dict]) -> list[int]:
    return [r["step"] for r in records]


def resumed_step(log: str) -> int:
    """The one step the log says a resume started from (every rank of the group says it)."""
    found = {int(step) for step in re.findall(r"resumed from \S*step-\d+ \(step (\d+)", log)}
    assert len(found) == 1, log
    return found.pop()


def sigterm_mid_step(run) -> None:
    """SIGTERM the actor while it waits for its step's data: the rollout is paused (SIGSTOP) so the step cannot
    finish, then resumed (SIGCONT). Paused during a weight sync (which waits for the rollout whatever the stop),
    the actor finishes the sync once the rollout is back and abandons the next step instead: the same outcome."""
    rollout = run.role("rollout")
    rollout.suspend()
    try:
        actor = run.role("actor")
        wait_until_idle(actor)  # it has trained its step and waits for the paused rollout
        os.kill(actor.pid, signal.SIGTERM)
        time.sleep(3.0)
    finally:
        rollout.resume()
    deadline = time.monotonic() + 90
    while "(asked to stop)" not in (run.out / "logs" / "actor-0.log").read_text():
        assert time.monotonic() < deadline, "the actor did not stop"
        time.sleep(0.2)


def wait_until_idle(process, timeout: float = 60.0) -> None:
    """Until `process` uses next to no CPU for a second (it waits on something): a fixed sleep is not enough on a
    machine busy with other tests, where the step the actor trains meanwhile can take several seconds."""
    deadline = time.monotonic() + timeout
    quiet = 0
    while quiet < 2 and time.monotonic() < deadline:
        quiet = quiet + 1 if process.cpu_percent(interval=0.5) < 10 else 0


def preempted_at(log: str) -> int:
    found = re.findall(r"stopped at step (\d+) of \d+ \(asked to stop\)", log)
    assert len(found) == 1, log
    return int(found[0])


@pytest.mark.slow
def test_a_sigterm_to_the_gym_actor_mid_run_resumes_at_the_next_step_uncharged(repo, start_run):
    run = start_run(
        repo / CARTPOLE, "--set=spec.trainer.steps=30", "--set=spec.failurePolicy.maxRestarts=0", *CARTPOLE_SETTINGS
    )
    run.wait_for_step(6)
    sigterm_mid_step(run)
    output = run.finish()
    # maxRestarts 0: a charged restart would have failed the job.
    assert run.process.returncode == 0, output
    assert "actor-0 exited with code 75 (preempted" in output, output
    assert "not counted against failurePolicy.maxRestarts" in output
    log = (run.out / "logs" / "actor-0.log").read_text()
    stopped = preempted_at(log)
    assert 6 <= stopped < 30
    assert f"waiting for step {stopped + 1}'s data: that step is abandoned" in log
    assert resumed_step(log) == stopped
    assert f"training 30 steps from step {stopped} " in log
    records = run.metrics()
    assert steps_of(records) == list(range(1, 31))  # none lost, none repeated
    assert [r["env_steps"] for r in records] == [256 * s for s in range(1, 31)]  # the counters came back too
    assert not run.roles()


@pytest.mark.slow
def test_a_sigterm_to_one_rank_stops_every_rank_at_the_same_step(repo, start_run, monkeypatch):
    """Two gloo ranks in one replica; only rank 1 is asked to stop: the all-reduced vote stops rank 0 too."""
    monkeypatch.setenv(TEST_RANKS_PER_REPLICA_ENV, "2")
    run = start_run(repo / CARTPOLE, "--set=spec.trainer.steps=16", *CARTPOLE_SETTINGS)
    run.wait_for_step(4)
    (rank1,) = [p for p in run.roles() if p.environ().get("LOCAL_RANK") == "1"]
    os.kill(rank1.pid, signal.SIGTERM)
    output = run.finish()
    assert run.process.returncode == 0, output
    assert "actor-0 exited with code 75 (preempted" in output, output
    log = (run.out / "logs" / "actor-0.log").read_text()
    stopped = preempted_at(log)  # rank 0's line
    assert f"stopped at step {stopped}, as every rank agreed" in log  # rank 1's, at the same step
    assert resumed_step(log) == stopped
    assert steps_of(run.metrics()) == list(range(1, 17))
    assert not run.roles()


@pytest.mark.slow
def test_a_sigterm_to_the_llm_actor_mid_step_resumes_at_the_next_step(repo, start_run):
    run = start_run(
        repo / GRPO, "--set=spec.trainer.steps=30", "--set=spec.failurePolicy.maxRestarts=0", *GRPO_SETTINGS
    )
    run.wait_for_step(3)
    sigterm_mid_step(run)
    output = run.finish()
    assert run.process.returncode == 0, output
    assert "actor-0 exited with code 75 (preempted" in output, output
    log = (run.out / "logs" / "actor-0.log").read_text()
    stopped = preempted_at(log)
    assert 3 <= stopped < 30
    # Stopped while the step's data was generated, the step is abandoned and said so; stopped while the weights went
    # to the paused rollout (the sync waits for it), no step had begun: either way the next group starts at the next.
    abandoned = re.findall(r"asked to stop while generating step (\d+): that step is abandoned", log)
    assert abandoned in ([], [str(stopped + 1)]), log
    assert resumed_step(log) == stopped
    records = run.metrics()
    assert steps_of(records) == list(range(1, 31))
    # The prompt stream came back with the checkpoint: batchSize x groupSize samples a step, across the restart.
    assert [r["samples"] for r in records] == [GRPO_BATCH * 8 * s for s in range(1, 31)]
    assert not run.roles()


@pytest.mark.slow
def test_ctrl_c_checkpoints_the_llm_actor_and_a_rerun_resumes_at_the_next_step(repo, start_run):
    settings = ("--set=spec.trainer.steps=10", *GRPO_SETTINGS)
    first = start_run(repo / GRPO, *settings, name="interrupted")
    first.wait_for_step(2)
    first.process.send_signal(signal.SIGINT)
    output = first.finish(timeout=120)
    assert first.process.returncode == 130, output
    checkpoints = CheckpointManager(first.out / "checkpoints").checkpoints()
    assert len(checkpoints) == 1, output
    step, _ = checkpoints[0]
    assert steps_of(first.metrics()) == list(range(1, step + 1))
    said = re.sub(r"\s+", " ", output)
    assert f"the latest checkpoint is step {step}" in said and f"to resume at step {step + 1}" in said, output
    assert not first.roles()

    again = start_run(repo / GRPO, *settings, name="interrupted")
    output = again.finish()
    assert again.process.returncode == 0, output
    assert resumed_step((again.out / "logs" / "actor-0.log").read_text()) == step
    assert steps_of(again.metrics()) == list(range(1, 11))


@pytest.mark.slow
def test_a_sigterm_to_rank_1_of_an_llm_actor_is_its_vote_and_every_rank_stops_at_one_step(repo, start_run, monkeypatch):
    """Rank 0 drives the llm loop; rank 1's stop request reaches it through the vote after each update."""
    monkeypatch.setenv(TEST_RANKS_PER_REPLICA_ENV, "2")
    run = start_run(repo / GRPO, "--set=spec.trainer.steps=30", *GRPO_SETTINGS)
    run.wait_for_step(3)
    (rank1,) = [p for p in run.roles() if p.environ().get("LOCAL_RANK") == "1"]
    os.kill(rank1.pid, signal.SIGTERM)
    output = run.finish()
    assert run.process.returncode == 0, output
    assert "actor-0 exited with code 75 (preempted" in output, output
    log = (run.out / "logs" / "actor-0.log").read_text()
    stopped = preempted_at(log)
    assert 3 <= stopped < 30
    assert f"stopped at step {stopped} with rank 0, which checkpointed it" in log  # rank 1, the same step
    assert "received SIGTERM" not in "".join(line for line in log.splitlines() if line.startswith("rank 0 |"))
    assert resumed_step(log) == stopped
    records = run.metrics()
    assert steps_of(records) == list(range(1, 31))
    assert [r["samples"] for r in records] == [GRPO_BATCH * 8 * s for s in range(1, 31)]
    assert not run.roles()
