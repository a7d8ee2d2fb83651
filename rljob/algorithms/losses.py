"""Policy and value losses, KL estimators, loss aggregation and off-policy correction weights.

Inputs are either per-sample ([B], gym PPO) or per-token ([B, L], LLMs) with an optional mask of
valid tokens. A per-sample tensor is treated as B sequences of one token, so every aggregation
mode reduces to the plain mean there.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch
from torch import Tensor

Aggregation = Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
AGGREGATIONS: tuple[Aggregation, ...] = (
    "token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
)
KLEstimator = Literal["k1", "k2", "k3"]
CorrectionType = Literal["none", "tis", "icepop"]


def _as_tokens(x: Tensor, mask: Tensor | None) -> tuple[Tensor, Tensor]:
    """View `x` as [sequences, tokens] with a float mask of the same shape."""
    tokens = x.unsqueeze(-1) if x.dim() == 1 else x
    if mask is None:
        return tokens, torch.ones_like(tokens)
    m = mask.unsqueeze(-1) if mask.dim() == 1 else mask
    if m.shape != tokens.shape:
        raise ValueError(f"mask shape {tuple(mask.shape)} does not match values shape {tuple(x.shape)}")
    return tokens, m.to(tokens.dtype)


def aggregate_loss(
    loss: Tensor,
    mask: Tensor | None = None,
    aggregation: Aggregation = "token-mean",
    norm_length: int | None = None,
    *,
    normalizer: float | None = None,
) -> Tensor:
    """Reduce a per-token loss to a scalar.

    - token-mean: every valid token weighs the same (DAPO); long answers weigh more.
    - seq-mean-token-sum: sum over a sequence's tokens, mean over sequences.
    - seq-mean-token-mean: mean over a sequence's tokens, then over sequences (original GRPO);
      biased towards short answers.
    - seq-mean-token-sum-norm: token sum divided by a constant length (Dr. GRPO), mean over
      sequences; `norm_length` defaults to the padded length L. A learner that splits a batch
      must pass one constant (the maximum response length) so every micro-batch divides alike.

    `normalizer` replaces the local denominator (token-mean: the valid tokens; seq-mean-*: the
    sequences) by a count over the whole minibatch: the sum of `loss_normalizer` over every
    micro-batch and rank. Each micro-batch's loss is then its share of the full-batch loss, so
    their sum (and its gradient) equals the loss of the batch taken at once, whatever the split.
    """
    if normalizer is not None and normalizer <= 0:
        raise ValueError(f"normalizer must be a positive token or sequence count, got {normalizer}")
    if mask is None and normalizer is None:
        # Fast path (gym PPO: one value per sample, no padding): no mask tensor to build and multiply.
        tokens = loss.unsqueeze(-1) if loss.dim() == 1 else loss
        if aggregation in ("token-mean", "seq-mean-token-mean"):
            return tokens.mean()
        if aggregation == "seq-mean-token-sum":
            return tokens.sum(dim=-1).mean()
        if aggregation == "seq-mean-token-sum-norm":
            return tokens.sum(dim=-1).mean() / (norm_length if norm_length is not None else tokens.shape[-1])
    tokens, m = _as_tokens(loss, mask)
    masked = tokens * m
    if aggregation == "token-mean":
        return masked.sum() / (m.sum().clamp(min=1.0) if normalizer is None else normalizer)
    if aggregation == "seq-mean-token-sum":
        per_sequence = masked.sum(dim=-1)
    elif aggregation == "seq-mean-token-mean":
        per_sequence = masked.sum(dim=-1) / m.sum(dim=-1).clamp(min=1.0)
    elif aggregation == "seq-mean-token-sum-norm":
        per_sequence = masked.sum(dim=-1) / (norm_length if norm_length is not None else tokens.shape[-1])
    else:
        raise ValueError(f"algorithm.lossAggregation {aggregation!r} is not one of {', '.join(AGGREGATIONS)}")
    return per_sequence.mean() if normalizer is None else per_sequence.sum() / normalizer


def loss_normalizer(mask: Tensor, aggregation: Aggregation) -> float:
    """This micro-batch's share of the denominator of `aggregation`: the number to all-reduce.

    token-mean counts valid tokens; the seq-mean-* modes count sequences (rows of `mask`; a
    per-sample [B] mask is B sequences of one token). Every row counts, also one without a valid
    token, exactly as in the local mean of `aggregate_loss`. Summed over the micro-batches of a
    minibatch and over ranks, it is the `normalizer` that makes the split losses add up to the
    full-batch loss.
    """
    if aggregation == "token-mean":
        return float(mask.sum().item())
    if aggregation in AGGREGATIONS:
        return float(mask.shape[0])
    raise ValueError(f"algorithm.lossAggregation {aggregation!r} is not one of {', '.join(AGGREGATIONS)}")


def masked_mean(x: Tensor, mask: Tensor | None = None) -> Tensor:
    if mask is None:
        return x.mean()
    tokens, m = _as_tokens(x, mask)
    return (tokens * m).sum() / m.sum().clamp(min=1.0)


def ppo_policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    clip_low: float,
    clip_high: float,
    dual_clip: float | None = None,
    mask: Tensor | None = None,
    aggregation: Aggregation = "token-mean",
    correction_weights: Tensor | None = None,
    *,
    norm_length: int | None = None,
    normalizer: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO clipped surrogate (Schulman et al. 2017, eq. 7), as a loss to minimise.

    ratio = exp(logprobs - old_logprobs)
    loss  = max(-A * ratio, -A * clip(ratio, 1 - clip_low, 1 + clip_high))
    Dual clip (Ye et al. 2020): for A < 0 the loss is also capped at -A * dual_clip, so a huge
    ratio on a bad action cannot dominate the update.
    `correction_weights` (detached, e.g. from `off_policy_weights`) scale each token's loss.
    `norm_length` and `normalizer` go to `aggregate_loss` (a constant Dr. GRPO length; the global
    token or sequence count of a minibatch split into micro-batches and ranks).

    stats: clip_fraction (share of valid tokens whose ratio left [1 - clip_low, 1 + clip_high]),
    approx_kl (the low-variance estimator mean((ratio - 1) - log ratio), Schulman's k3 of old
    vs new), ratio_mean.
    """
    log_ratio = logprobs - old_logprobs
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    per_token = torch.maximum(unclipped, clipped)
    if dual_clip is not None:
        if dual_clip <= 1.0:
            raise ValueError(f"algorithm.dualClip must be > 1, got {dual_clip}")
        capped = torch.minimum(per_token, -advantages * dual_clip)
        per_token = torch.where(advantages < 0, capped, per_token)
    if correction_weights is not None:
        per_token = per_token * correction_weights.detach()
    loss = aggregate_loss(per_token, mask, aggregation, norm_length, normalizer=normalizer)
    with torch.no_grad():
        outside = ((ratio < 1.0 - clip_low) | (ratio > 1.0 + clip_high)).to(ratio.dtype)
        stats = {
            "clip_fraction": masked_mean(outside, mask),
            "approx_kl": masked_mean((ratio - 1.0) - log_ratio, mask),
            "ratio_mean": masked_mean(ratio, mask),
        }
    return loss, stats


