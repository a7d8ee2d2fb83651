"""The rollout's view of an actor-critic that acts with its own torch module (a VLA): numpy in, numpy out, the
interface `TrajectoryCollector` drives (`NumpyPolicy`'s). Weight syncs load into the module itself, so `load` has
nothing to copy."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn

VALUE_CHUNK = 64
"""Observations per forward pass when valuing a whole batch's next states: bounds a large policy's activations."""


class TorchPolicy:
    def __init__(self, model: nn.Module) -> None:
        self.model: Any = model

    def load(self, model: nn.Module) -> None:
        self.model = model

    @torch.no_grad()
    def act(self, obs: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        actions, logprobs, values = self.model.act(torch.from_numpy(np.asarray(obs, dtype=np.float32)))
        return actions.cpu().numpy(), logprobs.cpu().numpy(), values.cpu().numpy()

    @torch.no_grad()
    def value(self, obs: np.ndarray) -> np.ndarray:
        obs = np.asarray(obs, dtype=np.float32)
        chunks = [
            self.model.value(torch.from_numpy(obs[i : i + VALUE_CHUNK])).cpu().numpy()
            for i in range(0, obs.shape[0], VALUE_CHUNK)
        ]
        return np.concatenate(chunks).astype(np.float32)
