"""`vectorization: native`: the simulator batches the replica's environments itself, as ManiSkill's GPU backend
does (one VectorEnv whose answers are torch tensors, its own same-step autoreset, `final_observation` as a batch)."""

from __future__ import annotations

import gymnasium
import numpy as np
import pytest
import torch
from gymnasium.vector import AutoresetMode, VectorEnv

from rljob.api.spec import GymTask
from rljob.runtime.gym.envs import GymConfigError, VectorGymEnv, check_task

BATCHED = "BatchedTensorReach-v0"


class _BatchedTensorReach(VectorEnv):
    """`num_envs` points on a line, batched in torch: each action moves every point; an episode ends after
    `max_episode_steps` steps and is solved when its point came within 0.5 of 3.0 (ManiSkill's conventions)."""

    metadata = {"autoreset_mode": AutoresetMode.SAME_STEP}

    def __init__(self, num_envs: int, max_episode_steps: int = 4) -> None:
        self.num_envs = num_envs
        self.limit = max_episode_steps
        self.single_observation_space = gymnasium.spaces.Box(-10.0, 10.0, (1,), dtype=np.float32)
        self.single_action_space = gymnasium.spaces.Box(-1.0, 1.0, (1,), dtype=np.float32)
        self.observation_space = gymnasium.vector.utils.batch_space(self.single_observation_space, num_envs)
        self.action_space = gymnasium.vector.utils.batch_space(self.single_action_space, num_envs)
        self.position = torch.zeros(num_envs, 1)
        self.elapsed = torch.zeros(num_envs, dtype=torch.int64)

    def reset(self, *, seed=None, options=None):
        self.position.zero_()
        self.elapsed.zero_()
        return self.position.clone(), {}

    def step(self, actions):
        self.position += torch.as_tensor(actions, dtype=torch.float32)
        self.elapsed += 1
        success = (self.position[:, 0] - 3.0).abs() < 0.5
        truncated = self.elapsed >= self.limit
        terminated = torch.zeros_like(truncated)
        obs, info = self.position.clone(), {"success": success}
        if truncated.any():
            info = {
                "success": success,
                "final_observation": obs.clone(),
                "_final_observation": truncated,
                "final_info": {"success": success.clone()},
                "_final_info": truncated,
            }
            self.position[truncated] = 0.0
            self.elapsed[truncated] = 0
            obs = self.position.clone()
        return obs, -(self.position[:, 0] - 3.0).abs(), terminated, truncated, info


gymnasium.register(BATCHED, entry_point=None, vector_entry_point=_BatchedTensorReach)


def test_a_simulator_batching_its_envs_in_torch_is_served_as_numpy():
    envs = VectorGymEnv(GymTask(env_id=BATCHED, vectorization="native"), 3)
    assert isinstance(envs.reset(seed=0), np.ndarray)
    moves = np.array([[1.0], [0.0], [1.0]], dtype=np.float32)
    for _ in range(2):
        result = envs.step(moves)
        assert isinstance(result.obs, np.ndarray) and np.isnan(result.successes).all()
    # env 0 and 2 pass 3.0 at their third step and move on; env 1 never moves
    envs.step(moves)
    result = envs.step(moves)
    assert result.truncated.all() and isinstance(result.rewards, np.ndarray)
    np.testing.assert_array_equal(result.final_obs[:, 0], [4.0, 0.0, 4.0])
    np.testing.assert_array_equal(result.obs[:, 0], [0.0, 0.0, 0.0])
    np.testing.assert_array_equal(result.successes, [1.0, 0.0, 1.0])
    envs.close()


def test_native_spaces_are_checked_on_one_batched_env():
    observation, action = check_task(GymTask(env_id=BATCHED, vectorization="native"))
    assert observation.shape == (1,) and action.shape == (1,)


def test_native_with_wrappers_names_the_field():
    task = GymTask.model_validate(
        {"envId": BATCHED, "vectorization": "native", "wrappers": [{"builtin": "normalize-observation"}]}
    )
    with pytest.raises(GymConfigError, match=r"spec\.task\.gym\.wrappers .*vectorization: native"):
        VectorGymEnv(task, 2)


def test_native_for_an_env_that_cannot_batch_itself_names_the_field():
    with pytest.raises(GymConfigError, match=r"spec\.task\.gym\.vectorization: native .* 'Acrobot-v1' has none"):
        VectorGymEnv(GymTask(env_id="Acrobot-v1", vectorization="native"), 2)


def test_native_with_next_step_autoreset_names_the_field():
    # gymnasium's own batched CartPole resets finished copies one step late
    with pytest.raises(GymConfigError, match=r"spec\.task\.gym\.vectorization: native: 'CartPole-v1' .*NextStep"):
        VectorGymEnv(GymTask(env_id="CartPole-v1", vectorization="native"), 2)
