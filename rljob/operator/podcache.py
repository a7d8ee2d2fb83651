"""The pods of every RLJob in view, kept from a LIST and a WATCH per namespace (or one for the cluster).

An informer of its own rather than kopf's pod handlers: kopf runs every watch event of every object through its
per-object machinery (a worker, a memory, a cause, a logger, the kwargs of each handler), about a millisecond a
pod event, and a job's 8 pods bring about 24 events on their way to Running: most of the operator's CPU at a
thousand jobs. Here an event costs its JSON parse and a few dict operations, and the cache keeps only what the
controller reads of a pod (`compact_pod`).

The cache also stays warm while the operator stands by for a peer (kopf pauses its own watches then), so a standby
that takes over acts at once. After a gap in a watch (410 Gone), the scope is listed again and replaced whole:
a pod deleted in the gap leaves the cache, though no DELETED event said so, and every job the re-list concerns is
told (`listed=True`) to read itself live before it acts.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterable
from typing import Any

from kopf._cogs.structs.references import match_namespace

from rljob.operator.client import ApiError, KubeClient
from rljob.operator.naming import LABEL_JOB

logger = logging.getLogger(__name__)

Raw = dict[str, Any]
Key = tuple[str, str]
PodChanged = Callable[[str, str, bool], None]
"""(namespace, job, listed): a pod of the job changed; `listed` when a (re-)list, not a watch event, found it."""

LIST_PAGE = 500
"""Pods per LIST page: a re-list at a thousand jobs reads 8,000 pods, a page at a time."""
RETRY_MAX_SECONDS = 30.0
WATCH_SECONDS = 300.0
"""The server ends each watch after this long (`timeoutSeconds`); the cache watches again from where it was."""
_KEEP_METADATA = (
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


def compact_pod(raw: Raw) -> Raw:
    """What the controller reads of a pod: pod specs are large, and the cache holds thousands."""
    meta = raw.get("metadata") or {}
    return {
        "metadata": {k: meta[k] for k in _KEEP_METADATA if k in meta},
        "spec": {"nodeName": (raw.get("spec") or {}).get("nodeName")},
        "status": dict(raw.get("status") or {}),
    }


def _pods_path(namespace: str | None) -> str:
    return f"/api/v1/namespaces/{namespace}/pods" if namespace else "/api/v1/pods"


class PodCache:
    """`pods_of(namespace, job)` answers from memory; `run(...)` keeps it current until cancelled."""

    def __init__(self, client: KubeClient, on_change: PodChanged, retry_seconds: float = 1.0) -> None:
        self.client = client
        self.on_change = on_change
        self.retry_seconds = retry_seconds
        self.by_job: dict[Key, dict[str, Raw]] = {}
        """(namespace, job) -> {pod uid: compact pod}."""
        self.job_of: dict[str, Key] = {}
        """Pod uid -> the (namespace, job) it is filed under."""
        self.listed: dict[str | None, asyncio.Event] = {}
        """Scope (a namespace; None: the cluster) -> set once its first LIST is in the cache."""
        self.cluster_wide = False

    # --- reading ---------------------------------------------------------------------------------------

    def pods_of(self, namespace: str, job: str) -> list[Raw]:
        return list(self.by_job.get((namespace, job), {}).values())

    def jobs(self) -> list[Key]:
        return list(self.by_job)

    async def ready(self, namespace: str) -> None:
        """Return once the pods of `namespace` have been listed: a job's first pass sees every pod it has."""
        event = self._listed_event(None if self.cluster_wide else namespace)
        if not event.is_set():
            await event.wait()

    def _listed_event(self, scope: str | None) -> asyncio.Event:
        event = self.listed.get(scope)
        if event is None:
            event = self.listed[scope] = asyncio.Event()
        return event

    # --- keeping it current ----------------------------------------------------------------------------

    def start(self, namespaces: Iterable[str] = (), all_namespaces: bool = False) -> asyncio.Task[None]:
        """`run` in a task of its own. The scope is settled here, before the task first runs, so a job's first pass
        (`ready`) never waits on a namespace's listing while the cache lists the cluster."""
        self.cluster_wide = all_namespaces
        return asyncio.create_task(self.run(namespaces, all_namespaces), name="rljob pod cache")

    async def run(self, namespaces: Iterable[str] = (), all_namespaces: bool = False) -> None:
        """Follow the cluster (`all_namespaces`), each named namespace, or, for kopf glob patterns
        (`team-*`, `!kube-*`), every namespace that matches, as namespaces come and go."""
        patterns = list(namespaces)
        self.cluster_wide = all_namespaces
        if all_namespaces:
            await self.follow(None)
            return
        if any(any(c in p for c in "*?!,") for p in patterns):
            await self._follow_matching(patterns)
            return
        async with asyncio.TaskGroup() as group:
            for namespace in dict.fromkeys(patterns):
                group.create_task(self.follow(namespace), name=f"rljob pods of {namespace}")

    async def follow(self, scope: str | None) -> None:
        """LIST the scope's pods of RLJobs, then WATCH from there; list again after a gap, retry after errors."""

        def changed(kind: str, pod: Raw) -> None:
            if kind == "DELETED":
                self._remove(pod)
            else:
                self._put(pod)

        await self._list_then_watch(
            f"pods of {scope or 'the cluster'}",
            _pods_path(scope),
            LABEL_JOB,
            lambda pods: self._replace(scope, pods),
            changed,
        )

    async def _list_then_watch(
        self,
        what: str,
        path: str,
        labels: str,
        listed: Callable[[list[Raw]], None],
        changed: Callable[[str, Raw], None],
    ) -> None:
        """An informer's loop: LIST `path` into `listed`, then WATCH from there into `changed` (event type, object),
        bookmarks skipped. After a gap (410 Gone) it lists again; after an error it retries, backing off."""
        since = ""
        failures = 0
        while True:
            try:
                if not since:
                    items, since = await self._list_all(path, labels)
                    listed(items)
                    failures = 0
                async for event in self.client.watch(path, labels, since, WATCH_SECONDS):
                    failures = 0
                    kind = event.get("type") or ""
                    obj = event.get("object") or {}
                    if kind == "ERROR":
                        # 410 Gone: the server no longer has the events since `since`; anything else: start over too.
                        logger.info("%s: the watch ended (%s); listing again", what, obj)
                        since = ""
                        break
                    since = (obj.get("metadata") or {}).get("resourceVersion") or since
                    if kind != "BOOKMARK":
                        changed(kind, obj)
            except asyncio.CancelledError:
                raise
            except ApiError as exc:
                if exc.status == 410:
                    since = ""
                delay = self._backoff(failures)
                failures += 1
                logger.warning("%s: %s; again in %.0f s", what, exc, delay)
                await asyncio.sleep(delay)
            except Exception:
                delay = self._backoff(failures)
                failures += 1
                logger.exception("%s: the watch failed; listing again in %.0f s", what, delay)
                since = ""
                await asyncio.sleep(delay)

    def _backoff(self, failures: int) -> float:
        """`retry_seconds`, doubled after each failure in a row up to `RETRY_MAX_SECONDS` (an RBAC without pods, an API
        server down for a while: a warning every half minute, not every second)."""
        return min(self.retry_seconds * 2 ** min(failures, 16), max(self.retry_seconds, RETRY_MAX_SECONDS))

    async def _list_all(self, path: str, labels: str) -> tuple[list[Raw], str]:
        """Every item of a LIST, a page at a time, and the resourceVersion to watch from."""
        items: list[Raw] = []
        token = ""
        while True:
            page = await self.client.list_page(path, labels, LIST_PAGE, token)
            items += page.get("items") or []
            meta = page.get("metadata") or {}
            token = meta.get("continue") or ""
            if not token:
                return items, str(meta.get("resourceVersion") or "")

    def _replace(self, scope: str | None, items: list[Raw]) -> None:
        """Replace the scope's pods with a fresh LIST's, and tell every job it concerns."""
        found = {uid: item for item in items if (uid := (item.get("metadata") or {}).get("uid"))}
        touched = {key for uid, key in self.job_of.items() if scope is None or key[0] == scope}
        for uid, key in list(self.job_of.items()):
            if (scope is None or key[0] == scope) and uid not in found:
                self._drop(uid)
        for item in found.values():
            key = self._file(item)
            if key is not None:
                touched.add(key)
        self._listed_event(scope).set()
        for namespace, job in touched:
            self.on_change(namespace, job, True)

    def _file(self, raw: Raw) -> Key | None:
        """Put the pod in the cache, under the job its label names; that job (None: no job label)."""
        meta = raw.get("metadata") or {}
        uid, job = meta.get("uid"), (meta.get("labels") or {}).get(LABEL_JOB)
        if not uid or not job:
            if uid:
                self._drop(uid)  # no longer one of an RLJob's pods
            return None
        key = (meta.get("namespace") or "", job)
        if self.job_of.get(uid, key) != key:
            self._drop(uid)  # relabelled to another job
        self.job_of[uid] = key
        self.by_job.setdefault(key, {})[uid] = compact_pod(raw)
        return key

    def _drop(self, uid: str) -> Key | None:
        key = self.job_of.pop(uid, None)
        if key is not None:
            pods = self.by_job.get(key)
            if pods is not None:
                pods.pop(uid, None)
                if not pods:
                    del self.by_job[key]
        return key

    def _put(self, raw: Raw) -> None:
        before = self.job_of.get((raw.get("metadata") or {}).get("uid") or "")
        key = self._file(raw)
        for changed in {before, key} - {None}:
            self.on_change(*changed, False)  # type: ignore[misc]

    def _remove(self, raw: Raw) -> None:
        key = self._drop((raw.get("metadata") or {}).get("uid") or "")
        if key is not None:
            self.on_change(*key, False)

    async def _follow_matching(self, patterns: list[str]) -> None:
        """A follower per namespace that matches a pattern, started and stopped as namespaces come and go."""
        followers: dict[str, asyncio.Task[None]] = {}

        def matches(name: str) -> bool:
            return any(match_namespace(name, pattern) for pattern in patterns)  # type: ignore[arg-type]

        names: set[str] = set()

        def sync() -> None:
            for name in names - followers.keys():
                followers[name] = asyncio.create_task(self.follow(name), name=f"rljob pods of {name}")
            for name in followers.keys() - names:
                followers.pop(name).cancel()
                for uid, key in list(self.job_of.items()):
                    if key[0] == name:
                        self._drop(uid)

        def listed(items: list[Raw]) -> None:
            names.clear()
            names.update(n for item in items if (n := (item.get("metadata") or {}).get("name")) and matches(n))
            sync()

        def changed(kind: str, namespace: Raw) -> None:
            name = (namespace.get("metadata") or {}).get("name")
            if kind in ("ADDED", "MODIFIED") and name and matches(name):
                names.add(name)
            elif kind == "DELETED" and name:
                names.discard(name)
            sync()

        try:
            await self._list_then_watch("namespaces", "/api/v1/namespaces", "", listed, changed)
        finally:
            for task in followers.values():
                task.cancel()
            for task in followers.values():
                with contextlib.suppress(asyncio.CancelledError):
                    await task
