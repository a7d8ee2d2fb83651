"""The operator's API client reads the proxy variables and ~/.netrc once, not on every request, and still goes
through the proxy the environment names; it sends a current token with every request and reports the server's
own words on an error."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from kubernetes_asyncio.client import Configuration

from rljob.operator.client import ApiError, KubeClient
from rljob.operator.controller import parse_job
from rljob.operator.manifests import build_children
from rljob.operator.settings import OperatorSettings
from tests.operator.controller.conftest import cartpole_job

POD = b'{"kind": "Pod", "metadata": {"name": "p"}}'


async def serve(
    requests: list[str],
    bodies: list[bytes] | None = None,
    heads: list[bytes] | None = None,
    status: bytes = b"200 OK",
    payload: bytes = POD,
) -> tuple[asyncio.Server, int]:
    """A server that answers every request with `payload` (a pod) and records its request line (a proxy sees the
    full URL), into `bodies` what it was sent and into `heads` the whole request head."""

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        requests.append(head.split(b"\r\n", 1)[0].decode())
        if heads is not None:
            heads.append(head)
        length = next(
            (int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length:")),
            0,
        )
        if bodies is not None:
            bodies.append(await reader.readexactly(length))
        writer.write(
            b"HTTP/1.1 "
            + status
            + b"\r\nContent-Type: application/json\r\nConnection: close\r\n"
            + f"Content-Length: {len(payload)}\r\n\r\n".encode()
            + payload
        )
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(answer, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "NO_PROXY", "http_proxy", "https_proxy", "no_proxy"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("NETRC", raising=False)
    return tmp_path


async def test_without_proxy_or_netrc_requests_go_straight_to_the_server_without_looking_again(clean_env: Path):
    requests: list[str] = []
    server, port = await serve(requests)
    client = KubeClient(Configuration(host=f"http://127.0.0.1:{port}"))
    try:
        assert client.api.rest_client.pool_manager.trust_env is False
        assert (await client.get("v1", "Pod", "ns", "p"))["metadata"]["name"] == "p"
        assert requests == ["GET /api/v1/namespaces/ns/pods/p HTTP/1.1"]
    finally:
        await client.close()
        server.close()


async def test_the_proxy_the_environment_names_is_still_used(clean_env: Path, monkeypatch: pytest.MonkeyPatch):
    requests: list[str] = []
    proxy, port = await serve(requests)
    monkeypatch.setenv("HTTP_PROXY", f"http://127.0.0.1:{port}")
    client = KubeClient(Configuration(host="http://kubernetes.example:6443"))
    try:
        assert client.api.rest_client.pool_manager.trust_env is False
        await client.get("v1", "Pod", "ns", "p")
        assert requests == ["GET http://kubernetes.example:6443/api/v1/namespaces/ns/pods/p HTTP/1.1"]
    finally:
        await client.close()
        proxy.close()


async def test_no_proxy_for_the_server_is_honoured(clean_env: Path, monkeypatch: pytest.MonkeyPatch):
    requests: list[str] = []
    server, port = await serve(requests)
    monkeypatch.setenv("HTTP_PROXY", "http://127.0.0.1:9")  # nothing listens there
    monkeypatch.setenv("NO_PROXY", "127.0.0.1")
    client = KubeClient(Configuration(host=f"http://127.0.0.1:{port}"))
    try:
        await client.get("v1", "Pod", "ns", "p")
        assert requests == ["GET /api/v1/namespaces/ns/pods/p HTTP/1.1"]
    finally:
        await client.close()
        server.close()


async def test_a_netrc_entry_for_the_server_keeps_aiohttps_own_lookups(clean_env: Path):
    (clean_env / ".netrc").write_text("machine kubernetes.example login me password secret\n")
    (clean_env / ".netrc").chmod(0o600)
    client = KubeClient(Configuration(host="http://kubernetes.example:6443"))
    try:
        assert client.api.rest_client.pool_manager.trust_env is True
    finally:
        await client.close()


async def test_a_manifest_goes_out_as_built(clean_env: Path):
    body = cartpole_job()
    body["metadata"].update(uid="u-1", generation=1)
    job, _ = parse_job(body)
    pod = next(c for c in build_children(job, OperatorSettings()) if c["kind"] == "Pod")
    requests: list[str] = []
    bodies: list[bytes] = []
    server, port = await serve(requests, bodies)
    client = KubeClient(Configuration(host=f"http://127.0.0.1:{port}"))
    try:
        await client.create("ns", pod)
        assert requests == ["POST /api/v1/namespaces/ns/pods HTTP/1.1"]
        assert json.loads(bodies[0]) == pod
    finally:
        await client.close()
        server.close()


async def test_every_request_carries_the_token_as_the_refresh_hook_left_it(clean_env: Path):
    """An exec plugin or a projected service-account token renews the token through the configuration's hook."""
    heads: list[bytes] = []
    server, port = await serve([], heads=heads)
    configuration = Configuration(host=f"http://127.0.0.1:{port}")
    configuration.api_key = {"BearerToken": "first"}
    configuration.api_key_prefix = {"BearerToken": "Bearer"}
    renewals = iter(["first", "second"])

    def refresh(config: Configuration) -> None:
        config.api_key["BearerToken"] = next(renewals)

    configuration.refresh_api_key_hook = refresh
    client = KubeClient(configuration)
    try:
        await client.get("v1", "Pod", "ns", "p")
        await client.list("v1", "Pod", "ns", labels="rljob.io/job in (a,b)")
        tokens = [next(line for line in h.split(b"\r\n") if line.lower().startswith(b"authorization:")) for h in heads]
        assert [t.split(b":", 1)[1].strip() for t in tokens] == [b"Bearer first", b"Bearer second"]
        assert heads[1].startswith(b"GET /api/v1/namespaces/ns/pods?labelSelector=rljob.io/job+in+(a,b) ")
    finally:
        await client.close()
        server.close()


async def test_an_error_answer_is_an_api_error_with_the_servers_message(clean_env: Path):
    status = {"kind": "Status", "code": 403, "reason": "Forbidden", "message": 'pods "p" is forbidden: exceeded quota'}
    server, port = await serve([], status=b"403 Forbidden", payload=json.dumps(status).encode())
    seen: list[tuple[str, int]] = []
    client = KubeClient(Configuration(host=f"http://127.0.0.1:{port}"), lambda verb, code: seen.append((verb, code)))
    try:
        with pytest.raises(ApiError) as raised:
            await client.create("ns", {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p"}})
        assert raised.value.status == 403
        assert str(raised.value) == (
            'create /api/v1/namespaces/ns/pods: 403 Forbidden: pods "p" is forbidden: exceeded quota'
        )
        assert seen == [("create", 403)]
    finally:
        await client.close()
        server.close()


async def test_a_server_that_is_not_there_is_status_0(clean_env: Path):
    server, port = await serve([])
    server.close()
    await server.wait_closed()
    client = KubeClient(Configuration(host=f"http://127.0.0.1:{port}"))
    try:
        with pytest.raises(ApiError) as raised:
            await client.get("v1", "Pod", "ns", "p")
        assert raised.value.status == 0
        assert "cannot reach the API server" in str(raised.value)
    finally:
        await client.close()
