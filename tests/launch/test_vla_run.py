"""`rljob run` of the tiny VLA example end to end: the env role serves PickColor's camera images, the rollout acts
with tiny-qwen2-vl's action tokens, the actor's PPO updates reach it as weights, and every step records the
episodes' success rate. (Whether it learns is the 40-step example's: docs/guides/embodied-vla.md; here 2 steps.)"""

from __future__ import annotations

import pytest

EXAMPLE = "examples/vla-tiny.yaml"


@pytest.mark.slow
def test_the_tiny_vla_example_trains_on_camera_images_and_records_its_success_rate(repo, start_run):
    run = start_run(
        repo / EXAMPLE,
        "--set=spec.trainer.steps=2",
        "--set=spec.trainer.batchSize=32",
        "--set=spec.checkpoint.interval=2",
        "--set=spec.logging.tensorboard=false",
        "--quiet",
    )
    output = run.finish()
    assert run.process.returncode == 0, output
    records = run.metrics()
    assert [r["step"] for r in records] == [1, 2]
    for record in records:
        assert record["episodes"] == 32  # one decision per episode: every transition ends one
        assert 0.0 <= record["success_rate"] <= 1.0 and record["grad_norm"] > 0
    assert (run.out / "checkpoints" / "step-00000002").is_dir()
    assert not run.roles()
