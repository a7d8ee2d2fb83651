"""MuJoCo tasks in the env role, and episode returns in the task's own units under reward wrappers."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import numpy as np
import pytest

from rljob.api.spec import GymTask
from rljob.runtime.gym.envs import VectorGymEnv, check_task


def _task(env_id: str, *wrappers: str) -> GymTask:
    return GymTask.model_validate({"envId": env_id, "wrappers": [{"builtin": w} for w in wrappers]})


def test_raw_rewards_are_the_envs_own_under_normalize_reward_also_where_episodes_end():
    envs = VectorGymEnv(_task("CartPole-v1", "normalize-reward"), 3)
    envs.reset(seed=0)
    ended, scaled = 0, []
    for _ in range(60):  # always pushing left: CartPole episodes end within ~10 steps
        result = envs.step(np.zeros(3, dtype=np.int64))
        ended += int((result.terminated | result.truncated).sum())
        scaled.extend(result.rewards.tolist())
        np.testing.assert_array_equal(result.raw_rewards, np.ones(3, dtype=np.float32))  # CartPole pays 1 a step
    envs.close()
    assert ended >= 6
    assert not np.allclose(scaled, 1.0)  # PPO trains on the normalised rewards


def test_without_wrappers_raw_rewards_are_the_rewards():
    envs = VectorGymEnv(_task("CartPole-v1"), 2)
    envs.reset(seed=0)
    result = envs.step(np.ones(2, dtype=np.int64))
    np.testing.assert_array_equal(result.raw_rewards, result.rewards)
    envs.close()


needs_mujoco = pytest.mark.skipif(
    importlib.util.find_spec("mujoco") is None, reason="MuJoCo tasks need the mujoco wheel (rljob's env extra)"
)


@needs_mujoco
@pytest.mark.parametrize(("env_id", "obs_dim", "action_dim"), [("Hopper-v5", 11, 3), ("HalfCheetah-v5", 17, 6)])
def test_mujoco_tasks_have_the_spaces_the_gaussian_mlp_takes(env_id, obs_dim, action_dim):
    observation_space, action_space = check_task(_task(env_id, "normalize-observation", "normalize-reward"))
    assert observation_space.shape == (obs_dim,)
    assert action_space.shape == (action_dim,)
    assert (action_space.low == -1).all() and (action_space.high == 1).all()


@needs_mujoco
def test_gaussian_samples_beyond_the_bounds_reach_mujoco_clipped():
    """The policy's logprob is of the sampled action; the simulator gets it clipped to the Box, as in SB3."""
    far, edge = VectorGymEnv(_task("Hopper-v5"), 2), VectorGymEnv(_task("Hopper-v5"), 2)
    far.reset(seed=3)
    edge.reset(seed=3)
    rng = np.random.default_rng(0)
    for _ in range(5):
        actions = (3 * rng.standard_normal((2, 3))).astype(np.float32)
        a, b = far.step(actions), edge.step(np.clip(actions, -1, 1))
        np.testing.assert_array_equal(a.obs, b.obs)
        np.testing.assert_array_equal(a.rewards, b.rewards)  # the control cost is of the clipped action
    far.close()
    edge.close()


def test_a_mujoco_task_without_the_mujoco_wheel_names_the_field_and_the_package():
    # In a fresh process: gymnasium imports its MuJoCo module once, and this one may have done so already.
    code = (
        "import sys; sys.modules['mujoco'] = None\n"
        "from rljob.api.spec import GymTask\n"
        "from rljob.runtime.gym.envs import GymConfigError, check_task\n"
        "try:\n"
        "    check_task(GymTask.model_validate({'envId': 'Hopper-v5'}))\n"
        "except GymConfigError as exc:\n"
        "    print(exc)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "spec.task.gym.envId 'Hopper-v5' needs a package that is not installed" in result.stdout
    assert "mujoco" in result.stdout.lower()
