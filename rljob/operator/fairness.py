"""A fair share of the reconcile slots across namespaces.

The operator reconciles at most `capacity` jobs at once. A plain semaphore hands freed slots out in arrival
order, so a namespace that posts 500 jobs at once queues every other namespace's jobs behind its own. Here
the waiters queue per namespace and a freed slot goes to the next namespace in turn (round robin), so one
namespace's burst delays another's first job by about one reconcile per busy namespace, not by the burst.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import OrderedDict, deque
from collections.abc import AsyncIterator


class FairSlots:
    """`async with slots.slot(namespace):` holds one of `capacity` slots, granted round robin by namespace."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be at least 1, not {capacity}")
        self.capacity = capacity
        self.busy = 0
        self.waiting: OrderedDict[str, deque[asyncio.Future[None]]] = OrderedDict()
        """Namespace -> its waiters in arrival order; the namespaces in the order they get the next slots."""

    def queued(self) -> int:
        return sum(len(waiters) for waiters in self.waiting.values())

    @contextlib.asynccontextmanager
    async def slot(self, namespace: str) -> AsyncIterator[None]:
        await self._acquire(namespace)
        try:
            yield
        finally:
            self._release()

    async def _acquire(self, namespace: str) -> None:
        if self.busy < self.capacity and not self.waiting:
            self.busy += 1
            return
        granted: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.waiting.setdefault(namespace, deque()).append(granted)
        try:
            await granted
        except asyncio.CancelledError:
            if granted.done() and not granted.cancelled():
                self._release()  # granted and cancelled in the same breath: hand the slot on
            else:
                self._drop(namespace, granted)
            raise

    def _drop(self, namespace: str, granted: asyncio.Future[None]) -> None:
        waiters = self.waiting.get(namespace)
        if waiters is None:
            return
        with contextlib.suppress(ValueError):
            waiters.remove(granted)
        if not waiters:
            del self.waiting[namespace]

    def _release(self) -> None:
        self.busy -= 1
        while self.waiting and self.busy < self.capacity:
            namespace, waiters = next(iter(self.waiting.items()))
            granted = waiters.popleft()
            # This namespace goes to the back of the line (or leaves it when it has no one else waiting).
            del self.waiting[namespace]
            if waiters:
                self.waiting[namespace] = waiters
            if not granted.done():
                self.busy += 1
                granted.set_result(None)
