"""spec.task.gym.wrappers, async vectorisation, episode successes and the env replica's step rate."""

from __future__ import annotations

import typing

import gymnasium
import numpy as np
import pytest

from rljob.api.spec import GymTask, GymWrapperName
from rljob.runtime.gym.env import StepRate
from rljob.runtime.gym.envs import GymConfigError, VectorGymEnv, make_env, step_successes
from rljob.runtime.gym.wrappers import BUILTIN_WRAPPERS

SOLVED_WHEN_RIGHT = "EpisodeSolvedWhenPushedRight-v0"


class _SolvedWhenPushedRight(gymnasium.Env):
    """Three steps per episode; `info["success"]` at the end says whether the last action was 1."""

    observation_space = gymnasium.spaces.Box(-1.0, 1.0, (2,), dtype=np.float32)
    action_space = gymnasium.spaces.Discrete(2)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        return np.zeros(2, dtype=np.float32), {}

    def step(self, action):
        self.t += 1
        done = self.t >= 3
        return np.zeros(2, dtype=np.float32), 1.0, done, False, ({"success": bool(action)} if done else {})


gymnasium.register(SOLVED_WHEN_RIGHT, entry_point=_SolvedWhenPushedRight)


def test_every_wrapper_name_the_schema_allows_is_built():
    assert set(typing.get_args(GymWrapperName)) == set(BUILTIN_WRAPPERS)


def test_frame_stack_wraps_each_environment():
    task = GymTask.model_validate(
        {"envId": "CartPole-v1", "wrappers": [{"builtin": "frame-stack", "args": {"size": 3}}]}
    )
    envs = VectorGymEnv(task, 2)
    assert envs.observation_space.shape == (3, 4)
    assert envs.reset(seed=0).shape == (2, 3, 4)
    envs.close()


def test_a_wrapper_class_by_reference_gets_its_args(tmp_path, monkeypatch):
    (tmp_path / "wrappers.py").write_text(
        "import gymnasium\n"
        "class Scaled(gymnasium.RewardWrapper):\n"
        "    def __init__(self, env, factor):\n"
        "        super().__init__(env)\n"
        "        self.factor = factor\n"
        "    def reward(self, reward):\n"
        "        return reward * self.factor\n"
    )
    monkeypatch.chdir(tmp_path)
    task = GymTask.model_validate(
        {"envId": "CartPole-v1", "wrappers": [{"module": "wrappers.py:Scaled", "args": {"factor": 3}}]}
    )
    env = make_env(task)
    env.reset(seed=0)
    assert env.step(0)[1] == 3.0


@pytest.mark.parametrize(
    ("wrapper", "message"),
    [
        ({"module": "wrappers.py:Missing"}, "spec.task.gym.wrappers[0].module: file wrappers.py does not exist"),
        ({"module": "json:JSONDecoder"}, "not a gymnasium.Wrapper subclass"),
        ({"builtin": "frame-stack", "args": {"sise": 4}}, "spec.task.gym.wrappers[0]: wrapping CartPole-v1"),
    ],
)
def test_a_wrong_wrapper_names_its_entry(tmp_path, monkeypatch, wrapper, message):
    monkeypatch.chdir(tmp_path)
    task = GymTask.model_validate({"envId": "CartPole-v1", "wrappers": [wrapper]})
    with pytest.raises(GymConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        VectorGymEnv(task, 1)


def test_async_environments_step_in_subprocesses_like_sync_ones():
    results = {}
    for mode in ("sync", "async"):
        envs = VectorGymEnv(GymTask(env_id="CartPole-v1", max_episode_steps=4, vectorization=mode), 3)
        first = envs.reset(seed=5)
        steps = [envs.step(np.array([0, 1, 0])) for _ in range(4)]
        envs.close()
        results[mode] = (first, steps[-1].final_obs, steps[-1].truncated)
    np.testing.assert_allclose(results["sync"][0], results["async"][0])
    np.testing.assert_allclose(results["sync"][1], results["async"][1])
    assert results["async"][2].all()


def test_episode_successes_are_read_where_episodes_end():
    envs = VectorGymEnv(GymTask(env_id=SOLVED_WHEN_RIGHT), 2)
    envs.reset(seed=0)
    for _ in range(2):
        assert np.isnan(envs.step(np.array([1, 0])).successes).all()
    np.testing.assert_array_equal(envs.step(np.array([1, 0])).successes, [1.0, 0.0])


def test_an_env_that_says_nothing_about_success_gives_no_rate():
    info = {"final_info": {"x": np.ones(2)}, "_final_info": np.array([True, False])}
    assert np.isnan(step_successes(info, np.array([True, False]))).all()


def test_step_rate_counts_steps_over_its_window():
    rate = StepRate(window_s=10.0)
    for second in range(5):
        rate.add(8, now=100.0 + second)
    assert rate.per_second(now=104.0) == pytest.approx(8.0)
    assert rate.per_second(now=200.0) == 0.0
