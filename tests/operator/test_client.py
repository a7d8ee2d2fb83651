"""The operator's API client reads the proxy variables and ~/.netrc once, not on every request, and still goes
through the proxy the environment names."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from kubernetes_asyncio.client import Configuration

from rljob.operator.client import KubeClient
from rljob.operator.controller import parse_job
from rljob.operator.manifests import build_children
from rljob.operator.settings import OperatorSettings
from tests.operator.controller.conftest import cartpole_job

POD = b'{"kind": "Pod", "metadata": {"name": "p"}}'


async def serve(requests: list[str], bodies: list[bytes] | None = None) -> tuple[asyncio.Server, int]:
    """A server that answers every request with a pod and records its request line (a proxy sees the full URL)
    and, into `bodies`, what it was sent."""

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        requests.append(head.split(b"\r\n", 1)[0].decode())
        length = next(
            (int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length:")),
            0,
        )
        if bodies is not None:
            bodies.append(await reader.readexactly(length))
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: close\r\n"
            + f"Content-Length: {len(POD)}\r\n\r\n".encode()
            + POD
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
        assert client.api.sanitize_for_serialization(pod) == pod  # what kubernetes_asyncio would have sent
    finally:
        await client.close()
        server.close()
