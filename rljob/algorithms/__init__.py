"""Advantages, policy losses, KL estimators, DAPO sampling and reward shaping: pure torch functions."""

from rljob.algorithms.advantages import (
    GROUP_ADVANTAGES,
    dr_grpo_advantages,
    gae_advantages,
    group_advantages,
    grpo_advantages,
    normalize,
    reinforce_pp_advantages,
    rloo_advantages,
)
from rljob.algorithms.losses import (
    POLICY_LOSSES,
    aggregate_loss,
    cispo_policy_loss,
    entropy_bonus,
    explained_variance,
    gspo_policy_loss,
    kl_estimate,
    loss_normalizer,
    masked_mean,
    off_policy_weights,
    policy_loss_for,
    ppo_policy_loss,
    value_loss,
)
from rljob.algorithms.preference import PreferenceLoss, bradley_terry_loss, dpo_loss
from rljob.algorithms.sampling import informative_groups
from rljob.algorithms.shaping import overlong_penalty

__all__ = [
    "GROUP_ADVANTAGES",
    "POLICY_LOSSES",
    "PreferenceLoss",
    "aggregate_loss",
    "bradley_terry_loss",
    "cispo_policy_loss",
    "dpo_loss",
    "dr_grpo_advantages",
    "entropy_bonus",
    "explained_variance",
    "gae_advantages",
    "group_advantages",
    "grpo_advantages",
    "gspo_policy_loss",
    "informative_groups",
    "kl_estimate",
    "loss_normalizer",
    "masked_mean",
    "normalize",
    "off_policy_weights",
    "overlong_penalty",
    "policy_loss_for",
    "ppo_policy_loss",
    "reinforce_pp_advantages",
    "rloo_advantages",
    "value_loss",
]
