"""Runs untrusted code in a fresh, confined process: the sandbox behind the `code_exec` reward.

Each run is a new `python -I -S` process (no user site, no site-packages, no PYTHON* variables) started in
its own session, in a private temporary working directory that is removed afterwards, with an environment
of PATH, LANG, HOME and TMPDIR only. The child confines itself before the code runs (see
`rljob.runtime.sandbox.child` for the mechanisms and docs/sandbox.md for what each platform enforces), and
this side enforces the wall clock: past `timeoutSeconds` (+ the interpreter's start-up allowance) every
process of the run is SIGKILLed, whatever signals it ignores. At most `maxConcurrency` runs at a time.

Nothing is forked from the calling process with Python code between fork and exec (`subprocess` with
`start_new_session` does the setsid in C), so a reward role with threads may run sandboxes safely.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from rljob.api.spec import SandboxSpec

CHILD_SOURCE = (Path(__file__).with_name("child.py")).read_text()
STARTUP_ALLOWANCE_SECONDS = 1.0
"""Added to timeoutSeconds for the wall clock: the interpreter starts and confines itself within it."""
MAX_PROCESSES = 16
"""Processes (threads included) one run may have at once: contains fork bombs."""
MAX_FILE_BYTES = 64 * 1024 * 1024
"""Largest file a run may write (RLIMIT_FSIZE): the working directory cannot fill the disk."""
OUTPUT_TAIL_BYTES = 2000
ALLOWED_ENV = ("PATH", "LANG", "LC_ALL")
"""The only variables a run inherits from the reward process (with fixed fallbacks); everything else, secrets
included, stays behind."""

Isolation = Literal["auto", "rlimits"]
"""auto: namespaces where the kernel allows them, else rlimits and the audit hook. rlimits: never namespaces
(what a platform without them gets; tests use it to prove the fallback)."""


class SandboxError(RuntimeError):
    """A run that was stopped or broke a rule: it scores 0 and counts as an error under its function's name."""


@dataclass(frozen=True)
class SandboxLimits:
    timeout_seconds: float = 10.0
    memory_mb: int = 1024
    network: bool = False
    processes: int = MAX_PROCESSES
    file_bytes: int = MAX_FILE_BYTES

    @classmethod
    def from_spec(cls, spec: SandboxSpec) -> SandboxLimits:
        return cls(timeout_seconds=spec.timeout_seconds, memory_mb=spec.memory_mb, network=spec.network)

    @property
    def cpu_seconds(self) -> int:
        return max(1, math.ceil(self.timeout_seconds))


@dataclass
class SandboxRun:
    """What one run did. `error` is set when it must score 0 as a counted error."""

    passed: int = 0
    total: int = 0
    crash: str | None = None
    """The code's own exception (a wrong answer, not a sandbox error)."""
    error: str | None = None
    namespaced: bool = False
    uid: int | None = None
    supervisor_pid: int | None = None
    exit_code: int | None = None
    output_tail: str = ""
    violations: list[str] = field(default_factory=list)

    @property
    def score(self) -> float:
        return self.passed / self.total if self.total and self.error is None else 0.0


