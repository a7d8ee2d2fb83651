"""A user's reward module (`module: file.py:fn`) run confined, under the same `spec.reward.sandbox` limits as
`code_exec`.

Design: a pool of at most `maxConcurrency` long-lived worker processes per module function. Each worker is
started like a code_exec run (`rljob.runtime.sandbox.child`, in its own session, with the environment
allowlist, a private temporary working directory, namespaces where the kernel allows them else the audit-hook
fallback, rlimits on address space, processes and file size, no new privileges, its own uid when the reward
role runs as root, no network unless `sandbox.network: true`), imports the user's module once, and then scores
one sample per request over a pipe. Why not a fresh process per sample like code_exec: a reward module
typically imports heavy packages (math-verify imports sympy: seconds), which a process per sample would pay
every time; a worker pays it once. What a sample costs is then one pickle each way (measured in docs/performance.md).

Differences from a code_exec run, and why:
- `python -I` without `-S`: the module may import installed packages (numpy, math_verify), so `site` runs
  (editable installs' finders included) and the worker's `sys.path` is the reward role's own (its PYTHONPATH
  and working directory, so `import helpers` beside `rewards.py` works as before). When the role runs as
  root, the worker drops to its own uid before importing anything of the user's; directories that uid could
  not reach (e.g. an interpreter or the module below /root, 0700) are opened by the worker while still root
  and imported through its own descriptors (`rljob.runtime.sandbox.child.hold_open_directories`): the user's code never
  runs as root, and no other file becomes readable.
- No CPU-time rlimit (it would add up over a worker's samples): the wall clock bounds each sample instead.
  Past `timeoutSeconds` the whole worker (every process of it, whatever signals it ignores) is SIGKILLed,
  the sample scores 0 with a counted error, and the next sample gets a fresh worker.
- A worker that dies (memory limit, crash, `os._exit`), hits a limit, breaks a rule or starts a process
  costs only that sample: it is killed (with all it started) and replaced on demand.
- Module state persists between the samples one worker scores, as it did in-process, but is not shared
  between workers; `maxConcurrency` workers score at once.

Builtin rewards (exact_match, format, math_verify, length_penalty) stay in the reward role's process: they
are rljob's own code. code_exec keeps one fresh run per sample: its code is the model's.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import secrets
import select
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from rljob.runtime.sandbox.runner import (
    CHILD_SOURCE,
    Isolation,
    SandboxLimits,
    describe_exit,
    kill_group,
    kill_run,
    sandbox_environment,
)

WORKER_START_SECONDS = 30.0
"""How long a worker may take to start, confine itself and import the module (sympy alone takes seconds on a
busy machine). Not charged to a sample's timeoutSeconds: a fresh worker after a kill would fail the next
sample otherwise."""
SINGLE_THREADED_LIBRARIES = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
"""Numeric libraries start a thread per core at import; the process limit (16, threads included) would refuse
them on a large node. A reward function scores one sample: one thread is what it needs."""


class ModuleCallError(RuntimeError):
    """A sample the module function could not score: its message says why (the function's own exception, or
    what the sandbox stopped). It scores 0 and counts one error under the function's name."""


class ModuleLoadError(RuntimeError):
    """The module cannot be imported in the sandbox (e.g. its file is not readable by the worker's uid)."""


