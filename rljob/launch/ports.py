"""Choosing the ports a launcher hands to role processes.

A launcher picks a port, lets it go, and a role binds it seconds later (and again on every restart). A port the
kernel hands out for outgoing connections (its ephemeral range) can be taken in between by any connection on the
machine (Ray's, gloo's, a download), and such a connection can hold it for as long as it lives: the role then
fails to bind, restart after restart. So ports are drawn below the ephemeral range, which only explicit binders
use, and above the range Ray keeps for its own workers (10002-19999 by default).
"""

from __future__ import annotations

import random
import socket
from collections.abc import Sequence
from pathlib import Path

EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
LOWEST_PORT = 20000
"""Above Ray's default worker ports (10002-19999) and the usual fixed service ports."""
FALLBACK_EPHEMERAL_START = 32768
"""Linux's default start, used when the range cannot be read (also below macOS's 49152)."""
ATTEMPTS_PER_PORT = 64


def ephemeral_start(range_file: Path = EPHEMERAL_RANGE_FILE) -> int:
    """The first port of the kernel's range for outgoing connections."""
    try:
        return int(range_file.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return FALLBACK_EPHEMERAL_START


def _bindable(port: int, host: str) -> socket.socket | None:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    # As the roles' servers bind: a port whose last listener left connections in TIME_WAIT is still usable.
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        s.bind((host, port))
        s.listen(1)  # Linux lets two SO_REUSEADDR sockets share a port until one listens
    except OSError:
        s.close()
        return None
    return s


def pick_ports(
    count: int,
    host: str = "",
    wanted: Sequence[int] = (),
    rng: random.Random | None = None,
    range_file: Path = EPHEMERAL_RANGE_FILE,
) -> list[int]:
    """`count` distinct ports free on `host` right now: each wanted one (non-zero) where it is still free, else a
    fresh one drawn below the ephemeral range. Falls back to a kernel-chosen port only when that range is too
    small to draw from."""
    rng = rng or random.SystemRandom()
    wanted = list(wanted) + [0] * (count - len(wanted))
    high = ephemeral_start(range_file)
    held: list[socket.socket] = []
    try:
        for port in wanted[:count]:
            s = _bindable(port, host) if port else None
            tries = ATTEMPTS_PER_PORT if high - LOWEST_PORT > 4 * count else 0
            while s is None and tries:
                s = _bindable(rng.randrange(LOWEST_PORT, high), host)
                tries -= 1
            held.append(s or _kernel_port(host))
        return [s.getsockname()[1] for s in held]
    finally:
        for s in held:
            s.close()


def _kernel_port(host: str) -> socket.socket:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.bind((host, 0))  # raises with the kernel's reason when no port at all can be had
    s.listen(1)
    return s
