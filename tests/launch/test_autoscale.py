"""The rollout autoscaling policy: bounds, proportional scale-up, cautious scale-down, cooldowns, no flapping."""

from __future__ import annotations

import pytest

from rljob.api.spec import AutoscaleSpec
from rljob.launch.autoscale import KEEP, Decision, Sample, decide, record, rewind

SPEC = AutoscaleSpec(
    min_replicas=1,
    max_replicas=6,
    target_trainer_wait=0.2,
    scale_up_cooldown_seconds=60,
    scale_down_cooldown_seconds=300,
)


def steps(*pairs: tuple[float, float | None], start: int = 1) -> list[Sample]:
    return [Sample(start + i, wait, idle) for i, (wait, idle) in enumerate(pairs)]


def test_a_trainer_waiting_above_target_adds_rollouts_in_proportion():
    decision = decide(SPEC, 3, steps((0.3, 0.0), (0.3, 0.0), (0.3, 0.0)), None, 0, 1000.0)
    # ceil(3 * 0.3 / 0.2) = 5
    assert decision.replicas == 5 and decision.direction == "Up"
    assert "waited 30% of its last 3 steps for generations (target 20%): 3 -> 5 rollouts" in decision.reason


def test_scale_up_adds_at_least_one_and_at_most_doubles_and_stops_at_max():
    assert decide(SPEC, 3, steps((0.21, 0.0), (0.21, 0.0)), None, 0, 0.0).replicas == 4  # ceil(3.15)=4
    assert decide(SPEC, 1, steps((0.9, 0.0), (0.9, 0.0)), None, 0, 0.0).replicas == 2  # not 5: doubling at most
    assert decide(SPEC, 5, steps((0.9, 0.0), (0.9, 0.0)), None, 0, 0.0).replicas == 6  # maxReplicas
    at_max = decide(SPEC, 6, steps((0.9, 0.0), (0.9, 0.0)), None, 0, 0.0)
    assert at_max.replicas == 6 and at_max.direction is None


def test_a_single_slow_step_decides_nothing_and_only_steps_after_the_last_scaling_count():
    assert decide(SPEC, 2, steps((0.9, 0.0)), None, 0, 0.0).direction is None
    # Steps 1-3 were at the old count (scaled at step 3): only step 4 is at this one.
    waiting = decide(SPEC, 4, steps((0.9, 0.0), (0.9, 0.0), (0.9, 0.0), (0.9, 0.0)), 0.0, 3, 1000.0)
    assert waiting == Decision(4, None, "waiting for 2 steps at 4 rollouts")


def test_cooldowns_hold_a_scaling_until_they_pass():
    busy = steps((0.6, 0.0), (0.6, 0.0), start=5)
    held = decide(SPEC, 2, busy, 1000.0, 4, 1059.0)
    assert held.replicas == 2 and "scale-up cooldown (60s)" in held.reason
    assert decide(SPEC, 2, busy, 1000.0, 4, 1060.0).replicas == 4
    idle = steps((0.0, 0.9), (0.0, 0.9), start=5)
    held = decide(SPEC, 3, idle, 1000.0, 4, 1299.0)
    assert held.replicas == 3 and "scale-down cooldown (300s)" in held.reason
    assert decide(SPEC, 3, idle, 1000.0, 4, 1300.0) == Decision(
        2,
        "Down",
        "the trainer waited 0% of its last 2 steps for generations (target 20%), rollouts idled 90%: 3 -> 2 rollouts",
    )


def test_scale_down_is_one_at_a_time_and_never_below_min():
    idle = steps((0.01, 0.95), (0.01, 0.95), (0.01, 0.95))
    assert decide(SPEC, 6, idle, None, 0, 0.0).replicas == 5
    floor = decide(SPEC, 1, idle, None, 0, 0.0)
    assert floor.replicas == 1 and floor.direction is None


@pytest.mark.parametrize(
    ("wait", "idle", "why"),
    [
        (0.15, 0.9, "the trainer waits, if below target: above half the target nothing moves"),
        (0.05, 0.3, "rollouts are busy most of the time"),
        (0.05, None, "no idle signal: never scale down blind"),
    ],
)
def test_the_band_between_scaling_up_and_down_holds_the_count(wait: float, idle: float | None, why: str):
    decision = decide(SPEC, 3, steps((wait, idle), (wait, idle)), None, 0, 0.0)
    assert decision.replicas == 3 and decision.direction is None, why


def test_a_scale_down_never_invites_the_next_scale_up():
    """Below half the target, one rollout fewer at most doubles the wait: still below the target."""
    idle = steps((0.099, 0.9), (0.099, 0.9))
    assert decide(SPEC, 2, idle, None, 0, 0.0).replicas == 1
    after = decide(SPEC, 1, steps((0.198, 0.1), (0.198, 0.1), start=3), 0.0, 2, 1000.0)
    assert after.replicas == 1 and after.direction is None


def test_counts_outside_the_bounds_go_back_to_them_at_once_whatever_the_cooldown():
    up = decide(SPEC, 0, [], 1000.0, 0, 1001.0)
    assert up == Decision(1, "Up", "0 rollouts is below autoscale.minReplicas 1: 0 -> 1")
    down = decide(SPEC, 9, [], 1000.0, 0, 1001.0)
    assert down == Decision(6, "Down", "9 rollouts is above autoscale.maxReplicas 6: 9 -> 6")


def test_a_hand_checked_run_grows_settles_and_shrinks_without_flapping():
    """One rollout, generation-bound; each scale-up halves the wait until it is within the target."""
    now, current, last_at, last_step = 0.0, 1, None, 0
    history: list[Sample] = []
    counts = []
    for step in range(1, 21):
        now += 30.0
        # Wait share at this count (generation spread over the rollouts); idle grows past 4 rollouts.
        wait = {1: 0.6, 2: 0.35, 3: 0.22, 4: 0.15}.get(current, 0.02)
        idle = 0.1 if current <= 4 else 0.7
        history = record(history, step, wait, idle)
        decision = decide(SPEC, current, history, last_at, last_step, now)
        if decision.direction is not None:
            current, last_at, last_step = decision.replicas, now, step
        counts.append(current)
    assert counts == [1, 2, 2] + [4] * 17


def test_record_keeps_new_steps_with_a_signal_only():
    samples = record([], 0, 0.5, 0.1)  # step 0: the actor has not stepped yet
    assert samples == []
    samples = record(samples, 1, None, None)  # a gym job, or no signal
    assert samples == []
    samples = record(samples, 1, 0.5, 0.1)
    assert record(samples, 1, 0.9, 0.1) == [Sample(1, 0.5, 0.1)]  # the same step read twice
    for step in range(2, 20):
        samples = record(samples, step, 0.5, None)
    assert len(samples) == KEEP and samples[-1].step == 19


def test_an_actor_resumed_at_an_earlier_step_is_heard_from_its_next_steps_on():
    """A restart resumed step 10's checkpoint after steps up to 14 (scaled at 13): steps 11+ decide again."""
    before = steps(*[(0.05, 0.9)] * 14)
    samples, last_scale_step = rewind(before, 10, 13)
    assert [s.step for s in samples] == list(range(1, 10)) and last_scale_step == 10
    for step in (11, 12):  # the steps after the resume, not old step 14's ghost
        samples = record(samples, step, 0.9, 0.0)
    assert decide(SPEC, 2, samples, 0.0, last_scale_step, 1000.0).direction == "Up"
    assert rewind(before, 14, 13) == (before, 13)  # the same or a later step changes nothing