class ModuleWorker:
    """One confined process that imported the module and scores samples one at a time."""

    def __init__(self, ref: str, limits: SandboxLimits, isolation: Isolation) -> None:
        self.limits = limits
        self.token = secrets.token_hex(16)
        self._buffer = b""
        self.root = Path(tempfile.mkdtemp(prefix="rljob-module-"))
        self.root.chmod(0o711)  # a worker dropped to its own uid must reach its working directory, and list nothing
        workdir = self.root / "work"
        workdir.mkdir()
        request_read, self._requests = os.pipe()
        self._results, result_write = os.pipe()
        lifeline_read, self._lifeline = os.pipe()
        try:
            self.process = subprocess.Popen(
                [sys.executable, "-I", "-c", CHILD_SOURCE],
                stdin=request_read,
                stdout=result_write,
                cwd=workdir,
                env={**sandbox_environment(workdir), **SINGLE_THREADED_LIBRARIES},
                start_new_session=True,  # its own process group and session: killed as a whole
                pass_fds=(lifeline_read,),
            )
        except OSError as exc:
            for fd in (self._requests, self._results, self._lifeline):
                os.close(fd)
            shutil.rmtree(self.root, ignore_errors=True)
            raise ModuleLoadError(f"the sandboxed worker could not be started: {exc}") from None
        finally:
            for fd in (request_read, result_write, lifeline_read):
                os.close(fd)
        setup = {
            "kind": "module",
            "token": self.token,
            "workdir": str(workdir),
            "isolation": isolation,
            "network": limits.network,
            "limits": {
                "memory_mb": limits.memory_mb,
                "cpu_seconds": None,
                "processes": limits.processes,
                "file_bytes": limits.file_bytes,
            },
            "ref": ref,
            "sys_path": [
                os.path.abspath(p) if p == "" or (not os.path.isabs(p) and os.path.exists(p)) else p for p in sys.path
            ],
            "lifeline_fd": lifeline_read,
        }
        try:
            self._send(json.dumps(setup).encode() + b"\n")
            ready = self._receive(
                time.monotonic() + WORKER_START_SECONDS,
                f"not ready within {WORKER_START_SECONDS:g}s (interpreter, confinement and the module's imports)",
            )
        except ModuleCallError as exc:
            self.stop()
            raise ModuleLoadError(f"the sandboxed worker did not start: {exc}") from None
        if ready.get("setup_error") or ready.get("load_error") or not ready.get("ready"):
            self.stop()
            problem = ready.get("load_error") or f"it could not confine itself: {ready.get('setup_error')}"
            raise ModuleLoadError(problem)
        self.namespaced: bool = ready["namespaced"]
        self.uid: int | None = ready.get("uid")

    @property
    def pid(self) -> int:
        """The worker's supervisor: every process of the worker is below it."""
        return self.process.pid

    def call(self, prompt: str, response: str, row: dict[str, Any], kwargs: dict[str, Any]) -> tuple[float, bool]:
        """(value, whether this worker may serve again); raises ModuleCallError (after which it may not)."""
        payload = pickle.dumps({"prompt": prompt, "response": response, "row": row, "kwargs": kwargs}, protocol=5)
        deadline = time.monotonic() + self.limits.timeout_seconds
        self._send(len(payload).to_bytes(8, "big") + payload)
        reply = self._receive(
            deadline,
            f"killed after the wall-clock limit (spec.reward.sandbox.timeoutSeconds: {self.limits.timeout_seconds:g}s)",
        )
        if "error" in reply:
            raise ModuleCallError(reply["error"]) if not reply.get("recycle") else _Recycle(reply["error"])
        return reply["value"], not reply.get("recycle")

    def stop(self) -> None:
        """SIGKILLs every process of the worker and removes its directory."""
        kill_run(self.pid)
        self.process.wait()
        kill_group(self.pid)  # what the function left in the group; a live group keeps its id from reuse
        for fd in (self._requests, self._results, self._lifeline):
            with contextlib.suppress(OSError):
                os.close(fd)
        shutil.rmtree(self.root, ignore_errors=True)

    def _send(self, data: bytes) -> None:
        try:
            while data:
                data = data[os.write(self._requests, data) :]
        except OSError:  # a broken pipe: the worker is gone
            raise _Recycle(self._died()) from None

    def _receive(self, deadline: float, late: str) -> dict[str, Any]:
        """The next reply line carrying this worker's token. When none comes by `deadline` the worker is killed
        and ModuleCallError says `late`."""
        poller = select.poll()
        poller.register(self._results, select.POLLIN)
        while True:
            line, newline, rest = self._buffer.partition(b"\n")
            if newline:
                self._buffer = rest
                head, _, body = line.partition(b" ")
                if head == self.token.encode():
                    return json.loads(body)
                continue
            left = deadline - time.monotonic()
            if left <= 0 or not poller.poll(max(1, int(left * 1000))):
                if time.monotonic() < deadline:
                    continue
                kill_run(self.pid)  # not reaped yet: its pid still names this worker's supervisor
                raise _Recycle(late)
            chunk = os.read(self._results, 1 << 16)
            if not chunk:
                raise _Recycle(self._died())
            self._buffer += chunk

    def _died(self) -> str:
        try:
            code = self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            kill_run(self.pid)
            code = self.process.wait()
        message = f"the sandboxed worker died ({describe_exit(code)})"
        if code == 137 or code == -9:
            message += f"; killed by the kernel: out of memory? (spec.reward.sandbox.memoryMb: {self.limits.memory_mb})"
        return message


class _Recycle(ModuleCallError):
    """A failure after which the worker must not serve again."""


class SandboxedFunction:
    """Calls like the user's function, `fn(prompt, response, row, **kwargs)`; each call runs in one of at most
    `max_concurrency` confined workers (see the module docstring)."""

    def __init__(self, ref: str, limits: SandboxLimits, max_concurrency: int = 4, isolation: Isolation = "auto"):
        self.ref = ref
        self.limits = limits
        self.isolation = isolation
        self._slots = threading.BoundedSemaphore(max_concurrency)
        self._lock = threading.Lock()
        self._idle: list[ModuleWorker] = []
        self._busy: set[ModuleWorker] = set()
        self._closed = False

    def start(self) -> ModuleWorker:
        """Starts one worker now (kept for the first sample): ModuleLoadError when the module does not load."""
        worker = ModuleWorker(self.ref, self.limits, self.isolation)
        with self._lock:
            self._idle.append(worker)
        return worker

    def __call__(self, prompt: str, response: str, row: dict[str, Any], **kwargs: Any) -> float:
        with self._slots:
            with self._lock:
                if self._closed:
                    raise ModuleCallError("the scorer is closed")
                worker = self._idle.pop() if self._idle else None
            if worker is None:
                try:
                    worker = ModuleWorker(self.ref, self.limits, self.isolation)
                except ModuleLoadError as exc:
                    raise ModuleCallError(str(exc)) from None
            with self._lock:
                self._busy.add(worker)
            keep = False
            try:
                value, keep = worker.call(prompt, response, row, kwargs)
                return value
            except _Recycle:
                raise
            except ModuleCallError:
                keep = True  # the function's own exception: the worker is fine
                raise
            finally:
                with self._lock:
                    self._busy.discard(worker)
                    if keep and not self._closed:
                        self._idle.append(worker)
                        worker = None
                if worker is not None:
                    worker.stop()

    def worker_pids(self) -> list[int]:
        """The supervisors of the live workers."""
        with self._lock:
            return [worker.pid for worker in [*self._idle, *self._busy]]

    def close(self) -> None:
        """Stops every idle worker now; a busy one is stopped when its call returns."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for worker in idle:
            worker.stop()
