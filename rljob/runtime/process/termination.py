"""The container's termination message: a line a role process leaves for the operator when it stops for good.

The kubelet copies what a container wrote to its terminationMessagePath (by default /dev/termination-log) into
the pod's status (`state.terminated.message`), which the operator quotes in the job's conditions. Outside a pod
the file does not exist and nothing is written. This module imports nothing heavy.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

TERMINATION_LOG = Path("/dev/termination-log")
"""Kubernetes' default terminationMessagePath."""


def write_termination_message(message: str, path: Path = TERMINATION_LOG) -> None:
    """In a pod, the container's termination message; elsewhere (no such file) nothing."""
    if path.exists():
        with contextlib.suppress(OSError):
            path.write_text(message[:4000], encoding="utf-8")  # the kubelet keeps at most 4096 bytes
