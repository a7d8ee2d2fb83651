"""The data plane over real pyzmq sockets: round trips, timeouts, a restarted peer, a retried request."""

from __future__ import annotations

import socket
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest

from rljob.runtime.wire.transport import (
    RemoteError,
    RequestClient,
    RequestServer,
    RequestTimeout,
    _Header,
    decode,
    encode,
)

SERVER = textwrap.dedent(
    """
    import os, sys
    from rljob.runtime.wire.transport import RequestServer
    calls = 0
    def count(payload):
        global calls
        calls += 1
        return {"calls": calls, "pid": os.getpid()}
    def echo(payload):
        return {"x": payload["x"] * 2}
    RequestServer(sys.argv[1], {"count": count, "echo": echo}).serve(lambda: False)
    """
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(endpoint: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", SERVER, endpoint])


def stop(process: subprocess.Popen[bytes]) -> None:
    process.kill()
    process.wait()


def test_arrays_round_trip_without_pickling():
    payload = {"obs": np.arange(12, dtype=np.float32).reshape(3, 4), "done": np.array([True, False]), "step": 7}
    header, decoded = decode(encode(_Header(id=3, method="m"), payload))
    assert header.id == 3 and decoded["step"] == 7
    np.testing.assert_array_equal(decoded["obs"], payload["obs"])
    assert decoded["obs"].dtype == np.float32 and decoded["done"].dtype == np.bool_


def test_request_reply_fans_out_to_several_servers():
    endpoints = [f"127.0.0.1:{free_port()}" for _ in range(2)]
    servers = [start_server(e) for e in endpoints]
    try:
        clients = [RequestClient(e, timeout=20) for e in endpoints]
        # Every request goes out before any reply is awaited: the servers work in parallel.
        requests = [c.send("echo", {"x": np.full(3, i, dtype=np.int64)}) for i, c in enumerate(clients)]
        replies = [c.receive(r) for c, r in zip(clients, requests, strict=True)]
        assert [r["x"].tolist() for r in replies] == [[0, 0, 0], [2, 2, 2]]
        with pytest.raises(RemoteError, match="unknown method"):
            clients[0].call("nope")
    finally:
        for s in servers:
            stop(s)


def test_call_to_an_absent_server_times_out_with_a_typed_error():
    client = RequestClient(f"127.0.0.1:{free_port()}", timeout=0.2, retries=1)
    with pytest.raises(RequestTimeout, match="no reply after 2 attempt"):
        client.call("count")


def test_client_reconnects_after_the_server_process_restarts():
    endpoint = f"127.0.0.1:{free_port()}"
    server = start_server(endpoint)
    client = RequestClient(endpoint, timeout=1.0, retries=30)
    try:
        first = client.call("count")
        assert first["calls"] == 1
        stop(server)
        # This request is in flight while nobody listens: the client resends it once the new server is up.
        request = client.send("count")
        server = start_server(endpoint)
        second = client.receive(request)
        assert second["pid"] != first["pid"] and second["calls"] == 1
        assert client.call("count")["calls"] == 2
    finally:
        stop(server)


class CountingClient(RequestClient):
    """A real client that records each time it puts a request on the wire (first send and every resend)."""

    def __init__(self, *args, **kwargs) -> None:
        self.sends = 0
        self.resent = threading.Event()
        super().__init__(*args, **kwargs)

    def _send_frames(self, frames):
        self.sends += 1
        if self.sends >= 2:
            self.resent.set()
        super()._send_frames(frames)


def test_a_retried_request_is_executed_once():
    endpoint = f"127.0.0.1:{free_port()}"
    client = CountingClient(endpoint, timeout=0.05, retries=400)  # ~20 s of retries at most: a safety net
    calls = []
    released = []

    def count(payload):
        # Hold the first execution until the client has given up waiting and resent the same request.
        released.append(client.resent.wait(timeout=30))
        calls.append(payload)
        return {"n": len(calls)}

    server = RequestServer(endpoint, {"count": count})
    stop = threading.Event()
    serving = threading.Thread(target=server.serve, args=(stop.is_set,))
    serving.start()
    try:
        reply = client.call("count", {"x": 1})
    finally:
        stop.set()
        serving.join(timeout=30)
        server.close()
    assert released == [True]  # the handler ran once, and only after the client had resent
    assert reply == {"n": 1}
    assert len(calls) == 1
    # The client resent the request while the first execution was held: the copies that reached the server
    # were answered from its reply cache (with the cache off the handler runs again and the reply is n=2).
    assert client.sends >= 2
