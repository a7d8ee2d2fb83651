"""The HTTP side of every role: `/healthz`, `/livez`, `/metrics` and, on actor replica 0, `/progress`.

A stdlib `ThreadingHTTPServer` in a daemon thread: no event loop to share with the role's own
work, nothing to install. The data plane never goes through here.
"""

from __future__ import annotations

import contextlib
import faulthandler
import http.client
import json
import logging
import sys
import threading
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from rljob.runtime.process.termination import TERMINATION_LOG, write_termination_message
from rljob.runtime.wire.liveness import Heartbeat

log = logging.getLogger(__name__)


def rfc3339_now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds").replace("+00:00", "Z")


@dataclass
class Progress:
    """RL progress as the operator reads it from `GET /progress` (the contract's exact keys)."""

    step: int
    total_steps: int
    reward_mean: float | None = None
    accuracy: float | None = None
    """llm jobs: share of samples the correctness reward (exact_match, math_verify) scores right."""
    updated_at: str = field(default_factory=rfc3339_now)
    """When `step` was reached (when the actor started, before its first step): the operator's Stalled clock."""
    issue: str = ""
    """Why the actor is not getting on with the next step (a weight round refused, a rollout not answering); ""
    while all is well."""
    trainer_wait: float | None = None
    """llm jobs: share of the latest step the trainer waited for generations (the rollout autoscaler's signal)."""
    rollout_idle: float | None = None
    """llm jobs: share of the rollouts' time in the latest step without generation work."""
    entropy: float | None = None
    """Mean policy entropy of the latest step (nats); None where it is not a Shannon entropy (continuous actions)."""
    mismatch_kl: float | None = None
    """llm jobs: rollout/trainer mismatch KL of the latest step (nats per token)."""
    late_replicas: tuple[tuple[str, float], ...] = ()
    """Replicas past their request deadline: (`role-i`, seconds without an answer), longest first."""

    def to_json(self) -> dict[str, object]:
        data: dict[str, object] = {
            "step": self.step,
            "totalSteps": self.total_steps,
            "rewardMean": self.reward_mean,
            "updatedAt": self.updated_at,
        }
        if self.accuracy is not None:
            data["accuracy"] = self.accuracy
        if self.issue:
            data["issue"] = self.issue
        if self.trainer_wait is not None:
            data["trainerWait"] = self.trainer_wait
        if self.rollout_idle is not None:
            data["rolloutIdle"] = self.rollout_idle
        data["entropy"] = self.entropy
        data["mismatchKl"] = self.mismatch_kl
        if self.late_replicas:
            data["lateReplicas"] = [{"replica": name, "seconds": round(s, 1)} for name, s in self.late_replicas]
        return data


class ProgressTracker:
    """Thread-safe latest progress; pass `tracker.snapshot` as the server's progress provider."""

    def __init__(
        self,
        total_steps: int,
        step: int = 0,
        issue: Callable[[], str] = str,
        late: Callable[[], list[tuple[str, float]]] = list,
    ) -> None:
        """`issue()` says why the next step is not coming, read at every snapshot ("" when nothing is wrong);
        `late()` lists the replicas past their request deadline (`LateReplicas.snapshot`)."""
        self._lock = threading.Lock()
        self._progress = Progress(step=step, total_steps=total_steps)
        self._issue = issue
        self._late = late

    def update(
        self,
        step: int,
        reward_mean: float | None,
        accuracy: float | None = None,
        trainer_wait: float | None = None,
        rollout_idle: float | None = None,
        entropy: float | None = None,
        mismatch_kl: float | None = None,
    ) -> None:
        with self._lock:
            # A step without finished episodes keeps the last known reward rather than blanking it.
            reward = reward_mean if reward_mean is not None else self._progress.reward_mean
            accuracy = accuracy if accuracy is not None else self._progress.accuracy
            self._progress = Progress(
                step=step,
                total_steps=self._progress.total_steps,
                reward_mean=reward,
                accuracy=accuracy,
                trainer_wait=trainer_wait,
                rollout_idle=rollout_idle,
                entropy=entropy,
                mismatch_kl=mismatch_kl,
            )

    def snapshot(self) -> Progress:
        with self._lock:
            progress = self._progress
        issue, late = self._issue(), tuple(self._late())
        return replace(progress, issue=issue, late_replicas=late) if issue or late else progress


def answers_ready(url: str, timeout_s: float = 1.0) -> bool:
    """True when `url` (another process's `/healthz`) answers 200 within `timeout_s`."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            return response.status == HTTPStatus.OK
    except (urllib.error.URLError, OSError):
        return False


def stuck_loop(url: str, timeout_s: float = 1.0) -> str:
    """What `url` (another process's `/livez`) says is stuck ("loop X has not beaten for ..."); "" when it answers
    200, is still starting, or does not answer (a process that does not answer is not known to be hung)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s):
            return ""
    except urllib.error.HTTPError as exc:
        body = exc.read().decode("utf-8", "replace").strip()
        return body if exc.code == HTTPStatus.SERVICE_UNAVAILABLE and body.startswith("loop ") else ""
    except (urllib.error.URLError, OSError, ValueError, http.client.HTTPException):
        return ""


