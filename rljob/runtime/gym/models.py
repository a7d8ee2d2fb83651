"""Actor-critic networks for gymnasium tasks: an MLP for vector observations, a CNN for images.

Orthogonal initialisation as in CleanRL's `ppo.py`, `ppo_continuous_action.py` and `ppo_atari.py`: hidden
layers gain sqrt(2), the policy head gain 0.01 (a nearly uniform initial policy), the value head gain 1.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import Tensor, nn
from torch.distributions import Categorical, Distribution, Normal

from rljob.runtime.gym.images import ImageLayout, ImageSpaceError, check_conv_fits, image_layout, is_pixel_space

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
    """The environment's observation or action space cannot be handled by the builtin network."""


def _action_setup(action_space: gymnasium.spaces.Space, architecture: str) -> tuple[bool, int, tuple[int, ...]]:
    """(discrete, number of policy outputs, shape of one action) for the action spaces the builtin networks emit."""
    from gymnasium import spaces

    if isinstance(action_space, spaces.Discrete):
        return True, int(action_space.n), ()
    if isinstance(action_space, spaces.Box) and len(action_space.shape) == 1:
        return False, int(action_space.shape[0]), (int(action_space.shape[0]),)
    raise UnsupportedSpaceError(
        f"the builtin {architecture} supports Discrete or 1-D Box action spaces, not {action_space}; "
        "choose another task.gym.envId or wrap the environment"
    )