def gspo_policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    clip_low: float,
    clip_high: float,
    dual_clip: float | None = None,
    mask: Tensor | None = None,
    aggregation: Aggregation = "seq-mean-token-mean",
    correction_weights: Tensor | None = None,
    *,
    norm_length: int | None = None,
    normalizer: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """GSPO (Zheng et al. 2025): PPO's clipped objective on a *sequence* importance ratio.

    s_i = exp(mean_t (log pi(y_it) - log pi_old(y_it)))   (length-normalised, eq. 7)
    Written in the GSPO-token form s_it = sg(s_i) * pi(y_it) / sg(pi(y_it)): every token of a
    sequence carries the value s_i, and the gradient is the sequence-level one. The paper averages
    per sequence (`seq-mean-token-mean`) and uses much smaller clip ranges than PPO (3e-4 / 4e-4).
    """
    tokens, m = _as_tokens(logprobs - old_logprobs, mask)
    seq_log_ratio = (tokens * m).sum(dim=-1, keepdim=True) / m.sum(dim=-1, keepdim=True).clamp(min=1.0)
    token_logprobs = logprobs.unsqueeze(-1) if logprobs.dim() == 1 else logprobs
    token_log_ratio = seq_log_ratio.detach() + token_logprobs - token_logprobs.detach()
    adv = advantages.unsqueeze(-1) if advantages.dim() < token_logprobs.dim() else advantages
    # ppo_policy_loss on log-ratio form: old logprobs of 0 and "logprobs" equal to the sequence log ratio.
    weights = None if correction_weights is None else correction_weights.reshape(token_logprobs.shape)
    return ppo_policy_loss(
        token_log_ratio,
        torch.zeros_like(token_log_ratio),
        adv.expand_as(token_log_ratio),
        clip_low,
        clip_high,
        dual_clip=dual_clip,
        mask=m,
        aggregation=aggregation,
        correction_weights=weights,
        norm_length=norm_length,
        normalizer=normalizer,
    )


