"""Partitions: one replica's host cut off the network (its link down) for longer than its request deadline, then
restored. The job keeps training on the other replica, names the lost one, and takes it back. Every replica on a
host of its own (lab.py), the real roles, the real transport."""

from __future__ import annotations

import json
import re
import time
import urllib.request

import pytest

from tests.multihost.conftest import load_example, run_in_lab

pytestmark = pytest.mark.slow

CUT_S = 12.0
"""How long the link stays down: four request deadlines (`requestTimeoutSeconds: 3`)."""


def read_step(run) -> int | None:
    try:
        with urllib.request.urlopen(run.progress_url, timeout=0.3) as response:
            return int(json.loads(response.read())["step"])
    except (OSError, ValueError, KeyError):
        return None


@pytest.mark.parametrize("role", ["reward", "rollout"])
def test_a_replica_cut_off_is_named_training_goes_on_and_it_is_taken_back(tmp_path, role):
    steps = 400  # the link must come back before the run ends, however fast the steps go
    job = load_example(
        "grpo-tiny-arithmetic.yaml",
        [
            f"spec.trainer.steps={steps}",
            "spec.trainer.batchSize=8",
            "spec.evaluation.interval=0",
            "spec.checkpoint.interval=1000",
            "spec.logging.tensorboard=false",
            f"spec.roles.{role}.replicas=2",
            f"spec.roles.{role}.requestTimeoutSeconds=3",
        ],
    )
    cut: dict[str, float | int] = {}

    def partition(run, lab) -> None:
        if "restored_at" in cut:
            return
        step = read_step(run)
        if step is None:
            return
        if "at" not in cut and step >= 5:
            lab.cut(role, 1)
            cut.update(at=time.monotonic(), step=step)
        elif "at" in cut and time.monotonic() - cut["at"] >= CUT_S:
            lab.restore(role, 1)
            cut.update(restored_at=time.monotonic(), restored_step=step)

    done = run_in_lab(job, tmp_path / "out", dns="answering", during=partition)
    log = "\n".join(done.lines)
    assert done.result.exit_code == 0, "\n".join(done.lines[-40:])
    assert "restored_at" in cut, f"the run ended before the link was restored: {cut}"
    # Named, with its work moved to the other replica; training went on while it was cut off.
    assert re.search(rf"{role}-1 has not answered for \d+ s; its work goes to {role}-0", log), log[-4000:]
    assert int(cut["restored_step"]) >= int(cut["step"]) + 3, cut
    # Taken back once its link is up again, without a restart.
    assert f"{role}-1 answers again" in log, log[-4000:]
    if role == "rollout":  # work goes to it again once it holds the latest weights
        assert re.search(r"rollout-1 has weights version \d+ again: it takes chunks again", log), log[-4000:]
    assert not done.result.replica_restarts.get(f"{role}-1"), done.result.replica_restarts
    records = [json.loads(x) for x in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines() if x.strip()]
    assert [r["step"] for r in records] == list(range(1, steps + 1))
    print(f"cut at step {cut['step']}, restored at step {cut['restored_step']} after {CUT_S:g}s")
