"""Actor-critic networks for gymnasium tasks with vector observations.

Separate policy and value MLPs with orthogonal initialisation, as in CleanRL's `ppo.py` and
`ppo_continuous_action.py`: hidden layers gain sqrt(2), the policy head gain 0.01 (a nearly
uniform initial policy), the value head gain 1.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import Tensor, nn
from torch.distributions import Categorical, Distribution, Normal

if TYPE_CHECKING:
    import gymnasium

    from rljob.api.spec import BuiltinNetwork, RLJobSpec

ACTIVATIONS: dict[str, type[nn.Module]] = {"tanh": nn.Tanh, "relu": nn.ReLU, "gelu": nn.GELU}


def _layer(in_features: int, out_features: int, gain: float) -> nn.Linear:
    layer = nn.Linear(in_features, out_features)
    nn.init.orthogonal_(layer.weight, gain)
    nn.init.constant_(layer.bias, 0.0)
    return layer


def _mlp(
    in_features: int, hidden_sizes: list[int], activation: str, out_features: int, head_gain: float
) -> nn.Sequential:
    layers: list[nn.Module] = []
    width = in_features
    for hidden in hidden_sizes:
        layers += [_layer(width, hidden, math.sqrt(2)), ACTIVATIONS[activation]()]
        width = hidden
    layers.append(_layer(width, out_features, head_gain))
    return nn.Sequential(*layers)


class UnsupportedSpaceError(ValueError):
    """The environment's observation or action space cannot be handled by the builtin MLP."""


class MLPActorCritic(nn.Module):
    """Policy and value MLPs over flat observations.

    Discrete actions: a Categorical over logits. Box actions: a diagonal Gaussian whose mean is the
    policy output and whose log-std is a learned, state-independent parameter (initialised at 0);
    log-probabilities and entropies are summed over action dimensions. Actions are not clipped
    here: the env role clips to the Box bounds, so the logprob stays that of the sampled action.
    """

    def __init__(
        self,
        obs_dim: int,
        action_space: gymnasium.spaces.Space,
        hidden_sizes: list[int] | tuple[int, ...] = (64, 64),
        activation: str = "tanh",
    ) -> None:
        super().__init__()
        from gymnasium import spaces

        if activation not in ACTIVATIONS:
            raise ValueError(f"model.builtin.activation {activation!r} is not one of {', '.join(ACTIVATIONS)}")
        hidden = list(hidden_sizes)
        if isinstance(action_space, spaces.Discrete):
            self.discrete = True
            self.action_dim = int(action_space.n)
            self.action_shape: tuple[int, ...] = ()
        elif isinstance(action_space, spaces.Box) and len(action_space.shape) == 1:
            self.discrete = False
            self.action_dim = int(action_space.shape[0])
            self.action_shape = (self.action_dim,)
        else:
            raise UnsupportedSpaceError(
                f"the builtin mlp supports Discrete or 1-D Box action spaces, not {action_space}; "
                "choose another task.gym.envId or wrap the environment"
            )
        self.obs_dim = obs_dim
        self.critic = _mlp(obs_dim, hidden, activation, 1, head_gain=1.0)
        self.actor = _mlp(obs_dim, hidden, activation, self.action_dim, head_gain=0.01)
        if not self.discrete:
            self.log_std = nn.Parameter(torch.zeros(self.action_dim))

    def distribution(self, obs: Tensor) -> Distribution:
        out = self.actor(obs)
        if self.discrete:
            return Categorical(logits=out)
        return Normal(out, self.log_std.exp().expand_as(out))

    def value(self, obs: Tensor) -> Tensor:
        return self.critic(obs).squeeze(-1)

    def _logprob_entropy(self, dist: Distribution, actions: Tensor) -> tuple[Tensor, Tensor]:
        if self.discrete:
            return dist.log_prob(actions.long()), dist.entropy()
        return dist.log_prob(actions).sum(-1), dist.entropy().sum(-1)

    @torch.no_grad()
    def act(self, obs: Tensor, deterministic: bool = False) -> tuple[Tensor, Tensor, Tensor]:
        """Sample actions for a batch of observations [B, obs_dim] -> (actions, logprobs [B], values [B])."""
        dist = self.distribution(obs)
        if not deterministic:
            actions = dist.sample()
        elif self.discrete:
            actions = dist.probs.argmax(-1)  # type: ignore[attr-defined]
        else:
            actions = dist.mean
        logprobs, _ = self._logprob_entropy(dist, actions)
        return actions, logprobs, self.value(obs)

    def evaluate(self, obs: Tensor, actions: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Log-probabilities, entropies and values of taken actions, with gradients (the PPO update)."""
        dist = self.distribution(obs)
        logprobs, entropy = self._logprob_entropy(dist, actions)
        return logprobs, entropy, self.value(obs)


def observation_dim(observation_space: gymnasium.spaces.Space) -> int:
    """Flat size of a Box observation space; other spaces get a clear error."""
    from gymnasium import spaces

    if not isinstance(observation_space, spaces.Box):
        raise UnsupportedSpaceError(
            f"the builtin mlp needs Box (vector) observations, not {observation_space}; "
            "choose another task.gym.envId or flatten its observations"
        )
    return int(np.prod(observation_space.shape))


def build_mlp_actor_critic(
    builtin: BuiltinNetwork,
    observation_space: gymnasium.spaces.Space,
    action_space: gymnasium.spaces.Space,
) -> MLPActorCritic:
    """The network `spec.model.builtin` describes, for one environment's spaces."""
    return MLPActorCritic(
        observation_dim(observation_space),
        action_space,
        hidden_sizes=builtin.hidden_sizes,
        activation=builtin.activation,
    )


PolicyBuilder = Callable[["RLJobSpec", "gymnasium.spaces.Space", "gymnasium.spaces.Space"], Any]
"""(spec, observation space, action space) -> the actor-critic module the actor trains and the rollouts act with
(`act`, `evaluate`, `value`, `discrete`, `action_shape`); raises `UnsupportedSpaceError` for spaces it cannot take.
The role programs pass one to the gym actor and rollout: the mlp's below, or a VLA's (`rljob.runtime.vla`)."""


def build_mlp_policy(
    spec: RLJobSpec, observation_space: gymnasium.spaces.Space, action_space: gymnasium.spaces.Space
) -> MLPActorCritic:
    """The default `PolicyBuilder`: the builtin mlp."""
    return build_mlp_actor_critic(spec.model.builtin, observation_space, action_space)
