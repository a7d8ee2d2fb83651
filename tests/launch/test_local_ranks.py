"""`rljob run` with several ranks per actor replica: the GPUs a job asks for, one per rank, and a real run."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from rljob.api import validate_job
from rljob.launch.local import TEST_RANKS_PER_REPLICA_ENV, LaunchError, assign_local_gpus, local_actor_ranks
from rljob.runtime.preflight import actor_rank_problems, gpu_problems


def refusal(job, device_count: int, cuda_visible_devices: str | None = None) -> str:
    """What the preflight says of the job's GPUs on a machine where torch sees `device_count` ("" when they fit)."""
    visible = [str(i) for i in range(device_count)]
    return "\n".join(p.render() for p in gpu_problems(job, visible, cuda_visible_devices))


EXAMPLE = Path(__file__).parents[2] / "examples" / "cartpole-ppo.yaml"


def cartpole(actor: dict | None = None, rollout: dict | None = None, **trainer):
    data = yaml.safe_load(EXAMPLE.read_text())
    data["spec"]["roles"]["actor"].update(actor or {})
    data["spec"]["roles"]["rollout"].update(rollout or {})
    data["spec"]["trainer"].update(trainer)
    return validate_job(data)


def test_two_one_gpu_actors_on_a_one_gpu_machine_are_refused_naming_the_numbers():
    job = cartpole({"replicas": 2, "gpusPerReplica": 1})
    message = refusal(job, device_count=1)
    assert message.startswith("spec.roles.actor.gpusPerReplica: the job asks for 2 GPUs on this machine")
    assert "spec.roles.actor.replicas (2) x spec.roles.actor.gpusPerReplica (1)" in message
    assert "torch sees 1 GPU (CUDA_VISIBLE_DEVICES unset)" in message


def test_gpus_of_actors_and_rollouts_are_counted_together_against_cuda_visible_devices():
    job = cartpole({"replicas": 1, "gpusPerReplica": 2}, {"gpusPerReplica": 1})
    assert refusal(job, device_count=3, cuda_visible_devices="0,1,2") == ""
    message = refusal(job, device_count=2, cuda_visible_devices="4,5")
    assert "asks for 3 GPUs" in message and "torch sees 2 GPUs (CUDA_VISIBLE_DEVICES='4,5')" in message
    assert "spec.roles.rollout.replicas (1) x spec.roles.rollout.gpusPerReplica (1)" in message


def test_a_gpu_job_on_a_machine_without_gpus_says_how_to_run_on_the_cpu():
    message = refusal(cartpole({"gpusPerReplica": 1}), device_count=0)
    assert "torch sees no GPU" in message and "--set spec.roles.actor.gpusPerReplica=0" in message
    with pytest.raises(LaunchError, match="torch sees no GPU"):
        assign_local_gpus(cartpole({"gpusPerReplica": 1}), [])


def test_a_cpu_job_asks_for_no_gpu():
    assert refusal(cartpole(), device_count=0) == ""
    assert assign_local_gpus(cartpole(), []) == {}


def test_each_replica_gets_gpus_of_its_own_actors_first():
    job = cartpole({"replicas": 2, "gpusPerReplica": 2}, {"gpusPerReplica": 1})
    visible = ["GPU-a", "GPU-b", "GPU-c", "GPU-d", "GPU-e", "GPU-f"]
    assert assign_local_gpus(job, visible, "GPU-a,GPU-b,GPU-c,GPU-d,GPU-e,GPU-f") == {
        ("actor", 0): "GPU-a,GPU-b",
        ("actor", 1): "GPU-c,GPU-d",
        ("rollout", 0): "GPU-e",
    }


def test_actor_ranks_follow_gpus_per_replica_or_the_test_hook():
    assert local_actor_ranks(cartpole(), env={}) == 1
    assert local_actor_ranks(cartpole({"gpusPerReplica": 4}), env={}) == 4
    assert local_actor_ranks(cartpole(), env={TEST_RANKS_PER_REPLICA_ENV: "2"}) == 2
    with pytest.raises(LaunchError, match=TEST_RANKS_PER_REPLICA_ENV):
        local_actor_ranks(cartpole(), env={TEST_RANKS_PER_REPLICA_ENV: "0"})


def test_every_minibatch_must_split_over_all_ranks_of_all_replicas():
    assert actor_rank_problems(cartpole({"replicas": 2}, batchSize=256), 2) == []
    (problem,) = actor_rank_problems(cartpole({"replicas": 1}, batchSize=248), 3)
    assert problem.render().startswith("spec.roles.actor.gpusPerReplica: spec.roles.actor.replicas (1) x 3 ranks")
    assert "(spec.trainer.batchSize 248 / spec.algorithm.minibatches 1 = 248 transitions)" in problem.message