class Sandbox:
    """Runs code against tests, `limits` per run, at most `max_concurrency` runs at once."""

    def __init__(self, limits: SandboxLimits, max_concurrency: int = 4, isolation: Isolation = "auto") -> None:
        self.limits = limits
        self.isolation = isolation
        self._slots = threading.BoundedSemaphore(max_concurrency)

    @classmethod
    def from_spec(cls, spec: SandboxSpec, isolation: Isolation = "auto") -> Sandbox:
        return cls(SandboxLimits.from_spec(spec), spec.max_concurrency, isolation)

    def run(self, code: str, tests: dict[str, Any]) -> SandboxRun:
        """Runs `code` against `tests` (see `parse_tests`) in a fresh confined process."""
        with self._slots:
            return self._run(code, tests)

    def _run(self, code: str, tests: dict[str, Any]) -> SandboxRun:
        token = secrets.token_hex(16)
        root = Path(tempfile.mkdtemp(prefix="rljob-sandbox-"))
        try:
            root.chmod(0o711)  # a run dropped to its own uid must reach its working directory, and list nothing
            workdir = root / "work"
            workdir.mkdir()
            request = {
                "token": token,
                "workdir": str(workdir),
                "isolation": self.isolation,
                "network": self.limits.network,
                "limits": {
                    "memory_mb": self.limits.memory_mb,
                    "cpu_seconds": self.limits.cpu_seconds,
                    "processes": self.limits.processes,
                    "file_bytes": self.limits.file_bytes,
                },
                "code": code,
                "tests": tests,
            }
            (root / "request.json").write_text(json.dumps(request))
            with (
                open(root / "request.json", "rb") as stdin,
                open(root / "result", "wb") as result,
                open(root / "output", "wb") as output,
            ):
                process = subprocess.Popen(
                    [sys.executable, "-I", "-S", "-c", CHILD_SOURCE],
                    stdin=stdin,
                    stdout=result,
                    stderr=output,
                    cwd=workdir,
                    env=sandbox_environment(workdir),
                    start_new_session=True,  # its own process group and session: killed as a whole
                    close_fds=True,
                )
            deadline = self.limits.timeout_seconds + STARTUP_ALLOWANCE_SECONDS
            timed_out = False
            try:
                process.wait(timeout=deadline)
            except subprocess.TimeoutExpired:
                timed_out = True
                kill_run(process.pid)  # not reaped yet: its pid still names this run's supervisor
            process.wait()
            kill_group(process.pid)  # what the code left in the group; a live group keeps its id from reuse
            return self._outcome(root, token, process, timed_out)
        finally:
            shutil.rmtree(root, ignore_errors=True)

    def _outcome(self, root: Path, token: str, process: subprocess.Popen, timed_out: bool) -> SandboxRun:
        run = SandboxRun(supervisor_pid=process.pid, exit_code=process.returncode)
        with open(root / "output", "rb") as f:
            f.seek(max(0, os.fstat(f.fileno()).st_size - OUTPUT_TAIL_BYTES))
            run.output_tail = f.read().decode(errors="replace")
        report = None
        with open(root / "result", "rb") as f:
            for line in f.read(1024 * 1024).splitlines():
                head, _, body = line.partition(b" ")
                if head == token.encode():
                    report = json.loads(body)
        if report is not None:
            run.namespaced = report["namespaced"]
            run.uid = report.get("uid")
            run.violations = report["violations"]
            run.passed, run.total, run.crash = report.get("passed", 0), report.get("total", 0), report.get("crash")
        limits = self.limits
        if timed_out:
            run.error = (
                f"killed after the wall-clock limit (spec.reward.sandbox.timeoutSeconds: {limits.timeout_seconds:g}s "
                f"+ {STARTUP_ALLOWANCE_SECONDS:g}s start-up)"
            )
        elif report is None:
            run.error = f"the sandboxed process ended without a result ({describe_exit(process.returncode)})"
            if process.returncode in (-signal.SIGXCPU, 128 + signal.SIGXCPU, 128 + signal.SIGKILL):
                run.error += f": CPU time limit ({limits.cpu_seconds}s, spec.reward.sandbox.timeoutSeconds)"
            tail = run.output_tail.strip().splitlines()
            if tail:
                run.error += f"; last output: {tail[-1][:300]}"
        elif report.get("setup_error"):
            run.error = f"the sandbox could not confine the run: {report['setup_error']}"
        elif run.violations:
            run.error = run.violations[0]
        return run


def describe_exit(code: int | None) -> str:
    if code is None:
        return "still running"
    signal_number = -code if code < 0 else code - 128 if code > 128 else 0
    if signal_number:
        try:
            return f"killed by {signal.Signals(signal_number).name}"
        except ValueError:
            return f"exit code {code}"
    return f"exit code {code}"


def sandbox_environment(workdir: Path) -> dict[str, str]:
    """The whole environment of a run: an allowlist, nothing else from this process."""
    env = {name: os.environ[name] for name in ALLOWED_ENV if name in os.environ}
    env.setdefault("PATH", "/usr/local/bin:/usr/bin:/bin")
    env.setdefault("LANG", "C.UTF-8")
    env.update(HOME=str(workdir), TMPDIR=str(workdir))
    return env


