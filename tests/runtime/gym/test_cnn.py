"""The builtin cnn: image layouts, shapes, init, act/evaluate agreement, the rollout's torch policy, and the errors
for observations it cannot take."""

from __future__ import annotations

import math

import gymnasium
import numpy as np
import pytest
import torch

from rljob.api.spec import AlgorithmSpec, BuiltinNetwork, TrainerSpec
from rljob.runtime.gym.images import ImageSpaceError, check_conv_fits, image_layout
from rljob.runtime.gym.models import CNNActorCritic, MLPActorCritic, UnsupportedSpaceError, build_actor_critic
from rljob.runtime.gym.numpy_policy import NumpyPolicy
from rljob.runtime.gym.ppo import BATCH_FIELDS, GymBatch, PPOLearner
from rljob.runtime.gym.torch_policy import TorchPolicy, rollout_policy

SMALL = BuiltinNetwork(architecture="cnn", channels=[8, 16], kernel_sizes=[3, 3], strides=[2, 1], hidden_sizes=[32])


def _pixels(*shape: int) -> gymnasium.spaces.Box:
    return gymnasium.spaces.Box(0, 255, shape, dtype=np.uint8)


@pytest.mark.parametrize(
    ("shape", "channels", "height", "width"),
    [
        ((84, 84), 1, 84, 84),  # atari: one grayscale frame
        ((4, 84, 84), 4, 84, 84),  # atari + frame-stack: channel-first
        ((28, 20, 3), 3, 28, 20),  # minigrid-rgb: channel-last
        ((3, 28, 20), 3, 28, 20),
        ((2, 28, 20, 3), 6, 28, 20),  # minigrid-rgb + frame-stack: a stack of channel-last images
    ],
)
def test_image_layouts_put_channels_first(shape, channels, height, width):
    layout = image_layout(_pixels(*shape))
    assert (layout.channels, layout.height, layout.width) == (channels, height, width)
    model = CNNActorCritic(layout, gymnasium.spaces.Discrete(3), [4], [3], [1], [8])
    obs = torch.randint(0, 256, (5, *shape), dtype=torch.uint8)
    images = model.images(obs)
    assert images.shape == (5, channels, height, width) and images.dtype == torch.float32
    assert float(images.max()) <= 1.0  # uint8 pixels scaled to [0, 1]


def test_channel_last_pixels_land_in_their_channel():
    layout = image_layout(_pixels(6, 5, 3))
    model = CNNActorCritic(layout, gymnasium.spaces.Discrete(2), [4], [3], [1], [8])
    obs = torch.zeros((1, 6, 5, 3), dtype=torch.uint8)
    obs[0, 2, 4, 1] = 255  # row 2, column 4, green
    images = model.images(obs)
    assert images[0, 1, 2, 4] == 1.0 and float(images.sum()) == 1.0


def test_shapes_and_evaluate_agrees_with_act_discrete_and_continuous():
    torch.manual_seed(0)
    for action_space in (gymnasium.spaces.Discrete(7), gymnasium.spaces.Box(-1, 1, (2,), dtype=np.float32)):
        model = build_actor_critic(SMALL, _pixels(20, 20, 3), action_space)
        obs = torch.randint(0, 256, (6, 20, 20, 3), dtype=torch.uint8)
        actions, logprobs, values = model.act(obs)
        assert actions.shape == (6, *model.action_shape) and logprobs.shape == (6,) and values.shape == (6,)
        again, entropy, values_again = model.evaluate(obs, actions)
        torch.testing.assert_close(again, logprobs)
        torch.testing.assert_close(values_again, values)
        assert entropy.shape == (6,)
        # the batch as other actor ranks receive it (floats, unscaled) gives the same numbers
        torch.testing.assert_close(model.evaluate(obs.float(), actions)[0], logprobs)


def test_orthogonal_init_with_cleanrl_gains_and_a_nearly_uniform_first_policy():
    model = build_actor_critic(SMALL, _pixels(20, 20, 3), gymnasium.spaces.Discrete(4))
    assert isinstance(model, CNNActorCritic)
    first_conv = model.trunk[0].weight.detach().reshape(8, -1)
    # orthogonal rows scaled by the gain: W W^T = gain^2 I (8 rows of 27 inputs)
    torch.testing.assert_close(first_conv @ first_conv.T, 2.0 * torch.eye(8), atol=1e-4, rtol=1e-4)
    head = model.policy_head.weight.detach()
    assert math.isclose(float(torch.linalg.matrix_norm(head, ord=2)), 0.01, rel_tol=1e-3)
    assert all(float(m.bias.detach().abs().max()) == 0 for m in model.modules() if isinstance(m, torch.nn.Conv2d))
    probs = model.distribution(torch.randint(0, 256, (3, 20, 20, 3), dtype=torch.uint8)).probs
    torch.testing.assert_close(probs, torch.full_like(probs, 0.25), atol=0.02, rtol=0)


def test_the_rollout_acts_with_the_torch_module_for_the_cnn_and_numpy_for_the_mlp():
    cnn = build_actor_critic(SMALL, _pixels(20, 20, 3), gymnasium.spaces.Discrete(3))
    mlp = build_actor_critic(BuiltinNetwork(), gymnasium.spaces.Box(-1, 1, (4,)), gymnasium.spaces.Discrete(3))
    assert isinstance(rollout_policy(cnn, 0), TorchPolicy)
    assert isinstance(rollout_policy(mlp, 0), NumpyPolicy)


