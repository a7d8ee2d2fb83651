"""The launchers' read of actor 0's `/progress`: an answer, or None however the actor fails to give one."""

from __future__ import annotations

import socket
import threading

from rljob.launch.local import read_progress


def serve_once(reply: bytes) -> str:
    """A one-request HTTP server that answers `reply` raw and closes; its URL."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def answer() -> None:
        connection, _ = listener.accept()
        with connection, listener:
            connection.recv(65536)
            connection.sendall(reply)

    threading.Thread(target=answer, daemon=True).start()
    return f"http://127.0.0.1:{port}/progress"


def test_an_answer_is_read_and_an_actor_gone_mid_answer_or_not_listening_is_none():
    body = b'{"step": 3, "totalSteps": 10}'
    whole = b"HTTP/1.0 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
    assert read_progress(serve_once(whole)) == {"step": 3, "totalSteps": 10}
    # The actor exited while answering: the body stops short of its length (http.client.IncompleteRead).
    cut = b"HTTP/1.0 200 OK\r\nContent-Type: application/json\r\nContent-Length: 254\r\n\r\n"
    assert read_progress(serve_once(cut)) is None
    assert read_progress(serve_once(b"HTTP/1.0 200 OK\r\n\r\n[1, 2]")) is None  # not a report
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        port = unused.getsockname()[1]
    assert read_progress(f"http://127.0.0.1:{port}/progress") is None
