"""`rljob run` says when a job stops completing steps, with what the actor reports, and when it recovers."""

from __future__ import annotations

from rljob.launch.stall import PROGRESSING, STALLED, StallWatch, stalled_message


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_no_step_within_the_deadline_is_said_once_with_the_reason_then_recovery_is_said():
    clock = Clock()
    watch = StallWatch(60, clock=clock)
    assert watch.observe(None, 150, "") is None  # the actor is not up yet: the clock runs from here
    clock.now += 30
    assert watch.observe(0, 150, "") is None
    clock.now += 31
    kind, message = watch.observe(0, 150, "weight sync: rollout(s) [0] did not accept weights version 0")
    assert kind == STALLED
    assert message.startswith("no training step for 61s (spec.failurePolicy.progressDeadlineSeconds: 60)")
    assert "before its first step (of 150)" in message and "did not accept weights version 0" in message
    clock.now += 100
    assert watch.observe(0, 150, "still") is None  # said once, not at every poll
    assert watch.observe(1, 150, "") == (PROGRESSING, "training resumed at step 1")
    clock.now += 59
    assert watch.observe(1, 150, "") is None


def test_steps_that_keep_coming_never_stall_and_zero_turns_the_check_off():
    clock = Clock()
    watch, off = StallWatch(10, clock=clock), StallWatch(0, clock=clock)
    for step in range(20):
        clock.now += 9
        assert watch.observe(step, 20, "") is None
        assert off.observe(0, 20, "") is None


def test_the_message_names_the_step_and_says_when_the_actor_gives_no_reason():
    assert "at step 7 of 10" in stalled_message(900, 900, 7, 10, "")
    assert "the actor reports no reason" in stalled_message(900, 900, 7, 10, "")
