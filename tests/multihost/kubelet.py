"""The kubelet's part for the pods the operator builds: each pod's container command with its env, run on a host
named after the pod (tests/multihost/lab.py), the job file from the rendered ConfigMap."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from rljob.runtime.wire.identity import TRANSPORT_KEY_FILE_ENV
from tests.multihost.lab import NetnsLab

LIMIT_S = 300


class Kubelet:
    """Runs the containers of a job's pods in the lab, one process per pod, and keeps every line they print."""

    def __init__(self, lab: NetnsLab, config_file: Path, home: Path, extra_env: dict[str, str] | None = None) -> None:
        self.lab, self.config_file, self.home = lab, config_file, home
        self.extra_env = extra_env or {}
        """Beside the pod's own variables (e.g. RLJOB_RUN_DIR: metrics.jsonl where a test reads it)."""
        # The job's Secret as the operator makes it (a random key) and the kubelet mounts it: a file every pod reads.
        self.key_file = config_file.with_name("transport-key")
        self.key_file.write_bytes(secrets.token_hex(32).encode())
        self.lines: list[str] = []
        self.processes: dict[str, subprocess.Popen[str]] = {}
        self._readers: list[threading.Thread] = []
        self._lock = threading.Lock()

    def start(self, pod: dict[str, Any]) -> None:
        labels = pod["metadata"]["labels"]
        (main,) = pod["spec"]["containers"]
        env = {"PATH": os.environ["PATH"], "HOME": str(self.home), "PYTHONPATH": os.environ.get("PYTHONPATH", "")}
        env.update({e["name"]: e["value"] for e in main["env"]})  # the namespace is set: every variable has a value
        env["RLJOB_CONFIG"] = str(self.config_file)  # where the ConfigMap volume would be mounted
        env[TRANSPORT_KEY_FILE_ENV] = str(self.key_file)  # where the Secret volume would be mounted
        env.update(self.extra_env)
        command = [str(Path(sys.executable).parent / main["command"][0]), *main["args"]]
        prefix = self.lab.command_prefix(labels["rljob.io/role"], int(labels["rljob.io/replica"]))
        process = subprocess.Popen(
            [*prefix, *command], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        name = pod["metadata"]["name"]
        self.processes[name] = process
        reader = threading.Thread(target=self._read, args=(name, process), daemon=True)
        reader.start()
        self._readers.append(reader)

    def run_until_done(self, pods: dict[str, dict[str, Any]], watched: str) -> subprocess.Popen[str]:
        """Start every pod, wait for `watched` (a pod's name) to end, stop the rest; `watched`'s process."""
        try:
            for pod in pods.values():
                self.start(pod)
            process = self.processes[watched]
            wait_for(lambda: process.poll() is not None, f"{watched} to finish")
        finally:
            self.stop()
        return process

    def _read(self, name: str, process: subprocess.Popen[str]) -> None:
        assert process.stdout is not None
        for line in process.stdout:
            with self._lock:
                self.lines.append(f"{name} | {line.rstrip()}")

    def output(self) -> list[str]:
        with self._lock:
            return list(self.lines)

    def stop(self) -> None:
        for process in self.processes.values():
            if process.poll() is None:
                process.terminate()
        for process in self.processes.values():
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        for reader in self._readers:
            reader.join(timeout=5)


def wait_for(condition, what: str, timeout_s: float = LIMIT_S) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")