class RoleHTTPServer:
    """Serves one role's health, Prometheus metrics and (optionally) progress on `port` (0: any free port)."""

    def __init__(self, port: int, registry: CollectorRegistry, host: str = "0.0.0.0") -> None:
        self.registry = registry
        self._ready = threading.Event()
        self._progress_provider: Callable[[], Progress] | None = None
        self._also: list[tuple[Callable[[], bool], str]] = []
        self._heartbeat: Heartbeat | None = None
        self._liveness_limit_s = 0.0
        self._said_stuck = False
        self._liveness_lock = threading.Lock()
        """Probes may come at once (the kubelet's, a launcher's): one of them says a hang, once."""
        self._termination_log = TERMINATION_LOG
        self._server = ThreadingHTTPServer((host, port), self._handler_class())
        self._server.daemon_threads = True
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        return int(self._server.server_address[1])

    def start(self) -> RoleHTTPServer:
        self._thread = threading.Thread(target=self._server.serve_forever, name="role-http", daemon=True)
        self._thread.start()
        return self

    def mark_ready(self) -> None:
        self._ready.set()

    def also_ready_when(self, check: Callable[[], bool], waiting_for: str) -> None:
        """`/healthz` answers ready only while `check()` is true too (asked at each probe); else 503 saying
        `waiting for <waiting_for>`."""
        self._also.append((check, waiting_for))

    def watch_liveness(self, heartbeat: Heartbeat, limit_s: float, termination_log: Path = TERMINATION_LOG) -> None:
        """`/livez`: 503 `starting` until a loop of `heartbeat` first beats, then 503 once one has not beaten for
        `limit_s` seconds (0: never), else 200. Answered from this server's thread, whatever the loops do.

        While it fails, the container's termination message (`termination_log`, in a pod) says why, so the pod
        the kubelet kills for it tells the operator (and `kubectl describe`) which loop hung."""
        self._heartbeat, self._liveness_limit_s = heartbeat, limit_s
        self._termination_log = termination_log

    def _not_live_because(self) -> str:
        """Why `/livez` fails now; "" when it answers 200 (always, without a heartbeat to watch)."""
        heartbeat = self._heartbeat
        if heartbeat is None:
            return ""
        if not heartbeat.started:
            return "starting"
        why = heartbeat.stuck(self._liveness_limit_s)
        with self._liveness_lock:
            if why and not self._said_stuck:
                # Once per hang: every thread's stack tells a deadlock from a native call that never returns.
                log.error("liveness fails (%s); the stacks of this process's threads follow", why)
                with contextlib.suppress(Exception):
                    faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
                write_termination_message(f"hung: {why}", self._termination_log)
            elif self._said_stuck and not why:
                log.warning("liveness passes again: the stuck loop got on")
                write_termination_message("", self._termination_log)
            self._said_stuck = bool(why)
        return why

    def _not_ready_because(self) -> str:
        """Why `/healthz` is not ready now; "" when it is."""
        if not self._ready.is_set():
            return "starting"
        return next((f"waiting for {what}" for check, what in self._also if not check()), "")

    def set_progress_provider(self, provider: Callable[[], Progress]) -> None:
        self._progress_provider = provider

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def __enter__(self) -> RoleHTTPServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _handler_class(self) -> type[BaseHTTPRequestHandler]:
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                path = self.path.split("?", 1)[0]
                if path == "/healthz":
                    why = server._not_ready_because()
                    if not why:
                        self._send(HTTPStatus.OK, b"ok\n", "text/plain; charset=utf-8")
                    else:
                        body = f"{why}\n".encode()
                        self._send(HTTPStatus.SERVICE_UNAVAILABLE, body, "text/plain; charset=utf-8")
                elif path == "/livez":
                    why = server._not_live_because()
                    status = HTTPStatus.SERVICE_UNAVAILABLE if why else HTTPStatus.OK
                    self._send(status, f"{why or 'ok'}\n".encode(), "text/plain; charset=utf-8")
                elif path == "/metrics":
                    self._send(HTTPStatus.OK, generate_latest(server.registry), CONTENT_TYPE_LATEST)
                elif path == "/progress" and server._progress_provider is not None:
                    body = json.dumps(server._progress_provider().to_json()).encode()
                    self._send(HTTPStatus.OK, body, "application/json")
                else:
                    self._send(HTTPStatus.NOT_FOUND, b"not found\n", "text/plain; charset=utf-8")

            def _send(self, status: HTTPStatus, body: bytes, content_type: str) -> None:
                # The caller may have given up waiting (a launcher's short progress poll): nothing to answer.
                with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                    self.send_response(status)
                    self.send_header("Content-Type", content_type)
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)

            def log_message(self, format: str, *args: object) -> None:
                # Probes hit these endpoints every few seconds: keep them out of the role's log.
                log.debug("%s " + format, self.address_string(), *args)

        return Handler
