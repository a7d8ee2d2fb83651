"""Retrying a peer: backoff that doubles up to a cap, a deadline, a stop event; no busy loop (a fake clock)."""

from __future__ import annotations

import threading

import pytest

from rljob.runtime.retry import retry
from rljob.runtime.transport import RemoteError, RequestTimeout


class FakeTime:
    """A clock that only moves when the code under test sleeps: every wait is recorded."""

    def __init__(self) -> None:
        self.now = 0.0
        self.waits: list[float] = []

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.waits.append(seconds)
        self.now += seconds


class FlakyPeer:
    """Fails `failures` times with `error`, then answers; each attempt costs `cost_s` of fake time."""

    def __init__(self, time: FakeTime, failures: int, error: Exception, cost_s: float = 0.0) -> None:
        self.time, self.failures, self.error, self.cost_s = time, failures, error, cost_s
        self.attempts = 0

    def __call__(self) -> str:
        self.attempts += 1
        self.time.now += self.cost_s
        if self.attempts <= self.failures:
            raise self.error
        return "answer"


def test_an_answer_at_the_first_attempt_waits_for_nothing():
    time = FakeTime()
    peer = FlakyPeer(time, 0, RequestTimeout("slow"))
    assert retry(peer, retry_on=(RequestTimeout,), deadline_s=10, clock=time.clock, sleep=time.sleep) == "answer"
    assert peer.attempts == 1 and time.waits == []


def test_a_peer_that_fails_at_once_is_retried_with_waits_doubling_up_to_the_cap():
    """A remote error comes back immediately: without backoff this was a busy loop until the deadline."""
    time = FakeTime()
    peer = FlakyPeer(time, 6, RemoteError("RuntimeError", "env not ready"))
    result = retry(
        peer,
        retry_on=(RemoteError,),
        deadline_s=60,
        first_delay_s=0.5,
        max_delay_s=3.0,
        clock=time.clock,
        sleep=time.sleep,
    )
    assert result == "answer" and peer.attempts == 7
    assert time.waits == [0.5, 1.0, 2.0, 3.0, 3.0, 3.0]


def test_past_the_deadline_the_last_error_is_raised_and_the_last_wait_ends_at_the_deadline():
    time = FakeTime()
    peer = FlakyPeer(time, 1000, RequestTimeout("no reply"), cost_s=1.0)
    told: list[tuple[str, float]] = []
    with pytest.raises(RequestTimeout, match="no reply"):
        retry(
            peer,
            retry_on=(RequestTimeout,),
            deadline_s=10,
            first_delay_s=1.0,
            max_delay_s=4.0,
            on_retry=lambda error, wait: told.append((str(error), wait)),
            clock=time.clock,
            sleep=time.sleep,
        )
    # attempt at 0 (ends 1), wait 1; attempt at 2 (ends 3), wait 2; at 5 (ends 6), wait 4 -> trimmed to 10.
    assert time.waits == [1.0, 2.0, 4.0] and peer.attempts == 4 and time.now == 11.0
    assert told == [("no reply", 1.0), ("no reply", 2.0), ("no reply", 4.0)]


def test_an_error_not_listed_is_raised_at_once():
    time = FakeTime()
    peer = FlakyPeer(time, 3, ValueError("a bug, not a slow peer"))
    with pytest.raises(ValueError):
        retry(peer, retry_on=(RequestTimeout,), deadline_s=60, clock=time.clock, sleep=time.sleep)
    assert peer.attempts == 1 and time.waits == []


def test_a_stop_request_ends_the_wait_with_interrupted_error():
    stop = threading.Event()
    attempts = 0

    def fails_then_stop_is_requested() -> str:
        nonlocal attempts
        attempts += 1
        stop.set()  # e.g. SIGTERM arrives while the peer is down
        raise RequestTimeout("no reply")

    # The real wait (stop.wait) returns at once because stop is set: no 60 s delay is waited out.
    with pytest.raises(InterruptedError):
        retry(fails_then_stop_is_requested, retry_on=(RequestTimeout,), deadline_s=600, first_delay_s=60, stop=stop)
    assert attempts == 1
