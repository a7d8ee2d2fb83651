"""Gymnasium environments as the env role steps them: vectorised, same-step autoreset, spaces on the wire.

Gymnasium 1.x vector envs reset a finished sub-env on the NEXT `step` call by default, which wastes a
step and makes the transition after an episode end meaningless. The env role uses SAME_STEP autoreset
instead: `step` returns the first observation of the new episode right away and the last observation of
the finished one separately (`final_obs`), which the rollout needs to bootstrap truncated episodes.
Terminated and truncated stay separate all the way to GAE.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import gymnasium
import numpy as np
from gymnasium import spaces
from gymnasium.envs.registration import load_env_creator
from gymnasium.vector import AsyncVectorEnv, AutoresetMode, SyncVectorEnv

from rljob.api.spec import BuiltinNetwork, GymTask
from rljob.runtime.gym.images import ARCHITECTURE_FIELD, ImageSpaceError, check_conv_fits, image_layout, is_pixel_space
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


def _create(task: GymTask, create: Callable[..., Any]) -> Any:
    """`create(envId, **envKwargs)` with configuration mistakes turned into `GymConfigError` naming the field."""
    kwargs: dict[str, Any] = dict(task.env_kwargs)
    if task.max_episode_steps is not None:
        kwargs["max_episode_steps"] = task.max_episode_steps
    try:
        return create(task.env_id, **kwargs)
    except gymnasium.error.DependencyNotInstalled as exc:
        raise GymConfigError(
            f"spec.task.gym.envId {task.env_id!r} needs a package that is not installed here: {exc}"
        ) from None
    except gymnasium.error.Error as exc:
        if "vector entry point" in str(exc):
            raise GymConfigError(
                f"spec.task.gym.vectorization: native needs an env that batches its own copies (registered with a "
                f"vector_entry_point, as ManiSkill's are); {task.env_id!r} has none: set vectorization to sync or "
                "async"
            ) from None
        raise UnknownEnvironment(
            f"spec.task.gym.envId {task.env_id!r}: {exc} Use a registered gymnasium id such as CartPole-v1 "
            "(python -c 'import gymnasium; gymnasium.pprint_registry()' lists them)."
        ) from None
    except ModuleNotFoundError as exc:  # before ImportError: whatever envKwargs say, a package is missing
        raise GymConfigError(
            f"spec.task.gym.envId {task.env_id!r} needs a module that is not installed here "
            f"({_first_line(exc).split('. Environment registration')[0]}): install it in the env role's image "
            "(MetaWorld: pip install 'rljob[sims]'), or fix the module part of envId"
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


def make_env(task: GymTask) -> gymnasium.Env:
    """One environment as `spec.task.gym` describes it.

    Configuration mistakes raise `GymConfigError` (fatal, naming the field); other failures propagate as they are.
    """
    env = _create(task, gymnasium.make)
    if task.wrappers:
        env = RecordRawReward(env)  # innermost: the env's own reward, before any wrapper rescales it
    try:
        return apply_wrappers(env, task.wrappers)
    except WrapperConfigError as exc:
        env.close()
        raise GymConfigError(str(exc)) from None


RAW_REWARD = "rljob_raw_reward"


class RecordRawReward(gymnasium.Wrapper):
    """Copies the env's own reward into `info[RAW_REWARD]`, so that episode returns are reported in the task's units
    when `normalize-reward` (or any wrapper) changes the reward PPO trains on."""

    def step(self, action: Any) -> tuple[Any, Any, bool, bool, dict[str, Any]]:
        obs, reward, terminated, truncated, info = self.env.step(action)
        return obs, reward, terminated, truncated, {**info, RAW_REWARD: reward}


def raw_rewards(info: dict[str, Any], rewards: np.ndarray, ended: np.ndarray) -> np.ndarray:
    """[n] the rewards before the wrappers (`RecordRawReward`); `rewards` where the env has no such record. With
    same-step autoreset an ended episode's last step info is `info["final_info"]`."""
    if RAW_REWARD not in info and RAW_REWARD not in info.get("final_info", {}):
        return rewards
    raw = np.array(rewards, dtype=np.float32)
    for source, where in ((info, ~ended), (info.get("final_info", {}), ended)):
        if RAW_REWARD in source:
            mask = np.asarray(source.get(f"_{RAW_REWARD}", np.ones_like(ended)), dtype=bool) & where
            raw[mask] = np.asarray(source[RAW_REWARD], dtype=np.float32)[mask]
    return raw


