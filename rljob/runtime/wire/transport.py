"""The data plane between role processes: pyzmq sockets, msgpack headers, numpy arrays as raw frames.

A message is a multipart ZMQ message: one msgpack header (request id, method, small metadata and the
dtype/shape of every array) followed by one frame per numpy array, sent without pickling and received
without copying, in one pattern: request/reply (`RequestClient` -> `RequestServer`), DEALER/ROUTER with
request ids. REQ sockets wedge when a reply is lost, so the client follows the "lazy pirate" pattern
instead: on timeout it throws its socket away (dropping whatever was queued for a dead peer), opens a fresh
one and resends the same request id. The server answers a repeated id from a per-client cache, so a
retried request is executed once. ZMQ reconnects to a restarted peer by itself; a peer that stays away
ends in `RequestTimeout`. `send` on several clients, then `receive` from each, lets their servers work in
parallel. A caller that keeps its own deadlines (rljob/runtime/wire/deadlines.py) uses the steps of `receive`
one by one: `wait` (a reply or None, the request still pending), `resend` (same id, fresh socket), `forget`.

With a job key (`RLJOB_TRANSPORT_KEY_FILE`, the per-job Secret the operator mounts) every message carries an
HMAC-SHA256 of its frames as one more frame: a server refuses a request without a valid one (PermissionError,
unsealed, so a caller without the key learns why) and a client ignores a reply without one. Without a key
(`rljob run`, the Ray launcher) messages are as before.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import itertools
import os
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any

import msgspec
import numpy as np
import zmq

from rljob.runtime.wire.identity import TRANSPORT_KEY_FILE_ENV

Payload = dict[str, Any]
"""A message body: numpy arrays (top-level values) travel as raw frames, everything else as msgpack."""
Handler = Callable[[Payload], Payload | None]


class TransportError(RuntimeError):
    """Base class of data-plane failures."""


class RequestTimeout(TransportError):
    """No reply within the timeout, after every retry: the peer is down or too slow."""


class RemoteError(TransportError):
    """The peer's handler raised; `kind` is the exception type name on the peer."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(f"{kind}: {message}")
        self.kind = kind
        self.message = message


class _Header(msgspec.Struct, omit_defaults=True):
    id: int = 0
    client: str = ""
    method: str = ""
    meta: dict[str, Any] = {}
    arrays: list[tuple[str, str, tuple[int, ...]]] = []
    error: tuple[str, str] | None = None


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(_Header)


def encode(header: _Header, payload: Mapping[str, Any] | None) -> list[Any]:
    """Header frame + one frame per top-level numpy array of `payload` (C-contiguous, not copied)."""
    meta: dict[str, Any] = {}
    arrays: list[tuple[str, str, tuple[int, ...]]] = []
    frames: list[Any] = []
    for key, value in (payload or {}).items():
        if isinstance(value, np.ndarray):
            value = np.ascontiguousarray(value)
            arrays.append((key, value.dtype.str, tuple(value.shape)))
            frames.append(memoryview(value.reshape(-1).view(np.uint8)) if value.size else b"")
        else:
            meta[key] = value
    header.meta, header.arrays = meta, arrays
    return [_encoder.encode(header), *frames]


def decode(frames: list[Any]) -> tuple[_Header, Payload]:
    """Inverse of `encode`; arrays are read-only views on the received buffers."""
    header = _decoder.decode(_bytes(frames[0]))
    payload: Payload = dict(header.meta)
    for (key, dtype, shape), frame in zip(header.arrays, frames[1:], strict=True):
        buffer = frame.buffer if isinstance(frame, zmq.Frame) else frame
        payload[key] = np.frombuffer(buffer, dtype=np.dtype(dtype)).reshape(shape)
    return header, payload


def transport_key() -> bytes | None:
    """This process's job key, or None where no key is set (local runs)."""
    path = os.environ.get(TRANSPORT_KEY_FILE_ENV)
    if not path:
        return None
    try:
        with open(path, "rb") as file:
            key = file.read().strip()
    except OSError as exc:
        raise TransportError(
            f"{TRANSPORT_KEY_FILE_ENV}={path} cannot be read ({exc.strerror}): the job's Secret is not mounted there"
        ) from None
    if not key:
        raise TransportError(f"{TRANSPORT_KEY_FILE_ENV}={path} is empty: the job's Secret holds no key")
    return key


def _mac(key: bytes, frames: list[Any]) -> bytes:
    digest = hmac.new(key, digestmod=hashlib.sha256)
    for frame in frames:
        data = frame.buffer if isinstance(frame, zmq.Frame) else frame
        digest.update(memoryview(data).nbytes.to_bytes(8, "little"))  # frame boundaries count too
        digest.update(data)
    return digest.digest()


