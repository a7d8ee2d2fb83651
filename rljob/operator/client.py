"""The operator's Kubernetes API calls, on the HTTP session of kubernetes_asyncio's ApiClient, which brings the
kubeconfig or in-cluster configuration: auth (token refresh included), TLS and proxy.

Objects stay plain dicts: the operator builds manifests as dicts and reads a few fields back, so the
generated model classes would only cost time. Every call is counted in the operator's metrics, and an
API error is raised as `ApiError` with the HTTP status.
"""

from __future__ import annotations

import asyncio
import datetime
import json
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any
from urllib.parse import urlencode

import aiohttp
from aiohttp.helpers import basicauth_from_netrc, get_env_proxy_for_url, netrc_from_env
from kubernetes_asyncio.client import ApiClient, Configuration
from yarl import URL

from rljob.api import API_VERSION, KIND, PLURAL

Manifest = dict[str, Any]
MERGE_PATCH = "application/merge-patch+json"
COMPONENT = "rljob-operator"
REQUEST_TIMEOUT = aiohttp.ClientTimeout(total=60, sock_connect=30)
"""A call that gets no answer in a minute fails (and is retried) instead of holding its job's worker for ever."""

_PLURALS = {
    "Pod": "pods",
    "Service": "services",
    "ConfigMap": "configmaps",
    "Secret": "secrets",
    "Event": "events",
    "ResourceQuota": "resourcequotas",
    "LimitRange": "limitranges",
    "PersistentVolumeClaim": "persistentvolumeclaims",
    "StorageClass": "storageclasses",
    "PodGroup": "podgroups",
    "NetworkPolicy": "networkpolicies",
    "KopfPeering": "kopfpeerings",
    "ClusterKopfPeering": "clusterkopfpeerings",
    KIND: PLURAL,
}


class ApiError(Exception):
    """A failed API call: `status` is the HTTP status (0 when the server could not be reached)."""

    def __init__(self, status: int, verb: str, path: str, message: str) -> None:
        super().__init__(f"{verb} {path}: {status} {message}")
        self.status = status
        self.verb = verb

    @property
    def not_found(self) -> bool:
        return self.status == 404

    @property
    def exists(self) -> bool:
        return self.status == 409


def object_path(api_version: str, kind: str, namespace: str, name: str | None = None) -> str:
    """`/api/v1/namespaces/ns/pods[/name]` or `/apis/group/version/namespaces/ns/plural[/name]`."""
    plural = _PLURALS.get(kind)
    if plural is None:
        raise ValueError(f"the operator does not manage {kind} objects")
    base = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
    path = f"{base}/namespaces/{namespace}/{plural}"
    return f"{path}/{name}" if name else path


def _cluster_path(api_version: str, kind: str) -> str:
    """The collection of a cluster-scoped kind (the ClusterKopfPeering, StorageClasses)."""
    plural = _PLURALS.get(kind)
    if plural is None:
        raise ValueError(f"the operator does not read {kind} objects")
    base = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
    return f"{base}/{plural}"


def _status_message(reason: str | None, body: bytes | str | None) -> str:
    """The server's own words (a Status object's message) when it sent some, else the HTTP reason."""
    try:
        status = json.loads(body) if body else {}
    except (TypeError, ValueError):
        status = {}
    message = status.get("message") if isinstance(status, dict) else None
    return f"{reason}: {message}" if message else str(reason)


