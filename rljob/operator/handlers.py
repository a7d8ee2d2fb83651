"""kopf handlers: thin. They keep the pod index and hand every event to the controller.

No kopf finalizers, annotations or progress storage on RLJobs: the handlers only watch (`on.event`,
`index`), so deleting an RLJob never waits for the operator, and the children go with it through
their owner references. A restarted operator sees every existing job as an initial-listing event
(kopf's resume) and every existing pod in the index before the first reconcile.
"""

from __future__ import annotations

from typing import Any

import kopf

from rljob.api import GROUP, PLURAL, VERSION
from rljob.operator.controller import Controller
from rljob.operator.naming import LABEL_JOB

POD_INDEX = "rljob_pods"


def compact_pod(body: kopf.Body) -> dict[str, Any]:
    """What the controller reads from a pod; the index keeps only this (pod specs are large)."""
    meta = body.get("metadata", {})
    keep = (
        "name",
        "namespace",
        "uid",
        "labels",
        "annotations",
        "ownerReferences",
        "deletionTimestamp",
        "deletionGracePeriodSeconds",
        "resourceVersion",
    )
    return {
        "metadata": {k: meta[k] for k in keep if k in meta},
        "spec": {"nodeName": body.get("spec", {}).get("nodeName")},
        "status": dict(body.get("status", {})),
    }


def register(registry: kopf.OperatorRegistry) -> None:
    """Add the operator's handlers to a kopf registry; the Controller comes in through `memo.controller`."""

    @kopf.index("v1", "pods", labels={LABEL_JOB: kopf.PRESENT}, registry=registry, id=POD_INDEX)
    async def rljob_pods(namespace: str, labels: dict[str, str], body: kopf.Body, **_: Any) -> dict[Any, Any]:
        # async: kopf runs a sync handler in a thread, a hop per pod event for a few dict lookups
        return {(namespace, labels[LABEL_JOB]): compact_pod(body)}

    @kopf.on.event("v1", "pods", labels={LABEL_JOB: kopf.PRESENT}, registry=registry, id="pod-changed")
    async def pod_changed(
        namespace: str, labels: dict[str, str], event: kopf.RawEvent, memo: kopf.Memo, **kwargs: Any
    ) -> None:
        controller: Controller = memo.controller
        controller.pod_index = kwargs[POD_INDEX]
        # A listing event (type None) comes from kopf's (re-)list: the job's worker then reads its pods live.
        controller.pod_event(namespace, labels[LABEL_JOB], listed=event["type"] is None)

    @kopf.on.event(GROUP, VERSION, PLURAL, registry=registry, id="rljob-changed")
    async def rljob_changed(event: kopf.RawEvent, memo: kopf.Memo, **kwargs: Any) -> None:
        controller: Controller = memo.controller
        controller.pod_index = kwargs[POD_INDEX]
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


def restrict_watches(settings: kopf.OperatorSettings) -> None:
    """Watch only the pods of RLJobs (server-side label selector), not every pod of the cluster."""
    settings.watching.label_selectors["v1", "pods"] = LABEL_JOB


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
