"""The job key on the data plane: with the per-job Secret's key, a request from a process without it (another job's
pod, where NetworkPolicies are not enforced) is refused before any handler runs."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from rljob.runtime.wire.transport import (
    TRANSPORT_KEY_FILE_ENV,
    RemoteError,
    RequestClient,
    RequestServer,
    RequestTimeout,
    TransportError,
    _Header,
    encode,
    seal,
    transport_key,
    unseal,
)

KEY = b"0123456789abcdef0123456789abcdef"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture()
def keyed_server() -> Iterator[tuple[str, RequestServer, list[int]]]:
    calls: list[int] = []

    def score(payload):
        calls.append(1)
        return {"score": payload["x"] * 2}

    endpoint = f"127.0.0.1:{free_port()}"
    server = RequestServer(endpoint, {"score": score}, key=KEY)
    stop = threading.Event()
    thread = threading.Thread(target=server.serve, args=(stop.is_set,), daemon=True)
    thread.start()
    yield endpoint, server, calls
    stop.set()
    thread.join(timeout=5)
    server.close()


def test_a_client_with_the_job_key_is_served(keyed_server):
    endpoint, server, calls = keyed_server
    client = RequestClient(endpoint, key=KEY, timeout=5)
    reply = client.call("score", {"x": np.arange(4, dtype=np.int64)})
    np.testing.assert_array_equal(reply["score"], [0, 2, 4, 6])
    assert calls == [1] and server.refused == 0
    client.close()


def test_a_client_without_the_key_is_refused_and_told_why(keyed_server, monkeypatch):
    endpoint, server, calls = keyed_server
    monkeypatch.delenv(TRANSPORT_KEY_FILE_ENV, raising=False)
    client = RequestClient(endpoint, timeout=5)
    with pytest.raises(RemoteError) as refused:
        client.call("score", {"x": np.arange(4)})
    assert refused.value.kind == "PermissionError" and "transport key" in refused.value.message
    assert calls == [] and server.refused == 1
    client.close()


def test_a_client_with_another_jobs_key_is_refused(keyed_server):
    endpoint, server, calls = keyed_server
    client = RequestClient(endpoint, key=b"another job's key", timeout=0.5, retries=0)
    with pytest.raises(RequestTimeout):  # the refusal is not sealed with its key: nothing it may trust arrives
        client.call("score", {"x": np.arange(4)})
    assert calls == [] and server.refused == 1
    client.close()


def test_a_tampered_frame_breaks_the_seal():
    frames = seal(KEY, encode(_Header(id=1, method="score"), {"x": np.arange(4, dtype=np.int64)}))
    assert unseal(KEY, frames) is not None
    tampered = [frames[0], np.arange(1, 5, dtype=np.int64).tobytes(), frames[-1]]
    assert unseal(KEY, tampered) is None
    assert unseal(KEY, frames[:-1]) is None  # no seal at all
    assert unseal(None, frames) == frames  # without a key nothing is checked


def test_the_key_comes_from_the_mounted_secret(tmp_path: Path, monkeypatch):
    path = tmp_path / "key"
    path.write_bytes(KEY + b"\n")
    monkeypatch.setenv(TRANSPORT_KEY_FILE_ENV, str(path))
    assert transport_key() == KEY
    path.write_bytes(b"")
    with pytest.raises(TransportError, match="empty"):
        transport_key()
    monkeypatch.delenv(TRANSPORT_KEY_FILE_ENV)
    assert transport_key() is None
