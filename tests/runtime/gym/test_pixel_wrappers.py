"""The atari and minigrid-rgb wrappers, and the env role's check of image observations against the network."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rljob.api.spec import BuiltinNetwork, GymTask
from rljob.runtime.gym.envs import GymConfigError, VectorGymEnv, check_task, space_from_wire, space_to_wire
from rljob.runtime.gym.models import build_actor_critic

pytest.importorskip("minigrid", reason="the pixels extra is not installed: pip install 'rljob[pixels]'")
pytest.importorskip("ale_py", reason="the pixels extra is not installed: pip install 'rljob[pixels]'")

MINIGRID = "minigrid:MiniGrid-Empty-5x5-v0"
SMALL_CNN = BuiltinNetwork(architecture="cnn", channels=[16, 32], kernel_sizes=[4, 3], strides=[2, 2])


def _task(env_id: str, *wrappers: dict, **fields) -> GymTask:
    return GymTask.model_validate({"envId": env_id, "wrappers": list(wrappers), **fields})


def test_minigrid_rgb_serves_the_agents_view_as_uint8_pixels():
    envs = VectorGymEnv(_task(MINIGRID, {"builtin": "minigrid-rgb", "args": {"tile_size": 4}}), 2, SMALL_CNN)
    assert envs.observation_space.shape == (28, 28, 3) and envs.observation_space.dtype == np.uint8
    obs = envs.reset(seed=0)
    assert obs.shape == (2, 28, 28, 3) and obs.dtype == np.uint8 and obs.max() > 0
    result = envs.step(np.array([2, 2]))  # forward
    assert result.obs.dtype == np.uint8
    envs.close()
    # the whole grid instead of the agent's view: 5x5 tiles
    observation, _ = check_task(
        _task(MINIGRID, {"builtin": "minigrid-rgb", "args": {"tile_size": 4, "partial": False}}), SMALL_CNN
    )
    assert observation.shape == (20, 20, 3)
    # image spaces travel to the rollout and actor as they are
    assert space_from_wire(space_to_wire(envs.observation_space)) == envs.observation_space


def test_atari_preprocessing_and_frame_stack_give_stacked_84x84_frames():
    task = _task(
        "ale_py:ALE/Pong-v5",
        {"builtin": "atari"},
        {"builtin": "frame-stack", "args": {"size": 4}},
        envKwargs={"frameskip": 1},
    )
    nature = BuiltinNetwork(architecture="cnn", hidden_sizes=[512])
    envs = VectorGymEnv(task, 2, nature)
    assert envs.observation_space.shape == (4, 84, 84) and envs.observation_space.dtype == np.uint8
    obs = envs.reset(seed=0)
    assert obs.shape == (2, 4, 84, 84)
    # The Nature DQN cnn the Pong example trains acts on the stacked frames as the rollout gives them.
    policy = build_actor_critic(nature, envs.observation_space, envs.action_space)
    actions, logprobs, values = policy.act(torch.as_tensor(obs))
    assert actions.shape == (2,) and torch.isfinite(logprobs).all() and torch.isfinite(values).all()
    assert envs.step(actions.numpy()).obs.shape == (2, 4, 84, 84)
    envs.close()


def test_atari_on_an_env_that_skips_frames_itself_says_which_setting_to_change():
    with pytest.raises(GymConfigError, match=r"spec\.task\.gym\.envKwargs\.frameskip: 1"):
        check_task(_task("ale_py:ALE/Pong-v5", {"builtin": "atari"}))


def test_wrong_minigrid_rgb_args_name_the_wrapper_entry():
    with pytest.raises(
        GymConfigError, match=r"spec\.task\.gym\.wrappers.*minigrid-rgb takes args tile_size and partial"
    ):
        check_task(_task(MINIGRID, {"builtin": "minigrid-rgb", "args": {"tilesize": 4}}))


@pytest.mark.parametrize(
    ("task", "network", "message"),
    [
        # pixels and the default mlp
        (
            _task(MINIGRID, {"builtin": "minigrid-rgb", "args": {"tile_size": 4}}),
            None,
            r"images, which the builtin mlp does not read; set spec\.model\.builtin\.architecture: cnn",
        ),
        # vectors and the cnn
        (_task("CartPole-v1"), SMALL_CNN, r"not an image: spec\.model\.builtin\.architecture cnn reads images"),
        # MiniGrid's dict observation (no image wrapper) and the cnn
        (_task(MINIGRID), SMALL_CNN, r"add an image wrapper \(atari, minigrid-rgb\) to spec\.task\.gym\.wrappers"),
        # 28x28 views and Nature DQN's strides
        (
            _task(MINIGRID, {"builtin": "minigrid-rgb", "args": {"tile_size": 4}}),
            BuiltinNetwork(architecture="cnn"),
            r"too small for the cnn.*spec\.model\.builtin\.kernelSizes / strides.*minigrid-rgb tile_size",
        ),
    ],
)
def test_observations_the_network_cannot_take_fail_when_the_env_role_starts(task, network, message):
    with pytest.raises(GymConfigError, match=message):
        VectorGymEnv(task, 1, network)
