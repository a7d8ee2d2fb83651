"""One way to retry a call to a peer: exponential backoff with jitter and a cap, a deadline, and a stop event.

Every wait between attempts grows (first_delay_s, doubled each time, at most max_delay_s), so a peer that
answers at once with an error is not hammered in a busy loop; each wait is drawn between half and all of its
step (jitter), so replicas that failed together do not retry together; the deadline bounds the whole wait,
after which the last error is raised for the caller to report; a set `stop` event ends the wait at once.
Loops that cannot use `retry` (they retry a whole step) take their waits from a `Backoff`.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


class Backoff:
    """Waits for a loop that retries: `next()` grows from `first_s` to `max_s`, jittered; `reset()` after a success."""

    def __init__(self, first_s: float = 0.1, max_s: float = 5.0, rng: random.Random | None = None) -> None:
        self.first_s, self.max_s = first_s, max_s
        self._step = first_s
        self._rng = rng or random.Random()

    def next(self) -> float:
        wait = self._step * (0.5 + 0.5 * self._rng.random())
        self._step = min(self._step * 2, self.max_s)
        return wait

    def reset(self) -> None:
        self._step = self.first_s


def retry(
    attempt: Callable[[], T],
    *,
    retry_on: tuple[type[Exception], ...],
    deadline_s: float,
    first_delay_s: float = 0.1,
    max_delay_s: float = 5.0,
    stop: threading.Event | None = None,
    on_retry: Callable[[Exception, float], None] | None = None,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], object] | None = None,
) -> T:
    """`attempt()`'s result, calling it again after each `retry_on` error until `deadline_s` has passed.

    Raises the last error at the deadline, any other error at once, and InterruptedError when `stop` is
    set. `on_retry(error, delay)` is told before each wait (to log it). `clock` and `sleep` are for tests;
    by default the wait is `stop.wait`, so a stop request does not wait out the delay.
    """
    if sleep is None:
        sleep = stop.wait if stop is not None else time.sleep
    deadline = clock() + deadline_s
    backoff = Backoff(first_delay_s, max_delay_s)
    while True:
        if stop is not None and stop.is_set():
            raise InterruptedError("stopping")
        try:
            return attempt()
        except retry_on as error:
            left = deadline - clock()
            if left <= 0:
                raise
            wait = min(backoff.next(), left)
            if on_retry is not None:
                on_retry(error, wait)
            sleep(wait)