def seal(key: bytes | None, frames: list[Any]) -> list[Any]:
    """`frames` with their HMAC appended (unchanged without a key)."""
    return frames if key is None else [*frames, _mac(key, frames)]


def unseal(key: bytes | None, frames: list[Any]) -> list[Any] | None:
    """The frames without their HMAC, or None when it is missing or wrong (unchanged without a key)."""
    if key is None:
        return frames
    if len(frames) < 2 or not hmac.compare_digest(_bytes(frames[-1]), _mac(key, frames[:-1])):
        return None
    return frames[:-1]


ZERO_COPY_BYTES = 1 << 16
"""Below this message size copying is cheaper than zero-copy, whose buffer release is signalled to a
garbage-collector thread (~100 us per send, measured): small per-step messages are copied."""


def _copy(frames: list[Any]) -> bool:
    return sum(len(f) if isinstance(f, bytes) else memoryview(f).nbytes for f in frames) < ZERO_COPY_BYTES


def _bytes(frame: Any) -> bytes:
    return frame.bytes if isinstance(frame, zmq.Frame) else bytes(frame)


def tcp(endpoint: str) -> str:
    """`host:port` -> `tcp://host:port` (ZMQ address)."""
    return endpoint if "://" in endpoint else f"tcp://{endpoint}"


def bind_address(endpoint: str) -> str:
    """Where a server binds for its advertised `host:port`: every interface, same port."""
    return f"tcp://*:{endpoint.rsplit(':', 1)[1]}" if "://" not in endpoint else endpoint


