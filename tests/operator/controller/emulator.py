"""A small, realistic Kubernetes API server for operator tests: kmock's emulator plus what kopf relies on.

kmock 0.8's `KubernetesEmulator` stores objects but leaves out server behaviour a controller depends
on. This subclass adds it, nothing more:

- `metadata.resourceVersion` (one global counter), `uid`, `creationTimestamp`, `generation` (bumped
  when anything but metadata and status changes), namespace filled from the URL, `generateName`;
- 409 `AlreadyExists` on create, 409 `Conflict` on a stale `resourceVersion` in a patch or a
  delete precondition, 422 `Invalid` on a failed JSON-patch `test`, 404 `NotFound`;
- the status subresource: patches of the object ignore `status`, patches of `/status` change only it;
- a scale subresource mapped onto a spec path (like the CRD's `specReplicasPath`);
- label selectors, and `metadata.name` / `metadata.namespace` field selectors, on list and watch;
  watches resume from a `resourceVersion` and answer 410 Gone
  when that version has been compacted away (`compact()`), as a real server does after a while;
- finalizers and `deletionTimestamp`; a deleted pod that has a node and has not finished stays, with
  `deletionTimestamp` and `deletionGracePeriodSeconds`, through its grace period: patches (the kubelet's
  status writes) do not remove it, only the kubelet stand-in does (`finish_termination`, or on its own
  `kubelet_seconds` after the delete unless the pod's node is in `lost_nodes`, whose kubelet is gone);
  an unscheduled or finished pod, or a delete with `gracePeriodSeconds: 0`, goes at once, as on a real
  server;
- asynchronous garbage collection: with `gc_seconds`, the dependents of a removed object are deleted
  that long afterwards (background propagation), not in the same call; `collect_garbage()` runs a pass;
- a body with a non-finite number (`NaN`, `Infinity`: not JSON) is refused with 400, as Go's decoder does;
- a `metadata.uid` in a merge patch is a precondition (409 Conflict when it is another object's);
- ResourceQuota and LimitRange admission of pods, as the LimitRanger and ResourceQuota plugins do: a container's
  missing requests and limits from the namespace's LimitRange defaults, then a 403 `exceeded quota` for a pod
  that would take a quota's usage past its `hard`; and the quota controller's part: every quota's `status.hard`
  and `status.used` follow the pods that exist (non-terminal ones), so a raised quota or a deleted pod shows;
- watches that ask for bookmarks (`allowWatchBookmarks`) get a BOOKMARK every `bookmark_seconds`;
- custom resources with a structural schema (`schemas`): unknown fields pruned, defaults applied, and a
  422 `Invalid` Status with `details.causes[]` for an object that breaks its schema (structural.py),
  checked against transcribed real-server responses in `recorded/`.

There is no kubelet, scheduler or garbage collector: tests play them with `patch_status`, `delete_object`
and `collect_garbage`, which go through the same write path as HTTP requests (watchers see them).
User reactions added with kmock's DSL (`kmock[...] << error`) win over this behaviour, which is how
tests inject API errors without changing the stored state.
"""

from __future__ import annotations

import asyncio
import copy
import datetime
import itertools
import json
import re
import uuid
from collections import defaultdict, deque
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

import aiohttp.web
import attrs
import jsonpatch
import kmock
from kmock._internal import apps, rendering

from rljob.operator.admission import parse_quantity
from tests.operator.controller.structural import apply_schema, invalid_status

Resource = kmock.resource
Raw = dict[str, Any]

PODS = Resource("", "v1", "pods")
NAMESPACES = Resource("", "v1", "namespaces")
RESOURCE_QUOTAS = Resource("", "v1", "resourcequotas")
LIMIT_RANGES = Resource("", "v1", "limitranges")
CLOSE = object()
"""Sentinel pushed into a live watch to end it with 410 Gone."""


