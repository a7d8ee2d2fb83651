"""Preference losses of the dpo stage: pure functions of sequence log-probabilities.

Inputs are per pair: the summed log-probability of the chosen and the rejected response under the policy and under
the frozen reference, and (ipo) each response's token count. The formulas are TRL 1.16's `DPOTrainer` ones:

- sigmoid (DPO, Rafailov et al. 2023): -log sigmoid(beta d), d = (pi_c - ref_c) - (pi_r - ref_r); with label
  smoothing e the conservative cDPO, -(1 - e) log sigmoid(beta d) - e log sigmoid(-beta d) (TRL's own sigmoid has no
  smoothing: e = 0 is it exactly).
- robust (Chowdhury et al. 2024): (-(1 - e) log sigmoid(beta d) + e log sigmoid(-beta d)) / (1 - 2e).
- ipo (Azar et al. 2023, eq. 17): (d' - 1 / (2 beta))^2, d' the gap of the per-token log-ratios (each response's
  log-ratio divided by its token count, as TRL does after checking with the IPO authors).

The implicit rewards are beta times each response's log-ratio; a pair is ranked right when the chosen one's is higher.
A reward model's loss (`bradley_terry_loss`) takes its scalar scores of the two responses instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch.nn.functional as F
from torch import Tensor

LossType = Literal["sigmoid", "ipo", "robust"]


@dataclass
class PreferenceLoss:
    """Per pair: the loss, and the implicit rewards of the chosen and rejected responses (detached)."""

    loss: Tensor
    chosen_rewards: Tensor
    rejected_rewards: Tensor

    @property
    def margins(self) -> Tensor:
        return self.chosen_rewards - self.rejected_rewards

    @property
    def correct(self) -> Tensor:
        """1 where the chosen response's implicit reward is above the rejected one's."""
        return (self.chosen_rewards > self.rejected_rewards).float()


def dpo_loss(
    policy_chosen: Tensor,
    policy_rejected: Tensor,
    reference_chosen: Tensor,
    reference_rejected: Tensor,
    *,
    beta: float,
    loss_type: LossType = "sigmoid",
    label_smoothing: float = 0.0,
    chosen_tokens: Tensor | None = None,
    rejected_tokens: Tensor | None = None,
) -> PreferenceLoss:
    """Per-pair preference loss from summed sequence log-probs (see the module doc); ipo needs the token counts."""
    chosen_ratio = policy_chosen - reference_chosen
    rejected_ratio = policy_rejected - reference_rejected
    delta = chosen_ratio - rejected_ratio
    if loss_type == "sigmoid":
        loss = -(1 - label_smoothing) * F.logsigmoid(beta * delta) - label_smoothing * F.logsigmoid(-beta * delta)
    elif loss_type == "robust":
        clean = -(1 - label_smoothing) * F.logsigmoid(beta * delta)
        flipped = -label_smoothing * F.logsigmoid(-beta * delta)
        loss = (clean - flipped) / (1 - 2 * label_smoothing)
    elif loss_type == "ipo":
        if chosen_tokens is None or rejected_tokens is None:
            raise ValueError("the ipo loss averages each response's log-ratio over its tokens: pass the token counts")
        gap = chosen_ratio / chosen_tokens.clamp(min=1) - rejected_ratio / rejected_tokens.clamp(min=1)
        loss = (gap - 1 / (2 * beta)) ** 2
    else:
        raise ValueError(f"algorithm.dpo.lossType {loss_type!r} is not one of sigmoid, ipo, robust")
    return PreferenceLoss(loss, beta * chosen_ratio.detach(), beta * rejected_ratio.detach())


def bradley_terry_loss(chosen_rewards: Tensor, rejected_rewards: Tensor) -> PreferenceLoss:
    """A reward model's loss per pair, -log sigmoid(r_chosen - r_rejected) (Bradley-Terry; TRL's `RewardTrainer`
    without margin or centring): the probability that the chosen response is preferred, maximised."""
    loss = -F.logsigmoid(chosen_rewards - rejected_rewards)
    return PreferenceLoss(loss, chosen_rewards.detach(), rejected_rewards.detach())