def read_environment_once(api: ApiClient) -> bool:
    """Read the proxy variables and ~/.netrc once for the API server instead of on every request; True when done.

    kubernetes_asyncio's session trusts the environment, so aiohttp looks both up again for every request, each
    in a worker thread (two thread hops a request): a quarter of the operator's CPU when it creates pods by the
    thousand. A proxy the environment names for the server is set on the client instead, and the session stops
    looking. A netrc entry for the server's host, or a proxy with credentials, keeps aiohttp's own lookups."""
    rest = api.rest_client
    session = rest.pool_manager
    url = URL(api.configuration.host)
    if not session.trust_env or url.host is None:
        return False
    try:
        basicauth_from_netrc(netrc_from_env(), url.host)
    except LookupError:
        pass  # no entry for the server: aiohttp would find none on any request either
    else:
        return False
    if not rest.proxy:
        try:
            proxy, proxy_auth = get_env_proxy_for_url(url)
        except LookupError:
            pass  # no proxy for the server (none set, or NO_PROXY names it)
        else:
            if proxy_auth is not None:
                return False
            rest.proxy = str(proxy)
    session._trust_env = False  # aiohttp has no public setter; the session is ours alone
    return True


class KubeClient:
    """The handful of calls the controller makes. `on_call(verb, status)` observes each one."""

    def __init__(self, configuration: Configuration, on_call: Callable[[str, int], None] | None = None) -> None:
        self.api = ApiClient(configuration)
        read_environment_once(self.api)
        self.on_call = on_call or (lambda verb, status: None)

    async def close(self) -> None:
        await self.api.close()

    async def _request(
        self,
        verb: str,
        method: str,
        path: str,
        query: list[tuple[str, str]] | None = None,
        body: Any = None,
        content_type: str = "application/json",
        timeout: aiohttp.ClientTimeout = REQUEST_TIMEOUT,
    ) -> aiohttp.ClientResponse:
        """One request on the ApiClient's session, with its auth, TLS and proxy: the 2xx response, its body unread
        (the caller releases it); `ApiError` for any other answer, or none.

        Not `ApiClient.call_api`: for plain JSON its per-call walk of headers, query and body (to convert model
        objects) and its response decoding cost as much CPU as the HTTP request itself."""
        configuration = self.api.configuration
        rest = self.api.rest_client
        headers = {**self.api.default_headers, "Accept": "application/json", "Content-Type": content_type}
        # Asked on every request, as kubernetes_asyncio does: a refresh hook (an exec plugin, a projected
        # service-account token) keeps the token current.
        token = (await configuration.auth_settings()).get("BearerToken")
        if token:
            headers[token["key"]] = token["value"]
        url = configuration.host + path
        if query:
            url += "?" + urlencode(query)
        options: dict[str, Any] = {"headers": headers, "timeout": timeout}
        if body is not None:
            options["data"] = json.dumps(body)
        if rest.proxy:
            options["proxy"] = rest.proxy
        if rest.proxy_headers:
            options["proxy_headers"] = rest.proxy_headers
        if rest.server_hostname:
            options["server_hostname"] = rest.server_hostname
        try:
            response = await rest.pool_manager.request(method, url, **options)
            if not 200 <= response.status < 300:
                try:
                    data = await response.read()
                finally:
                    response.release()
                self.on_call(verb, response.status)
                raise ApiError(response.status, verb, path, _status_message(response.reason, data))
        except (OSError, TimeoutError, aiohttp.ClientError) as exc:  # aiohttp's are not all OSErrors
            self.on_call(verb, 0)
            raise ApiError(0, verb, path, f"cannot reach the API server: {exc}") from None
        self.on_call(verb, 200)
        return response

    async def _call(
        self,
        verb: str,
        method: str,
        path: str,
        body: Any = None,
        content_type: str = "application/json",
        query: list[tuple[str, str]] | None = None,
    ) -> Manifest:
        response = await self._request(verb, method, path, query, body, content_type)
        try:
            data = await response.read()
        except (OSError, TimeoutError, aiohttp.ClientError) as exc:
            raise ApiError(0, verb, path, f"the answer broke off: {exc}") from None
        finally:
            response.release()
        try:
            result = json.loads(data) if data else {}
        except ValueError:
            raise ApiError(response.status, verb, path, f"the answer is not JSON: {data[:200]!r}") from None
        return result if isinstance(result, dict) else {}

    async def create(self, namespace: str, manifest: Manifest) -> Manifest:
        path = object_path(manifest["apiVersion"], manifest["kind"], namespace)
        return await self._call("create", "POST", path, manifest)

    async def get(self, api_version: str, kind: str, namespace: str, name: str) -> Manifest:
        return await self._call("get", "GET", object_path(api_version, kind, namespace, name))

    async def get_cluster_object(self, api_version: str, kind: str, name: str) -> Manifest:
        """GET a cluster-scoped object (the ClusterKopfPeering)."""
        return await self._call("get", "GET", f"{_cluster_path(api_version, kind)}/{name}")

    async def list(
        self, api_version: str, kind: str, namespace: str, labels: str = "", fields: str = ""
    ) -> list[Manifest]:
        """LIST with label and field selectors (a live read: the watch caches can miss what vanished)."""
        query = [(k, v) for k, v in (("labelSelector", labels), ("fieldSelector", fields)) if v]
        result = await self._call("list", "GET", object_path(api_version, kind, namespace), query=query)
        return list(result.get("items") or [])

    async def list_cluster(self, api_version: str, kind: str) -> list[Manifest]:
        """LIST a cluster-scoped kind (the StorageClasses)."""
        result = await self._call("list", "GET", _cluster_path(api_version, kind))
        return list(result.get("items") or [])

    async def list_named(
        self, api_version: str, kind: str, namespace: str | None, name: str
    ) -> tuple[Manifest | None, str]:
        """The object called `name` (None when there is none) and the resourceVersion to watch it from."""
        path = object_path(api_version, kind, namespace) if namespace is not None else _cluster_path(api_version, kind)
        result = await self._call("list", "GET", path, query=[("fieldSelector", f"metadata.name={name}")])
        found = next((i for i in result.get("items") or [] if (i.get("metadata") or {}).get("name") == name), None)
        return found, str((result.get("metadata") or {}).get("resourceVersion") or "")

    async def watch_named(
        self, api_version: str, kind: str, namespace: str | None, name: str, since: str, timeout: float
    ) -> bool:
        """Watch the object called `name` from resourceVersion `since`: True at its first change, False when
        `timeout` seconds pass without one (or the server ends the watch: 410 Gone included)."""
        path = object_path(api_version, kind, namespace) if namespace is not None else _cluster_path(api_version, kind)
        query = [
            ("watch", "true"),
            ("fieldSelector", f"metadata.name={name}"),
            ("timeoutSeconds", str(max(int(timeout), 1))),
        ]
        if since:
            query.append(("resourceVersion", since))
        response = await self._request("watch", "GET", path, query, timeout=aiohttp.ClientTimeout(total=timeout + 5))
        try:
            async with asyncio.timeout(timeout):
                async for line in response.content:
                    if not line.strip():
                        continue
                    event = json.loads(line)
                    if event.get("type") in ("ADDED", "MODIFIED", "DELETED"):
                        return True
                    if event.get("type") == "ERROR":
                        return False
        except (TimeoutError, aiohttp.ClientError, ValueError):
            return False
        finally:
            response.release()
        return False

    async def list_page(self, path: str, labels: str, limit: int, token: str = "") -> Manifest:
        """One page of a LIST of the collection at `path` (a namespace's or the cluster's), `limit` items at most:
        its `items`, and in `metadata` the `continue` token of the next page and the `resourceVersion` to watch
        from."""
        query = [("labelSelector", labels), ("limit", str(limit))] if labels else [("limit", str(limit))]
        if token:
            query.append(("continue", token))
        return await self._call("list", "GET", path, query=query)

    async def watch(self, path: str, labels: str, since: str, timeout: float) -> AsyncIterator[Manifest]:
        """The events of a WATCH of the collection at `path` from resourceVersion `since`, bookmarks included, parsed
        one line at a time as they arrive; it ends when the server ends the watch (after `timeout` seconds)."""
        query = [
            ("watch", "true"),
            ("allowWatchBookmarks", "true"),
            ("resourceVersion", since),
            ("timeoutSeconds", str(max(int(timeout), 1))),
        ]
        if labels:
            query.append(("labelSelector", labels))
        limit = aiohttp.ClientTimeout(total=None, sock_connect=30, sock_read=timeout + 30)
        response = await self._request("watch", "GET", path, query, timeout=limit)
        pending = b""
        try:
            # Split the lines here: aiohttp's own line reader refuses a line over 64 KiB (a pod with large
            # annotations).
            async for chunk in response.content.iter_any():
                pending += chunk
                *lines, pending = pending.split(b"\n")
                for line in lines:
                    if line.strip():
                        yield json.loads(line)
        except (OSError, TimeoutError, aiohttp.ClientError, ValueError) as exc:
            raise ApiError(0, "watch", path, f"the watch broke off: {exc}") from None
        finally:
            response.release()

    async def patch(self, api_version: str, kind: str, namespace: str, name: str, patch: Manifest) -> Manifest:
        path = object_path(api_version, kind, namespace, name)
        return await self._call("patch", "PATCH", path, patch, MERGE_PATCH)

    async def delete(self, api_version: str, kind: str, namespace: str, name: str, uid: str | None = None) -> None:
        """Delete; with `uid`, only that incarnation (a precondition: a recreated namesake is left alone)."""
        body: Manifest = {"apiVersion": "v1", "kind": "DeleteOptions", "propagationPolicy": "Background"}
        if uid:
            body["preconditions"] = {"uid": uid}
        await self._call("delete", "DELETE", object_path(api_version, kind, namespace, name), body)

    async def patch_job_status(
        self, namespace: str, name: str, status: Manifest, preconditions: Manifest | None = None
    ) -> Manifest:
        """Merge-patch the status; `preconditions` (`uid`, `resourceVersion`) make a changed job a 409."""
        path = object_path(API_VERSION, KIND, namespace, name) + "/status"
        body: Manifest = {"status": status}
        if preconditions:
            body["metadata"] = dict(preconditions)
        return await self._call("patch", "PATCH", path, body, MERGE_PATCH)

    async def scale_job(self, namespace: str, name: str, replicas: int) -> Manifest:
        """Set the rollout count through the scale subresource, as `kubectl scale rljob/NAME` does."""
        path = object_path(API_VERSION, KIND, namespace, name) + "/scale"
        return await self._call("patch", "PATCH", path, {"spec": {"replicas": replicas}}, MERGE_PATCH)

    async def post_event(self, job: Manifest, kind: str, reason: str, message: str, now: datetime.datetime) -> Manifest:
        """A core/v1 Event on the RLJob: what `kubectl describe rljob` lists."""
        meta = job["metadata"]
        stamp = now.astimezone(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        event = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"name": f"{meta['name']}.{uuid.uuid4().hex[:16]}", "namespace": meta["namespace"]},
            "involvedObject": {
                "apiVersion": API_VERSION,
                "kind": KIND,
                "name": meta["name"],
                "namespace": meta["namespace"],
                "uid": meta.get("uid"),
                "resourceVersion": meta.get("resourceVersion"),
            },
            "type": kind,
            "reason": reason,
            "message": message[:1024],
            "source": {"component": COMPONENT},
            "reportingComponent": COMPONENT,
            "reportingInstance": COMPONENT,
            "firstTimestamp": stamp,
            "lastTimestamp": stamp,
            "count": 1,
        }
        return await self.create(meta["namespace"], event)


async def load_configuration() -> Configuration:
    """In a pod: the ServiceAccount; elsewhere: the current kubeconfig context (KUBECONFIG honoured)."""
    from kubernetes_asyncio import config

    configuration = Configuration()
    try:
        config.load_incluster_config(client_configuration=configuration)
    except config.ConfigException:
        await config.load_kube_config(client_configuration=configuration)
    return configuration
