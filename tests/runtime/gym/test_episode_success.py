"""An episode counts as solved when the env flagged success at any of its steps ("success once")."""

from __future__ import annotations

import gymnasium
import numpy as np

from rljob.api.spec import GymTask
from rljob.runtime.gym.envs import EpisodeSuccess, VectorGymEnv, step_successes

SUCCESS_EVERY_STEP = "SuccessFlaggedEveryStep-v0"


class _SuccessFlaggedEveryStep(gymnasium.Env):
    """Like MetaWorld: four steps then truncation, `info["success"]` (a float) at every step: 1.0 while the
    action is 1."""

    observation_space = gymnasium.spaces.Box(-1.0, 1.0, (2,), dtype=np.float32)
    action_space = gymnasium.spaces.Discrete(2)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        return np.zeros(2, dtype=np.float32), {}

    def step(self, action):
        self.t += 1
        return np.zeros(2, dtype=np.float32), 0.0, False, self.t >= 4, {"success": float(action)}


gymnasium.register(SUCCESS_EVERY_STEP, entry_point=_SuccessFlaggedEveryStep)


def test_an_episode_that_succeeded_midway_and_drifted_off_counts_as_solved():
    envs = VectorGymEnv(GymTask(env_id=SUCCESS_EVERY_STEP), 2)
    envs.reset(seed=0)
    # env 0 reaches the goal at its second step only, env 1 never does
    for actions in ([0, 0], [1, 0], [0, 0]):
        assert np.isnan(envs.step(np.array(actions)).successes).all()
    np.testing.assert_array_equal(envs.step(np.array([0, 0])).successes, [1.0, 0.0])
    # the next episodes start unsolved: success at the last step alone counts too
    for actions in ([0, 0], [0, 0], [0, 0]):
        envs.step(np.array(actions))
    np.testing.assert_array_equal(envs.step(np.array([0, 1])).successes, [0.0, 1.0])
    envs.close()


def test_a_reset_forgets_the_unfinished_episodes_successes():
    envs = VectorGymEnv(GymTask(env_id=SUCCESS_EVERY_STEP), 1)
    envs.reset(seed=0)
    envs.step(np.array([1]))
    envs.reset(seed=1)
    for _ in range(3):
        envs.step(np.array([0]))
    np.testing.assert_array_equal(envs.step(np.array([0])).successes, [0.0])
    envs.close()


def test_step_flags_come_from_the_ended_episodes_final_info():
    ended = np.array([True, False, False])
    info = {
        "success": np.array([0.0, 1.0, 0.0]),
        "_success": np.array([False, True, False]),  # env 0's entry is its new episode's reset info: absent
        "final_info": {"success": np.array([1.0, 0.0, 0.0]), "_success": np.array([True, False, False])},
    }
    np.testing.assert_array_equal(step_successes(info, ended), [1.0, 1.0, np.nan])


def test_envs_that_never_say_give_no_episode_flag():
    tracker = EpisodeSuccess(2)
    flags = np.array([np.nan, 0.0], dtype=np.float32)
    assert np.isnan(tracker.update(flags, np.array([False, False]))).all()
    result = tracker.update(np.array([np.nan, np.nan], dtype=np.float32), np.array([True, True]))
    assert np.isnan(result[0]) and result[1] == 0.0
