"""Retrying a peer: jittered backoff that doubles up to a cap, a deadline, a stop event; no busy loop (a fake clock)."""

from __future__ import annotations

import threading

import pytest

from rljob.runtime.process.retry import Backoff, retry
from rljob.runtime.wire.transport import RemoteError, RequestTimeout


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
    assert_jittered(time.waits, [0.5, 1.0, 2.0, 3.0, 3.0, 3.0])


def assert_jittered(waits: list[float], steps: list[float]) -> None:
    """Each wait lies between half and all of its step: replicas that failed together do not retry together."""
    assert len(waits) == len(steps)
    for wait, step in zip(waits, steps, strict=True):
        assert step / 2 <= wait <= step


def test_backoff_grows_to_its_cap_with_jitter_and_starts_over_after_a_reset():
    backoff = Backoff(first_s=0.1, max_s=1.0)
    assert_jittered([backoff.next() for _ in range(6)], [0.1, 0.2, 0.4, 0.8, 1.0, 1.0])
    backoff.reset()
    assert_jittered([backoff.next()], [0.1])
    spread = {round(Backoff(1.0, 1.0).next(), 6) for _ in range(50)}
    assert len(spread) > 10  # not the same wait for every replica


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
    # Each attempt costs 1 s; waits of (jittered) 1, 2, 4, 4 ... never past the deadline (the last one is trimmed to
    # end at it), and the first attempt that ends past it raises: none starts after the deadline.
    assert 10.0 <= time.now <= 11.0 and peer.attempts == len(time.waits) + 1
    ends, now = [], 0.0
    for wait in time.waits:
        now += 1.0 + wait  # an attempt, then the wait after it
        ends.append(now)
    assert all(end <= 10.0 + 1e-9 for end in ends), ends
    assert_jittered(time.waits[:-1], [1.0, 2.0, 4.0, 4.0][: len(time.waits) - 1])
    assert [wait for _, wait in told] == time.waits and all(error == "no reply" for error, _ in told)


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
