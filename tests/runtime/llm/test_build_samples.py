"""The actor turns scored groups into samples with the advantage estimator and settings of the resolved job."""

from __future__ import annotations

import numpy as np
import pytest

from rljob.api.loading import load_job_file
from rljob.api.presets import resolve_algorithm
from rljob.api.spec import AlgorithmSpec, OverlongShaping
from rljob.runtime.llm.actor import Group, build_samples, overlong_shaping


def group(rewards: list[float], lengths: list[int], loss_masks: list[list[int]] | None = None) -> Group:
    completions = []
    for i, length in enumerate(lengths):
        completion = {"token_ids": list(range(length)), "logprobs": [-1.0] * length}
        if loss_masks is not None:
            completion["loss_mask"] = loss_masks[i]
        completions.append(completion)
    return Group(row=0, prompt_ids=[1, 2], completions=completions, version=0, rewards=np.array(rewards))


def test_reinforce_pp_weighs_responses_by_their_trained_tokens():
    # Response 0 has 4 tokens but a text environment wrote one of them: 3 trained tokens, as in the hand example
    # of tests/algorithms (centred 0.5, -0.5 | 0, 0 over 3, 1 | 2, 2 tokens).
    groups = [group([1.0, 0.0], [4, 1], loss_masks=[[1, 1, 0, 1], [1]]), group([0.5, 0.5], [2, 2])]
    samples = build_samples(groups, resolve_algorithm(AlgorithmSpec(name="reinforce_pp")), group_size=2)
    advantages = [s["advantage"] for s in samples]
    assert advantages == pytest.approx(
        [0.375 / 0.330719, -0.625 / 0.330719, -0.125 / 0.330719, -0.125 / 0.330719], abs=1e-5
    )


def test_normalize_advantages_false_gives_grpo_the_centred_rewards():
    groups = [group([1.0, 0.0, 0.0, 0.0], [1, 1, 1, 1])]
    scaled = build_samples(groups, resolve_algorithm(AlgorithmSpec(name="grpo")), group_size=4)
    centred = build_samples(
        groups, resolve_algorithm(AlgorithmSpec(name="grpo", normalize_advantages=False)), group_size=4
    )
    assert [s["advantage"] for s in scaled] == pytest.approx([1.5, -0.5, -0.5, -0.5], abs=1e-5)
    assert [s["advantage"] for s in centred] == pytest.approx([0.75, -0.25, -0.25, -0.25])


def test_a_multi_turn_episode_is_penalised_for_its_length_against_the_episode_s_budget_not_one_turn_s():
    """The calculator: maxTokens 16 caps each turn, maxResponseLength 32 the episode. An episode of 20 tokens
    (two turns and a reply) is well inside it; the penalty ramps over the buffer's last 6 tokens before 32."""
    from pathlib import Path

    spec = load_job_file(Path(__file__).parents[3] / "examples" / "grpo-tiny-calculator.yaml").spec
    spec.algorithm.overlong = OverlongShaping(buffer=6)
    assert overlong_shaping(spec, [10, 20, 26, 29, 32]) == pytest.approx([0.0, 0.0, 0.0, -0.5, -1.0])
    spec.task.llm.env = None  # single turn: a response is at most one call's maxTokens
    assert overlong_shaping(spec, [10, 13, 16]) == pytest.approx([0.0, -0.5, -1.0])
    spec.algorithm.overlong = None
    assert overlong_shaping(spec, [16]) == pytest.approx([0.0])
