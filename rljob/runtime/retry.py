"""One way to retry a call to a peer: exponential backoff with a cap, a deadline, and a stop event.

Every wait between attempts grows (first_delay_s, doubled each time, at most max_delay_s), so a peer that
answers at once with an error is not hammered in a busy loop; the deadline bounds the whole wait, after
which the last error is raised for the caller to report; a set `stop` event ends the wait at once.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


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
    delay = first_delay_s
    while True:
        if stop is not None and stop.is_set():
            raise InterruptedError("stopping")
        try:
            return attempt()
        except retry_on as error:
            left = deadline - clock()
            if left <= 0:
                raise
            wait = min(delay, left)
            if on_retry is not None:
                on_retry(error, wait)
            sleep(wait)
            delay = min(delay * 2, max_delay_s)
