"""`rljob run` of the tiny GRPO example collocated (`roles.rollout.collocated`, weights by ipc) on the CPU.

The weights go through real shared memory (/dev/shm) and the rollout sleeps and wakes around every update; the
run must train exactly as the broadcast one does: the same weights reach the rollout, so it samples the same
responses from its seeded generator and every step's rewards are the same.
"""

from __future__ import annotations

import pytest

EXAMPLE = "examples/grpo-tiny-arithmetic.yaml"
SHORT = (
    "--set=spec.trainer.steps=12",
    "--set=spec.trainer.batchSize=16",
    "--set=spec.checkpoint.interval=0",
    "--set=spec.logging.tensorboard=false",
    "--quiet",
)
COLLOCATED = ("--set=spec.roles.rollout.collocated=true", "--set=spec.rollout.weightSync.method=ipc")


@pytest.mark.slow
def test_a_collocated_run_with_ipc_weights_trains_exactly_as_the_broadcast_run(repo, start_run):
    collocated = start_run(repo / EXAMPLE, *SHORT, *COLLOCATED, name="collocated")
    output = collocated.finish()
    assert collocated.process.returncode == 0, output
    broadcast = start_run(repo / EXAMPLE, *SHORT, name="broadcast")
    output = broadcast.finish()
    assert broadcast.process.returncode == 0, output

    log = (collocated.out / "logs" / "rollout-0.log").read_text()
    assert "collocated: the engine sleeps while the actor trains" in log  # the actor's loop put it to sleep
    records, reference = collocated.metrics(), broadcast.metrics()
    assert [r["step"] for r in records] == list(range(1, 13))
    # Every step generated from the weights just trained (each version was loaded before generation).
    assert all(r["mismatch_max_gap"] < 1e-4 for r in records), records
    assert [r["reward_mean"] for r in records] == [r["reward_mean"] for r in reference]
    assert [r["accuracy"] for r in records] == [r["accuracy"] for r in reference]


def test_each_collocated_actor_is_told_where_the_rollout_beside_it_answers_healthz():
    """As in its pod: an actor on a GPU loads only once that rollout's engine holds its memory, and is ready only
    while the rollout is."""
    from rljob.launch.local import ReplicaHost, beside_collocated_rollouts, free_ports
    from rljob.runtime.wire.identity import COLLOCATED_ROLLOUT_HEALTH_ENV, local_identities, ports_needed

    replicas = {"actor": 1, "rollout": 1, "reward": 1}
    identities = local_identities("co", replicas, "job.yaml", free_ports(ports_needed(replicas)))
    rollout = next(i for i in identities if i.role == "rollout")
    beside = {i.role: i for i in beside_collocated_rollouts(identities, None)}
    url = f"http://127.0.0.1:{rollout.metrics_port}/healthz"
    assert beside["actor"].to_env()[COLLOCATED_ROLLOUT_HEALTH_ENV] == url
    assert COLLOCATED_ROLLOUT_HEALTH_ENV not in beside["rollout"].to_env()
    assert COLLOCATED_ROLLOUT_HEALTH_ENV not in beside["reward"].to_env()

    hosts = {("rollout", 0): ReplicaHost("co-rollout-0", "10.0.0.7")}
    placed = beside_collocated_rollouts(identities, lambda role, replica: hosts[(role, replica)])
    actor = next(i for i in placed if i.role == "actor")
    assert actor.to_env()[COLLOCATED_ROLLOUT_HEALTH_ENV] == f"http://10.0.0.7:{rollout.metrics_port}/healthz"