def now_rfc3339() -> str:
    return datetime.datetime.now(tz=datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def clone(raw: Any) -> Any:
    """A deep copy of a stored object (plain JSON): a JSON round trip is several times faster than
    `copy.deepcopy`, which matters when a benchmark stores thousands of pods; anything else is deep-copied."""
    try:
        return json.loads(json.dumps(raw))
    except (TypeError, ValueError):
        return copy.deepcopy(raw)


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch: nested mappings merge, null deletes, everything else replaces."""
    if not isinstance(patch, Mapping):
        return copy.deepcopy(patch)
    result = dict(target) if isinstance(target, Mapping) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


_SELECTOR_TERM = re.compile(
    r"^\s*(?:(?P<neg>!)\s*(?P<absent>[\w./-]+)"
    r"|(?P<key>[\w./-]+)\s*(?:(?P<op>==|!=|=)\s*(?P<value>[\w./-]*)"
    r"|\s+(?P<setop>in|notin)\s*\((?P<values>[^)]*)\))?)\s*$"
)


def _split_selector(selector: str) -> list[str]:
    """Split on commas outside parentheses: `a in (x,y),b=c` is two terms."""
    terms, depth, current = [], 0, ""
    for char in selector:
        depth += char == "("
        depth -= char == ")"
        if char == "," and depth == 0:
            terms.append(current)
            current = ""
        else:
            current += char
    terms.append(current)
    return [t for t in terms if t.strip()]


def selector_matches(selector: str, labels: Mapping[str, str]) -> bool:
    """Kubernetes label-selector semantics: `k=v`, `k==v`, `k!=v`, `k`, `!k`, `k in (..)`, `k notin (..)`."""
    for term in _split_selector(selector):
        match = _SELECTOR_TERM.match(term)
        if match is None:
            raise ValueError(f"unparsable label selector term {term!r}")
        if match["neg"]:
            if match["absent"] in labels:
                return False
            continue
        key = match["key"]
        if match["op"] in ("=", "=="):
            if labels.get(key) != match["value"]:
                return False
        elif match["op"] == "!=":
            if labels.get(key) == match["value"]:
                return False
        elif match["setop"]:
            values = {v.strip() for v in match["values"].split(",") if v.strip()}
            if match["setop"] == "in" and labels.get(key) not in values:
                return False
            if match["setop"] == "notin" and key in labels and labels[key] in values:
                return False
        elif key not in labels:
            return False
    return True


@attrs.define
class _Watch:
    resource: Resource
    namespace: str | None
    selector: str
    fields: dict[str, str] = attrs.field(factory=dict)
    queue: asyncio.Queue[Any] = attrs.field(factory=asyncio.Queue)

    def wants(self, raw: Raw) -> bool:
        meta = raw.get("metadata", {})
        if self.namespace is not None and meta.get("namespace") != self.namespace:
            return False
        if any(meta.get(k) != v for k, v in self.fields.items()):
            return False
        return selector_matches(self.selector, meta.get("labels") or {})


@attrs.define(kw_only=True)
class KubernetesApiEmulator(kmock.KubernetesEmulator):
    """kmock's emulator with resource versions, conflicts, subresources, selectors and watch resumption."""

    status_subresources: set[Resource] = attrs.field(factory=set)
    """Resources whose `status` is written only through `/status`."""
    scale_subresources: dict[Resource, tuple[str, ...]] = attrs.field(factory=dict)
    """Resource -> path of its replica count in the object, e.g. ("spec", "roles", "rollout", "replicas")."""
    graceful_pod_deletion: bool = True
    """Pods terminate through their grace period (False: a deleted pod goes at once, a server-less shortcut)."""
    kubelet_seconds: float | None = None
    """The kubelet stand-in: a terminating pod's containers stop, and the pod goes, this long after the delete
    (None: only when a test calls `finish_termination`)."""
    lost_nodes: set[str] = attrs.field(factory=set)
    """Nodes whose kubelet is gone: their pods never finish terminating (stuck Terminating)."""
    gc_seconds: float | None = None
    """Garbage collector: delete the dependents of a removed object this long afterwards (None: only when a
    test calls `collect_garbage`)."""
    bookmark_seconds: float = 1.0
    """How often a watch that allows bookmarks gets one."""
    schemas: dict[Resource, tuple[str, str, dict[str, Any]]] = attrs.field(factory=dict)
    """Resource -> (kind, group, openAPIV3Schema) of custom resources the server prunes, defaults and validates."""
    keep_history: bool = True
    """kmock keeps every version of every object (handy in tests); benchmarks turn it off to save memory."""
    watch_log_size: int = 10_000
    latency: dict[str, float] = attrs.field(factory=dict)
    """The latency model: seconds each request waits before it is served, by "read" (GET, LIST) and "write"
    (POST, PATCH, PUT, DELETE); watches are not delayed. It stands in for what a real API server adds (etcd's
    round trip, admission); waiting does not hold the event loop, so concurrent requests overlap as on a real
    server. Empty: no delay (the tests)."""

    _revision: itertools.count[int] = attrs.field(factory=lambda: itertools.count(1), init=False)
    _last_revision: int = attrs.field(default=0, init=False)
    _compacted: int = attrs.field(default=0, init=False)
    _logs: dict[Resource, deque[tuple[int, Raw]]] = attrs.field(factory=lambda: defaultdict(deque), init=False)
    _watches: list[_Watch] = attrs.field(factory=list, init=False)
    _builtin_reactions: int = attrs.field(default=0, init=False)
    _direct: dict[Any, Any] = attrs.field(factory=dict, init=False)
    _keys: dict[Resource, dict[Any, None]] = attrs.field(factory=lambda: defaultdict(dict), init=False)
    _terminated: set[str] = attrs.field(factory=set, init=False)
    """uids of terminating pods whose containers stopped (the kubelet is done; finalizers may remain)."""
    _timers: set[asyncio.TimerHandle] = attrs.field(factory=set, init=False)
    """Object keys by resource, in creation order: lists and watches do not walk every object."""

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        # PUT (replace) is not a kmock action; serve it for the scale subresource and status writes.
        self.fallback["put"] << self._serve_replace
        self._builtin_reactions = len(self._payloads)
        self._direct = {
            kmock.action.LIST: self._serve_list,
            kmock.action.WATCH: self._serve_watch,
            kmock.action.FETCH: self._serve_fetch,
            kmock.action.CREATE: self._serve_create,
            kmock.action.UPDATE: self._serve_update,
            kmock.action.DELETE: self._serve_delete,
        }

    # --- request dispatch -----------------------------------------------------------------------

    async def __call__(self, raw_request: aiohttp.web.BaseRequest) -> aiohttp.web.StreamResponse:
        if self.latency and raw_request.query.get("watch") != "true":
            await asyncio.sleep(self.latency.get("read" if raw_request.method == "GET" else "write", 0.0))
        if raw_request.method in ("POST", "PUT", "PATCH"):
            # Python's json accepts NaN and Infinity; Go's decoder (kube-apiserver) refuses them with 400.
            text = await raw_request.text()
            try:
                if "NaN" in text or "Infinity" in text:  # a second parse only where one could be
                    json.loads(text or "null", parse_constant=_refuse_constant)
            except _NonFinite as exc:
                error = kmock.KubernetesError(400, "BadRequest", f"the body is not valid JSON: {exc}")
                return await self._render_error(error)
            except ValueError:
                pass  # kmock answers what it cannot parse
        # kmock 0.8 cannot parse the cluster-wide `/api/v1/namespaces` path (kopf lists and watches it
        # when scanning namespaces): build that request here and serve it like any other list or watch.
        if raw_request.path.rstrip("/") != "/api/v1/namespaces" or raw_request.method != "GET":
            return await super().__call__(raw_request)
        await raw_request.read()
        params = dict(raw_request.query)
        request = rendering.Request(
            id=len(self._requests),
            raw_request=raw_request,
            url=raw_request.url,
            method=raw_request.method,
            params=params,
            headers=dict(raw_request.headers),
            action=kmock.action.WATCH if params.get("watch") == "true" else kmock.action.LIST,
            resource=NAMESPACES,
        )
        self._requests.append(request)
        try:
            return await self._handle(request)
        except Exception as exc:
            return await self._render_error(exc)

    async def _handle(self, request: rendering.Request) -> Any:
        # Skip kmock's own state changes (KubernetesEmulator._handle): the fallbacks below own the state,
        # so a user reaction that answers a request (an injected error) leaves the state untouched.
        # Without user reactions, serve directly: kmock matches every request against every reaction
        # by walking the request history, which grows quadratic under load (benchmarks).
        direct = self._direct.get(request.action) if len(self._payloads) == self._builtin_reactions else None
        if (
            direct is not None
            and request.resource is not None
            and request.resource.plural
            and request.method.value != "PUT"
        ):
            if request.action == kmock.action.WATCH:
                return await rendering.Response(payload=direct)(request)
            # A JSON answer as kmock renders it, without its pattern matching on the payload's type per request.
            created = request.action == kmock.action.CREATE
            return aiohttp.web.json_response(await direct(request), status=201 if created else 200)
        return await apps.RawHandler._handle(self, request)

    async def _serve_fetch(self, request: rendering.Request) -> Raw:
        obj = self._stored(request.resource, request.namespace, request.name)
        if request.subresource == "scale":
            return self._scale_of(request.resource, obj)
        return obj

    async def _serve_list(self, request: rendering.Request) -> Raw:
        self._require_known(request.resource)
        selector = request.params.get("labelSelector", "")
        fields = _field_selector(request.params.get("fieldSelector", ""))
        items = self._all(
            request.resource,
            request.namespace,
            lambda raw: self._selected(raw, selector) and all(raw["metadata"].get(k) == v for k, v in fields.items()),
            copies=False,
        )
        metadata = {"resourceVersion": str(self._last_revision)}
        # Pages, as kube-apiserver cuts them for `limit`: the `continue` token says where the next one starts
        # (here an offset; the server's is opaque).
        limit = int(request.params.get("limit") or 0)
        if limit > 0:
            start = int(request.params.get("continue") or 0)
            items, rest = items[start : start + limit], items[start + limit :]
            if rest:
                metadata["continue"] = str(start + limit)
        return {"apiVersion": "v1", "kind": "List", "metadata": metadata, "items": items}

    async def _serve_watch(self, request: rendering.Request) -> AsyncIterator[Any]:
        self._require_known(request.resource)
        yield b""  # send the headers now: the stream may stay silent for a while
        selector = request.params.get("labelSelector", "")
        since = request.params.get("resourceVersion")
        watch = _Watch(
            request.resource, request.namespace, selector, _field_selector(request.params.get("fieldSelector", ""))
        )
        self._watches.append(watch)
        getter: asyncio.Future[Any] | None = None
        try:
            if since in (None, "", "0"):
                for raw in self._all(request.resource, request.namespace, copies=False):
                    if watch.wants(raw):
                        yield _line({"type": "ADDED", "object": raw})
            elif int(since) < self._compacted:
                yield _line(_gone(since))
                return
            else:
                for revision, event in list(self._logs[request.resource]):
                    if revision > int(since) and watch.wants(event["object"]):
                        yield _line(event)
            timeout = float(request.params.get("timeoutSeconds") or 0) or None
            bookmarks = request.params.get("allowWatchBookmarks") == "true"
            async with asyncio.timeout(timeout):
                while True:
                    if getter is None:
                        getter = asyncio.ensure_future(watch.queue.get())
                    done, _ = await asyncio.wait({getter}, timeout=self.bookmark_seconds if bookmarks else None)
                    if not done:
                        yield _line(self._bookmark(request.resource))
                        continue
                    event, getter = getter.result(), None
                    if event is CLOSE:
                        yield _line(_gone(since or "0"))
                        return
                    yield _line(event)
        except TimeoutError:
            return
        finally:
            if getter is not None:
                getter.cancel()
            self._watches.remove(watch)

    async def _serve_create(self, request: rendering.Request) -> Raw:
        self._require_known(request.resource)
        body = request.data
        if not isinstance(body, Mapping):
            raise kmock.KubernetesError(400, "BadRequest", "the request body must be a JSON object")
        return self._create(request.resource, request.namespace, body)

    async def _serve_update(self, request: rendering.Request) -> Raw:
        if request.subresource == "scale":
            return self._patch_scale(request.resource, request.namespace, request.name, request.data)
        return self._patch(request.resource, request.namespace, request.name, request.data, request.subresource)

    async def _serve_replace(self, request: rendering.Request) -> Raw:
        if request.subresource == "scale":
            return self._patch_scale(request.resource, request.namespace, request.name, request.data)
        if request.subresource == "status":
            status = (request.data or {}).get("status")
            return self._patch(request.resource, request.namespace, request.name, {"status": status}, "status")
        raise kmock.KubernetesError(405, "MethodNotAllowed", "this emulator replaces only status and scale")

    async def _serve_delete(self, request: rendering.Request) -> Raw:
        options = request.data if isinstance(request.data, Mapping) else {}
        return self._delete(
            request.resource,
            request.namespace,
            request.name,
            options.get("preconditions"),
            options.get("gracePeriodSeconds"),
        )

    # --- the state: also called directly by tests playing kubelet, scheduler and GC -------------

    # The public methods answer copies a caller may change; the underscored ones, used to serve requests, answer
    # the stored object itself (never changed in place: every write stores a new one).

    def create_object(self, resource: Resource, namespace: str | None, body: Mapping[str, Any]) -> Raw:
        return clone(self._create(resource, namespace, body))

    def _create(self, resource: Resource, namespace: str | None, body: Mapping[str, Any]) -> Raw:
        raw = clone(dict(body))
        meta = raw.setdefault("metadata", {})
        if namespace is not None:
            if meta.get("namespace") not in (None, namespace):
                raise kmock.KubernetesError(
                    400, "BadRequest", "the namespace of the object does not match the namespace of the request"
                )
            meta["namespace"] = namespace
        if not meta.get("name"):
            if not meta.get("generateName"):
                raise kmock.KubernetesError(422, "Invalid", "metadata.name or metadata.generateName is required")
            meta["name"] = meta["generateName"] + uuid.uuid4().hex[:5]
        key = (resource, meta.get("namespace"), meta["name"])
        if key in self._objects and not self._objects[key].deleted:
            raise kmock.KubernetesError(
                409, "AlreadyExists", f'{resource.plural} "{meta["name"]}" already exists', {"name": meta["name"]}
            )
        for server_field in ("resourceVersion", "deletionTimestamp", "deletionGracePeriodSeconds"):
            meta.pop(server_field, None)
        meta["uid"] = str(uuid.uuid4())
        meta["creationTimestamp"] = now_rfc3339()
        meta["generation"] = 1
        if resource in self.status_subresources:
            raw.pop("status", None)
        raw = self._structural(resource, raw, ("spec",) if resource in self.status_subresources else ("spec", "status"))
        if resource == PODS:
            raw = self._admit_pod(meta.get("namespace"), raw)
        return self._store(resource, key, raw, "ADDED")

    # --- ResourceQuota and LimitRange: admission plugins and the quota controller ------------------

    def _admit_pod(self, namespace: str | None, pod: Raw) -> Raw:
        """LimitRanger's defaults, then the ResourceQuota plugin's check (403 Forbidden `exceeded quota`)."""
        for limit_range in self._all(LIMIT_RANGES, namespace):
            for item in (limit_range.get("spec") or {}).get("limits") or []:
                if item.get("type") != "Container":
                    continue
                for container in (pod.get("spec") or {}).get("containers") or []:
                    resources = container.setdefault("resources", {})
                    for key, value in (item.get("default") or {}).items():
                        resources.setdefault("limits", {}).setdefault(key, value)
                    for key, value in (item.get("defaultRequest") or {}).items():
                        resources.setdefault("requests", {}).setdefault(key, value)
        for container in (pod.get("spec") or {}).get("containers") or []:
            resources = container.get("resources") or {}
            for key, value in (resources.get("limits") or {}).items():
                resources.setdefault("requests", {}).setdefault(key, value)
        usage = _pod_usage(pod)
        for quota in self._all(RESOURCE_QUOTAS, namespace):
            hard = {k: parse_quantity(v) for k, v in ((quota.get("spec") or {}).get("hard") or {}).items()}
            used = {k: parse_quantity(v) for k, v in (((quota.get("status") or {}).get("used")) or {}).items()}
            over = [k for k in sorted(hard) if usage.get(k, 0) and used.get(k, 0) + usage[k] > hard[k]]
            if over:

                def listed(values: Mapping[str, Any], keys: list[str] = over) -> str:
                    return ",".join(f"{k}={_render(values.get(k, 0))}" for k in keys)

                raise kmock.KubernetesError(
                    403,
                    "Forbidden",
                    f'pods "{pod["metadata"]["name"]}" is forbidden: exceeded quota: {quota["metadata"]["name"]}, '
                    f"requested: {listed(usage)}, used: {listed(used)}, limited: {listed(hard)}",
                )
        return pod

    def count_quotas(self, namespace: str | None) -> None:
        """The quota controller: each quota's `status.hard` is its spec's, `status.used` what live pods use."""
        quotas = self._all(RESOURCE_QUOTAS, namespace)
        if not quotas:
            return
        pods = [
            p for p in self._all(PODS, namespace) if (p.get("status") or {}).get("phase") not in ("Succeeded", "Failed")
        ]
        for quota in quotas:
            hard = (quota.get("spec") or {}).get("hard") or {}
            used = {key: 0 for key in hard}
            for pod in pods:
                for key, value in _pod_usage(pod).items():
                    if key in used:
                        used[key] += value
            status = {"hard": dict(hard), "used": {k: _render(v) for k, v in used.items()}}
            if quota.get("status") != status:
                key = (RESOURCE_QUOTAS, namespace, quota["metadata"]["name"])
                self._store(RESOURCE_QUOTAS, key, dict(quota, status=status), "MODIFIED")

    def patch_object(
        self,
        resource: Resource,
        namespace: str | None,
        name: str,
        patch: Any,
        subresource: str | None = None,
    ) -> Raw:
        return clone(self._patch(resource, namespace, name, patch, subresource))

    def _patch(
        self, resource: Resource | None, namespace: str | None, name: str | None, patch: Any, subresource: str | None
    ) -> Raw:
        old = self._stored(resource, namespace, name)
        if isinstance(patch, list):
            try:
                new = jsonpatch.apply_patch(old, patch)
            except jsonpatch.JsonPatchTestFailed as exc:
                raise kmock.KubernetesError(422, "Invalid", f"the JSON patch test failed: {exc}") from None
            except (jsonpatch.JsonPatchException, jsonpatch.JsonPointerException) as exc:
                raise kmock.KubernetesError(422, "Invalid", f"the JSON patch cannot be applied: {exc}") from None
        elif isinstance(patch, Mapping):
            expected = (patch.get("metadata") or {}).get("resourceVersion")
            if expected is not None and expected != old["metadata"]["resourceVersion"]:
                raise _conflict(resource, name)
            uid = (patch.get("metadata") or {}).get("uid")
            if uid is not None and uid != old["metadata"]["uid"]:
                raise kmock.KubernetesError(
                    409,
                    "Conflict",
                    f'Operation cannot be fulfilled on {resource.plural} "{name}": Precondition failed: '
                    f"UID in precondition: {uid}, UID in object meta: {old['metadata']['uid']}",
                )
            new = merge_patch(old, patch)
        else:
            raise kmock.KubernetesError(400, "BadRequest", "a patch is a JSON object or a JSON-patch list")
        if resource in self.status_subresources:
            # The main endpoint ignores status; /status changes nothing but status.
            if subresource == "status":
                new = dict(old, status=new.get("status"))
            else:
                new = dict(new, status=old.get("status"))
            if new.get("status") is None:
                new.pop("status")
        if resource in self.status_subresources:
            parts: tuple[str, ...] = ("status",) if subresource == "status" else ("spec",)
        else:
            parts = ("spec", "status")
        new = self._structural(resource, new, parts)
        if new == old:
            return old
        new["metadata"] = dict(new["metadata"])  # it may still be the stored object's own
        for server_field in ("uid", "creationTimestamp", "resourceVersion", "generation", "deletionTimestamp"):
            if server_field in old["metadata"]:
                new["metadata"][server_field] = old["metadata"][server_field]
        if _spec_of(new) != _spec_of(old):
            new["metadata"]["generation"] = old["metadata"].get("generation", 1) + 1
        key = (resource, namespace, name)
        # The last finalizer went: the object goes, unless it is a pod its kubelet has not finished with.
        deleting = new["metadata"].get("deletionTimestamp") and not new["metadata"].get("finalizers")
        if deleting and not self._still_terminating(resource, new):
            self._store(resource, key, new, "MODIFIED")
            return self._remove(resource, key)
        return self._store(resource, key, new, "MODIFIED")

    def _structural(self, resource: Resource, raw: Raw, parts: tuple[str, ...]) -> Raw:
        """Prune, default and validate a custom resource as kube-apiserver does (structural.py)."""
        if resource not in self.schemas:
            return raw
        kind, group, schema = self.schemas[resource]
        result, causes = apply_schema(raw, schema, parts)
        if causes:
            status = invalid_status(kind, group, raw["metadata"].get("name", ""), causes)
            raise kmock.KubernetesError(422, "Invalid", status["message"], status["details"])
        return result

    def patch_status(self, resource: Resource, namespace: str | None, name: str, status: Mapping[str, Any]) -> Raw:
        return self.patch_object(resource, namespace, name, {"status": dict(status)}, subresource="status")

    def delete_object(
        self,
        resource: Resource,
        namespace: str | None,
        name: str,
        preconditions: Mapping[str, Any] | None = None,
        grace_period_seconds: int | None = None,
    ) -> Raw:
        return clone(self._delete(resource, namespace, name, preconditions, grace_period_seconds))

    def _delete(
        self,
        resource: Resource | None,
        namespace: str | None,
        name: str | None,
        preconditions: Mapping[str, Any] | None,
        grace_period_seconds: int | None,
    ) -> Raw:
        old = self._stored(resource, namespace, name)
        meta = old["metadata"]
        for field in ("uid", "resourceVersion"):
            if preconditions and preconditions.get(field) not in (None, meta.get(field)):
                raise _conflict(resource, name)
        key = (resource, namespace, name)
        if meta.get("deletionTimestamp"):
            if resource == PODS and grace_period_seconds == 0 and not meta.get("finalizers"):
                return self._remove(resource, key)  # a forced delete of a pod that was terminating
            return old
        graceful = resource == PODS and self._graceful(old, grace_period_seconds)
        if meta.get("finalizers") or graceful:
            new = copy.deepcopy(old)
            new["metadata"]["deletionTimestamp"] = now_rfc3339()
            if graceful:
                grace = grace_period_seconds
                if grace is None:
                    grace = (old.get("spec") or {}).get("terminationGracePeriodSeconds", 30)
                new["metadata"]["deletionGracePeriodSeconds"] = grace
                self._later(self.kubelet_seconds, self._kubelet_done, namespace, name, meta["uid"])
            return self._store(resource, key, new, "MODIFIED")
        return self._remove(resource, key)

    def _graceful(self, pod: Raw, grace_period_seconds: int | None) -> bool:
        """A real server deletes a pod at once when no kubelet runs it: unscheduled, or already finished."""
        if not self.graceful_pod_deletion or grace_period_seconds == 0:
            return False
        if not (pod.get("spec") or {}).get("nodeName"):
            return False
        return (pod.get("status") or {}).get("phase") not in ("Succeeded", "Failed")

    def _still_terminating(self, resource: Resource, raw: Raw) -> bool:
        return (
            resource == PODS
            and raw["metadata"].get("deletionGracePeriodSeconds") is not None
            and raw["metadata"]["uid"] not in self._terminated
        )

    def _kubelet_done(self, namespace: str, name: str, uid: str) -> None:
        current = self.read_object(PODS, namespace, name)
        if current is None or current["metadata"]["uid"] != uid:
            return
        if (current.get("spec") or {}).get("nodeName") in self.lost_nodes:
            return  # no kubelet confirms anything: the pod stays Terminating
        self.finish_termination(namespace, name)

    def finish_termination(self, namespace: str, name: str) -> None:
        """Kubelet: a terminating pod's containers have stopped; the pod goes once no finalizer holds it."""
        key = (PODS, namespace, name)
        current = self._current(PODS, namespace, name)
        self._terminated.add(current["metadata"]["uid"])
        if not current["metadata"].get("finalizers"):
            self._remove(PODS, key)

    def collect_garbage(self) -> list[tuple[Resource, str | None, str]]:
        """Garbage collector: delete every object whose owners (by uid) no longer exist."""
        alive = {raw["metadata"]["uid"] for _, raw in self._live_items()}
        removed = []
        for (resource, namespace, name), raw in list(self._live_items()):
            owners = raw["metadata"].get("ownerReferences") or []
            if raw["metadata"].get("deletionTimestamp"):
                continue  # already being deleted
            if owners and not any(o.get("uid") in alive for o in owners):
                self.delete_object(resource, namespace, name)
                removed.append((resource, namespace, name))
        return removed

    def _later(self, delay: float | None, callback: Any, *args: Any) -> None:
        """Run `callback(*args)` `delay` seconds from now on the running loop (nothing without either)."""
        if delay is None:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return

        def fire() -> None:
            self._timers.discard(handle)
            callback(*args)

        handle = loop.call_later(delay, fire)
        self._timers.add(handle)

    def stop_timers(self) -> None:
        """Cancel the kubelet's and garbage collector's pending work (at the end of a test)."""
        for handle in self._timers:
            handle.cancel()
        self._timers.clear()

    def compact(self) -> None:
        """Forget every past revision and end live watches with 410 Gone, like etcd compaction."""
        self._compacted = self._last_revision + 1
        for log in self._logs.values():
            log.clear()
        for watch in self._watches:
            watch.queue.put_nowait(CLOSE)

    def read_object(self, resource: Resource, namespace: str | None, name: str) -> Raw | None:
        key = (resource, namespace, name)
        if key not in self._objects or self._objects[key].deleted:
            return None
        return clone(self._objects[key].raw)

    def list_objects(self, resource: Resource, namespace: str | None = None, selector: str = "") -> list[Raw]:
        return self._all(resource, namespace, lambda raw: self._selected(raw, selector))

    # --- internals ------------------------------------------------------------------------------

    def _store(self, resource: Resource, key: Any, raw: Raw, event_type: str) -> Raw:
        revision = next(self._revision)
        self._last_revision = revision
        raw["metadata"]["resourceVersion"] = str(revision)
        if key not in self._objects:
            self._objects[key] = raw
            self._keys[resource][key] = None
        else:
            obj = self._objects[key]
            if not self.keep_history:
                del obj.history[:]
            obj.history.append(raw)
        # Stored objects are never changed in place (each write stores a new one), so the event shares it.
        self._publish(resource, revision, {"type": event_type, "object": raw})
        if resource == PODS or (resource == RESOURCE_QUOTAS and _spec_of(raw).get("spec") is not None):
            self.count_quotas(raw["metadata"].get("namespace"))
        return raw

    def _remove(self, resource: Resource, key: Any) -> Raw:
        obj = self._objects[key]
        raw = clone(obj.raw)
        revision = next(self._revision)
        self._last_revision = revision
        raw["metadata"]["resourceVersion"] = str(revision)
        obj.delete()
        if not self.keep_history:
            del self._objects[key]
            self._keys[resource].pop(key, None)
        self._terminated.discard(raw["metadata"].get("uid"))
        self._publish(resource, revision, {"type": "DELETED", "object": raw})
        if resource == PODS:
            self.count_quotas(raw["metadata"].get("namespace"))
        self._later(self.gc_seconds, self.collect_garbage)
        return raw

    def _bookmark(self, resource: Resource | None) -> Raw:
        """A BOOKMARK: no object, only the resourceVersion the watch may resume from."""
        info = (
            self.resources.get(f"{resource.group}/{resource.version}/{resource.plural}".lstrip("/"))
            if resource
            else None
        )
        kind = info.kind if info is not None and info.kind else "Object"
        api_version = "v1" if resource is None or not resource.group else f"{resource.group}/{resource.version}"
        metadata = {"resourceVersion": str(self._last_revision)}
        return {"type": "BOOKMARK", "object": {"kind": kind, "apiVersion": api_version, "metadata": metadata}}

    def _publish(self, resource: Resource, revision: int, event: Raw) -> None:
        log = self._logs[resource]
        log.append((revision, event))
        while len(log) > self.watch_log_size:
            self._compacted = max(self._compacted, log.popleft()[0] + 1)
        for watch in self._watches:
            if watch.resource == resource and watch.wants(event["object"]):
                watch.queue.put_nowait(event)

    def _current(self, resource: Resource | None, namespace: str | None, name: str | None) -> Raw:
        return clone(self._stored(resource, namespace, name))

    def _stored(self, resource: Resource | None, namespace: str | None, name: str | None) -> Raw:
        """The stored object itself (404 when there is none): read it, never change it."""
        key = (resource, namespace, name)
        if resource is None or name is None or key not in self._objects or self._objects[key].deleted:
            raise kmock.KubernetesError(
                404, "NotFound", f'{getattr(resource, "plural", "object")} "{name}" not found', {"name": name}
            )
        return self._objects[key].raw

    def _live_items(self) -> list[tuple[Any, Raw]]:
        return [(key, obj.raw) for key, obj in self._objects.items() if not obj.deleted]

    def _all(
        self,
        resource: Resource | None,
        namespace: str | None,
        wanted: Callable[[Raw], bool] | None = None,
        copies: bool = True,
    ) -> list[Raw]:
        """Copies of the live objects of `resource` (in `namespace`) that `wanted` selects: selected before they
        are copied, so a LIST by label of a few pods among thousands costs a few copies. `copies=False`: the stored
        objects themselves, to answer a request with."""
        keys = self._keys.get(resource, {}) if resource is not None else {}
        objects = self._objects
        return [
            clone(obj.raw) if copies else obj.raw
            for key in keys
            if (namespace is None or key[1] == namespace)
            and not (obj := objects[key]).deleted
            and (wanted is None or wanted(obj.raw))
        ]

    @staticmethod
    def _selected(raw: Raw, selector: str) -> bool:
        return not selector or selector_matches(selector, raw.get("metadata", {}).get("labels") or {})

    def _require_known(self, resource: Resource | None) -> None:
        # Declared resources first: kmock's own lookup walks every stored object.
        if resource is not None and (resource in self.resources or resource in self._keys):
            return
        if resource is None or resource not in self._get_resources():
            raise kmock.KubernetesError(404, "NotFound", f"the server could not find the resource {resource}")

    def _scale_of(self, resource: Resource | None, obj: Raw) -> Raw:
        path = self.scale_subresources.get(resource) if resource is not None else None
        if path is None:
            raise kmock.KubernetesError(404, "NotFound", f"{resource} has no scale subresource")
        value: Any = obj
        for part in path:
            value = (value or {}).get(part)
        return {
            "apiVersion": "autoscaling/v1",
            "kind": "Scale",
            "metadata": {k: obj["metadata"][k] for k in ("name", "namespace", "uid", "resourceVersion")},
            "spec": {"replicas": value or 0},
        }

    def _patch_scale(self, resource: Resource | None, namespace: str | None, name: str | None, body: Any) -> Raw:
        obj = self._current(resource, namespace, name)
        path = self.scale_subresources.get(resource) if resource is not None else None
        replicas = ((body or {}).get("spec") or {}).get("replicas")
        if path is None or not isinstance(replicas, int) or replicas < 0:
            raise kmock.KubernetesError(422, "Invalid", "spec.replicas must be a non-negative integer")
        patch: Raw = {}
        node = patch
        for part in path[:-1]:
            node = node.setdefault(part, {})
        node[path[-1]] = replicas
        assert resource is not None and name is not None
        updated = self.patch_object(resource, namespace, name, patch)
        return self._scale_of(resource, dict(updated, metadata=obj["metadata"] | updated["metadata"]))


def _pod_usage(pod: Raw) -> dict[str, Any]:
    """What a pod counts against a quota (kube-apiserver's pod evaluator, without scopes or init containers)."""
    usage: dict[str, Any] = {"pods": 1, "count/pods": 1}
    for container in (pod.get("spec") or {}).get("containers") or []:
        resources = container.get("resources") or {}
        for kind in ("requests", "limits"):
            for key, value in (resources.get(kind) or {}).items():
                amount = parse_quantity(value)
                names = [f"{kind}.{key}"] + ([key] if kind == "requests" and key in ("cpu", "memory") else [])
                for name in names:
                    usage[name] = usage.get(name, 0) + amount
    return usage


def _render(amount: Any) -> str:
    return f"{amount:f}".rstrip("0").rstrip(".") if "." in f"{amount:f}" else f"{amount:f}"


def _spec_of(raw: Raw) -> Raw:
    return {k: v for k, v in raw.items() if k not in ("metadata", "status")}


def _conflict(resource: Resource, name: str) -> kmock.KubernetesError:
    return kmock.KubernetesError(
        409,
        "Conflict",
        f'Operation cannot be fulfilled on {resource.plural} "{name}": the object has been modified; '
        "please apply your changes to the latest version and try again",
    )


def _field_selector(selector: str) -> dict[str, str]:
    """`metadata.name=x,metadata.namespace=y` -> {"name": "x", "namespace": "y"}: the fields every resource has."""
    fields = {}
    for term in filter(None, (t.strip() for t in selector.split(","))):
        key, _, value = term.partition("=")
        key = key.rstrip("=")
        if key not in ("metadata.name", "metadata.namespace"):
            raise kmock.KubernetesError(400, "BadRequest", f'"{key}" is not a known field selector')
        fields[key.removeprefix("metadata.")] = value.lstrip("=")
    return fields


class _NonFinite(ValueError):
    pass


def _refuse_constant(name: str) -> Any:
    raise _NonFinite(f"{name} is not a JSON number")


def _line(event: Raw) -> bytes:
    """A watch event as its line on the wire (encoded here: kmock's renderer matches every item's type first)."""
    return json.dumps(event).encode() + b"\n"


def _gone(since: str) -> Raw:
    return {
        "type": "ERROR",
        "object": {
            "apiVersion": "v1",
            "kind": "Status",
            "status": "Failure",
            "code": 410,
            "reason": "Expired",
            "message": f"too old resource version: {since}",
        },
    }
