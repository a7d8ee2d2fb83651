"""A job's built children, kept between passes as compressed JSON: about 3 KB a job of 8 pods instead of about
95 KB of Python dicts, which at 1,000 jobs is most of what the operator would otherwise hold. Unpacking (about a
third of a millisecond) gives the caller fresh dicts of its own, so a pass unpacks only what it acts on: the
pods' metadata, all the planner reads, stays unpacked (about 1 KB a pod)."""

from __future__ import annotations

import json
import zlib
from typing import Any

Raw = dict[str, Any]


class PackedChildren:
    """The pods (by name) and the other children of one build, packed; `heads` holds each pod's metadata."""

    __slots__ = ("_data", "heads")

    def __init__(self, pods: dict[str, Raw], others: list[Raw]) -> None:
        self._data = zlib.compress(json.dumps([pods, others], separators=(",", ":")).encode(), 1)
        heads = {name: {"metadata": pod["metadata"]} for name, pod in pods.items()}
        self.heads: dict[str, Raw] = json.loads(json.dumps(heads))  # a copy, as JSON as the unpacked pods
        """Pod name -> `{"metadata": ...}` of the pod, shared by every pass: read it, never change it."""

    def unpack(self) -> tuple[dict[str, Raw], list[Raw]]:
        pods, others = json.loads(zlib.decompress(self._data))
        return pods, others

    @property
    def size(self) -> int:
        """Bytes held packed (the heads not counted)."""
        return len(self._data)
