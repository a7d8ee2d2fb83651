"""Each RLJob may post a burst of Events, then one per refill period."""

from __future__ import annotations

from rljob.operator.eventlimit import EventBucket


def test_a_burst_passes_then_events_wait_for_the_refill() -> None:
    bucket = EventBucket(burst=3, refill_seconds=10.0)
    assert [bucket.allow(100.0) for _ in range(4)] == [True, True, True, False]
    assert bucket.allow(105.0) is False  # half a token back
    assert bucket.allow(110.5) is True
    assert bucket.allow(110.5) is False
    # A long quiet spell refills the bucket up to the burst, no further.
    assert [bucket.allow(1000.0) for _ in range(4)] == [True, True, True, False]
