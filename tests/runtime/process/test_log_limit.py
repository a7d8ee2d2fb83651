"""Retry loops log one line per distinct reason per interval, then say how many they held back."""

from __future__ import annotations

import logging

from rljob.runtime.process.log_limit import LimitedLog, reason_of


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_reason_repeated_within_the_interval_is_counted_not_logged(caplog):
    clock = Clock()
    log = LimitedLog(logging.getLogger("test.limited"), interval_s=30, clock=clock)
    with caplog.at_level(logging.WARNING, logger="test.limited"):
        for _ in range(1000):  # a busy loop's worth of the same failure
            log.warning("fetch:WeightsMissing", "rollout request failed (%s)", "weights missing")
            clock.now += 0.01
        clock.now = 31
        log.warning("fetch:WeightsMissing", "rollout request failed (%s)", "weights missing")
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2
    assert lines[0] == "rollout request failed (weights missing)"
    assert lines[1].startswith("rollout request failed (weights missing) (and 999 more like it in the last 31s)")


def test_distinct_reasons_each_get_their_line(caplog):
    log = LimitedLog(logging.getLogger("test.limited2"), interval_s=30, clock=Clock())
    with caplog.at_level(logging.WARNING, logger="test.limited2"):
        assert log.warning("a", "first reason")
        assert log.warning("b", "second reason")
        assert not log.warning("a", "first reason again")
    assert [r.getMessage() for r in caplog.records] == ["first reason", "second reason"]


def test_the_reason_of_an_error_ignores_its_numbers():
    assert reason_of(RuntimeError("weights version 3 round 17")) == reason_of(
        RuntimeError("weights version 4 round 18")
    )
    assert reason_of(RuntimeError("a")) != reason_of(ValueError("a"))
