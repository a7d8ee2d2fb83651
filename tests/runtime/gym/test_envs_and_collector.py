"""What the env role steps and how the rollout acts: autoreset, truncation, spaces, numpy policy."""

from __future__ import annotations

import gymnasium
import numpy as np
import pytest
import torch

from rljob.api.spec import GymTask
from rljob.runtime.gym.envs import (
    EnvNotReset,
    GymConfigError,
    UnknownEnvironment,
    VectorGymEnv,
    check_spaces,
    check_task,
    env_share,
    space_from_wire,
    space_to_wire,
)
from rljob.runtime.gym.models import MLPActorCritic
from rljob.runtime.gym.numpy_policy import NumpyPolicy
from rljob.runtime.weights.sync import buckets


def test_env_share_covers_every_environment_once():
    shares = [env_share(10, 3, r) for r in range(3)]
    assert shares == [(0, 4), (4, 3), (7, 3)]


def test_truncated_episode_keeps_its_final_observation_and_resets_in_the_same_step():
    envs = VectorGymEnv(GymTask(env_id="CartPole-v1", max_episode_steps=5), 2)
    with pytest.raises(EnvNotReset):
        envs.step(np.zeros(2, dtype=np.int64))
    obs = envs.reset(seed=0)
    for _ in range(4):
        result = envs.step(np.array([0, 1]))
        assert not (result.terminated | result.truncated).any()
        np.testing.assert_array_equal(result.final_obs, result.obs)
        obs = result.obs
    last = envs.step(np.array([0, 1]))
    assert last.truncated.all() and not last.terminated.any()
    # SAME_STEP autoreset: `obs` already starts the next episode, `final_obs` ends this one.
    assert not np.allclose(last.obs, last.final_obs)
    assert np.abs(last.obs).max() <= 0.05  # CartPole resets into [-0.05, 0.05]
    assert np.abs(last.final_obs - obs).max() < 1.0


def test_termination_is_not_truncation():
    envs = VectorGymEnv(GymTask(env_id="CartPole-v1"), 1)
    envs.reset(seed=1)
    for _ in range(200):
        result = envs.step(np.array([1]))  # always push right: the pole falls
        if result.terminated[0]:
            break
    assert result.terminated[0] and not result.truncated[0]


def test_unknown_env_id_names_the_field():
    with pytest.raises(UnknownEnvironment, match=r"^spec\.task\.gym\.envId 'NoSuchEnv-v0'.*registered gymnasium id"):
        VectorGymEnv(GymTask(env_id="NoSuchEnv-v0"), 1)


class EnvThatCannotConnect(gymnasium.Env):
    """Its constructor fails like an env that downloads assets or connects to a simulator, on a bad day."""

    def __init__(self) -> None:
        raise ConnectionResetError("connection reset by peer while fetching the env's assets")


class EnvThatRejectsItsArguments(gymnasium.Env):
    def __init__(self, level: int = 0) -> None:
        raise ValueError(f"level must be 1..3, got {level}")


gymnasium.register("EnvThatCannotConnect-v0", entry_point=EnvThatCannotConnect)
gymnasium.register("EnvThatRejectsItsArguments-v0", entry_point=EnvThatRejectsItsArguments)


def test_a_transient_failure_creating_an_env_is_not_a_configuration_error():
    # Not a GymConfigError: the env role exits non-fatally and the failure policy starts it again.
    with pytest.raises(ConnectionResetError, match="connection reset"):
        VectorGymEnv(GymTask(env_id="EnvThatCannotConnect-v0"), 1)


def test_an_env_constructor_rejecting_its_arguments_names_the_field():
    with pytest.raises(GymConfigError, match=r"^spec\.task\.gym\.envKwargs: creating 'EnvThatRejectsItsArguments-v0'"):
        VectorGymEnv(GymTask(env_id="EnvThatRejectsItsArguments-v0", env_kwargs={"level": 7}), 1)


