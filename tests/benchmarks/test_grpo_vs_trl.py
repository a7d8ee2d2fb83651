"""The GRPO benchmark's TRL side computes rljob's reward and refuses settings it cannot reproduce; its sides,
seed summary and update roofline are computed as documented."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.grpo_vs_trl import (
    ASYNC_OVERRIDES,
    load_spec,
    seconds_to,
    side_settings,
    summarize,
    trl_reward_functions,
    trl_settings,
    update_roofline,
)
from rljob.runtime.llm.episodes.rewards import RewardScorer

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


def test_an_async_side_runs_the_same_engine_one_version_stale_with_a_valid_manifest():
    assert side_settings("rljob_hf") == ("hf", [])
    assert side_settings("rljob_vllm_async") == ("vllm", list(ASYNC_OVERRIDES))
    spec = load_spec(EXAMPLE, list(ASYNC_OVERRIDES)).spec
    assert spec.rollout.async_.max_staleness == 1 and spec.algorithm.off_policy.type == "tis"


def _run(seed, rate, held_out, train_s=2.0):
    return {
        "seed": seed,
        "completions_per_s": rate,
        "heldout_greedy_accuracy": held_out,
        "train_accuracy_last": held_out,
        "update_roofline": {"share_of_roof": 0.5},
        "seconds_to_accuracy": {"0.5": 10.0 + seed, "0.8": None if seed else 30.0},
        "time_s": {"train": train_s},
    }


def test_the_summary_pairs_each_rljob_run_with_trls_run_of_the_same_seed():
    runs = {
        "rljob_hf": [_run(0, 1500.0, 0.9), _run(1, 1200.0, 0.8)],
        "trl": [_run(1, 1000.0, 0.7), _run(0, 1000.0, 0.8)],
    }
    summary = summarize(runs)
    ratio = summary["rljob_hf"]["ratio_completions_per_s_vs_trl"]
    assert ratio["mean"] == pytest.approx(1.35) and (ratio["min"], ratio["max"]) == (1.2, 1.5)
    assert summary["rljob_hf"]["heldout_greedy_accuracy"]["mean"] == pytest.approx(0.85)
    assert summary["trl"]["completions_per_s"]["std"] == 0.0
    assert "ratio_completions_per_s_vs_trl" not in summary["trl"]
    assert summary["rljob_hf"]["seconds_to_accuracy_0.5"]["mean"] == pytest.approx(10.5)
    assert summary["rljob_hf"]["seconds_to_accuracy_0.8"]["reached"] == "1 of 2 seeds"


def test_seconds_to_accuracy_is_the_first_point_of_the_smoothed_curve_at_each_target():
    curve = [(100, 0.1), (200, 0.55), (300, 0.4), (400, 0.81)]
    assert seconds_to(curve, [1.0, 2.0, 3.0, 4.0]) == {"0.5": 2.0, "0.8": 4.0}
    assert seconds_to(curve[:3], [1.0, 2.0, 3.0]) == {"0.5": 2.0, "0.8": None}


def test_the_update_roofline_counts_six_flops_per_weight_and_trained_token():
    result = {**_run(0, 1.0, 0.5, train_s=16.0), "response_tokens": 500}
    roof = update_roofline(result, parameters=1000, prompt_tokens=1500, passes=6, rate=1e6)
    assert roof["flops"] == 6 * 1000 * 2000
    assert roof["ideal_s"] == pytest.approx(12.0)
    assert roof["share_of_roof"] == pytest.approx(0.75)  # 12 s of FLOPs at the roof took 16 s
    assert update_roofline({**result, "response_tokens": None}, 1000, 1500, 6, 1e6) is None
