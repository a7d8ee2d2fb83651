"""The entropy and mismatch windows against hand-computed step sequences, as `rljob run` and the operator see them."""

from __future__ import annotations

from rljob.api.spec import HealthSpec
from rljob.launch.health import (
    ENTROPY_BELOW_FLOOR,
    ENTROPY_COLLAPSED,
    MISMATCH_HIGH,
    RECOVERED,
    HealthWatch,
    Streak,
    checks,
    health_summary,
    observe,
)


def _entropy_check(floor: float = 0.1, window: int = 3):
    return checks(HealthSpec(entropy_floor=floor, window_steps=window, mismatch_kl_threshold=0))[0]


def test_entropy_below_the_floor_for_the_window_sets_the_condition_once_then_recovery_clears_it():
    check, streak = _entropy_check(), Streak()
    # steps 1..6: 0.5 0.05 0.05 0.5 0.05 0.05 -> no run of 3 yet; 7: 0.05 -> steps 5, 6, 7 below
    for step, value in [(1, 0.5), (2, 0.05), (3, 0.05), (4, 0.5), (5, 0.05), (6, 0.05)]:
        assert observe(check, streak, step, value, active=False) is None
    verdict = observe(check, streak, 7, 0.05, active=False)
    assert verdict is not None and verdict.type == ENTROPY_COLLAPSED and verdict.active
    assert verdict.reason == ENTROPY_BELOW_FLOOR
    assert verdict.message == (
        "policy entropy 0.05 at step 7, below spec.health.entropyFloor (0.1) for 3 steps (since step 5)"
    )
    assert observe(check, streak, 8, 0.04, active=True) is None  # said once, not every step
    back = observe(check, streak, 9, 0.3, active=True)
    assert back is not None and not back.active and back.reason == RECOVERED
    assert back.message == "policy entropy 0.3 is back above spec.health.entropyFloor (0.1) at step 9"


def test_a_step_seen_again_counts_nothing_and_steps_between_two_looks_count():
    check, streak = _entropy_check(window=10), Streak()
    assert observe(check, streak, 4, 0.01, active=False) is None
    for _ in range(20):  # the same step read again and again (an operator restart, a fast poll)
        assert observe(check, streak, 4, 0.01, active=False) is None
    assert streak == Streak(since=4, step=4)
    verdict = observe(check, streak, 13, 0.02, active=False)  # looks at 4 and 13: steps 4..13 are 10 steps
    assert verdict is not None and "for 10 steps (since step 4)" in verdict.message


def test_mismatch_above_the_threshold_and_a_missing_value_or_zero_threshold_do_nothing():
    watch = HealthWatch(HealthSpec(mismatch_kl_threshold=0.01, window_steps=2, entropy_floor=0))
    assert watch.observe({"step": 1, "mismatchKl": 0.2, "entropy": 0.0}) == []
    [verdict] = watch.observe({"step": 2, "mismatchKl": 0.3, "entropy": 0.0})
    assert verdict.type == MISMATCH_HIGH and verdict.active
    assert "rollout/trainer mismatch KL 0.3 at step 2, above spec.health.mismatchKlThreshold (0.01)" in verdict.message
    assert watch.active == {MISMATCH_HIGH}
    assert watch.observe({"step": 3, "mismatchKl": None}) == []  # gym actors report no mismatch
    [back] = watch.observe({"step": 4, "mismatchKl": 0.001})
    assert not back.active and watch.active == set()
    assert watch.observe(None) == []
    assert checks(HealthSpec(entropy_floor=0, mismatch_kl_threshold=0)) == []


def test_the_health_column_lists_true_conditions_in_a_fixed_order():
    assert health_summary(set()) == ""
    assert health_summary({MISMATCH_HIGH, ENTROPY_COLLAPSED}) == "EntropyCollapsed,MismatchHigh"


def test_an_actor_resumed_at_an_earlier_step_is_counted_again_from_there():
    check, streak = _entropy_check(), Streak()
    for step in (10, 11):
        observe(check, streak, step, 0.05, active=False)
    assert observe(check, streak, 8, 0.05, active=False) is None  # resumed step 8's checkpoint
    assert (streak.step, streak.since) == (8, None)
    assert observe(check, streak, 9, 0.05, active=False) is None  # steps 9.. count, not after 11 only
    assert observe(check, streak, 10, 0.05, active=False) is None
    verdict = observe(check, streak, 11, 0.05, active=False)
    assert verdict is not None and "for 3 steps (since step 9)" in verdict.message


def test_after_the_run_the_records_say_what_the_looks_missed_once_and_only_for_values_progress_reported():
    watch = HealthWatch(HealthSpec(entropy_floor=0.5, window_steps=3, mismatch_kl_threshold=0.01))
    # The only looks: step 0 (nothing trained yet) and step 6, the last (a gym actor: no mismatch KL).
    assert watch.observe({"step": 0, "entropy": None, "mismatchKl": None}) == []
    assert watch.observe({"step": 6, "entropy": 0.1, "mismatchKl": None}) == []
    # mismatch_kl stands in for a value /progress never reported: it must not fire.
    records = [{"step": step, "entropy": 0.1 if step > 2 else 0.9, "mismatch_kl": 0.9} for step in range(1, 7)]
    [verdict] = watch.settle(records)
    assert verdict.type == ENTROPY_COLLAPSED and verdict.active
    assert verdict.message == (
        "policy entropy 0.1 at step 5, below spec.health.entropyFloor (0.5) for 3 steps (since step 3)"
    )
    assert watch.active == {ENTROPY_COLLAPSED}
    assert watch.settle(records) == []  # already said


def test_a_condition_said_during_the_run_is_not_said_again_and_a_missed_recovery_is():
    watch = HealthWatch(HealthSpec(entropy_floor=0.5, window_steps=1, mismatch_kl_threshold=0))
    [collapsed] = watch.observe({"step": 2, "entropy": 0.1})
    assert collapsed.active
    records = [{"step": 1, "entropy": 0.9}, {"step": 2, "entropy": 0.1}]
    assert watch.settle(records) == []
    [back] = watch.settle([*records, {"step": 3, "entropy": 0.8}])
    assert not back.active and back.reason == RECOVERED and watch.active == set()


def test_no_look_with_a_value_settles_nothing_a_gaussian_policys_entropy_included():
    watch = HealthWatch(HealthSpec(entropy_floor=0.5, window_steps=1, mismatch_kl_threshold=0))
    assert watch.observe({"step": 1, "entropy": None}) == []  # a continuous-action actor's /progress
    assert watch.settle([{"step": step, "entropy": -3.0} for step in range(1, 9)]) == []


def test_an_llm_job_looked_at_only_before_its_first_step_still_settles_from_its_records():
    watch = HealthWatch(HealthSpec(entropy_floor=0.5, window_steps=2, mismatch_kl_threshold=0.01), llm=True)
    assert watch.observe({"step": 0, "entropy": None, "mismatchKl": None}) == []  # nothing trained yet
    records = [{"step": step, "entropy": 0.2, "mismatch_kl": 0.001} for step in range(1, 5)]
    [verdict] = watch.settle(records)
    assert verdict.type == ENTROPY_COLLAPSED and "for 2 steps (since step 1)" in verdict.message
