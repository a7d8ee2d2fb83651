"""The request deadline follows a role's observed latency; late replicas are named, listed and rejoin."""

from __future__ import annotations

import logging

import pytest

from rljob.runtime.wire.deadlines import FIRST_S, MIN_SAMPLES, LatencyDeadline, LateReplicas
from rljob.runtime.wire.role_http import ProgressTracker


def test_the_first_deadline_holds_until_enough_answers_were_seen():
    deadline = LatencyDeadline("reward")
    for _ in range(MIN_SAMPLES - 1):
        deadline.observe(0.5)
    assert deadline.seconds() == FIRST_S
    deadline.observe(0.5)
    assert deadline.seconds() == 10.0  # 5 x 0.5 s is under the floor


def test_the_deadline_is_a_multiple_of_the_95th_percentile_of_recent_latencies():
    deadline = LatencyDeadline("rollout", floor_s=1.0, window=20)
    for seconds in [1.0] * 18 + [3.0, 40.0]:
        deadline.observe(seconds)
    # p95 of 20 latencies is the 19th smallest (3 s): one outlier does not set the pace.
    assert deadline.seconds() == pytest.approx(15.0)
    for _ in range(20):  # the job got slower: the old latencies leave the window
        deadline.observe(4.0)
    assert deadline.seconds() == pytest.approx(20.0)


def test_the_spec_override_replaces_the_derived_deadline_and_bad_latencies_are_ignored():
    deadline = LatencyDeadline("env", override=2.5)
    for seconds in [100.0] * 10:
        deadline.observe(seconds)
    assert deadline.seconds() == 2.5
    derived = LatencyDeadline("env", floor_s=0.1)
    for seconds in [float("nan"), -1.0, float("inf")] + [0.2] * MIN_SAMPLES:
        derived.observe(seconds)
    assert derived.seconds() == pytest.approx(1.0)


def test_a_late_replica_is_named_once_per_interval_listed_in_progress_and_rejoins(caplog):
    now = [100.0]
    late = LateReplicas(logging.getLogger("test.late"), clock=lambda: now[0], log_interval_s=30)
    tracker = ProgressTracker(total_steps=10, step=3, issue=late.issue, late=late.snapshot)
    caplog.set_level(logging.INFO, logger="test.late")
    now[0] = 145.0
    late.late("reward-0", since=100.0, moved_to=["reward-1"])
    late.late("reward-0", since=120.0, moved_to=["reward-1"])  # still the first request's silence
    assert [r.getMessage() for r in caplog.records] == ["reward-0 has not answered for 45 s; its work goes to reward-1"]
    payload = tracker.snapshot().to_json()
    assert payload["lateReplicas"] == [{"replica": "reward-0", "seconds": 45.0}]
    assert payload["issue"] == "reward-0 has not answered for 45 s (its work goes to reward-1)"
    now[0] = 180.0
    late.late("reward-0", since=100.0, moved_to=[])
    assert (
        caplog.records[-1]
        .getMessage()
        .startswith("reward-0 has not answered for 80 s; no other replica can take its work: waiting")
    )
    assert late.answered("reward-0") and not late.answered("reward-0")
    assert caplog.records[-1].getMessage() == "reward-0 answers again after 80 s; it takes work again"
    payload = tracker.snapshot().to_json()
    assert "lateReplicas" not in payload and "issue" not in payload
    now[0] = 190.0
    late.late("reward-0", since=185.0, moved_to=["reward-1"])  # late again: named at once, a new silence
    assert caplog.records[-1].getMessage() == "reward-0 has not answered for 5 s; its work goes to reward-1"