class ActorCritic(nn.Module):
    """What PPO, the rollout and checkpoints use of a builtin network; subclasses define `policy_and_value`.

    Discrete actions: a Categorical over logits. Box actions: a diagonal Gaussian whose mean is the
    policy output and whose log-std is a learned, state-independent parameter (initialised at 0);
    log-probabilities and entropies are summed over action dimensions. Actions are not clipped
    here: the env role clips to the Box bounds, so the logprob stays that of the sampled action.
    """

    discrete: bool
    action_dim: int
    action_shape: tuple[int, ...]
    input_shape: tuple[int, ...]
    """The shape of one observation as this network takes it (PPO reshapes batches to [n, *input_shape])."""

    def _init_actions(self, action_space: gymnasium.spaces.Space, architecture: str) -> None:
        self.discrete, self.action_dim, self.action_shape = _action_setup(action_space, architecture)
        if not self.discrete:
            self.log_std = nn.Parameter(torch.zeros(self.action_dim))

    def policy_and_value(self, obs: Tensor) -> tuple[Tensor, Tensor]:
        """(policy outputs [B, action_dim]: logits or Gaussian means, values [B])."""
        raise NotImplementedError

    def value(self, obs: Tensor) -> Tensor:
        return self.policy_and_value(obs)[1]

    def _distribution(self, out: Tensor) -> Distribution:
        if self.discrete:
            return Categorical(logits=out)
        return Normal(out, self.log_std.exp().expand_as(out))

    def distribution(self, obs: Tensor) -> Distribution:
        return self._distribution(self.policy_and_value(obs)[0])

    def _logprob_entropy(self, dist: Distribution, actions: Tensor) -> tuple[Tensor, Tensor]:
        if self.discrete:
            return dist.log_prob(actions.long()), dist.entropy()
        return dist.log_prob(actions).sum(-1), dist.entropy().sum(-1)

    @torch.no_grad()
    def act(self, obs: Tensor, deterministic: bool = False) -> tuple[Tensor, Tensor, Tensor]:
        """Sample actions for a batch of observations [B, *obs_shape] -> (actions, logprobs [B], values [B])."""
        out, values = self.policy_and_value(obs)
        dist = self._distribution(out)
        if not deterministic:
            actions = dist.sample()
        elif self.discrete:
            actions = dist.probs.argmax(-1)  # type: ignore[attr-defined]
        else:
            actions = dist.mean
        logprobs, _ = self._logprob_entropy(dist, actions)
        return actions, logprobs, values

    def evaluate(self, obs: Tensor, actions: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Log-probabilities, entropies and values of taken actions, with gradients (the PPO update)."""
        out, values = self.policy_and_value(obs)
        logprobs, entropy = self._logprob_entropy(self._distribution(out), actions)
        return logprobs, entropy, values


class MLPActorCritic(ActorCritic):
    """Separate policy and value MLPs over flat observations."""

    def __init__(
        self,
        obs_dim: int,
        action_space: gymnasium.spaces.Space,
        hidden_sizes: list[int] | tuple[int, ...] = (64, 64),
        activation: str = "tanh",
    ) -> None:
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"model.builtin.activation {activation!r} is not one of {', '.join(ACTIVATIONS)}")
        hidden = list(hidden_sizes)
        self._init_actions(action_space, "mlp")
        self.obs_dim = obs_dim
        self.input_shape = (obs_dim,)
        self.critic = _mlp(obs_dim, hidden, activation, 1, head_gain=1.0)
        self.actor = _mlp(obs_dim, hidden, activation, self.action_dim, head_gain=0.01)

    def policy_and_value(self, obs: Tensor) -> tuple[Tensor, Tensor]:
        obs = obs.flatten(1)  # stacked vectors (frame-stack) are read as one
        return self.actor(obs), self.critic(obs).squeeze(-1)

    def value(self, obs: Tensor) -> Tensor:
        return self.critic(obs.flatten(1)).squeeze(-1)


def _conv(in_channels: int, out_channels: int, kernel: int, stride: int) -> nn.Conv2d:
    layer = nn.Conv2d(in_channels, out_channels, kernel, stride)
    nn.init.orthogonal_(layer.weight, math.sqrt(2))
    nn.init.constant_(layer.bias, 0.0)
    return layer


class CNNActorCritic(ActorCritic):
    """Convolutions and dense layers shared by a policy head and a value head, as CleanRL's `ppo_atari.py`.

    Observations arrive as the env serves them (uint8 pixels, channel-first or channel-last, maybe stacked): the
    network permutes them to [B, C, H, W] and scales uint8 to [0, 1] itself, so they travel and wait in buffers as
    bytes. Orthogonal init: gain sqrt(2) for the trunk, 0.01 for the policy head, 1 for the value head.
    """

    def __init__(
        self,
        layout: ImageLayout,
        action_space: gymnasium.spaces.Space,
        channels: list[int] | tuple[int, ...] = (32, 64, 64),
        kernel_sizes: list[int] | tuple[int, ...] = (8, 4, 3),
        strides: list[int] | tuple[int, ...] = (4, 2, 1),
        hidden_sizes: list[int] | tuple[int, ...] = (512,),
        activation: str = "relu",
    ) -> None:
        super().__init__()
        if not len(channels) == len(kernel_sizes) == len(strides):
            raise ValueError("model.builtin channels, kernelSizes and strides need one entry per convolution each")
        if activation not in ACTIVATIONS:
            raise ValueError(f"model.builtin.activation {activation!r} is not one of {', '.join(ACTIVATIONS)}")
        try:
            height, width = check_conv_fits(layout, list(kernel_sizes), list(strides))
        except ImageSpaceError as exc:
            raise UnsupportedSpaceError(str(exc)) from None
        self._init_actions(action_space, "cnn")
        self.layout = layout
        self.input_shape = layout.shape
        layers: list[nn.Module] = []
        depth = layout.channels
        for out_channels, kernel, stride in zip(channels, kernel_sizes, strides, strict=True):
            layers += [_conv(depth, out_channels, kernel, stride), nn.ReLU()]
            depth = out_channels
        layers.append(nn.Flatten())
        width_in = depth * height * width
        for hidden in hidden_sizes:
            layers += [_layer(width_in, hidden, math.sqrt(2)), ACTIVATIONS[activation]()]
            width_in = hidden
        self.trunk = nn.Sequential(*layers)
        self.policy_head = _layer(width_in, self.action_dim, 0.01)
        self.value_head = _layer(width_in, 1, 1.0)
        self._permutation = (0, *(axis + 1 for axis in layout.permutation))

    def images(self, obs: Tensor) -> Tensor:
        """[B, *observation shape] as served -> [B, C, H, W] floats."""
        x = obs.permute(self._permutation).reshape(obs.shape[0], self.layout.channels, self.layout.height, -1)
        return x.to(torch.float32) * self.layout.scale

    def policy_and_value(self, obs: Tensor) -> tuple[Tensor, Tensor]:
        features = self.trunk(self.images(obs))
        return self.policy_head(features), self.value_head(features).squeeze(-1)


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


def build_actor_critic(
    builtin: BuiltinNetwork,
    observation_space: gymnasium.spaces.Space,
    action_space: gymnasium.spaces.Space,
) -> ActorCritic:
    """The network `spec.model.builtin.architecture` names (mlp when unset), for one environment's spaces."""
    if builtin.architecture == "cnn":
        try:
            layout = image_layout(observation_space)
        except ImageSpaceError as exc:
            raise UnsupportedSpaceError(str(exc)) from None
        return CNNActorCritic(
            layout,
            action_space,
            channels=builtin.channels,
            kernel_sizes=builtin.kernel_sizes,
            strides=builtin.strides,
            hidden_sizes=builtin.hidden_sizes,
            activation=builtin.activation,
        )
    if is_pixel_space(observation_space):
        raise UnsupportedSpaceError(
            f"the observation space {observation_space} holds images; the builtin mlp reads vectors: set "
            "spec.model.builtin.architecture: cnn"
        )
    return build_mlp_actor_critic(builtin, observation_space, action_space)


PolicyBuilder = Callable[["RLJobSpec", "gymnasium.spaces.Space", "gymnasium.spaces.Space"], Any]
"""(spec, observation space, action space) -> the actor-critic the actor trains and the rollouts act with (`act`,
`evaluate`, `value`, `policy_and_value`, `discrete`, `action_shape`, `input_shape`); raises `UnsupportedSpaceError`
for spaces it cannot take. The role programs pass one to the gym actor and rollout: the builtin networks' below, or
a VLA's (`rljob.runtime.vla`)."""


def build_builtin_policy(
    spec: RLJobSpec, observation_space: gymnasium.spaces.Space, action_space: gymnasium.spaces.Space
) -> ActorCritic:
    """The default `PolicyBuilder`: the builtin network `spec.model.builtin` names."""
    return build_actor_critic(spec.model.builtin, observation_space, action_space)
