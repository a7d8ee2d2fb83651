"""A non-finite loss or gradient norm stops the actor: every rank agrees, nothing is applied or checkpointed,
and the run ends with EXIT_DIVERGED and a line naming the step, the values and the last good checkpoint."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from rljob.launch.local import free_ports
from rljob.runtime.optim.divergence import Diverged, check_update
from rljob.runtime.process.termination import write_termination_message
from rljob.runtime.records.checkpoint import CheckpointManager
from rljob.runtime.wire.identity import EXIT_DIVERGED

JOB = """\
apiVersion: rljob.io/v1alpha1
kind: RLJob
metadata:
  name: diverge
spec:
  task:
    type: gym
    gym: {envId: CartPole-v1, numEnvs: 2}
  algorithm: {name: ppo, minibatches: 1, epochs: 4}
  trainer: {steps: 2, batchSize: 64, optimizer: sgd, learningRate: 0.001}
  checkpoint: {interval: 1, keep: 5}
  roles:
    actor: {replicas: 1}
    rollout: {replicas: 1}
    env: {replicas: 1}
"""


def test_finite_values_pass_and_a_non_finite_one_is_named_with_the_step():
    check_update(3, {"loss": 0.5, "grad_norm": 1.2}, 1, torch.device("cpu"))
    with pytest.raises(Diverged) as raised:
        check_update(3, {"loss": math.nan, "grad_norm": math.inf}, 1, torch.device("cpu"))
    assert str(raised.value) == (
        "diverged at step 3: non-finite loss and grad_norm (loss nan, grad_norm inf); the update was not applied"
    )
    named = raised.value.with_checkpoint([(1, Path("/ck/step-00000001")), (2, Path("/ck/step-00000002"))])
    assert str(named).endswith("; last good checkpoint: /ck/step-00000002 (step 2)")
    assert "no checkpoint was written before it" in str(Diverged(1, {"loss": math.nan}, True).with_checkpoint([]))


def test_the_termination_message_is_written_only_where_kubernetes_provides_the_file(tmp_path):
    log = tmp_path / "termination-log"
    write_termination_message("diverged at step 3", log)
    assert not log.exists()  # not in a pod: nothing is created
    log.write_text("")
    write_termination_message("diverged at step 3", log)
    assert log.read_text() == "diverged at step 3"


def _rank(rank: int, port: int, results: dict) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        check_update(5, {"loss": math.nan if rank == 1 else 0.25}, 2, torch.device("cpu"))
        results[rank] = "applied"
    except Diverged as exc:
        results[rank] = str(exc)
    finally:
        dist.destroy_process_group()


def test_every_rank_stops_when_one_ranks_loss_is_not_finite():
    results = mp.Manager().dict()
    mp.spawn(_rank, args=(free_ports(1)[0], results), nprocs=2)
    assert results[1].startswith("diverged at step 5: non-finite loss (loss nan)")
    assert results[0].startswith("diverged at step 5: a non-finite loss or gradient norm on another actor rank")


def _run(job: Path, out: Path, *overrides: str) -> subprocess.CompletedProcess[str]:
    sets = [arg for item in overrides for arg in ("--set", item)]
    return subprocess.run(
        [sys.executable, "-m", "rljob.cli.main", "run", str(job), "--out", str(out), "--quiet", *sets],
        capture_output=True,
        text=True,
        timeout=300,  # a safety net; the two steps and the diverged one take seconds
        env={**os.environ, "COLUMNS": "400"},
    )


@pytest.mark.slow
def test_a_learning_rate_that_overflows_stops_the_run_with_the_values_and_keeps_the_last_good_checkpoint(tmp_path):
    job = tmp_path / "job.yaml"
    job.write_text(JOB)
    out = tmp_path / "run"
    first = _run(job, out)
    assert first.returncode == 0, first.stdout + first.stderr
    checkpoints = CheckpointManager(out / "checkpoints")
    assert [step for step, _ in checkpoints.checkpoints()] == [1, 2]
    before = {path: (path / "state.pt").stat().st_mtime_ns for _, path in checkpoints.checkpoints()}

    # Resumed from step 2 with plain SGD at 1e30: the first minibatch's update overflows the weights, and the
    # next minibatch's loss is no longer finite.
    diverged = _run(job, out, "spec.trainer.steps=4", "spec.trainer.learningRate=1.0e+30")
    output = diverged.stdout + diverged.stderr
    assert diverged.returncode == EXIT_DIVERGED, output
    assert "actor-0 diverged at step 3: non-finite loss" in output
    assert "the update was not applied" in output
    assert f"last good checkpoint: {out / 'checkpoints'}" in output and "(step 2)" in output
    assert "not restarted (it would diverge again from the same checkpoint)" in output
    after = CheckpointManager(out / "checkpoints").checkpoints()
    assert [step for step, _ in after] == [1, 2]  # nothing written from the bad weights
    assert {path: (path / "state.pt").stat().st_mtime_ns for _, path in after} == before


@pytest.mark.slow
def test_an_llm_actor_diverged_by_its_learning_rate_stops_at_the_step_and_keeps_the_last_good_checkpoint(tmp_path):
    example = Path(__file__).parents[3] / "examples" / "grpo-tiny-arithmetic.yaml"
    out = tmp_path / "run"
    # Two passes per step: the first applies the overflowing update, the second sees the non-finite loss.
    common = ("spec.checkpoint.interval=1", "spec.evaluation.interval=0", "spec.algorithm.epochs=2")
    first = _run(example, out, "spec.trainer.steps=2", *common)
    assert first.returncode == 0, first.stdout + first.stderr
    diverged = _run(example, out, "spec.trainer.steps=4", "spec.trainer.learningRate=1.0e+30", *common)
    output = diverged.stdout + diverged.stderr
    assert diverged.returncode == EXIT_DIVERGED, output
    assert "actor-0 diverged at step 3: non-finite loss" in output
    assert f"last good checkpoint: {out / 'checkpoints' / 'step-00000002'} (step 2)" in output
    assert [step for step, _ in CheckpointManager(out / "checkpoints").checkpoints()] == [1, 2]


@pytest.mark.slow
def test_a_supervised_warm_up_that_overflows_stops_the_actor_before_rl_starts(tmp_path):
    example = Path(__file__).parents[3] / "examples" / "grpo-tiny-arithmetic.yaml"
    sft = ("spec.sft.steps=4", "spec.sft.responseKey=answer", "spec.sft.learningRate=1.0e+30")
    diverged = _run(example, tmp_path / "run", "spec.trainer.steps=2", "spec.evaluation.interval=0", *sft)
    output = diverged.stdout + diverged.stderr
    assert diverged.returncode == EXIT_DIVERGED, output
    assert "actor-0 diverged at step 0: non-finite" in output and "the update was not applied" in output
    assert "not restarted" in output
