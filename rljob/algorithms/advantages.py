"""Advantage estimators: GAE for PPO on environments, group baselines for the LLM family.

Every function is pure: tensors in, tensors out, no module state. Shapes are explicit in the
docstrings; time runs along dim 0 for GAE ([T, N]: steps x environments).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor


def gae_advantages(
    rewards: Tensor,
    values: Tensor,
    next_values: Tensor,
    terminated: Tensor,
    ended: Tensor,
    gamma: float,
    lam: float,
) -> tuple[Tensor, Tensor]:
    """Generalized Advantage Estimation (Schulman et al. 2016, eq. 11-16) on [T, N] tensors.

    - `values[t]` is V(s_t); `next_values[t]` is V(s_{t+1}). When the episode was *truncated* at
      step t, `next_values[t]` must be the value of the final observation (the bootstrap: the
      episode could have continued); when it *terminated*, `next_values[t]` is ignored.
    - `terminated[t]`: the episode ended by termination at step t (no future reward).
    - `ended[t]`: the episode ended at step t by termination OR truncation; it stops the
      recursion so advantages never leak across episode boundaries.

    delta_t = r_t + gamma * (1 - terminated_t) * next_values_t - values_t        (eq. 12)
    A_t     = delta_t + gamma * lam * (1 - ended_t) * A_{t+1},   A_T = 0         (eq. 16)
    returns = A + values  (the lambda-return, the value target)
    """
    if not (rewards.shape == values.shape == next_values.shape == terminated.shape == ended.shape):
        raise ValueError(
            "gae_advantages needs rewards, values, next_values, terminated and ended of one shape [T, N], got "
            f"{[tuple(x.shape) for x in (rewards, values, next_values, terminated, ended)]}"
        )
    not_terminated = 1.0 - terminated.to(values.dtype)
    not_ended = 1.0 - ended.to(values.dtype)
    deltas = rewards + gamma * not_terminated * next_values - values
    advantages = torch.zeros_like(values)
    running = torch.zeros_like(values[0])
    for t in reversed(range(rewards.shape[0])):
        running = deltas[t] + gamma * lam * not_ended[t] * running
        advantages[t] = running
    return advantages, advantages + values


def normalize(advantages: Tensor, eps: float = 1e-8, mask: Tensor | None = None) -> Tensor:
    """Zero mean, unit (population) standard deviation, over the masked entries when a mask is given."""
    if mask is None:
        return (advantages - advantages.mean()) / (advantages.std(correction=0) + eps)
    m = mask.to(advantages.dtype)
    count = m.sum().clamp(min=1.0)
    mean = (advantages * m).sum() / count
    var = (((advantages - mean) ** 2) * m).sum() / count
    return (advantages - mean) / (var.sqrt() + eps) * m


# --- group baselines (one row per prompt, one column per sample of that prompt) -----------------


def _check_groups(rewards: Tensor) -> None:
    if rewards.dim() != 2 or rewards.shape[1] < 2:
        raise ValueError(
            f"group advantages need rewards of shape [prompts, group_size >= 2], got {tuple(rewards.shape)}"
        )


def grpo_advantages(rewards: Tensor, eps: float = 1e-6, scale_by_std: bool = True) -> Tensor:
    """GRPO outcome advantages (Shao et al. 2024, sec. 4.1.2): A_i = (r_i - mean(r)) / (std(r) + eps).

    `rewards` is [prompts, group_size]. The std is the sample std (Bessel-corrected) as in the
    reference implementations. `scale_by_std=False` is Dr. GRPO (Liu et al. 2025): dividing by
    the std over-weights prompts that are almost always right or wrong, so it is dropped.
    A group whose rewards are all equal gets advantage 0 either way.
    """
    _check_groups(rewards)
    centred = rewards - rewards.mean(dim=1, keepdim=True)
    if not scale_by_std:
        return centred
    return centred / (rewards.std(dim=1, keepdim=True) + eps)


def dr_grpo_advantages(rewards: Tensor, scale_by_std: bool = False) -> Tensor:
    """Dr. GRPO: the group mean as baseline, no std scaling (`scale_by_std=True` is GRPO's advantage)."""
    return grpo_advantages(rewards, scale_by_std=scale_by_std)


def rloo_advantages(rewards: Tensor, scale_by_std: bool = False, eps: float = 1e-6) -> Tensor:
    """REINFORCE Leave-One-Out (Ahmadian et al. 2024): A_i = r_i - mean_{j != i} r_j.

    Equivalently G / (G - 1) * (r_i - mean(r)): each sample's baseline excludes itself, so it is unbiased.
    The paper does not scale by a std; `scale_by_std=True` divides by the group's sample std (+ eps) as GRPO.
    """
    _check_groups(rewards)
    group_size = rewards.shape[1]
    leave_one_out_mean = (rewards.sum(dim=1, keepdim=True) - rewards) / (group_size - 1)
    advantages = rewards - leave_one_out_mean
    if not scale_by_std:
        return advantages
    return advantages / (rewards.std(dim=1, keepdim=True) + eps)


def reinforce_pp_advantages(
    rewards: Tensor, token_counts: Tensor | None = None, eps: float = 1e-6, scale_by_std: bool = True
) -> Tensor:
    """REINFORCE++ with baseline (Hu et al. 2025, arXiv:2501.03262, eq. 10): subtract the group mean, then
    normalise over every token of the global batch.

    c_ij = r_ij - mean_j r_ij; with n_ij the trained tokens of response ij (`token_counts`, shaped like
    `rewards`) and N = sum n_ij, each response's advantage is spread over its tokens, so
      mean = sum n_ij c_ij / N,   var = sum n_ij (c_ij - mean)^2 / N   (population variance over the N tokens)
      A_ij = (c_ij - mean) / (sqrt(var) + eps)
    Long responses weigh more in the batch statistics, as their tokens do in the loss. veRL's baseline variant
    divides by N - 1 instead (Bessel): a factor sqrt((N - 1) / N) apart, nothing at a real batch's N.
    Without `token_counts` every response counts as one token. The global normalisation instead of GRPO's
    per-group std keeps prompts comparable and avoids the std blow-up of nearly-solved prompts.
    `scale_by_std=False` returns the group-centred c_ij.
    """
    _check_groups(rewards)
    centred = rewards - rewards.mean(dim=1, keepdim=True)
    if not scale_by_std:
        return centred
    weights = torch.ones_like(centred) if token_counts is None else token_counts.to(centred.dtype)
    if weights.shape != centred.shape:
        raise ValueError(
            f"reinforce_pp needs token_counts shaped like rewards {tuple(rewards.shape)}, got {tuple(weights.shape)}"
        )
    tokens = weights.sum().clamp(min=1.0)
    mean = (weights * centred).sum() / tokens
    variance = (weights * (centred - mean) ** 2).sum() / tokens
    return (centred - mean) / (variance.sqrt() + eps)


GroupAdvantageFn = Callable[..., Tensor]

GROUP_ADVANTAGES: dict[str, GroupAdvantageFn] = {
    "grpo": grpo_advantages,
    "dr_grpo": dr_grpo_advantages,
    "dapo": grpo_advantages,  # DAPO keeps GRPO's advantage; it changes clipping, sampling and aggregation
    "gspo": grpo_advantages,  # GSPO changes the ratio (sequence level), not the advantage
    "cispo": grpo_advantages,  # CISPO changes the clipping (of the IS weight), not the advantage
    "rloo": rloo_advantages,
    "reinforce_pp": reinforce_pp_advantages,
    "distill": grpo_advantages,  # the rewards' part, weighted by distill.rewardWeight (the teacher's is per token)
}
"""Group advantage estimator per `spec.algorithm.name`. PPO uses `gae_advantages` instead."""


TOKEN_WEIGHTED = frozenset({"reinforce_pp"})
"""Estimators whose statistics weigh each response by its token count."""


def group_advantages(
    algorithm: str, rewards: Tensor, *, scale_by_std: bool | None = None, token_counts: Tensor | None = None
) -> Tensor:
    """Advantages of [prompts, group_size] rewards with the estimator of `algorithm`.

    `scale_by_std` (spec.algorithm.normalizeAdvantages) overrides the estimator's own default; `token_counts`
    ([prompts, group_size], the trained tokens of each response) feeds the token-weighted estimators.
    """
    try:
        fn = GROUP_ADVANTAGES[algorithm]
    except KeyError:
        known = ", ".join(sorted(GROUP_ADVANTAGES))
        hint = " ppo uses gae_advantages on trajectories." if algorithm == "ppo" else ""
        raise ValueError(
            f"algorithm.name {algorithm!r} has no group advantage estimator (known: {known}).{hint}"
        ) from None
    kwargs: dict[str, object] = {} if scale_by_std is None else {"scale_by_std": scale_by_std}
    if algorithm in TOKEN_WEIGHTED:
        kwargs["token_counts"] = token_counts
    return fn(rewards, **kwargs)
