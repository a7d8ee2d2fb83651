"""Gymnasium environments as the env role steps them: vectorised, same-step autoreset, spaces on the wire.

Gymnasium 1.x vector envs reset a finished sub-env on the NEXT `step` call by default, which wastes a
step and makes the transition after an episode end meaningless. The env role uses SAME_STEP autoreset
instead: `step` returns the first observation of the new episode right away and the last observation of
the finished one separately (`final_obs`), which the rollout needs to bootstrap truncated episodes.
Terminated and truncated stay separate all the way to GAE.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import gymnasium
import numpy as np
from gymnasium import spaces
from gymnasium.vector import AutoresetMode, SyncVectorEnv

from rljob.api.spec import GymTask


class EnvNotReset(RuntimeError):
    """`step` before `reset` (a restarted env process): the caller resets and carries on."""


class UnknownEnvironment(ValueError):
    """`task.gym.envId` is not registered with gymnasium."""


def env_share(num_envs: int, replicas: int, replica: int) -> tuple[int, int]:
    """(first index, count) of the environments env replica `replica` steps; earlier replicas take the remainder."""
    base, extra = divmod(num_envs, replicas)
    count = base + (1 if replica < extra else 0)
    start = replica * base + min(replica, extra)
    return start, count


def make_env(task: GymTask) -> gymnasium.Env:
    kwargs: dict[str, Any] = dict(task.env_kwargs)
    if task.max_episode_steps is not None:
        kwargs["max_episode_steps"] = task.max_episode_steps
    try:
        return gymnasium.make(task.env_id, **kwargs)
    except gymnasium.error.Error as exc:
        raise UnknownEnvironment(f"task.gym.envId {task.env_id!r}: {exc}") from None


def space_to_wire(space: spaces.Space) -> dict[str, Any]:
    """Discrete and Box spaces as msgpack-able dicts (the builtin MLP supports nothing else)."""
    if isinstance(space, spaces.Discrete):
        return {"type": "discrete", "n": int(space.n), "start": int(space.start)}
    if isinstance(space, spaces.Box):
        return {
            "type": "box",
            "low": space.low.tolist(),
            "high": space.high.tolist(),
            "shape": list(space.shape),
            "dtype": space.dtype.str,
        }
    raise ValueError(f"the env role serves Discrete or Box spaces, not {space}")


def space_from_wire(wire: dict[str, Any]) -> spaces.Space:
    if wire["type"] == "discrete":
        return spaces.Discrete(wire["n"], start=wire.get("start", 0))
    return spaces.Box(
        low=np.asarray(wire["low"], dtype=wire["dtype"]),
        high=np.asarray(wire["high"], dtype=wire["dtype"]),
        shape=tuple(wire["shape"]),
        dtype=np.dtype(wire["dtype"]),
    )


@dataclass
class StepResult:
    obs: np.ndarray
    """[n, *obs_shape] observations to act on next (first observation of a new episode where one ended)."""
    rewards: np.ndarray
    terminated: np.ndarray
    truncated: np.ndarray
    final_obs: np.ndarray
    """[n, *obs_shape] last observation of the episode that ended at this step; equals `obs` elsewhere."""


class VectorGymEnv:
    """`count` copies of one gymnasium env, stepped together with same-step autoreset."""

    def __init__(self, task: GymTask, count: int) -> None:
        if count < 1:
            raise ValueError("an env replica needs at least one environment (task.gym.numEnvs >= roles.env.replicas)")
        make_env(task).close()  # fail early, with the envId in the message
        self.vector = SyncVectorEnv(
            [lambda: make_env(task) for _ in range(count)], autoreset_mode=AutoresetMode.SAME_STEP
        )
        self.count = count
        self.observation_space = self.vector.single_observation_space
        self.action_space = self.vector.single_action_space
        self._ready = False

    def reset(self, seed: int | None) -> np.ndarray:
        seeds = None if seed is None else [seed + i for i in range(self.count)]
        obs, _ = self.vector.reset(seed=seeds)
        self._ready = True
        return obs

    def step(self, actions: np.ndarray) -> StepResult:
        if not self._ready:
            raise EnvNotReset("environments were not reset since this env process started")
        if isinstance(self.action_space, spaces.Box):
            actions = np.clip(actions, self.action_space.low, self.action_space.high)
        obs, rewards, terminated, truncated, info = self.vector.step(actions)
        final_obs = obs
        mask = info.get("_final_obs")
        if mask is not None and mask.any():
            final_obs = obs.copy()
            for i in np.flatnonzero(mask):
                final_obs[i] = info["final_obs"][i]
        return StepResult(
            obs=obs,
            rewards=np.asarray(rewards, dtype=np.float32),
            terminated=np.asarray(terminated, dtype=bool),
            truncated=np.asarray(truncated, dtype=bool),
            final_obs=final_obs,
        )

    def close(self) -> None:
        self.vector.close()
