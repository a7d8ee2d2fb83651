"""`rljob run` of a vision-language job end to end: the tiny shapes example's images travel from the actor to the
rollout and into the update, the engine and the trainer agree on every log-prob, and the export loads back with
its image processor. (Whether it learns is `make demo`-sized: 600 steps, in the README; here a few steps.)"""

from __future__ import annotations

import pytest
import torch

EXAMPLE = "examples/grpo-vlm-tiny-shapes.yaml"


@pytest.mark.slow
def test_grpo_vlm_tiny_shapes_trains_on_its_images_evaluates_and_exports(repo, start_run):
    from transformers import AutoImageProcessor, AutoModelForImageTextToText

    run = start_run(
        repo / EXAMPLE,
        "--set=spec.trainer.steps=6",
        "--set=spec.trainer.batchSize=8",
        "--set=spec.evaluation.interval=3",
        "--set=spec.evaluation.size=16",
        "--set=spec.checkpoint.interval=3",
        "--set=spec.logging.tensorboard=false",
        "--quiet",
    )
    output = run.finish()
    assert run.process.returncode == 0, output
    records = run.metrics()
    assert [r["step"] for r in records] == list(range(1, 7))
    for record in records:
        assert record["mismatch_max_gap"] < 1e-4  # the rollout generated from the images the trainer reads
        assert record["prompts_skipped_images"] == 0 and record["grad_norm"] > 0
    assert [r["eval_prompts"] for r in records if "eval_prompts" in r] == [16, 16]
    model = AutoModelForImageTextToText.from_pretrained(run.out / "model")
    processor = AutoImageProcessor.from_pretrained(run.out / "model")
    assert model.config.vision_config.patch_size == processor.patch_size == 8
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert not run.roles()


@pytest.mark.slow
def test_fsdp2_shards_the_vision_tower_over_two_actor_ranks_and_the_rollout_gets_it_whole(repo, start_run):
    """Vision blocks are sharded like decoder layers (the tower is trained: freezeVisionTower is off): the rollout's
    log-probs, computed from the gathered weights, match the sharded trainer's."""
    run = start_run(
        repo / EXAMPLE,
        "--set=spec.trainer.steps=4",
        "--set=spec.trainer.batchSize=8",
        "--set=spec.trainer.parallelism=fsdp2",
        "--set=spec.roles.actor.replicas=2",
        "--set=spec.evaluation.interval=0",
        "--set=spec.checkpoint.interval=2",
        "--set=spec.logging.tensorboard=false",
        "--quiet",
    )
    output = run.finish()
    assert run.process.returncode == 0, output
    assert "2 actor rank(s) (fsdp2: the policy sharded over them)" in (run.out / "logs" / "actor-0.log").read_text()
    records = run.metrics()
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert all(r["mismatch_max_gap"] < 1e-4 and r["grad_norm"] > 0 for r in records)
    assert (run.out / "checkpoints" / "step-00000004" / "sharded").is_dir()
    assert (run.out / "checkpoints" / "hf-latest" / "preprocessor_config.json").is_file()