def cispo_policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    clip_low: float,
    clip_high: float,
    dual_clip: float | None = None,
    mask: Tensor | None = None,
    aggregation: Aggregation = "token-mean",
    correction_weights: Tensor | None = None,
    *,
    norm_length: int | None = None,
    normalizer: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """CISPO (MiniMax-M1, Chen et al. 2025, eq. 4): clip the importance weight, never drop a token's gradient.

    loss_t = -sg(min(ratio_t, 1 + clip_high)) * A_t * log pi(y_t)
    PPO zeroes the gradient of a clipped token; rare "fork" tokens are exactly those, so CISPO keeps
    them with a bounded weight. As in the paper no lower bound is imposed (`clip_low` and
    `dual_clip` are unused). stats as in `ppo_policy_loss`; clip_fraction counts capped weights.
    """
    log_ratio = logprobs - old_logprobs
    ratio = torch.exp(log_ratio)
    weight = torch.clamp(ratio, max=1.0 + clip_high).detach()
    per_token = -weight * advantages * logprobs
    if correction_weights is not None:
        per_token = per_token * correction_weights.detach()
    loss = aggregate_loss(per_token, mask, aggregation, norm_length, normalizer=normalizer)
    with torch.no_grad():
        stats = {
            "clip_fraction": masked_mean((ratio > 1.0 + clip_high).to(ratio.dtype), mask),
            "approx_kl": masked_mean((ratio - 1.0) - log_ratio, mask),
            "ratio_mean": masked_mean(ratio, mask),
        }
    return loss, stats


PolicyLossFn = Callable[..., tuple[Tensor, dict[str, Tensor]]]

POLICY_LOSSES: dict[str, PolicyLossFn] = {
    "ppo": ppo_policy_loss,
    "grpo": ppo_policy_loss,
    "dr_grpo": ppo_policy_loss,
    "dapo": ppo_policy_loss,  # with clip-higher (clipRatioHigh 0.28) and token-mean aggregation
    "rloo": ppo_policy_loss,
    "distill": ppo_policy_loss,  # with per-token advantages from the teacher (the learner adds them)
    "reinforce_pp": ppo_policy_loss,
    "gspo": gspo_policy_loss,
    "cispo": cispo_policy_loss,
}
"""Policy loss per `spec.algorithm.name`; all share `ppo_policy_loss`'s signature."""


def policy_loss_for(algorithm: str) -> PolicyLossFn:
    try:
        return POLICY_LOSSES[algorithm]
    except KeyError:
        raise ValueError(
            f"algorithm.name {algorithm!r} has no policy loss (known: {', '.join(sorted(POLICY_LOSSES))})"
        ) from None


