"""The rollout's policy for networks numpy cannot run cheaply (the cnn): the torch module itself, no autograd.

Same interface as `NumpyPolicy` (`act`, `value`, `load`). Convolutions in torch beat a numpy im2col by far, so the
cnn's inference stays in torch; sampling uses this policy's own generator, as `NumpyPolicy` uses its own.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from rljob.runtime.gym.models import ActorCritic, MLPActorCritic
from rljob.runtime.gym.numpy_policy import NumpyPolicy

VALUE_CHUNK = 1024
"""Observations per forward pass when valuing a whole batch's next states (bounds the activations' memory)."""


class TorchPolicy:
    """Sampling actions, logprobs and values like `ActorCritic.act`, with the rollout's model (the weights it
    receives land in that model, so `load` has nothing to copy)."""

    def __init__(self, model: ActorCritic, seed: int) -> None:
        self.model = model
        self.generator = torch.Generator().manual_seed(seed)

    def load(self, model: ActorCritic) -> None:
        self.model = model

    @torch.no_grad()
    def value(self, obs: np.ndarray) -> np.ndarray:
        parts = [
            self.model.value(torch.from_numpy(obs[start : start + VALUE_CHUNK])).numpy()
            for start in range(0, len(obs), VALUE_CHUNK)
        ]
        return np.concatenate(parts).astype(np.float32)

    @torch.no_grad()
    def act(self, obs: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        if not isinstance(self.model, ActorCritic):  # a policy of its own kind (a VLA's action tokens) samples itself
            actions, logprobs, values = self.model.act(torch.from_numpy(obs))
            return actions.numpy(), logprobs.numpy().astype(np.float32), values.numpy().astype(np.float32)
        out, values = self.model.policy_and_value(torch.from_numpy(obs))
        if self.model.discrete:
            log_probs = torch.log_softmax(out, dim=-1)
            # Gumbel-max: argmax(logits + Gumbel noise) is a sample of the categorical distribution.
            gumbel = -torch.log(-torch.log(torch.rand(out.shape, generator=self.generator).clamp_min(1e-20)))
            actions = torch.argmax(log_probs + gumbel, dim=-1)
            logprobs = log_probs.gather(-1, actions.unsqueeze(-1)).squeeze(-1)
        else:
            log_std = self.model.log_std
            actions = out + log_std.exp() * torch.randn(out.shape, generator=self.generator)
            normal = -((actions - out) ** 2) / (2 * (2 * log_std).exp()) - log_std - 0.5 * math.log(2 * math.pi)
            logprobs = normal.sum(-1)
        return actions.numpy(), logprobs.numpy().astype(np.float32), values.numpy().astype(np.float32)


def rollout_policy(model: ActorCritic, seed: int) -> NumpyPolicy | TorchPolicy:
    """The fastest policy for acting with `model`: numpy for the mlp (per-call overhead dominates), torch otherwise."""
    if isinstance(model, MLPActorCritic):
        return NumpyPolicy(model, seed)
    return TorchPolicy(model, seed)
