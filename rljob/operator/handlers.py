"""kopf handlers: thin. They hand every RLJob and ResourceQuota event to the controller.

No kopf finalizers, annotations or progress storage on RLJobs: the handlers only watch (`on.event`), so
deleting an RLJob never waits for the operator, and the children go with it through their owner references.
A restarted operator sees every existing job as an initial-listing event (kopf's resume); the controller's
pod cache (podcache.py) has listed every existing pod before a job's first reconcile.
"""

from __future__ import annotations

from typing import Any

import kopf

from rljob.api import GROUP, PLURAL, VERSION
from rljob.operator.controller import Controller


def register(registry: kopf.OperatorRegistry) -> None:
    """Add the operator's handlers to a kopf registry; the Controller comes in through `memo.controller`.
    Pods are not among them: the controller keeps its own cache of them (podcache.py)."""

    @kopf.on.event(GROUP, VERSION, PLURAL, registry=registry, id="rljob-changed")
    async def rljob_changed(event: kopf.RawEvent, memo: kopf.Memo, **_: Any) -> None:
        controller: Controller = memo.controller
        controller.job_event(event["type"], dict(event["object"]))

    @kopf.on.event("v1", "resourcequotas", registry=registry, id="quota-changed")
    async def quota_changed(namespace: str, memo: kopf.Memo, **_: Any) -> None:
        """Jobs waiting for quota (Ready=False QuotaExceeded) look again when a quota or its usage changes."""
        controller: Controller = memo.controller
        controller.quota_changed(namespace)

    @kopf.on.cleanup(registry=registry, id="stop-workers")
    async def stop_workers(memo: kopf.Memo, **_: Any) -> None:
        """Stop the job workers and close connections while kopf shuts down: kopf waits for leftover tasks."""
        controller: Controller = memo.controller
        await controller.stop()


class NoDiffBase(kopf.DiffBaseStorage):
    """kopf's diff base for handlers that only watch: none. kopf builds the "essence" of every object on every
    event (a deep copy of the body, twice, and the progress annotations cleared from it) to find the changes
    that `on.create`/`on.update`/`on.field` and daemons react to. This operator registers none of those
    (`watch_only` checks), so the essence is never read: at 1,000 jobs x 8 pods those copies were a third of
    the operator's CPU time."""

    def build(self, *, body: kopf.Body, extra_fields: Any = None) -> kopf.BodyEssence:
        return kopf.BodyEssence()

    def fetch(self, *, body: kopf.Body) -> kopf.BodyEssence | None:
        return kopf.BodyEssence()

    def store(self, *, body: kopf.Body, patch: kopf.Patch, essence: kopf.BodyEssence) -> None:
        return None


def watch_only(registry: kopf.OperatorRegistry) -> bool:
    """Whether every handler of `registry` only watches or indexes (so `NoDiffBase` loses nothing)."""
    return not registry._changing.get_all_handlers() and not registry._spawning.get_all_handlers()
