"""A gymnasium environment whose `step` never returns: the env role serving it hangs inside a request.

Registered on import as `Hanging-v0`; a job names it `tests.runtime.wire.hanging_env:Hanging-v0` (gymnasium
imports the module before it looks the id up).
"""

from __future__ import annotations

import threading
from typing import Any

import gymnasium
import numpy as np
from gymnasium import spaces


class HangingEnv(gymnasium.Env):
    observation_space = spaces.Box(-1.0, 1.0, (2,), np.float32)
    action_space = spaces.Discrete(2)

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[Any, dict]:
        super().reset(seed=seed)
        return np.zeros(2, np.float32), {}

    def step(self, action: Any) -> tuple[Any, float, bool, bool, dict]:
        threading.Event().wait()  # a deadlock: nothing ever sets it
        raise AssertionError("unreachable")


if "Hanging-v0" not in gymnasium.registry:
    gymnasium.register("Hanging-v0", entry_point=HangingEnv)


HUNG_ENV_JOB = """\
apiVersion: rljob.io/v1alpha1
kind: RLJob
metadata:
  name: hung-env
spec:
  task:
    type: gym
    gym: {envId: "tests.runtime.wire.hanging_env:Hanging-v0", numEnvs: 2}
  algorithm: {name: ppo, minibatches: 1}
  trainer: {steps: 3, batchSize: 64}
  failurePolicy: {maxReplacements: 1}
  roles:
    actor: {replicas: 1}
    rollout: {replicas: 1}
    env: {replicas: 1, probes: {livenessTimeoutSeconds: 2}}
"""
"""A job whose env replica hangs at its first step: a launcher kills it, its replacement hangs again, and the
failure policy (maxReplacements 1) ends the job."""
