"""Reconcile slots are shared fairly: one namespace's burst does not queue another namespace's first job."""

from __future__ import annotations

import asyncio

import pytest

from rljob.operator.fairness import FairSlots


async def _hold(slots: FairSlots, namespace: str, order: list[str], release: asyncio.Event) -> None:
    async with slots.slot(namespace):
        order.append(namespace)
        await release.wait()


async def test_a_freed_slot_goes_to_the_next_namespace_in_turn_not_to_the_longest_queue() -> None:
    slots = FairSlots(capacity=1)
    order: list[str] = []
    releases = [asyncio.Event() for _ in range(7)]
    tasks = [asyncio.create_task(_hold(slots, "busy", order, releases[i])) for i in range(5)]
    await asyncio.sleep(0)
    tasks.append(asyncio.create_task(_hold(slots, "quiet", order, releases[5])))
    tasks.append(asyncio.create_task(_hold(slots, "other", order, releases[6])))
    await asyncio.sleep(0)
    assert order == ["busy"] and slots.queued() == 6
    for i in (0, 1, 5, 6, 2, 3, 4):  # release whoever holds the slot, in the order they got it
        releases[i].set()
        await asyncio.sleep(0)
        await asyncio.sleep(0)
    await asyncio.gather(*tasks)
    # The busy namespace was in line first: its next job goes, then quiet's and other's, then busy's rest.
    # The quiet namespace's job waited for two busy passes, not for all five.
    assert order == ["busy", "busy", "quiet", "other", "busy", "busy", "busy"]
    assert slots.busy == 0 and slots.queued() == 0


async def test_up_to_capacity_passes_run_at_once_and_a_cancelled_waiter_leaves_no_slot_taken() -> None:
    slots = FairSlots(capacity=2)
    order: list[str] = []
    release = asyncio.Event()
    holders = [asyncio.create_task(_hold(slots, "a", order, release)) for _ in range(2)]
    waiter = asyncio.create_task(_hold(slots, "b", order, release))
    await asyncio.sleep(0)
    assert order == ["a", "a"] and slots.queued() == 1
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert slots.queued() == 0
    release.set()
    await asyncio.gather(*holders)
    assert slots.busy == 0
    async with slots.slot("c"):
        assert slots.busy == 1


def test_a_capacity_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="capacity must be at least 1"):
        FairSlots(0)