def _from_vector_entry_point(env_id: str, count: int, kwargs: dict[str, Any]) -> gymnasium.vector.VectorEnv:
    """What `gymnasium.make_vec(..., vectorization_mode="vector_entry_point")` does, without its refusal of envs
    registered with `additional_wrappers`: ManiSkill registers every env with one (its own vector entry point
    applies it through `gymnasium.make`), so make_vec refuses all of them under gymnasium 1.x."""
    module, _, name = env_id.rpartition(":")
    if module:
        importlib.import_module(module)  # `pkg.module:EnvId`: the module registers the env
    spec = gymnasium.spec(name)
    if spec.vector_entry_point is None:
        raise gymnasium.error.Error(f"{env_id} has no vector entry point")
    create = spec.vector_entry_point
    if not callable(create):
        create = load_env_creator(create)
    arguments = {**spec.kwargs, **kwargs}
    if spec.max_episode_steps is not None:
        arguments.setdefault("max_episode_steps", spec.max_episode_steps)
    return create(num_envs=count, **arguments)


def make_native_vector(task: GymTask, count: int) -> gymnasium.vector.VectorEnv:
    """`count` environments the simulator batches itself (`vectorization: native`): its registered vector entry
    point, e.g. ManiSkill's GPU scenes, all stepped by one `step` call."""
    if task.wrappers:
        raise GymConfigError(
            "spec.task.gym.wrappers wrap single environments; with spec.task.gym.vectorization: native the "
            "simulator batches them itself: remove the wrappers (or pass the simulator's own options in envKwargs)"
        )

    vector = _create(task, lambda env_id, **kwargs: _from_vector_entry_point(env_id, count, kwargs))
    mode = vector.metadata.get("autoreset_mode")
    if mode != AutoresetMode.SAME_STEP:
        vector.close()
        raise GymConfigError(
            f"spec.task.gym.vectorization: native: {task.env_id!r} batches its copies but resets a finished one "
            f"with autoreset mode {getattr(mode, 'value', mode)}; the env role needs same-step autoreset (the last "
            "observation of an episode next to the first of the next): set vectorization to sync or async"
        )
    return vector


def to_numpy(value: Any) -> np.ndarray:
    """Simulators that batch on a GPU (ManiSkill) answer with torch tensors: copied to host memory."""
    if hasattr(value, "detach"):
        value = value.detach().cpu().numpy()
    return np.asarray(value)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def check_spaces(
    env_id: str,
    observation_space: spaces.Space,
    action_space: spaces.Space,
    network: BuiltinNetwork | None = None,
    vla: bool = False,
) -> None:
    """The spaces the builtin network handles: vector observations (a Box, flattened) for the mlp, images the
    convolutions fit for the cnn; Discrete (from 0) or 1-D Box actions for both. A VLA (`model.vla`) checks its
    own spaces when it is built (`rljob.runtime.vla`)."""
    if vla:
        return
    architecture = (network.architecture if network else None) or "mlp"
    if architecture == "cnn":
        assert network is not None
        try:
            check_conv_fits(image_layout(observation_space), network.kernel_sizes, network.strides)
        except ImageSpaceError as exc:
            raise GymConfigError(f"spec.task.gym.envId {env_id!r}: {exc}") from None
    elif is_pixel_space(observation_space):
        raise GymConfigError(
            f"spec.task.gym.envId {env_id!r} has observation space {observation_space}: images, which the builtin "
            f"mlp does not read; set {ARCHITECTURE_FIELD}: cnn"
        )
    elif not isinstance(observation_space, spaces.Box):
        raise GymConfigError(
            f"spec.task.gym.envId {env_id!r} has observation space {observation_space}; the builtin mlp needs "
            "vector observations (a Box, flattened; frame-stack stacks them): choose another envId or register a "
            "wrapped env that flattens them"
        )
    discrete = isinstance(action_space, spaces.Discrete) and int(action_space.start) == 0
    box = isinstance(action_space, spaces.Box) and len(action_space.shape) == 1
    if not (discrete or box):
        raise GymConfigError(
            f"spec.task.gym.envId {env_id!r} has action space {action_space}; the builtin {architecture} acts in "
            "Discrete (starting at 0) or 1-D Box action spaces: choose another envId or register a wrapped env"
        )


def check_task(
    task: GymTask, network: BuiltinNetwork | None = None, vla: bool = False
) -> tuple[spaces.Space, spaces.Space]:
    """Create one environment, check its spaces against `network` (`spec.model.builtin`; mlp when None), close it:
    `GymConfigError` names what to fix."""
    if task.vectorization == "native":
        vector = make_native_vector(task, 1)
        try:
            check_spaces(task.env_id, vector.single_observation_space, vector.single_action_space, network, vla)
            return vector.single_observation_space, vector.single_action_space
        finally:
            vector.close()
    env = make_env(task)
    try:
        check_spaces(task.env_id, env.observation_space, env.action_space, network, vla)
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
"""Where simulators report a solved task in `info` (ManiSkill and MetaWorld: `success`; SB3 and robosuite
wrappers: `is_success`)."""


