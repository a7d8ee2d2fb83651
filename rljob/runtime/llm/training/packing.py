"""Micro-batches by token budget (`trainer.microBatchTokens`): which samples share a forward/backward pass.

A micro-batch is right-padded to its longest sequence, so its cost is rows x longest. Sorting by length and
filling each micro-batch while that product stays within the budget (next-fit decreasing) puts sequences of
like length together: little padding, few passes, and no pass larger than the budget. The loss does not depend
on the packing (it is normalised over the whole minibatch), so any grouping gives the same update.
"""

from __future__ import annotations


def pack_by_tokens(lengths: list[int], budget: int, max_rows: int | None = None) -> list[list[int]]:
    """Indices into `lengths`, grouped so that len(group) x max length of the group <= `budget` and
    len(group) <= `max_rows`; longest sequences first. A sequence longer than the budget is a group of its own."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    groups: list[list[int]] = []
    for i in order:
        # Sorted longest first: a group's padded width is its first member's length.
        last = groups[-1] if groups else None
        if last and (len(last) + 1) * lengths[last[0]] <= budget and (max_rows is None or len(last) < max_rows):
            last.append(i)
            continue
        groups.append([i])
    return groups


def split_to_count(groups: list[list[int]], count: int) -> list[list[int]]:
    """`groups` cut into exactly `count` groups by halving the one with most rows, again and again.

    Sharded (fsdp2) ranks must run the same number of passes: each pass's collectives pair up across ranks.
    A half of a group that fits the budget fits it too. Needs `count` <= the number of indices.
    """
    groups = [list(g) for g in groups]
    total = sum(len(g) for g in groups)
    if count > total:
        raise ValueError(f"cannot cut {total} samples into {count} micro-batches")
    while len(groups) < count:
        largest = max(range(len(groups)), key=lambda k: len(groups[k]))
        group = groups.pop(largest)
        half = len(group) // 2
        groups[largest:largest] = [group[:half], group[half:]]
    return groups