@pytest.mark.parametrize("action_space", [gymnasium.spaces.Discrete(3), gymnasium.spaces.Box(-1, 1, (2,))])
def test_torch_policy_logprobs_and_values_match_the_model(action_space):
    model = build_actor_critic(SMALL, _pixels(20, 20, 3), action_space)
    policy = TorchPolicy(model, seed=3)
    obs = np.random.default_rng(0).integers(0, 256, (64, 20, 20, 3), dtype=np.uint8)
    actions, logprobs, values = policy.act(obs)
    assert actions.shape == (64, *model.action_shape) and logprobs.dtype == np.float32
    expected, _, expected_values = model.evaluate(torch.from_numpy(obs), torch.from_numpy(actions))
    np.testing.assert_allclose(logprobs, expected.detach().numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(values, expected_values.detach().numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(policy.value(obs), values, rtol=1e-5, atol=1e-5)
    # the same seed samples the same actions
    np.testing.assert_array_equal(TorchPolicy(model, seed=3).act(obs)[0], actions)


def test_the_mlp_reads_stacked_vectors_flattened():
    model = MLPActorCritic(12, gymnasium.spaces.Discrete(2))
    obs = np.random.default_rng(0).standard_normal((5, 3, 4)).astype(np.float32)
    _, logprobs, values = NumpyPolicy(model, 0).act(obs)
    np.testing.assert_allclose(values, model.value(torch.from_numpy(obs)).detach().numpy(), rtol=1e-5, atol=1e-5)
    assert logprobs.shape == (5,)


def test_images_too_small_for_the_convolutions_name_the_fields_and_the_fix():
    layout = image_layout(_pixels(28, 28, 3))
    assert check_conv_fits(layout, [4, 3], [2, 2]) == (6, 6)
    with pytest.raises(ImageSpaceError) as caught:
        check_conv_fits(layout, [8, 4, 3], [4, 2, 1])  # Nature DQN: 28 -> 6 -> 2 -> nothing
    message = str(caught.value)
    assert "28x28" in message and "convolution 2 (kernel 3, stride 1) gets 2x2" in message
    assert "spec.model.builtin.kernelSizes" in message and "spec.task.gym.wrappers" in message
    with pytest.raises(UnsupportedSpaceError, match="too small for the cnn"):
        build_actor_critic(BuiltinNetwork(architecture="cnn"), _pixels(28, 28, 3), gymnasium.spaces.Discrete(3))


def test_vector_observations_with_the_cnn_and_images_with_the_mlp_name_the_architecture():
    with pytest.raises(UnsupportedSpaceError, match=r"not an image: spec\.model\.builtin\.architecture cnn"):
        build_actor_critic(SMALL, gymnasium.spaces.Box(-1, 1, (4,)), gymnasium.spaces.Discrete(2))
    with pytest.raises(UnsupportedSpaceError, match=r"set spec\.model\.builtin\.architecture: cnn"):
        build_actor_critic(BuiltinNetwork(), _pixels(84, 84), gymnasium.spaces.Discrete(2))
    with pytest.raises(UnsupportedSpaceError, match="the builtin cnn supports Discrete or 1-D Box action spaces"):
        build_actor_critic(SMALL, _pixels(20, 20, 3), gymnasium.spaces.MultiDiscrete([2, 2]))


def _pixel_batch(seed: int, steps: int = 8, envs: int = 4) -> GymBatch:
    g = torch.Generator().manual_seed(seed)
    return GymBatch(
        obs=torch.randint(0, 256, (steps, envs, 20, 20, 3), generator=g, dtype=torch.uint8),
        actions=torch.randint(0, 3, (steps, envs), generator=g),
        logprobs=torch.full((steps, envs), -1.1) + 0.05 * torch.randn(steps, envs, generator=g),
        values=torch.randn(steps, envs, generator=g),
        next_values=torch.randn(steps, envs, generator=g),
        rewards=torch.ones(steps, envs),
        terminated=torch.rand(steps, envs, generator=g) < 0.1,
        truncated=torch.zeros(steps, envs, dtype=torch.bool),
    )


def _cnn_learner() -> PPOLearner:
    torch.manual_seed(0)
    model = build_actor_critic(SMALL, _pixels(20, 20, 3), gymnasium.spaces.Discrete(3))
    trainer = TrainerSpec(steps=2, batch_size=32, learning_rate=1e-3, grad_clip=0.5, seed=3)
    return PPOLearner(model, AlgorithmSpec(name="ppo", epochs=2, minibatches=2), trainer)


def test_a_ppo_update_trains_the_cnn_on_uint8_batches_as_on_the_float_copy_other_ranks_get():
    as_bytes, as_floats = _cnn_learner(), _cnn_learner()
    before = [p.detach().clone() for p in as_bytes.model.parameters()]
    batch = _pixel_batch(0)
    stats = as_bytes.update(batch)
    # other actor ranks receive the batch as one float32 tensor (actor._share_batch)
    floats = GymBatch(**{f: getattr(batch, f) for f in BATCH_FIELDS if f != "obs"}, obs=batch.obs.float())
    assert stats == as_floats.update(floats)
    assert all(not torch.equal(a, b) for a, b in zip(before, as_bytes.model.parameters(), strict=True))