def step_successes(info: dict[str, Any], ended: np.ndarray) -> np.ndarray:
    """[n] each environment's success flag at this step (1.0 / 0.0), NaN where the env does not say. Where an
    episode ended, the flag of its last step: same-step autoreset moves that step's info to `info["final_info"]`
    and leaves the new episode's reset info in `info`."""
    result = np.full(ended.shape, np.nan, dtype=np.float32)
    for source, rows in ((info, ~ended), (info.get("final_info", info), ended)):
        if not rows.any():
            continue
        for key in SUCCESS_KEYS:
            if key in source:
                values = to_numpy(source[key]).astype(np.float32).reshape(ended.shape[0], -1)[:, -1]
                known = to_numpy(source.get(f"_{key}", np.ones_like(ended))).astype(bool) & rows
                result[known] = values[known]
                break
    return result


class EpisodeSuccess:
    """Whether each environment's current episode succeeded at ANY step so far, reported when it ends.

    "Success once" is how MetaWorld's and ManiSkill's evaluations count a solved episode: in a fixed-length episode
    (MetaWorld truncates at its step limit and never terminates on success while training) an arm that reached
    the goal and drifted off afterwards still solved the task. For envs that terminate on success (ManiSkill's
    default) it equals the last step's flag.
    """

    def __init__(self, count: int) -> None:
        self.solved = np.zeros(count, dtype=bool)
        self.reported = np.zeros(count, dtype=bool)

    def reset(self) -> None:
        self.solved[:] = False
        self.reported[:] = False

    def update(self, flags: np.ndarray, ended: np.ndarray) -> np.ndarray:
        """[n] 1.0 / 0.0 where an episode ended solved at some step / never solved; NaN where none ended or the
        env never said."""
        known = ~np.isnan(flags)
        self.reported |= known
        self.solved |= known & (np.nan_to_num(flags) > 0.5)
        result = np.full(ended.shape, np.nan, dtype=np.float32)
        done = ended & self.reported
        result[done] = self.solved[done]
        self.solved[ended] = False
        self.reported[ended] = False
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
    """[n] 1.0 / 0.0 where an episode ended that the env's `info["success"]` marked solved at some step / at no
    step (`EpisodeSuccess`); NaN elsewhere."""
    raw_rewards: np.ndarray
    """[n] the env's own rewards, before `spec.task.gym.wrappers` changed them (episode returns sum these)."""


class VectorGymEnv:
    """`count` copies of one gymnasium env, stepped together with same-step autoreset."""

    def __init__(self, task: GymTask, count: int, network: BuiltinNetwork | None = None, vla: bool = False) -> None:
        if count < 1:
            raise ValueError("an env replica needs at least one environment (task.gym.numEnvs >= roles.env.replicas)")
        check_task(task, network, vla)  # fail early, naming the field to fix
        makers = [lambda: make_env(task) for _ in range(count)]
        self.vector: gymnasium.vector.VectorEnv
        if task.vectorization == "native":
            self.vector = make_native_vector(task, count)
        elif task.vectorization == "async":
            # spawn: the env process already runs threads (heartbeat, transport), which fork would copy mid-state.
            self.vector = AsyncVectorEnv(makers, autoreset_mode=AutoresetMode.SAME_STEP, context="spawn")
        else:
            self.vector = SyncVectorEnv(makers, autoreset_mode=AutoresetMode.SAME_STEP)
        self.count = count
        self.observation_space = self.vector.single_observation_space
        self.action_space = self.vector.single_action_space
        self._ready = False
        self._success = EpisodeSuccess(count)

    def reset(self, seed: int | None) -> np.ndarray:
        seeds = None if seed is None else [seed + i for i in range(self.count)]
        obs, _ = self.vector.reset(seed=seeds)
        self._success.reset()
        self._ready = True
        return to_numpy(obs)

    def step(self, actions: np.ndarray) -> StepResult:
        if not self._ready:
            raise EnvNotReset("environments were not reset since this env process started")
        if isinstance(self.action_space, spaces.Box):
            actions = np.clip(actions, self.action_space.low, self.action_space.high)
        obs, rewards, terminated, truncated, info = self.vector.step(actions)
        obs = to_numpy(obs)
        final_obs = obs
        # gymnasium's vectors: "final_obs" (one entry per env); ManiSkill's: "final_observation" (a batch)
        for key in ("final_obs", "final_observation"):
            if key not in info:
                continue
            mask = to_numpy(info[f"_{key}"]).astype(bool)
            final_obs = obs.copy()
            if isinstance(info[key], np.ndarray) and info[key].dtype == object:
                for i in np.flatnonzero(mask):
                    final_obs[i] = info[key][i]
            else:
                final_obs[mask] = to_numpy(info[key])[mask]
            break
        terminated, truncated = to_numpy(terminated).astype(bool), to_numpy(truncated).astype(bool)
        ended = terminated | truncated
        rewards = to_numpy(rewards).astype(np.float32)
        return StepResult(
            obs=obs,
            rewards=rewards,
            terminated=terminated,
            truncated=truncated,
            final_obs=final_obs,
            successes=self._success.update(step_successes(info, ended), ended),
            raw_rewards=raw_rewards(info, rewards, ended),
        )

    def close(self) -> None:
        self.vector.close()