def value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    clip: float | None = None,
    mask: Tensor | None = None,
) -> Tensor:
    """Squared-error value loss 0.5 * (V - R)^2, masked mean.

    With `clip` (PPO2 / CleanRL `clip_vloss`): V_clipped = V_old + clip(V - V_old, -clip, clip)
    and the loss is 0.5 * max((V - R)^2, (V_clipped - R)^2), so the value cannot move more than
    `clip` away from the rollout's estimate in one update.
    """
    unclipped = (values - returns) ** 2
    if clip is None:
        return 0.5 * masked_mean(unclipped, mask)
    v_clipped = old_values + torch.clamp(values - old_values, -clip, clip)
    clipped = (v_clipped - returns) ** 2
    return 0.5 * masked_mean(torch.maximum(unclipped, clipped), mask)


def entropy_bonus(
    entropy: Tensor,
    mask: Tensor | None = None,
    aggregation: Aggregation = "token-mean",
    *,
    norm_length: int | None = None,
    normalizer: float | None = None,
) -> Tensor:
    """Aggregated policy entropy; the total loss subtracts `entropy_coef` times this.

    `norm_length` and `normalizer` as in `aggregate_loss`, so split micro-batches add up here too.
    """
    return aggregate_loss(entropy, mask, aggregation, norm_length, normalizer=normalizer)


def kl_estimate(logprobs: Tensor, ref_logprobs: Tensor, estimator: KLEstimator = "k3") -> Tensor:
    """Per-token estimate of KL(pi || pi_ref) from samples of pi (Schulman, "Approximating KL divergence").

    With log_r = log pi_ref(x) - log pi(x):
    - k1 = -log_r                 unbiased, high variance, can be negative
    - k2 = 0.5 * log_r^2          biased, low variance, >= 0
    - k3 = exp(log_r) - 1 - log_r unbiased, low variance, >= 0 (used by GRPO)
    log_r is clamped to [-20, 20] in k3 so exp cannot overflow on a wild token.
    """
    log_r = ref_logprobs - logprobs
    if estimator == "k1":
        return -log_r
    if estimator == "k2":
        return 0.5 * log_r**2
    if estimator == "k3":
        log_r = torch.clamp(log_r, -20.0, 20.0)
        return torch.exp(log_r) - 1.0 - log_r
    raise ValueError(f"algorithm.klEstimator {estimator!r} is not one of k1, k2, k3")


def off_policy_weights(
    old_logprobs: Tensor,
    rollout_logprobs: Tensor,
    correction: CorrectionType,
    low: float,
    high: float,
    mask: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Per-token weights correcting for the rollout engine sampling from a slightly different policy.

    k = pi_trainer(old) / pi_rollout, computed from the trainer's recomputed old logprobs and the
    logprobs the rollout engine reported with each token.
    - tis (truncated importance sampling, Yao et al. 2025): w = min(k, high).
    - icepop (Ling team 2025): w = k inside [low, high], 0 outside: such tokens are dropped.
    - none: w = 1.
    The weights carry no gradient. stats: corrected_fraction (tokens truncated or dropped) and
    rollout_ratio_mean.
    """
    with torch.no_grad():
        ratio = torch.exp(old_logprobs - rollout_logprobs)
        if correction == "none":
            weights = torch.ones_like(ratio)
            touched = torch.zeros_like(ratio)
        elif correction == "tis":
            weights = torch.clamp(ratio, max=high)
            touched = (ratio > high).to(ratio.dtype)
        elif correction == "icepop":
            inside = (ratio >= low) & (ratio <= high)
            weights = torch.where(inside, ratio, torch.zeros_like(ratio))
            touched = (~inside).to(ratio.dtype)
        else:
            raise ValueError(f"algorithm.offPolicy.type {correction!r} is not one of none, tis, icepop")
        stats = {
            "corrected_fraction": masked_mean(touched, mask),
            "rollout_ratio_mean": masked_mean(ratio, mask),
        }
    return weights, stats


def explained_variance(predicted: Tensor, target: Tensor) -> float:
    """1 - Var[target - predicted] / Var[target]: 1 is a perfect value function, <= 0 no better than a constant.

    NaN when the target has no variance (nothing to explain), as in CleanRL and SB3.
    """
    var_target = torch.var(target, correction=0)
    if var_target.item() == 0.0:
        return float("nan")
    return float(1.0 - torch.var(target - predicted, correction=0) / var_target)
