"""ddp's gradient sum over the actor ranks: bucketed, in place, a bounded number of buckets in flight.

Gradients of IN_PLACE_MIN_BYTES or more are all-reduced where they are (no copy); smaller ones are packed into a
flat bucket of at most `bucket_bytes`, all-reduced and copied back. Every all-reduce is asynchronous and at most
MAX_BUCKETS_IN_FLIGHT packed buckets exist at once, so the sum needs the gradients plus two buckets, not the three
copies of every gradient a single flat tensor and a clone per parameter took.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

IN_PLACE_MIN_BYTES = 4 * 2**20
"""Gradients this big are summed where they are, each on its own all-reduce."""
GRAD_BUCKET_BYTES = 32 * 2**20
"""The most bytes of small gradients packed into one all-reduce."""
MAX_BUCKETS_IN_FLIGHT = 2
"""Packed buckets allocated at once: one being summed while the next is packed."""


def _buckets(grads: list[Tensor], bucket_bytes: int) -> list[list[Tensor]]:
    """The small gradients grouped so each group holds at most `bucket_bytes` (grouped by dtype and device)."""
    groups: dict[tuple[torch.dtype, torch.device], list[list[Tensor]]] = {}
    sizes: dict[tuple[torch.dtype, torch.device], int] = {}
    for g in grads:
        key = (g.dtype, g.device)
        nbytes = g.numel() * g.element_size()
        if key not in groups or sizes[key] + nbytes > bucket_bytes:
            groups.setdefault(key, []).append([])
            sizes[key] = 0
        groups[key][-1].append(g)
        sizes[key] += nbytes
    return [bucket for buckets in groups.values() for bucket in buckets]


def sum_gradients(params: list[nn.Parameter], bucket_bytes: int = GRAD_BUCKET_BYTES) -> None:
    """Sum every parameter's gradient over the ranks, in place (a missing gradient counts as zeros)."""
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    grads = [p.grad for p in params]
    big = [g for g in grads if g.is_contiguous() and g.numel() * g.element_size() >= IN_PLACE_MIN_BYTES]
    big_ids = {id(g) for g in big}
    works: list[Any] = [dist.all_reduce(g, async_op=True) for g in big]
    in_flight: list[tuple[Any, Tensor, list[Tensor]]] = []
    for members in _buckets([g for g in grads if id(g) not in big_ids], bucket_bytes):
        if len(in_flight) == MAX_BUCKETS_IN_FLIGHT:
            _unpack(*in_flight.pop(0))
        flat = torch.cat([g.reshape(-1) for g in members])
        in_flight.append((dist.all_reduce(flat, async_op=True), flat, members))
    while in_flight:
        _unpack(*in_flight.pop(0))
    for work in works:
        work.wait()


def _unpack(work: Any, flat: Tensor, members: list[Tensor]) -> None:
    work.wait()
    offset = 0
    for g in members:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()