def test_env_kwargs_the_env_does_not_take_name_the_field():
    with pytest.raises(GymConfigError, match=r"^spec\.task\.gym\.envKwargs \{'foo': 1\} do not fit 'CartPole-v1'"):
        VectorGymEnv(GymTask(env_id="CartPole-v1", env_kwargs={"foo": 1}), 1)


@pytest.mark.parametrize(
    ("observation_space", "action_space", "problem"),
    [
        (gymnasium.spaces.Tuple([gymnasium.spaces.Discrete(3)]), gymnasium.spaces.Discrete(2), "observation space"),
        (gymnasium.spaces.Box(0, 255, (4, 4), dtype=np.uint8), gymnasium.spaces.Discrete(2), "observation space"),
        (gymnasium.spaces.Box(0, 1, (4,)), gymnasium.spaces.MultiDiscrete([2, 2]), "action space"),
        (gymnasium.spaces.Box(0, 1, (4,)), gymnasium.spaces.Discrete(2, start=1), "action space"),
        (gymnasium.spaces.Box(0, 1, (4,)), gymnasium.spaces.Box(0, 1, (2, 2)), "action space"),
    ],
)
def test_spaces_the_builtin_mlp_cannot_handle_name_the_env_id(observation_space, action_space, problem):
    with pytest.raises(GymConfigError, match=rf"^spec\.task\.gym\.envId 'X-v0' has {problem}"):
        check_spaces("X-v0", observation_space, action_space)


def test_a_tuple_observation_env_is_refused_and_supported_envs_pass():
    with pytest.raises(GymConfigError, match=r"'Blackjack-v1' has observation space Tuple"):
        check_task(GymTask(env_id="Blackjack-v1"))
    observation, action = check_task(GymTask(env_id="Pendulum-v1"))
    assert observation.shape == (3,) and action.shape == (1,)
    observation, action = check_task(GymTask(env_id="CartPole-v1"))
    assert observation.shape == (4,) and action.n == 2


@pytest.mark.parametrize("env_id", ["CartPole-v1", "Pendulum-v1"])
def test_spaces_survive_the_wire(env_id):
    env = gymnasium.make(env_id)
    for space in (env.observation_space, env.action_space):
        assert space_from_wire(space_to_wire(space)) == space


@pytest.mark.parametrize("env_id", ["CartPole-v1", "Pendulum-v1"])
def test_numpy_policy_matches_the_torch_model(env_id):
    env = gymnasium.make(env_id)
    torch.manual_seed(0)
    model = MLPActorCritic(env.observation_space.shape[0], env.action_space)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * torch.randn_like(p))  # move away from the near-uniform initial policy
    policy = NumpyPolicy(model, seed=0)
    obs = np.random.default_rng(0).normal(size=(16, env.observation_space.shape[0])).astype(np.float32)
    actions, logprobs, values = policy.act(obs)
    torch_logprobs, _, torch_values = model.evaluate(torch.from_numpy(obs), torch.from_numpy(actions))
    np.testing.assert_allclose(logprobs, torch_logprobs.detach().numpy(), atol=1e-5)
    np.testing.assert_allclose(values, torch_values.detach().numpy(), atol=1e-5)


def test_numpy_policy_samples_from_the_policy_distribution():
    env = gymnasium.make("CartPole-v1")
    model = MLPActorCritic(4, env.action_space)
    with torch.no_grad():
        model.actor[-1].bias.copy_(torch.tensor([0.0, np.log(3.0)]))  # p(action 1) = 0.75 everywhere
        model.actor[-1].weight.zero_()
    actions, _, _ = NumpyPolicy(model, seed=1).act(np.zeros((20000, 4), dtype=np.float32))
    assert actions.mean() == pytest.approx(0.75, abs=0.01)


def test_weight_buckets_respect_the_size_limit():
    tensors = [torch.zeros(100), torch.zeros(100), torch.zeros(1000), torch.zeros(10)]
    assert buckets(tensors, bucket_bytes=1000) == [[0, 1], [2], [3]]
