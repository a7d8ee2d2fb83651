"""Run a command as an unprivileged uid, with the paths it needs made reachable: a test fixture for root.

`python tests/runtime/sandbox/as_unprivileged.py UID STAGING PATH... -- COMMAND...` (as root) drops to UID (its own
group, no supplementary groups) and execs COMMAND. A PATH that UID cannot reach because a directory above it
is closed to others (e.g. a pyenv interpreter under /root, mode 0700) is shown to it in a private mount
namespace of this process only: the path is bind-mounted aside (under STAGING), a world-readable tmpfs covers
the closed directory, and the path is bind-mounted back at its place inside it. The host is not changed.
Exits 77 with the reason on stderr when a path is unreachable and no mount namespace can be made.
"""

from __future__ import annotations

import ctypes
import os
import sys

CLONE_NEWNS = 0x00020000
MS_BIND, MS_REC, MS_PRIVATE = 4096, 16384, 1 << 18
UNAVAILABLE = 77


def closed_ancestor(path: str) -> str | None:
    """The highest directory on the way to `path` that others may not traverse, if any."""
    parts = os.path.realpath(path).split(os.sep)
    for depth in range(2, len(parts) + 1):
        directory = os.sep.join(parts[:depth])
        if os.path.isdir(directory) and not os.stat(directory).st_mode & 0o001:
            return directory
    return None


def expose(paths: list[str], staging: str) -> None:
    libc = ctypes.CDLL(None, use_errno=True)

    def mount(source, target, fstype, flags, data=None):
        if libc.mount(source, target.encode(), fstype, flags, data) != 0:
            error = ctypes.get_errno()
            raise OSError(error, f"mount {target}: {os.strerror(error)}")

    closed = {p: closed_ancestor(p) for p in (os.path.realpath(p) for p in paths)}
    closed = {path: ancestor for path, ancestor in closed.items() if ancestor is not None}
    if not closed:
        return
    if libc.unshare(CLONE_NEWNS) != 0:
        error = ctypes.get_errno()
        raise OSError(error, f"unshare(CLONE_NEWNS): {os.strerror(error)}")
    mount(None, "/", None, MS_REC | MS_PRIVATE)
    aside = {}
    for index, path in enumerate(closed):
        aside[path] = os.path.join(staging, str(index))
        os.makedirs(aside[path], exist_ok=True)
        mount(path.encode(), aside[path], None, MS_BIND | MS_REC)
    for ancestor in sorted(set(closed.values())):
        mount(b"tmpfs", ancestor, b"tmpfs", 0, b"mode=755")
    for path, where in aside.items():
        os.makedirs(path, exist_ok=True)
        mount(where.encode(), path, None, MS_BIND | MS_REC)


def main() -> None:
    separator = sys.argv.index("--")
    uid, staging, paths = int(sys.argv[1]), sys.argv[2], sys.argv[3:separator]
    command = sys.argv[separator + 1 :]
    try:
        expose(paths, staging)
    except OSError as exc:
        sys.stderr.write(f"cannot make {paths} reachable for uid {uid}: {exc}\n")
        sys.exit(UNAVAILABLE)
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)
    os.execv(command[0], command)


if __name__ == "__main__":
    main()
