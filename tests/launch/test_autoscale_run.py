"""`rljob run` honours spec.roles.rollout.autoscale: generation-bound, the run starts a second rollout process,
which joins the actor's membership without restarting it, and the run succeeds."""

from __future__ import annotations

import json

import pytest

EXAMPLE = "examples/grpo-tiny-arithmetic.yaml"


@pytest.mark.slow
def test_a_generation_bound_run_grows_its_rollouts_from_min_replicas(repo, start_run):
    run = start_run(
        repo / EXAMPLE,
        # Long enough that the second rollout process (seconds to start: torch, the policy) joins well before the
        # end, on a quiet machine too (40 steps once ended before it joined).
        "--set=spec.trainer.steps=150",
        "--set=spec.trainer.batchSize=16",
        # 32 sampled tokens per response against one cheap update: the trainer mostly waits for generation.
        "--set=spec.task.llm.maxResponseLength=32",
        "--set=spec.evaluation.interval=0",
        "--set=spec.checkpoint.interval=0",
        "--set=spec.logging.tensorboard=false",
        "--set=spec.roles.rollout.autoscale.minReplicas=1",
        "--set=spec.roles.rollout.autoscale.maxReplicas=2",
        "--set=spec.roles.rollout.autoscale.targetTrainerWait=0.05",
        "--set=spec.roles.rollout.autoscale.scaleUpCooldownSeconds=0",
        "--quiet",
    )
    output = run.finish()
    assert run.process.returncode == 0, output
    assert "reached trainer.steps (150)" in output
    assert "autoscale: the trainer waited" in output and "(target 5%): 1 -> 2 rollouts" in output
    records = run.metrics()
    assert [r["step"] for r in records] == list(range(1, 151))
    counts = [r["rollout_replicas"] for r in records]
    assert counts[0] == 1 and counts[-1] == 2, counts  # started at minReplicas, grew, within maxReplicas
    assert all(0.0 <= r["trainer_wait"] <= 1.0 for r in records)
    actor_log = (run.out / "logs" / "actor-0.log").read_text()
    assert "rollout 1 (" in actor_log and "joined: sending it weights version" in actor_log
    assert "restarting the actor group" not in output  # the actor was never restarted
    members = json.loads((run.out / "rollouts.json").read_text())
    assert [m["replica"] for m in members["rollouts"]] == [0, 1]