def kill_group(group: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(group, signal.SIGKILL)


def kill_run(supervisor_pid: int) -> None:
    """SIGKILL every process of a live run, whatever it ignores: every descendant of its supervisor (which
    escaped descendants are reparented to, as a subreaper) until none is left, then its process group and the
    supervisor. The supervisor is stopped first so that it cannot exit and orphan what is left meanwhile."""
    import psutil

    try:
        supervisor = psutil.Process(supervisor_pid)
        supervisor.suspend()
    except psutil.NoSuchProcess:
        kill_group(supervisor_pid)
        return
    killed: list[psutil.Process] = []
    for _ in range(100):  # a fork bomb under its process limit cannot outrun this for long
        left = supervisor.children(recursive=True)
        if not left:
            break
        for process in left:
            with contextlib.suppress(psutil.NoSuchProcess):
                process.kill()
                killed.append(process)
    kill_group(supervisor_pid)
    with contextlib.suppress(psutil.NoSuchProcess):
        supervisor.kill()
    # SIGKILL takes effect when the process next runs: on a busy machine a killed process can still look alive
    # for a moment. Return only once each is dead (a zombie awaiting its reaper is).
    deadline = time.monotonic() + 5.0
    while killed and time.monotonic() < deadline:
        killed = [process for process in killed if _alive(process)]
        if killed:
            time.sleep(0.005)


def _alive(process: Any) -> bool:
    import psutil

    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


# --- tests of a row ------------------------------------------------------------------------------


class UnrunnableTestsError(ValueError):
    """A row's tests in a shape code_exec cannot run."""


def parse_tests(tests: Any) -> dict[str, Any]:
    """A row's tests as the sandbox runs them.

    - a string of Python: every top-level `assert` is one test; other statements (imports, helpers) run
      first, in order;
    - a list of strings: each is one test (an assert statement or a small block);
    - a list of {"input": ..., "output": ...}: the code runs once per pair with `input` on stdin and passes
      when what it prints equals `output` (trailing whitespace of each line ignored);
    - a JSON string of either list.
    """
    import ast

    if isinstance(tests, str):
        stripped = tests.strip()
        if stripped.startswith("["):
            try:
                return parse_tests(json.loads(stripped))
            except json.JSONDecodeError:
                pass
        try:
            module = ast.parse(tests)
        except SyntaxError as exc:
            raise UnrunnableTestsError(f"the tests are not valid Python ({exc.msg}, line {exc.lineno})") from None
        asserts = [ast.get_source_segment(tests, node) or "" for node in module.body if isinstance(node, ast.Assert)]
        setup = [ast.get_source_segment(tests, n) or "" for n in module.body if not isinstance(n, ast.Assert)]
        if not asserts:
            raise UnrunnableTestsError("the tests hold no assert statement")
        return {"kind": "asserts", "setup": setup, "asserts": asserts}
    if isinstance(tests, list) and tests:
        if all(isinstance(t, str) for t in tests):
            return {"kind": "asserts", "setup": [], "asserts": list(tests)}
        if all(isinstance(t, dict) and "input" in t and "output" in t for t in tests):
            return {"kind": "io", "cases": [{"input": str(t["input"]), "output": str(t["output"])} for t in tests]}
    raise UnrunnableTestsError(
        "tests must be Python asserts (a string or a list of strings) or a list of {input, output} pairs "
        f"(got {type(tests).__name__})"
    )


# --- what this platform can enforce --------------------------------------------------------------


def check_sandbox(spec: SandboxSpec, isolation: Isolation = "auto") -> list[tuple[str, str]]:
    """(field path, message) for every sandbox limit this machine cannot enforce, found by a probe run."""
    if not sys.platform.startswith("linux"):
        return [
            (
                "spec.reward.sandbox",
                f"code_exec needs Linux to confine runs (rlimits, namespaces, /proc); this is {sys.platform}: "
                "run the reward role on Linux (a pod does) or drop code_exec",
            )
        ]
    # The probe computes a little and opens nothing: only a sandbox that cannot confine itself fails it.
    probe = Sandbox(SandboxLimits.from_spec(spec), 1, isolation).run(
        "total = sum(range(1000))", parse_tests("assert total == 499500")
    )
    if probe.passed == 1 and probe.error is None:
        return []
    problem = probe.error or probe.crash or "the probe's test failed"
    if "memory" in problem.lower() or "MemoryError" in probe.output_tail:
        return [
            (
                "spec.reward.sandbox.memoryMb",
                f"{spec.memory_mb} MiB is too little for the sandboxed interpreter ({problem}); raise it",
            )
        ]
    return [("spec.reward.sandbox", f"this machine cannot confine code_exec runs: a probe run failed ({problem})")]
