"""Which rollout replicas actor rank 0 feeds: the list it started with, or a file the operator keeps current.

On Kubernetes the operator writes the ready rollout replicas of an llm job into a ConfigMap
(`<job>-rollouts`, key `rollouts.json`) mounted into the actor pods; the kubelet refreshes the mounted file
when the ConfigMap changes, so `kubectl scale rljob/NAME --replicas=N` reaches the trainer without
restarting it. The actor finds the file through RLJOB_ROLLOUT_MEMBERS_FILE (`RoleIdentity.rollout_members_file`).
Without a file (`rljob run`: the launcher restarts a dead rollout process on its own port, which the pool
notices by its new incarnation tag) the membership is the static endpoint list of the identity.

The document: `{"rollouts": [{"replica": 0, "endpoint": "job-rollout-0.job:29600"}, ...]}`.
This module imports nothing heavy: the operator writes the document with `members_document`.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Mapping

log = logging.getLogger("rljob.actor")

MEMBERS_KEY = "rollouts.json"
"""Key of the document in the membership ConfigMap; the file's name where it is mounted."""
CHECK_INTERVAL_S = 1.0
"""How often the file is looked at (one stat call; it is read again only when it changed)."""

Members = dict[int, str]
"""Replica index -> `host:port` of its data-plane endpoint."""


class MembershipError(ValueError):
    """The membership document is not what `members_document` writes; says what is wrong."""


def members_document(members: Mapping[int, str]) -> str:
    """The document listing `members`, in replica order (stable text: an unchanged set is an unchanged file)."""
    rollouts = [{"replica": replica, "endpoint": members[replica]} for replica in sorted(members)]
    return json.dumps({"rollouts": rollouts}, indent=1) + "\n"


def parse_members(text: str) -> Members:
    try:
        document = json.loads(text)
    except json.JSONDecodeError as exc:
        raise MembershipError(f"not JSON: {exc}") from None
    entries = document.get("rollouts") if isinstance(document, dict) else None
    if not isinstance(entries, list):
        raise MembershipError('expected {"rollouts": [{"replica": N, "endpoint": "host:port"}, ...]}')
    members: Members = {}
    for i, entry in enumerate(entries):
        replica = entry.get("replica") if isinstance(entry, dict) else None
        endpoint = entry.get("endpoint") if isinstance(entry, dict) else None
        if not isinstance(replica, int) or replica < 0 or not isinstance(endpoint, str) or ":" not in endpoint:
            raise MembershipError(f"rollouts[{i}] needs a replica index >= 0 and a host:port endpoint (got {entry!r})")
        if replica in members:
            raise MembershipError(f"rollouts[{i}]: replica {replica} is listed twice")
        members[replica] = endpoint
    return members


class RolloutMembership:
    """The current rollout replicas: `changed()` returns them when they differ from what it last returned."""

    def __init__(self, static: list[str], path: str = "", check_interval_s: float = CHECK_INTERVAL_S) -> None:
        self.static: Members = dict(enumerate(static))
        self.path = path
        self.check_interval_s = check_interval_s
        self._signature: tuple[int, int, int] | None = None
        self._next_check = 0.0
        self._last: Members | None = None

    def _read(self) -> Members | None:
        """The members the file lists; None when it has not changed since the last read or cannot be used."""
        try:
            stat = os.stat(self.path)  # follows the kubelet's `..data` symlink swap to the new file
        except FileNotFoundError:
            # Not written yet: the identity's list meanwhile. Once seen, the file alone says who is in.
            return self.static if self._signature is None else None
        signature = (stat.st_ino, stat.st_mtime_ns, stat.st_size)
        if signature == self._signature:
            return None
        try:
            with open(self.path, encoding="utf-8") as f:
                text = f.read()
        except OSError as exc:
            log.warning("cannot read the rollout membership file %s (trying again): %s", self.path, exc)
            return None
        self._signature = signature
        try:
            members = parse_members(text)
            # An llm job always has rollout replicas: none listed means none is Ready yet (job start), and
            # the identity's endpoints are worth trying meanwhile rather than waiting for the kubelet's
            # next refresh of the mounted file (up to a minute).
            return members or self.static
        except MembershipError as exc:
            # Keep feeding the replicas known so far; the next write of the file is read again.
            log.warning("rollout membership file %s ignored, keeping %d replica(s): %s", self.path, len(self), exc)
            return None

    def changed(self) -> Members | None:
        """The current members when they changed since the last call (always on the first call), else None."""
        if self._last is not None and (not self.path or time.monotonic() < self._next_check):
            return None  # a static list never changes; a file is looked at every `check_interval_s`
        self._next_check = time.monotonic() + self.check_interval_s
        members = self._read() if self.path else self.static
        if members is None or members == self._last:
            return None
        self._last = dict(members)
        return dict(members)

    def __len__(self) -> int:
        return len(self._last or {})
