"""The GRPO benchmark's TRL side computes rljob's reward and refuses settings it cannot reproduce."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.grpo_vs_trl import load_spec, trl_reward_functions, trl_settings
from rljob.runtime.llm.rewards import RewardScorer

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "grpo-tiny-arithmetic.yaml"


def test_trl_reward_functions_sum_to_the_reward_rljobs_scorer_gives():
    spec = load_spec(EXAMPLE, []).spec
    functions, weights = trl_reward_functions(spec)
    assert [f.__name__ for f in functions] == ["exact_match", "format"]
    assert weights == [1.0, 0.2]
    answers = ["7", "7", "7", "7", "7", "7", "12", "0", "7"]
    responses = ["7", " 7", "7\n", "3", "77", "x", "12", "", "7.0"]
    prompts = ["3+4="] * len(answers)
    terms = [f(prompts, responses, answer=answers) for f in functions]
    trl_total = [sum(w * t[i] for w, t in zip(weights, terms, strict=True)) for i in range(len(responses))]
    scorer = RewardScorer(spec.reward, answer_key=spec.task.llm.dataset.answer_key)
    try:
        scored = scorer.score(
            [
                {
                    "prompt": p,
                    "response": r,
                    "row": {"prompt": p, "answer": a},
                    "finish_reason": "stop",
                    "response_tokens": 2,
                }
                for p, r, a in zip(prompts, responses, answers, strict=True)
            ]
        )
    finally:
        scorer.close()
    assert trl_total == pytest.approx(scored.rewards)
    assert terms == [scored.terms["exact_match"], scored.terms["format"]]
    assert len(set(trl_total)) > 2  # right, right-but-unformatted and wrong answers all occur


@pytest.mark.parametrize(
    ("override", "field"),
    [
        ("spec.algorithm.lossAggregation=seq-mean-token-sum", "spec.algorithm.lossAggregation"),
        ("spec.rollout.async.maxStaleness=1", "spec.rollout.async.maxStaleness"),
        ("spec.algorithm.name=rloo", "spec.algorithm.name"),
    ],
)
def test_trl_settings_refuse_what_grpotrainer_cannot_reproduce(override, field):
    spec = load_spec(EXAMPLE, [override]).spec
    with pytest.raises(SystemExit, match=field):
        trl_settings(spec)
