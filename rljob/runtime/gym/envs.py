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
from gymnasium.vector import AsyncVectorEnv, AutoresetMode, SyncVectorEnv

from rljob.api.spec import GymTask
from rljob.runtime.gym.wrappers import WrapperConfigError, apply_wrappers


class EnvNotReset(RuntimeError):
    """`step` before `reset` (a restarted env process): the caller resets and carries on."""


class GymConfigError(ValueError):
    """The gym task as configured cannot run (envId, envKwargs or the env's spaces); the message names the
    field and the fix. Restarting does not help: the env role exits with its fatal-config code."""


class UnknownEnvironment(GymConfigError):
    """`spec.task.gym.envId` is not registered with gymnasium (or its package is not installed)."""


def env_share(num_envs: int, replicas: int, replica: int) -> tuple[int, int]:
    """(first index, count) of the environments env replica `replica` steps; earlier replicas take the remainder."""
    base, extra = divmod(num_envs, replicas)
    count = base + (1 if replica < extra else 0)
    start = replica * base + min(replica, extra)
    return start, count


CONFIGURATION_ERRORS = (ImportError, ValueError, LookupError, AttributeError, NotImplementedError)
"""What an env's constructor raises for arguments or code that fail the same way on every attempt. Anything
else (OSError and ConnectionError from an env that downloads assets or connects to a simulator, RuntimeError,
...) may pass on a retry: it propagates unchanged, the role exits with an ordinary failure, and the failure
policy starts it again, within spec.failurePolicy.maxReplacements."""


def make_env(task: GymTask) -> gymnasium.Env:
    """One environment as `spec.task.gym` describes it.

    Configuration mistakes raise `GymConfigError` (fatal, naming the field); other failures propagate as they are.
    """
    kwargs: dict[str, Any] = dict(task.env_kwargs)
    if task.max_episode_steps is not None:
        kwargs["max_episode_steps"] = task.max_episode_steps
    try:
        env = gymnasium.make(task.env_id, **kwargs)
    except gymnasium.error.DependencyNotInstalled as exc:
        raise GymConfigError(
            f"spec.task.gym.envId {task.env_id!r} needs a package that is not installed here: {exc}"
        ) from None
    except gymnasium.error.Error as exc:
        raise UnknownEnvironment(
            f"spec.task.gym.envId {task.env_id!r}: {exc} Use a registered gymnasium id such as CartPole-v1 "
            "(python -c 'import gymnasium; gymnasium.pprint_registry()' lists them)."
        ) from None
    except TypeError as exc:
        raise GymConfigError(
            f"spec.task.gym.envKwargs {dict(task.env_kwargs)!r} do not fit {task.env_id!r}: "
            f"{_first_line(exc).split(' was raised from the environment creator')[0]}. "
            f"Pass only keyword arguments that {task.env_id} takes, or remove spec.task.gym.envKwargs."
        ) from None
    except CONFIGURATION_ERRORS as exc:  # the env's own constructor rejected its arguments, or an import failed
        where = "spec.task.gym.envKwargs" if task.env_kwargs else "spec.task.gym.envId"
        raise GymConfigError(
            f"{where}: creating {task.env_id!r} with {kwargs!r} failed: {type(exc).__name__}: {_first_line(exc)}. "
            "Fix spec.task.gym.envId / spec.task.gym.envKwargs so that gymnasium.make accepts them."
        ) from None
    try:
        return apply_wrappers(env, task.wrappers)
    except WrapperConfigError as exc:
        env.close()
        raise GymConfigError(str(exc)) from None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def check_spaces(env_id: str, observation_space: spaces.Space, action_space: spaces.Space) -> None:
    """The spaces the gym policies handle: vector (1-D Box, the mlp) or image (3-D Box, a VLA) observations,
    Discrete (from 0) or 1-D Box actions. Which policy takes which, the policy says when it is built."""
    if not (isinstance(observation_space, spaces.Box) and len(observation_space.shape) in (1, 3)):
        raise GymConfigError(
            f"spec.task.gym.envId {env_id!r} has observation space {observation_space}; the builtin mlp needs "
            "vector observations (a 1-D Box), a VLA (model.vla) images (a [height, width, 3] Box): choose another "
            "envId or register a wrapped env that flattens them"
        )
    discrete = isinstance(action_space, spaces.Discrete) and int(action_space.start) == 0
    box = isinstance(action_space, spaces.Box) and len(action_space.shape) == 1
    if not (discrete or box):
        raise GymConfigError(
            f"spec.task.gym.envId {env_id!r} has action space {action_space}; the builtin mlp acts in Discrete "
            "(starting at 0) or 1-D Box action spaces: choose another envId or register a wrapped env"
        )


