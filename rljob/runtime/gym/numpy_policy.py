"""The rollout's copy of an `MLPActorCritic`, evaluated with numpy.

Acting on a handful of observations is dominated by per-call overhead in torch (distribution objects,
dispatch): numpy does the same arithmetic in a fraction of the time, and the rollout does it once per
environment step. The weights are the trainer's, copied after every weight sync; `test_numpy_policy`
checks that logprobs and values match the torch model.
"""

from __future__ import annotations

import numpy as np
from torch import nn

from rljob.runtime.gym.models import MLPActorCritic

_ACTIVATIONS = {
    nn.Tanh: np.tanh,
    nn.ReLU: lambda x: np.maximum(x, 0.0),
}


def _gelu(x: np.ndarray) -> np.ndarray:
    import torch

    return torch.nn.functional.gelu(torch.from_numpy(x)).numpy()


def _layers(sequential: nn.Sequential) -> list[tuple[np.ndarray, np.ndarray, object]]:
    """[(weight.T, bias, activation after it or None)] of a Linear/activation stack."""
    modules = list(sequential)
    out = []
    for i, module in enumerate(modules):
        if isinstance(module, nn.Linear):
            following = modules[i + 1] if i + 1 < len(modules) else None
            act = None
            if following is not None:
                act = _gelu if isinstance(following, nn.GELU) else _ACTIVATIONS[type(following)]
            out.append(
                (
                    module.weight.detach().numpy().T.astype(np.float32).copy(),
                    module.bias.detach().numpy().astype(np.float32).copy(),
                    act,
                )
            )
    return out


def _forward(layers: list[tuple[np.ndarray, np.ndarray, object]], x: np.ndarray) -> np.ndarray:
    for weight, bias, act in layers:
        x = x @ weight + bias
        if act is not None:
            x = act(x)  # type: ignore[operator]
    return x


class NumpyPolicy:
    """Sampling actions, logprobs and values like `MLPActorCritic.act`, from a snapshot of its weights."""

    def __init__(self, model: MLPActorCritic, seed: int) -> None:
        self.discrete = model.discrete
        self.rng = np.random.default_rng(seed)
        self.load(model)

    def load(self, model: MLPActorCritic) -> None:
        self.actor = _layers(model.actor)
        self.critic = _layers(model.critic)
        if not self.discrete:
            self.log_std = model.log_std.detach().numpy().astype(np.float32).copy()

    def value(self, obs: np.ndarray) -> np.ndarray:
        return _forward(self.critic, obs.reshape(len(obs), -1))[:, 0]

    def act(self, obs: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        obs = obs.reshape(len(obs), -1)  # stacked vectors (frame-stack) are read as one
        out = _forward(self.actor, obs)
        if self.discrete:
            shifted = out - out.max(axis=1, keepdims=True)
            log_probs = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
            # Gumbel-max: argmax(logits + Gumbel noise) is a sample of the categorical distribution.
            gumbel = -np.log(-np.log(self.rng.random(out.shape, dtype=np.float32)))
            actions = np.argmax(log_probs + gumbel, axis=1)
            logprobs = log_probs[np.arange(len(actions)), actions]
        else:
            std = np.exp(self.log_std)
            actions = (out + std * self.rng.standard_normal(out.shape, dtype=np.float32)).astype(np.float32)
            logprobs = (-((actions - out) ** 2) / (2 * std**2) - self.log_std - 0.5 * np.log(2 * np.pi)).sum(axis=1)
        return actions, logprobs.astype(np.float32), self.value(obs).astype(np.float32)
