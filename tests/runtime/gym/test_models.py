import math

import gymnasium as gym
import numpy as np
import pytest
import torch

from rljob.api.spec import BuiltinNetwork
from rljob.runtime.gym.models import MLPActorCritic, UnsupportedSpaceError, build_mlp_actor_critic


def test_discrete_policy_shapes_and_evaluate_matches_act():
    torch.manual_seed(0)
    model = MLPActorCritic(4, gym.spaces.Discrete(2), hidden_sizes=[16, 16], activation="tanh")
    obs = torch.randn(8, 4)
    actions, logprobs, values = model.act(obs)
    assert actions.shape == (8,) and logprobs.shape == (8,) and values.shape == (8,)
    assert not logprobs.requires_grad
    new_logprobs, entropy, new_values = model.evaluate(obs, actions)
    torch.testing.assert_close(new_logprobs, logprobs)
    torch.testing.assert_close(new_values, values)
    # policy head gain 0.01: the initial policy is nearly uniform over the 2 actions
    assert torch.allclose(entropy, torch.full((8,), math.log(2)), atol=1e-3)
    assert new_logprobs.requires_grad


def test_box_policy_is_a_diagonal_gaussian_with_state_independent_log_std():
    torch.manual_seed(0)
    space = gym.spaces.Box(low=-1.0, high=1.0, shape=(3,), dtype=np.float32)
    model = MLPActorCritic(5, space, hidden_sizes=[32], activation="relu")
    obs = torch.randn(6, 5)
    actions, logprobs, values = model.act(obs)
    assert actions.shape == (6, 3) and logprobs.shape == (6,) and values.shape == (6,)
    new_logprobs, entropy, _ = model.evaluate(obs, actions)
    torch.testing.assert_close(new_logprobs, logprobs)
    # log-std 0 -> entropy of a unit Gaussian per dimension, summed over 3 dimensions
    torch.testing.assert_close(entropy, torch.full((6,), 3 * 0.5 * math.log(2 * math.pi * math.e)))
    assert model.log_std.shape == (3,)


def test_orthogonal_init_follows_cleanrl_gains():
    torch.manual_seed(0)
    model = MLPActorCritic(4, gym.spaces.Discrete(2), hidden_sizes=[64, 64])
    policy_head = model.actor[-1].weight
    value_head = model.critic[-1].weight
    hidden = model.actor[0].weight
    # an orthogonal matrix with gain g has singular values g
    assert torch.linalg.svdvals(policy_head).max().item() == pytest.approx(0.01, rel=1e-4)
    assert torch.linalg.svdvals(value_head).max().item() == pytest.approx(1.0, rel=1e-4)
    assert torch.linalg.svdvals(hidden).max().item() == pytest.approx(math.sqrt(2), rel=1e-4)
    assert all((layer.bias == 0).all() for layer in (model.actor[0], model.actor[-1], model.critic[-1]))


def test_built_from_the_spec_for_cartpole():
    env = gym.make("CartPole-v1")
    model = build_mlp_actor_critic(
        BuiltinNetwork(hidden_sizes=[8, 8], activation="gelu"), env.observation_space, env.action_space
    )
    assert [m.out_features for m in model.actor if isinstance(m, torch.nn.Linear)] == [8, 8, 2]
    assert isinstance(model.actor[1], torch.nn.GELU)
    actions, _, _ = model.act(torch.as_tensor(env.reset(seed=0)[0]).unsqueeze(0))
    assert env.action_space.contains(int(actions[0]))


def test_unsupported_spaces_get_a_clear_error():
    with pytest.raises(UnsupportedSpaceError, match="Discrete or 1-D Box"):
        MLPActorCritic(4, gym.spaces.MultiBinary(3))
    with pytest.raises(UnsupportedSpaceError, match="Box"):
        build_mlp_actor_critic(BuiltinNetwork(), gym.spaces.Discrete(3), gym.spaces.Discrete(2))


def test_deterministic_act_picks_the_most_likely_action():
    torch.manual_seed(0)
    model = MLPActorCritic(4, gym.spaces.Discrete(3), hidden_sizes=[8])
    obs = torch.randn(5, 4)
    actions, _, _ = model.act(obs, deterministic=True)
    torch.testing.assert_close(actions, model.distribution(obs).probs.argmax(-1))
