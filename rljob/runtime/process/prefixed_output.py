"""Copy a child process's output into this one's, line by line, each line prefixed with whose it is."""

from __future__ import annotations

import threading
from typing import BinaryIO


def copy_prefixed(source: BinaryIO, prefix: str, out: BinaryIO, lock: threading.Lock) -> None:
    """Write every line of `source` (until it closes) to `out` as `prefix + line`, whole lines under `lock`, so
    lines of several children never mix; a last line without its newline gets one."""
    start = prefix.encode()
    for raw in source:
        with lock:
            out.write(start + raw if raw.endswith(b"\n") else start + raw + b"\n")
            out.flush()