def test_rljob_run_refuses_gpus_the_machine_lacks_before_starting_anything(tmp_path):
    out = tmp_path / "out"
    overrides = ["--set", "spec.roles.actor.gpusPerReplica=8", "--set", "spec.roles.actor.replicas=2"]
    result = subprocess.run(
        [sys.executable, "-m", "rljob.cli.main", "run", str(EXAMPLE), "--out", str(out), *overrides],
        env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
        capture_output=True,
        text=True,
        timeout=120,  # a safety net: refused before any role process starts
    )
    output = result.stdout + result.stderr
    assert result.returncode == 1, output
    assert "spec.roles.actor.gpusPerReplica: the job asks for 16 GPUs on this machine" in output
    assert "Traceback" not in output
    assert not out.exists()


@pytest.mark.slow
def test_an_actor_replica_of_two_cpu_ranks_trains_cartpole_to_the_end(cartpole_manifest, start_run, monkeypatch):
    """The path of a replica with gpusPerReplica: 2, on CPU ranks (gloo) through the test hook."""
    monkeypatch.setenv(TEST_RANKS_PER_REPLICA_ENV, "2")
    run = start_run(cartpole_manifest(steps=3, interval=3, envs=1))
    output = run.finish()
    assert run.process.returncode == 0, output
    assert "reached trainer.steps (3)" in output
    assert "actor[0] started ranks 0..1 of WORLD_SIZE 2 (2 per replica)" in output
    log = (run.out / "logs" / "actor-0.log").read_text()
    assert "rank 0 of 2 (local rank 0 of 2) on cpu" in log and "rank 1 of 2 (local rank 1 of 2) on cpu" in log
    assert "training 3 steps from step 0 (2 actor ranks)" in log
    assert [r["step"] for r in run.metrics()] == [1, 2, 3]
    assert not run.roles()


@pytest.mark.slow
def test_a_killed_rank_takes_its_replica_down_and_the_actor_group_restarts(cartpole_manifest, start_run, monkeypatch):
    monkeypatch.setenv(TEST_RANKS_PER_REPLICA_ENV, "2")
    run = start_run(cartpole_manifest(steps=12, interval=3, envs=1), "--quiet")
    run.wait_for_step(4)
    (rank1,) = [p for p in run.roles() if p.environ().get("LOCAL_RANK") == "1"]
    rank1.kill()
    output = run.finish()
    assert run.process.returncode == 0, output
    assert "actor-0 exited with code 137: restarting the actor group from the latest checkpoint (1/3)" in output
    log = (run.out / "logs" / "actor-0.log").read_text()
    assert "actor[0] rank 1 exited with code -9: stopping the other ranks of this replica" in log
    assert "resumed from" in log
    assert [r["step"] for r in run.metrics()] == list(range(1, 13))
    assert not run.roles()


def test_an_autoscaled_rollout_role_gets_gpus_for_its_max_replicas_up_front():
    """A rollout the scaler starts later needs a GPU of its own, not the actor's."""
    data = yaml.safe_load((EXAMPLE.parent / "grpo-tiny-arithmetic.yaml").read_text())
    data["spec"]["roles"]["actor"].update(gpusPerReplica=1)
    data["spec"]["roles"]["rollout"].update(gpusPerReplica=1, autoscale={"minReplicas": 1, "maxReplicas": 3})
    job = validate_job(data)
    assert assign_local_gpus(job, ["g0", "g1", "g2", "g3"], None) == {
        ("actor", 0): "g0",
        ("rollout", 0): "g1",
        ("rollout", 1): "g2",
        ("rollout", 2): "g3",
    }
    message = refusal(job, device_count=2)
    assert "spec.roles.rollout.autoscale.maxReplicas (3) x spec.roles.rollout.gpusPerReplica (1)" in message


def test_a_collocated_rollout_sees_the_gpus_of_the_actor_it_runs_beside_and_asks_for_none_of_its_own():
    data = yaml.safe_load((EXAMPLE.parent / "grpo-tiny-arithmetic.yaml").read_text())
    data["spec"]["roles"]["actor"].update(gpusPerReplica=2)
    data["spec"]["roles"]["rollout"].update(collocated=True)
    data["spec"]["rollout"]["weightSync"] = {"method": "ipc"}
    job = validate_job(data)
    assert refusal(job, device_count=2) == ""  # two GPUs are enough: the rollout shares the actor's
    assert assign_local_gpus(job, ["g0", "g1"], None) == {("actor", 0): "g0,g1", ("rollout", 0): "g0,g1"}
