"""Camera frames become the vision tower's inputs exactly as Qwen2-VL's own image processor makes them."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gymnasium import spaces

from rljob.api.spec import ModelSpec
from rljob.runtime.llm.models.policy import tiny_image_processor
from rljob.runtime.vla.images import ObservationError, Patcher


@pytest.mark.parametrize("side", [32, 48])
def test_a_batch_of_frames_is_patched_as_the_qwen2_vl_processor_patches_each(side):
    spec = ModelSpec.model_validate({"builtin": {"architecture": "tiny-qwen2-vl", "patchSize": 4}})
    processor = tiny_image_processor(spec)
    patcher = Patcher.for_space(spaces.Box(0, 255, (side, side, 3), np.uint8), processor)
    frames = np.random.default_rng(0).integers(0, 256, (3, side, side, 3), dtype=np.uint8)
    reference = processor(images=list(frames), return_tensors="np")
    pixel_values, grid = patcher(torch.from_numpy(frames).reshape(3, -1).float())  # flat, as the learner has them
    assert np.allclose(pixel_values.numpy(), reference["pixel_values"], atol=1e-5)
    assert grid.tolist() == reference["image_grid_thw"].tolist()
    assert patcher.image_tokens == (side // 4) ** 2 // 4


@pytest.mark.parametrize("space", [spaces.Box(-1.0, 1.0, (4,)), spaces.Box(0, 255, (32, 32, 1), np.uint8)])
def test_observations_that_are_not_rgb_images_are_refused_naming_the_field(space):
    spec = ModelSpec.model_validate({"builtin": {"architecture": "tiny-qwen2-vl"}})
    with pytest.raises(ObservationError, match=r"spec.task.gym.envId: the VLA reads camera images"):
        Patcher.for_space(space, tiny_image_processor(spec))
