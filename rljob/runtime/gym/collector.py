"""Collecting PPO trajectories from env replicas with a batched policy (the rollout role's gym engine).

Every transition records the rollout's logprob, value and policy version. Values of the next state are
computed here too (`next_values`): for a truncated episode that is the value of its final observation,
which GAE needs to bootstrap (treating truncation as termination biases the value function).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import numpy as np

from rljob.runtime.gym.numpy_policy import NumpyPolicy
from rljob.runtime.gym.torch_policy import TorchPolicy
from rljob.runtime.process.retry import retry
from rljob.runtime.wire.transport import RemoteError, RequestClient, RequestTimeout, TransportError

log = logging.getLogger("rljob.rollout")

Policy = NumpyPolicy | TorchPolicy

STEP_TIMEOUT_S = 2.0
RECOVER_TIMEOUT_S = 120.0


class EnvUnavailable(RuntimeError):
    """An env replica stayed unreachable for RECOVER_TIMEOUT_S: the rollout gives up (and is restarted)."""


@dataclass
class EnvReplica:
    index: int
    client: RequestClient
    count: int = 0
    tag: str = ""
    obs: np.ndarray | None = None
    running_return: np.ndarray = field(default_factory=lambda: np.zeros(0))
    running_length: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))


class TrajectoryCollector:
    """Steps the env replicas assigned to one rollout replica with one policy, T steps at a time."""

    def __init__(self, endpoints: list[tuple[int, str]], seed: int) -> None:
        if not endpoints:
            raise ValueError(
                "this rollout replica has no env replica to drive: set roles.env.replicas >= roles.rollout.replicas"
            )
        self.replicas = [EnvReplica(i, RequestClient(e, timeout=STEP_TIMEOUT_S, retries=1)) for i, e in endpoints]
        self.seed = seed
        self._resets = 0
        self.spaces = self._wait_for(self.replicas[0], "spaces", {})
        for replica in self.replicas:
            replica.count = int(self._wait_for(replica, "spaces", {})["count"])
        self.num_envs = sum(r.count for r in self.replicas)
        # Pixels (uint8 images) stay bytes in the batch buffers, 4x less memory than float32: the cnn scales them
        # itself. Everything else is stored as float32, the mlp's dtype.
        wire = self.spaces["observation_space"]
        pixels = wire.get("dtype") == np.dtype(np.uint8).str and len(wire.get("shape", ())) >= 2
        self.obs_dtype = np.dtype(np.uint8) if pixels else np.dtype(np.float32)
        self.env_restarts = 0

    def _wait_for(self, replica: EnvReplica, method: str, payload: dict) -> dict:
        try:
            return retry(
                lambda: replica.client.call(method, payload),
                retry_on=(RequestTimeout, RemoteError),  # a replica starting again answers errors at first
                deadline_s=RECOVER_TIMEOUT_S,
                on_retry=lambda exc, _: log.warning(
                    "env replica %d not answering %s (%s); retrying", replica.index, method, exc
                ),
            )
        except (RequestTimeout, RemoteError) as exc:
            raise EnvUnavailable(f"env replica {replica.index} unreachable: {exc}") from exc

    def _reset(self, replica: EnvReplica) -> None:
        self._resets += 1
        reply = self._wait_for(replica, "reset", {"seed": self.seed + 100_003 * self._resets})
        replica.obs = np.array(reply["obs"])
        replica.tag = reply["tag"]
        replica.running_return = np.zeros(replica.count)
        replica.running_length = np.zeros(replica.count, dtype=np.int64)

    def collect(self, steps: int, policy: Policy, version: int) -> dict[str, np.ndarray | int | float]:
        """`steps` transitions of every environment, all with policy `version`; retried from scratch when an
        env replica fails midway (its partial batch is dropped, never trained on)."""
        while True:
            for replica in self.replicas:
                if replica.obs is None:
                    self._reset(replica)
            try:
                return self._collect_once(steps, policy, version)
            except _EnvFailed as failed:
                self.env_restarts += 1
                log.warning("%s failed: resetting the environments and restarting the batch", failed)
                # The healthy replicas have stepped past what this batch recorded: reset them too.
                for replica in self.replicas:
                    replica.obs = None

    def _collect_once(self, steps: int, policy: Policy, version: int) -> dict[str, np.ndarray | int | float]:
        started = time.perf_counter()
        obs = np.concatenate([r.obs for r in self.replicas])  # type: ignore[misc]
        n = obs.shape[0]
        obs_buf = np.zeros((steps + 1, *obs.shape), dtype=self.obs_dtype)
        next_obs = np.zeros((steps, *obs.shape), dtype=self.obs_dtype)
        actions_buf: np.ndarray | None = None
        logprobs = np.zeros((steps, n), dtype=np.float32)
        values = np.zeros((steps, n), dtype=np.float32)
        rewards = np.zeros((steps, n), dtype=np.float32)
        terminated = np.zeros((steps, n), dtype=bool)
        truncated = np.zeros((steps, n), dtype=bool)
        episode_returns: list[float] = []
        episode_lengths: list[int] = []
        episode_successes: list[float] = []
        bounds = np.cumsum([0] + [r.count for r in self.replicas])
        running_return = np.concatenate([r.running_return for r in self.replicas])
        running_length = np.concatenate([r.running_length for r in self.replicas])
        obs_buf[0] = obs
        for t in range(steps):
            actions, logprobs[t], values[t] = policy.act(obs_buf[t])
            if actions_buf is None:
                actions_buf = np.zeros((steps, *actions.shape), dtype=actions.dtype)
            actions_buf[t] = actions
            replies = self._step_all([actions[bounds[i] : bounds[i + 1]] for i in range(len(self.replicas))])
            obs_buf[t + 1] = np.concatenate([r["obs"] for r in replies])
            next_obs[t] = np.concatenate([r["final_obs"] for r in replies])
            rewards[t] = np.concatenate([r["rewards"] for r in replies])
            terminated[t] = np.concatenate([r["terminated"] for r in replies])
            truncated[t] = np.concatenate([r["truncated"] for r in replies])
            successes = np.concatenate([r["successes"] for r in replies])
            # Returns in the task's units: the rewards before a wrapper (normalize-reward) rescaled them.
            running_return += np.concatenate([r.get("raw_rewards", r["rewards"]) for r in replies])
            running_length += 1
            for i in np.flatnonzero(terminated[t] | truncated[t]):
                episode_returns.append(float(running_return[i]))
                episode_lengths.append(int(running_length[i]))
                if not np.isnan(successes[i]):
                    episode_successes.append(float(successes[i]))
                running_return[i] = 0.0
                running_length[i] = 0
        # V(s_{t+1}) for every step in one pass; where an episode ended, s_{t+1} is its final observation.
        next_values = policy.value(next_obs.reshape(steps * n, *obs.shape[1:])).reshape(steps, n)
        for i, replica in enumerate(self.replicas):
            replica.obs = obs_buf[steps, bounds[i] : bounds[i + 1]].copy()
            replica.running_return = running_return[bounds[i] : bounds[i + 1]].copy()
            replica.running_length = running_length[bounds[i] : bounds[i + 1]].copy()
        return {
            "obs": obs_buf[:steps],
            "actions": actions_buf,
            "logprobs": logprobs,
            "values": values,
            "next_values": next_values,
            "rewards": rewards,
            "terminated": terminated,
            "truncated": truncated,
            "episode_returns": np.asarray(episode_returns, dtype=np.float64),
            "episode_lengths": np.asarray(episode_lengths, dtype=np.int64),
            "episode_successes": np.asarray(episode_successes, dtype=np.float32),
            "version": version,
            "collect_s": time.perf_counter() - started,
        }

    def _step_all(self, actions: list[np.ndarray]) -> list[dict]:
        started = [(r, r.client.send("step", {"actions": a})) for r, a in zip(self.replicas, actions, strict=True)]
        replies, failed = [], []
        # Collect every reply even when one replica fails: the others have stepped and their state moved on.
        for replica, request_id in started:
            try:
                reply = replica.client.receive(request_id)
                if reply["tag"] != replica.tag:
                    raise RemoteError("EnvNotReset", "env process restarted")
                replies.append(reply)
            except TransportError:
                failed.append(replica)
        if failed:
            raise _EnvFailed(failed)
        return replies

    def close(self) -> None:
        for replica in self.replicas:
            replica.client.close()


class _EnvFailed(Exception):
    def __init__(self, replicas: list[EnvReplica]) -> None:
        super().__init__(", ".join(f"env replica {r.index}" for r in replicas))
        self.replicas = replicas
