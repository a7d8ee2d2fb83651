"""CameraImage turns a simulator's Dict observation into the one RGB image a VLA reads."""

from __future__ import annotations

import gymnasium
import numpy as np
import pytest
from gymnasium.wrappers import AddRenderObservation

from rljob.api.spec import GymTask
from rljob.runtime.gym.envs import make_env
from rljob.runtime.vla.camera import CameraImage
from rljob.runtime.vla.images import check_image_space


def test_the_image_at_the_key_is_the_observation(monkeypatch):
    monkeypatch.setenv("SDL_VIDEODRIVER", "dummy")
    env = AddRenderObservation(gymnasium.make("CartPole-v1", render_mode="rgb_array"), render_only=False)
    camera = CameraImage(env, key="pixels")
    check_image_space(camera.observation_space)
    image, _ = camera.reset(seed=0)
    assert image.shape == camera.observation_space.shape == (400, 600, 3) and image.dtype == np.uint8
    assert np.array_equal(image, env.render())
    camera.close()


def test_it_is_named_in_a_job_like_any_wrapper_class():
    task = GymTask.model_validate(
        {
            "envId": "CartPole-v1",
            "envKwargs": {"render_mode": "rgb_array"},
            "wrappers": [
                {"module": "gymnasium.wrappers:AddRenderObservation", "args": {"render_only": False}},
                {"module": "rljob.runtime.vla.camera:CameraImage", "args": {"key": "pixels"}},
            ],
        }
    )
    env = make_env(task)
    assert env.observation_space.shape == (400, 600, 3)
    env.close()


def test_a_key_the_observation_lacks_says_what_it_has():
    env = AddRenderObservation(gymnasium.make("CartPole-v1", render_mode="rgb_array"), render_only=False)
    with pytest.raises(
        ValueError,
        match=r"key 'sensor_data/base_camera/rgb': the observation has no 'sensor_data' "
        r"\(it has: pixels, state\)",
    ):
        CameraImage(env, key="sensor_data/base_camera/rgb")
    with pytest.raises(ValueError, match=r"not one RGB image"):
        CameraImage(env, key="state")
