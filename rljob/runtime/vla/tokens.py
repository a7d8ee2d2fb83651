"""OpenVLA's action tokens: each action dimension of a Box space is discretized into `bins` evenly spaced values
(bin centers from `low` to `high`), and bin i of every dimension is the i-th reserved token of the vocabulary; a
Discrete(n) space maps action a onto reserved token a. No model: pure tensor arithmetic."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from rljob.runtime.gym.models import UnsupportedSpaceError


class ActionSpaceError(UnsupportedSpaceError):
    """The policy cannot emit actions of this space; the message names the field and the fix."""


@dataclass(frozen=True)
class ActionTokenizer:
    """Actions <-> bin indices (and bin indices <-> token ids, via `token_ids`)."""

    bins: int
    """Tokens per action dimension: `model.vla.actionBins` for Box actions, n for Discrete(n)."""
    dims: int
    """Action dimensions, each one token: 1 for a Discrete space."""
    discrete: bool
    low: tuple[float, ...] = ()
    high: tuple[float, ...] = ()

    @classmethod
    def for_space(cls, space: object, bins: int) -> ActionTokenizer:
        from gymnasium import spaces

        if bins < 2:
            raise ActionSpaceError(f"spec.model.vla.actionBins must be >= 2 (got {bins})")
        if isinstance(space, spaces.Discrete):
            if int(space.start) != 0 or int(space.n) < 2:
                raise ActionSpaceError(
                    f"spec.task.gym.envId: the VLA emits Discrete actions from 0 with at least 2 choices, not {space}"
                )
            return cls(bins=int(space.n), dims=1, discrete=True)
        if isinstance(space, spaces.Box) and len(space.shape) == 1:
            low, high = np.asarray(space.low, np.float64), np.asarray(space.high, np.float64)
            if not (np.isfinite(low).all() and np.isfinite(high).all()) or (high <= low).any():
                raise ActionSpaceError(
                    f"spec.task.gym.envId: the VLA discretizes each Box action dimension between finite bounds, "
                    f"not {space}; wrap the env so its action bounds are finite (e.g. gymnasium's RescaleAction)"
                )
            return cls(bins=bins, dims=int(space.shape[0]), discrete=False, low=tuple(low), high=tuple(high))
        raise ActionSpaceError(
            f"spec.task.gym.envId: the VLA emits Discrete or 1-D Box actions, not {space}; "
            "choose another envId or wrap the environment"
        )

    @property
    def action_shape(self) -> tuple[int, ...]:
        return () if self.discrete else (self.dims,)

    def centers(self) -> Tensor:
        """[dims, bins] the action value of every bin (Box spaces)."""
        low, high = torch.tensor(self.low), torch.tensor(self.high)
        steps = torch.linspace(0.0, 1.0, self.bins, dtype=torch.float64)
        return (low[:, None] + (high - low)[:, None] * steps[None, :]).float()

    def to_actions(self, indices: Tensor) -> Tensor:
        """[B, dims] bin indices -> the actions the env receives: [B] ints (Discrete) or [B, dims] floats (Box)."""
        if self.discrete:
            return indices[:, 0]
        centers = self.centers().to(indices.device)
        return torch.gather(centers.expand(indices.shape[0], -1, -1), 2, indices.unsqueeze(-1)).squeeze(-1)

    def to_indices(self, actions: Tensor) -> Tensor:
        """Actions -> [B, dims] bin indices; the nearest bin for a Box value (exact for values `to_actions` gave)."""
        if self.discrete:
            return actions.long().reshape(-1, 1)
        low = torch.tensor(self.low, device=actions.device, dtype=torch.float64)
        high = torch.tensor(self.high, device=actions.device, dtype=torch.float64)
        position = (actions.double() - low) / (high - low) * (self.bins - 1)
        return position.round().clamp(0, self.bins - 1).long()
