"""A weight round on CUDA waits for its own stream after every bucket, never for the whole device (issue 33,
items 3 and 6). The CUDA calls are recorded, not made: the round runs on CPU tensors with a recorder standing in for
its stream, so what a GPU would be asked to do, and when, is checked here."""

from __future__ import annotations

import contextlib

import pytest
import torch

from rljob.runtime.weights import sync
from rljob.runtime.weights.sync import IN_PLACE_MIN_BYTES, broadcast_state

BUCKET = 4 * IN_PLACE_MIN_BYTES
TENSORS = [torch.zeros(IN_PLACE_MIN_BYTES // 4) for _ in range(10)]  # 1 MiB of fp32 each: 4 per bucket
TENSORS += [torch.zeros(16) for _ in range(6)]  # small ones, packed


class Work:
    def wait(self) -> None:
        pass


class RootGroup:
    def rank(self) -> int:
        return 0

    def broadcast(self, tensor: torch.Tensor, root: int) -> Work:
        return Work()


@pytest.fixture
def events(monkeypatch):
    """Every bucket's tensors as they are built, every synchronisation of the round's stream, and any device-wide
    synchronisation (which must not happen)."""
    recorded: list[tuple[str, int]] = []

    class Stream:
        def synchronize(self) -> None:
            recorded.append(("stream.synchronize", 0))

    monkeypatch.setattr(sync, "round_stream", lambda device: Stream() if device.type == "cuda" else None)
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: recorded.append(("torch.cuda.synchronize", 0)))
    return recorded


def materialize(recorded: list[tuple[str, int]]):
    def build(i: int) -> torch.Tensor:
        recorded.append(("built", TENSORS[i].numel() * 4))
        return TENSORS[i].clone()

    return build


def test_a_gathered_round_on_cuda_builds_one_bucket_at_a_time_and_waits_for_its_stream_only(events):
    placeholders = [torch.empty(t.shape, device="meta") for t in TENSORS]
    broadcast_state(RootGroup(), placeholders, BUCKET, materialize(events), device=torch.device("cuda", 0))
    assert ("torch.cuda.synchronize", 0) not in events
    built_since_wait, most = 0, 0
    for name, size in events:
        built_since_wait = 0 if name == "stream.synchronize" else built_since_wait + size
        most = max(most, built_since_wait)
    assert most <= BUCKET  # never more than one bucket of full tensors outstanding
    assert events.count(("stream.synchronize", 0)) == len(sync.buckets(placeholders, BUCKET))
    assert events[-1] == ("stream.synchronize", 0)


def test_a_round_on_the_host_has_no_stream_to_wait_for(events):
    placeholders = [torch.empty(t.shape, device="meta") for t in TENSORS]
    broadcast_state(RootGroup(), placeholders, BUCKET, materialize(events), device=torch.device("cpu"))
    assert {name for name, _ in events} == {"built"}
