"""A vision-language policy through the hf engine and the learner: both feed the model the same images, so the
trainer recomputes the log-probs the engine sampled with; image tokens are never sampled; the learner updates with
the images; the vision tower can be frozen; the export loads back with its image processor."""

from __future__ import annotations

import copy

import pytest
import torch

from rljob.api.loading import load_job_file
from rljob.runtime.llm.data.images import VisionInputs
from rljob.runtime.llm.data.prompts import PromptEncoder
from rljob.runtime.llm.data.rows import load_rows
from rljob.runtime.llm.engines.base import Sampling
from rljob.runtime.llm.engines.hf import HFEngine
from rljob.runtime.llm.models.policy import export_hf, freeze_vision_tower, load_policy, vision_token_ids
from rljob.runtime.llm.training.learner import LLMLearner, collate, token_logprobs
from rljob.runtime.llm.training.logprobs import shares_prompts
from tests.conftest import REPO

EXAMPLE = REPO / "examples" / "grpo-vlm-tiny-shapes.yaml"


@pytest.fixture(scope="module")
def job():
    return load_job_file(EXAMPLE)


@pytest.fixture(scope="module")
def policy(job):
    rows = load_rows(job.spec.task.llm, 0)[:64]
    model, tokenizer = load_policy(job.spec.model, job.spec.task.llm, rows, 0, torch.device("cpu"))
    return model, tokenizer, rows


@pytest.fixture(scope="module")
def encoded(job, policy):
    _, tokenizer, rows = policy
    encoder = PromptEncoder(job.spec.task.llm, tokenizer)
    return [encoder.encode(row, i) for i, row in enumerate(rows[:6])]


def generate(policy, encoded, sampling: Sampling):
    model, tokenizer, _ = policy
    engine = HFEngine(model, tokenizer, torch.device("cpu"))
    return engine.generate([ids for ids, _ in encoded], sampling, vision=VisionInputs.concat([v for _, v in encoded]))


def samples_of(encoded, out):
    return [
        {
            "prompt_ids": ids,
            "response_ids": c.token_ids,
            "rollout_logprobs": c.logprobs,
            "advantage": 1.0 if i % 2 else -1.0,
            "vision": vision,
        }
        for (ids, vision), group in zip(encoded, out, strict=True)
        for i, c in enumerate(group)
    ]


def learner_for(job, model, tokenizer) -> LLMLearner:
    spec = job.spec
    return LLMLearner(
        model, spec.algorithm, spec.trainer, pad_id=tokenizer.pad_token_id, temperature=1.0, max_response_tokens=4
    )


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_the_trainer_recomputes_the_log_probs_the_engine_sampled_with_the_same_images(policy, encoded, temperature):
    model, tokenizer, _ = policy
    torch.manual_seed(3)
    out = generate(policy, encoded, Sampling(n=4, temperature=temperature, max_tokens=6))
    batch = collate(samples_of(encoded, out), tokenizer.pad_token_id)
    assert batch.vision is not None and batch.vision.images == len(encoded) * 4
    with torch.no_grad():
        trainer, _ = token_logprobs(model, batch, temperature, with_entropy=False)
    mask = batch.response_mask.bool()
    gap = float((trainer - batch.rollout_logprobs)[mask].abs().max())
    assert gap < 1e-4, gap
    # The images matter: other images give other log-probs for the same tokens.
    other = copy.copy(batch)
    other.vision = VisionInputs(batch.vision.pixel_values[::-1].copy(), batch.vision.image_grid_thw)
    with torch.no_grad():
        blind, _ = token_logprobs(model, other, temperature, with_entropy=False)
    assert float((blind - trainer)[mask].abs().max()) > 1e-3


def test_image_markup_tokens_are_never_sampled(policy, encoded):
    model, _, _ = policy
    forbidden = set(vision_token_ids(model.config))
    assert len(forbidden) == 4
    torch.manual_seed(4)
    out = generate(policy, encoded, Sampling(n=16, temperature=1.5, max_tokens=8))
    assert not forbidden & {t for group in out for c in group for t in c.token_ids}


def test_greedy_copies_of_a_prompt_with_images_are_one_decode(policy, encoded):
    out = generate(policy, encoded, Sampling(n=3, greedy=True, max_tokens=4))
    assert all(len({tuple(c.token_ids) for c in group}) == 1 and len(group) == 3 for group in out)


def test_the_learner_updates_a_vision_language_policy_and_its_vision_tower(job, policy, encoded):
    model, tokenizer, _ = policy
    model = copy.deepcopy(model)
    assert not shares_prompts(model)  # rows with images run whole: a shared prefix would lose their positions
    torch.manual_seed(5)
    out = generate((model, tokenizer, None), encoded, Sampling(n=4, max_tokens=4))
    tower = model.model.visual.blocks[0].mlp.fc1.weight
    before = tower.detach().clone()
    learner = learner_for(job, model, tokenizer)
    stats = learner.update(samples_of(encoded, out))
    assert stats["grad_norm"] > 0 and not torch.equal(before, tower.detach())


def test_a_frozen_vision_tower_stays_as_loaded_while_its_projector_trains(job, policy, encoded):
    model, tokenizer, _ = policy
    model = copy.deepcopy(model)
    assert freeze_vision_tower(model) > 0
    tower, merger = model.model.visual.blocks[0].mlp.fc1.weight, model.model.visual.merger.mlp[0].weight
    before_tower, before_merger = tower.detach().clone(), merger.detach().clone()
    torch.manual_seed(6)
    out = generate((model, tokenizer, None), encoded, Sampling(n=4, max_tokens=4))
    learner = learner_for(job, model, tokenizer)
    learner.update(samples_of(encoded, out))
    assert torch.equal(before_tower, tower.detach()) and not torch.equal(before_merger, merger.detach())


def test_the_export_loads_back_with_its_image_processor(tmp_path, policy, encoded):
    from transformers import AutoImageProcessor, AutoModelForImageTextToText

    model, tokenizer, _ = policy
    export_hf(model, tokenizer, tmp_path / "model")
    loaded = AutoModelForImageTextToText.from_pretrained(tmp_path / "model")
    processor = AutoImageProcessor.from_pretrained(tmp_path / "model")
    assert processor.patch_size == tokenizer.image_processor.patch_size
    ids, vision = encoded[0]
    inputs = torch.tensor([ids])
    from rljob.runtime.llm.models.policy import vision_kwargs

    with torch.no_grad():
        a = model(input_ids=inputs, **vision_kwargs(model, inputs, vision)).logits
        b = loaded(input_ids=inputs, **vision_kwargs(loaded, inputs, vision)).logits
    assert torch.allclose(a, b, atol=1e-5)