def check_task(task: GymTask) -> tuple[spaces.Space, spaces.Space]:
    """Create one environment, check its spaces, close it: `GymConfigError` names what to fix."""
    env = make_env(task)
    try:
        check_spaces(task.env_id, env.observation_space, env.action_space)
        return env.observation_space, env.action_space
    finally:
        env.close()


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


SUCCESS_KEYS = ("success", "is_success")
"""Where simulators report a solved episode in `info` (ManiSkill and MetaWorld: `success`; SB3 and robosuite
wrappers: `is_success`); read at the step an episode ends."""


def episode_successes(info: dict[str, Any], ended: np.ndarray) -> np.ndarray:
    """[n] 1.0 where an episode ended solved, 0.0 where it ended unsolved, NaN where none ended or the env does not
    say. With same-step autoreset the ended episode's info is `info["final_info"]`."""
    result = np.full(ended.shape, np.nan, dtype=np.float32)
    if not ended.any():
        return result
    final = info.get("final_info", info)
    for key in SUCCESS_KEYS:
        if key in final:
            values = np.asarray(final[key], dtype=np.float32).reshape(ended.shape[0], -1)[:, -1]
            known = np.asarray(final.get(f"_{key}", np.ones_like(ended)), dtype=bool) & ended
            result[known] = values[known]
            break
    return result


@dataclass
class StepResult:
    obs: np.ndarray
    """[n, *obs_shape] observations to act on next (first observation of a new episode where one ended)."""
    rewards: np.ndarray
    terminated: np.ndarray
    truncated: np.ndarray
    final_obs: np.ndarray
    """[n, *obs_shape] last observation of the episode that ended at this step; equals `obs` elsewhere."""
    successes: np.ndarray
    """[n] 1.0 / 0.0 where an episode ended solved / unsolved by the env's `info["success"]`; NaN elsewhere."""


class VectorGymEnv:
    """`count` copies of one gymnasium env, stepped together with same-step autoreset."""

    def __init__(self, task: GymTask, count: int) -> None:
        if count < 1:
            raise ValueError("an env replica needs at least one environment (task.gym.numEnvs >= roles.env.replicas)")
        check_task(task)  # fail early, naming the field to fix
        makers = [lambda: make_env(task) for _ in range(count)]
        if task.vectorization == "async":
            # spawn: the env process already runs threads (heartbeat, transport), which fork would copy mid-state.
            self.vector: gymnasium.vector.VectorEnv = AsyncVectorEnv(
                makers, autoreset_mode=AutoresetMode.SAME_STEP, context="spawn"
            )
        else:
            self.vector = SyncVectorEnv(makers, autoreset_mode=AutoresetMode.SAME_STEP)
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
        terminated, truncated = np.asarray(terminated, dtype=bool), np.asarray(truncated, dtype=bool)
        return StepResult(
            obs=obs,
            rewards=np.asarray(rewards, dtype=np.float32),
            terminated=terminated,
            truncated=truncated,
            final_obs=final_obs,
            successes=episode_successes(info, terminated | truncated),
        )

    def close(self) -> None:
        self.vector.close()