class RequestClient:
    """Calls one `RequestServer`; survives the server restarting (see module docstring)."""

    def __init__(
        self,
        endpoint: str,
        *,
        timeout: float = 10.0,
        retries: int = 2,
        hwm: int = 64,
        context: zmq.Context | None = None,
        key: bytes | None = None,
    ) -> None:
        self.endpoint = tcp(endpoint)
        self.key = key if key is not None else transport_key()
        self.timeout = timeout
        self.retries = retries
        self.hwm = hwm
        self._context = context or zmq.Context.instance()
        self._client = uuid.uuid4().hex
        self._ids = itertools.count(1)
        self._socket: zmq.Socket | None = None
        self._pending: dict[int, tuple[str, list[Any]]] = {}
        self._connect()

    def _connect(self) -> None:
        if self._socket is not None:
            self._socket.close(linger=0)
        socket = self._context.socket(zmq.DEALER)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.SNDHWM, self.hwm)
        socket.setsockopt(zmq.RCVHWM, self.hwm)
        # Reconnect quickly to a restarted peer (defaults back off to 100 ms anyway; keep it bounded).
        socket.setsockopt(zmq.RECONNECT_IVL, 50)
        socket.setsockopt(zmq.RECONNECT_IVL_MAX, 500)
        socket.connect(self.endpoint)
        self._socket = socket

    @property
    def socket(self) -> zmq.Socket:
        assert self._socket is not None
        return self._socket

    def send(self, method: str, payload: Mapping[str, Any] | None = None) -> int:
        """Start a request; collect its reply with `receive(id)`. Lets one caller fan out to many servers."""
        request_id = next(self._ids)
        frames = seal(self.key, encode(_Header(id=request_id, client=self._client, method=method), payload))
        self._pending[request_id] = (method, frames)
        self._send_frames(frames)
        return request_id

    def _send_frames(self, frames: list[Any]) -> None:
        # A full outgoing queue (HWM) means the peer is gone or swamped: the retry path reconnects.
        with contextlib.suppress(zmq.Again):
            self.socket.send_multipart(frames, copy=_copy(frames), flags=zmq.NOBLOCK)

    def receive(self, request_id: int, timeout: float | None = None, retries: int | None = None) -> Payload:
        """The reply to `request_id`; resends on timeout, raises `RequestTimeout` after the last retry."""
        timeout = self.timeout if timeout is None else timeout
        retries = self.retries if retries is None else retries
        method = self._pending[request_id][0]
        try:
            for attempt in range(retries + 1):
                if attempt:
                    self.resend(request_id)
                reply = self.wait(request_id, timeout)
                if reply is not None:
                    return reply
            raise RequestTimeout(
                f"{method} to {self.endpoint}: no reply after {retries + 1} attempt(s) of {timeout:g}s"
            )
        finally:
            self.forget(request_id)

    def wait(self, request_id: int, timeout: float) -> Payload | None:
        """The reply to `request_id` if it comes within `timeout` seconds (0: only one already here), else None;
        the request stays pending: wait again, `resend` it or `forget` it. Replies to other requests are dropped
        (late replies to abandoned requests)."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if not self.socket.poll(max(0, int(left * 1000)), zmq.POLLIN):
                return None
            opened = unseal(self.key, self.socket.recv_multipart(copy=False))
            if opened is None:
                continue  # not from a server of this job
            header, payload = decode(opened)
            if header.id != request_id:
                continue  # a late reply to an abandoned request
            if header.error is not None:
                raise RemoteError(*header.error)
            return payload

    def resend(self, request_id: int) -> None:
        """Send a pending request again on a fresh socket (the lazy pirate step): same id, so a server that has
        it already answers from its cache instead of doing the work twice."""
        self._connect()
        self._send_frames(self._pending[request_id][1])

    def forget(self, request_id: int) -> None:
        """Abandon a request: a reply that still comes for it is dropped."""
        self._pending.pop(request_id, None)

    def call(
        self,
        method: str,
        payload: Mapping[str, Any] | None = None,
        timeout: float | None = None,
        retries: int | None = None,
    ) -> Payload:
        return self.receive(self.send(method, payload), timeout, retries)

    def close(self) -> None:
        if self._socket is not None:
            self._socket.close(linger=0)
            self._socket = None


class RequestServer:
    """Answers requests by method name, one at a time, from the thread that calls `serve`/`poll_once`."""

    def __init__(
        self,
        endpoint: str,
        handlers: Mapping[str, Handler],
        *,
        hwm: int = 64,
        context: zmq.Context | None = None,
        cache_per_client: int = 4,
        key: bytes | None = None,
    ) -> None:
        self.handlers = dict(handlers)
        self.key = key if key is not None else transport_key()
        self.refused = 0
        """Requests refused for a missing or wrong job key."""
        self._context = context or zmq.Context.instance()
        self.socket = self._context.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.SNDHWM, hwm)
        self.socket.setsockopt(zmq.RCVHWM, hwm)
        self.socket.bind(bind_address(endpoint))
        self._cache_size = cache_per_client
        self._replies: dict[str, OrderedDict[int, list[Any]]] = {}
        self.requests = 0

    def poll_once(self, timeout: float) -> bool:
        """Handle at most one request; False when none arrived within `timeout` seconds."""
        if not self.socket.poll(int(timeout * 1000), zmq.POLLIN):
            return False
        frames = self.socket.recv_multipart(copy=False)
        routing, body = frames[0], unseal(self.key, frames[1:])
        if body is None:
            self._refuse(routing, frames[1:])
            return True
        header, payload = decode(body)
        cache = self._replies.setdefault(header.client, OrderedDict())
        reply = cache.get(header.id)
        if reply is None:
            reply = self._handle(header, payload)
            cache[header.id] = reply
            while len(cache) > self._cache_size:
                cache.popitem(last=False)
        self.requests += 1
        # A reply whose client went away is dropped by ZMQ (ROUTER drops unroutable messages).
        self.socket.send_multipart([routing, *reply], copy=_copy(reply))
        return True

    def _handle(self, header: _Header, payload: Payload) -> list[Any]:
        handler = self.handlers.get(header.method)
        try:
            if handler is None:
                raise KeyError(f"unknown method {header.method!r}; this server knows {sorted(self.handlers)}")
            result = handler(payload)
        except Exception as exc:
            return seal(self.key, encode(_Header(id=header.id, error=(type(exc).__name__, str(exc))), None))
        return seal(self.key, encode(_Header(id=header.id), result))

    def _refuse(self, routing: Any, frames: list[Any]) -> None:
        """A request without this job's key: answered unsealed, so a caller without the key learns why."""
        self.refused += 1
        try:
            request_id = _decoder.decode(_bytes(frames[0])).id if frames else 0
        except msgspec.DecodeError:
            request_id = 0
        error = ("PermissionError", "the request does not carry this job's transport key (RLJOB_TRANSPORT_KEY_FILE)")
        self.socket.send_multipart([routing, *encode(_Header(id=request_id, error=error), None)])

    def serve(
        self,
        should_stop: Callable[[], bool],
        idle: Callable[[], None] | None = None,
        beat: Callable[[], None] | None = None,
    ) -> None:
        """Handle requests until `should_stop()`; `beat()` before each poll (every 0.1 s while idle), so a
        handler that never returns stops the beats (the role's heartbeat)."""
        while not should_stop():
            if beat is not None:
                beat()
            if not self.poll_once(0.1) and idle is not None:
                idle()

    def close(self) -> None:
        self.socket.close(linger=0)


def process_tag() -> str:
    """A short id of this process incarnation: peers compare it to notice a restart."""
    return f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
