"""Keeps the job workers still while kopf's peering has paused this operator (a hot standby).

kopf pauses its watch streams when another live operator of the same peering name has a higher priority
(or the same one: then kopf pauses every operator). The controller's job workers do not run on kopf's
streams alone: their own timers (resync, back-off, TTL) wake them, and a paused replica would go on
creating and deleting pods beside the active one. The gate reads the peering objects kopf keeps alive
(`ClusterKopfPeering` for an all-namespaces operator, `KopfPeering` in each served namespace), applies
kopf's rule to them with this operator's identity and priority, and the workers do nothing while it says
"standby". The identity is the one kopf runs with (passed to `kopf.operator`), so the gate sees itself in
the same record kopf writes.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import os
import socket
import uuid
from collections.abc import Callable, Iterable
from typing import Any

from rljob.operator.client import ApiError, KubeClient

logger = logging.getLogger(__name__)

PEERING_API_VERSION = "kopf.dev/v1"
CLUSTER_PEERING = "ClusterKopfPeering"
NAMESPACED_PEERING = "KopfPeering"


def new_identity() -> str:
    """This operator's peering identity: the pod name when the chart sets POD_ID, unique anyway."""
    base = os.environ.get("POD_ID") or socket.gethostname()
    return f"{base}-rljob-{uuid.uuid4().hex[:8]}"


def _parse_time(value: Any) -> datetime.datetime | None:
    if not isinstance(value, str):
        return None
    try:
        parsed = datetime.datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return None
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=datetime.UTC)


def standby_reason(peering: dict[str, Any], identity: str, priority: int, now: datetime.datetime) -> str | None:
    """Why this operator must stand by according to one peering object (kopf's rule), or None.

    `status` maps each operator's identity to {priority, lifetime, lastseen}; a peer is live until
    lastseen + lifetime. A live peer with a higher priority wins; one with the same priority pauses both."""
    peers = peering.get("status") or {}
    for peer_id, info in sorted(peers.items()):
        if peer_id == identity or not isinstance(info, dict):
            continue
        lastseen = _parse_time(info.get("lastseen")) or now
        if lastseen + datetime.timedelta(seconds=int(info.get("lifetime", 60))) <= now:
            continue  # dead: kopf cleans it up
        peer_priority = int(info.get("priority", 0))
        if peer_priority > priority:
            return f"operator {peer_id} has a higher peering priority ({peer_priority} > {priority})"
        if peer_priority == priority:
            return f"operator {peer_id} has the same peering priority ({priority}): kopf pauses both"
    return None


class PeeringGate:
    """Whether this operator stands by; refreshed from the peering objects every `poll_seconds`."""

    def __init__(
        self,
        client: KubeClient,
        name: str,
        identity: str,
        priority: int,
        clusterwide: bool,
        poll_seconds: float = 5.0,
        clock: Callable[[], datetime.datetime] = lambda: datetime.datetime.now(tz=datetime.UTC),
    ) -> None:
        self.client = client
        self.name = name
        self.identity = identity
        self.priority = priority
        self.clusterwide = clusterwide
        self.poll_seconds = poll_seconds
        self.clock = clock
        self.reason: str | None = None
        self.checked = asyncio.Event()
        """Set after the first check: until then the operator stands by (it may be the standby)."""
        self.versions: dict[str | None, str] = {}
        """Scope (namespace, None for the cluster) -> the resourceVersion its peering object was read at."""

    @property
    def paused(self) -> bool:
        return self.reason is not None or not self.checked.is_set()

    def _kind(self) -> str:
        return CLUSTER_PEERING if self.clusterwide else NAMESPACED_PEERING

    async def _read(self, namespace: str | None) -> dict[str, Any] | None:
        # A LIST by name, not a GET: it also gives the version to watch from, whether the object exists or not
        # (none yet: nobody else announced itself).
        peering, version = await self.client.list_named(PEERING_API_VERSION, self._kind(), namespace, self.name)
        self.versions[namespace] = version
        return peering

    async def refresh(self, namespaces: Iterable[str]) -> bool:
        """Re-read the peering objects; True when the standby state changed."""
        scopes: list[str | None] = [None] if self.clusterwide else sorted(set(namespaces))
        self.versions = {}
        reason = None
        for scope in scopes:
            peering = await self._read(scope)
            if peering is not None:
                reason = reason or standby_reason(peering, self.identity, self.priority, self.clock())
        changed = reason != self.reason or not self.checked.is_set()
        if reason != self.reason:
            if reason is not None:
                logger.info("peering %s: standing by, job workers paused: %s", self.name, reason)
            else:
                logger.info("peering %s: active, job workers resume", self.name)
        self.reason = reason
        self.checked.set()
        return changed

    async def run(self, namespaces: Callable[[], Iterable[str]], on_change: Callable[[], None]) -> None:
        """Read, then watch the peering objects until one changes (kopf pauses the moment a peer appears in
        them, so the workers must stop then too) or `poll_seconds` pass; until cancelled. `on_change` runs after
        each change of the standby state."""
        while True:
            try:
                if await self.refresh(namespaces()):
                    on_change()
            except ApiError as exc:
                logger.warning("peering %s: cannot read the peering object, state kept: %s", self.name, exc)
                await asyncio.sleep(self.poll_seconds)
                continue
            await self.wait_for_change()

    async def wait_for_change(self) -> None:
        """Until a peering object read by the last refresh changes, or `poll_seconds` pass."""
        watches = [
            asyncio.create_task(
                self.client.watch_named(PEERING_API_VERSION, self._kind(), scope, self.name, version, self.poll_seconds)
            )
            for scope, version in self.versions.items()
        ]
        if not watches:
            await asyncio.sleep(self.poll_seconds)
            return
        started = asyncio.get_running_loop().time()
        try:
            pending = set(watches)
            while pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                if any(not t.cancelled() and t.exception() is None and t.result() for t in done):
                    return  # a change: read again now
                if any(t.exception() is not None for t in done if not t.cancelled()):
                    break  # the watch failed: fall back to waiting out the poll interval
            left = self.poll_seconds - (asyncio.get_running_loop().time() - started)
            if left > 0:
                await asyncio.sleep(left)
        finally:
            for task in watches:
                task.cancel()
            await asyncio.gather(*watches, return_exceptions=True)
