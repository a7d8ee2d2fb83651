"""Each algorithm's defaults as its paper states them; a field the user sets always wins over its preset.

The preset fields of `spec.algorithm` default to unset (None) in the model and in the CRD, so an unset field
can be told from one set to the preset's value even after the API server stored the object. `resolve_algorithm`
fills the unset ones; `departures` lists what a resolved algorithm sets otherwise, for `rljob validate`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from rljob.api.spec import OFFLINE_STAGES, AlgorithmName, AlgorithmSpec, OverlongShaping

Aggregation = Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]

OVERLONG_BUFFER_SHARE = 0.2
"""DAPO's overlong buffer as a share of the response budget: 4096 of 20480 tokens (Yu et al. 2025, sec. 4.1)."""


@dataclass(frozen=True)
class AlgorithmPreset:
    """The settings an algorithm's paper trains with."""

    loss_aggregation: Aggregation
    clip_ratio_low: float
    clip_ratio_high: float
    kl_coef: float
    normalize_advantages: bool
    """Scale advantages by a standard deviation (which one depends on the estimator)."""
    dynamic_sampling: bool
    overlong: bool
    """DAPO's overlong shaping, with a buffer of `OVERLONG_BUFFER_SHARE` of task.llm.maxResponseLength."""
    reference: str


PRESETS: dict[AlgorithmName, AlgorithmPreset] = {
    "ppo": AlgorithmPreset(
        "token-mean", 0.2, 0.2, 0.0, True, False, False, "Schulman et al. 2017, PPO (arXiv:1707.06347)"
    ),
    # DeepSeekMath sec. 4.1-4.2: 1/G sum_i 1/|o_i| sum_t (eq. 3), eps 0.2, beta 0.04 with the k3 estimator.
    "grpo": AlgorithmPreset(
        "seq-mean-token-mean", 0.2, 0.2, 0.04, True, False, False, "Shao et al. 2024, DeepSeekMath (arXiv:2402.03300)"
    ),
    # Dr. GRPO sec. 3.2: no std scaling, token sums over a constant length, no KL term.
    "dr_grpo": AlgorithmPreset(
        "seq-mean-token-sum-norm",
        0.2,
        0.2,
        0.0,
        False,
        False,
        False,
        "Liu et al. 2025, Understanding R1-Zero-Like Training (arXiv:2503.20783)",
    ),
    # DAPO sec. 3: clip-higher (0.2 / 0.28), dynamic sampling, token-level loss, overlong shaping; no KL.
    "dapo": AlgorithmPreset("token-mean", 0.2, 0.28, 0.0, True, True, True, "Yu et al. 2025, DAPO (arXiv:2503.14476)"),
    # RLOO treats the whole response as one action: the loss sums its tokens' log-probabilities.
    "rloo": AlgorithmPreset(
        "seq-mean-token-sum",
        0.2,
        0.2,
        0.0,
        False,
        False,
        False,
        "Ahmadian et al. 2024, Back to Basics (arXiv:2402.14740)",
    ),
    # REINFORCE++ eq. 10: advantages normalised over every token of the global batch; PPO clip 0.2.
    "reinforce_pp": AlgorithmPreset(
        "token-mean", 0.2, 0.2, 0.0, True, False, False, "Hu et al. 2025, REINFORCE++ (arXiv:2501.03262)"
    ),
    # GSPO sec. 4.1: sequence-level ratio, 1/G sum over sequences, clip ranges 3e-4 / 4e-4.
    "gspo": AlgorithmPreset(
        "seq-mean-token-mean", 3e-4, 4e-4, 0.0, True, False, False, "Zheng et al. 2025, GSPO (arXiv:2507.18071)"
    ),
    # MiniMax-M1 sec. 3.1: token-level normalisation as DAPO, with DAPO's dynamic sampling and length penalty. The
    # paper tunes only the upper IS-weight bound without stating it: DAPO's 0.28 stands in.
    "cispo": AlgorithmPreset(
        "token-mean", 0.2, 0.28, 0.0, True, True, True, "MiniMax 2025, MiniMax-M1 / CISPO (arXiv:2506.13585)"
    ),
    # On-policy distillation: the per-token signal is the teacher's, unnormalised (GKD, arXiv:2306.13649; Thinking
    # Machines' on-policy distillation, 2025); PPO's clip bounds each update, no KL to the starting policy.
    "distill": AlgorithmPreset(
        "token-mean", 0.2, 0.2, 0.0, False, False, False, "Agarwal et al. 2024, GKD (arXiv:2306.13649)"
    ),
}
"""The paper defaults of every RL `spec.algorithm.name`."""

OFFLINE_PRESET = AlgorithmPreset("token-mean", 0.2, 0.2, 0.0, False, False, False, "offline post-training stage")
"""The RL fields of an offline stage (sft, dpo, reward_model): filled so every resolved job reads complete, used by
none of them."""


def preset_of(name: str) -> AlgorithmPreset:
    """The preset of an RL algorithm, or the neutral one of an offline stage."""
    return OFFLINE_PRESET if name in OFFLINE_STAGES else PRESETS[name]  # type: ignore[index]


PRESET_FIELDS: tuple[tuple[str, str], ...] = (
    ("loss_aggregation", "lossAggregation"),
    ("clip_ratio_low", "clipRatioLow"),
    ("clip_ratio_high", "clipRatioHigh"),
    ("kl_coef", "klCoef"),
    ("normalize_advantages", "normalizeAdvantages"),
    ("dynamic_sampling", "dynamicSampling"),
)
"""Scalar preset fields: (attribute, manifest key)."""


def overlong_buffer(max_response_length: int) -> int:
    """DAPO's buffer for a response budget: a fifth of it, at least one token."""
    return max(1, int(max_response_length * OVERLONG_BUFFER_SHARE))


def resolve_algorithm(algorithm: AlgorithmSpec, max_response_length: int | None = None) -> AlgorithmSpec:
    """`algorithm` with every unset preset field filled from its paper; fields already set are kept.

    `max_response_length` (the longest response: task.llm.maxResponseLength, or a shorter rollout.maxTokens of a
    single-turn task; None for gym tasks) sizes the overlong buffer: without
    it, or when the budget is too short for a buffer, the overlong preset stays off.
    """
    preset = preset_of(algorithm.name)
    resolved = algorithm.model_copy(deep=True)
    for attribute, _ in PRESET_FIELDS:
        if getattr(resolved, attribute) is None:
            setattr(resolved, attribute, getattr(preset, attribute))
    overlong = resolved.overlong
    if overlong is None and preset.overlong and max_response_length is not None and max_response_length >= 2:
        resolved.overlong = OverlongShaping(buffer=overlong_buffer(max_response_length))
    elif overlong is not None and overlong.enabled and overlong.buffer is None and max_response_length is not None:
        overlong.buffer = overlong_buffer(max_response_length)
    return resolved


def departures(algorithm: AlgorithmSpec) -> list[tuple[str, object, object]]:
    """(manifest key, value, paper value) of each setting of a resolved algorithm that departs from its preset (none
    for an offline stage, which reads none of them)."""
    if algorithm.name in OFFLINE_STAGES:
        return []
    preset = PRESETS[algorithm.name]
    found: list[tuple[str, object, object]] = [
        (key, getattr(algorithm, attribute), getattr(preset, attribute))
        for attribute, key in PRESET_FIELDS
        if getattr(algorithm, attribute) != getattr(preset, attribute)
    ]
    shaping = algorithm.overlong is not None and algorithm.overlong.enabled
    if shaping != preset.overlong:
        found.append(("overlong", "on" if shaping else "off", "on" if preset.overlong else "off"))
    return found
