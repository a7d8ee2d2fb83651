"""Micro-batches by token budget: every sample once, no pass over the budget, equal pass counts on demand."""

from __future__ import annotations

import pytest

from rljob.runtime.llm.training.packing import pack_by_tokens, split_to_count

LENGTHS = [30, 5, 12, 30, 7, 7, 18, 3, 25, 9, 11, 4]


def padded(lengths: list[int], group: list[int]) -> int:
    return len(group) * max(lengths[i] for i in group)


@pytest.mark.parametrize("budget", [30, 45, 64, 1000])
def test_packing_keeps_every_micro_batch_within_the_budget_and_every_sample_once(budget):
    groups = pack_by_tokens(LENGTHS, budget)
    assert sorted(i for g in groups for i in g) == list(range(len(LENGTHS)))
    assert all(padded(LENGTHS, g) <= budget for g in groups)
    if budget == 1000:
        assert len(groups) == 1  # everything fits one pass
    # Sorted by length: like lengths share a pass, so padding stays small.
    assert padded(LENGTHS, groups[0]) == 30 * len(groups[0])


def test_packing_short_sequences_shares_passes_that_a_row_count_would_not():
    lengths = [64] + [8] * 15
    groups = pack_by_tokens(lengths, 128)
    assert [len(g) for g in groups] == [2, 14]  # the long one with one short, then the short ones together
    assert [len(g) for g in pack_by_tokens(lengths, 128, max_rows=4)] == [2, 4, 4, 4, 2]


def test_a_sequence_over_the_budget_is_a_micro_batch_of_its_own():
    assert pack_by_tokens([50, 10, 10], 40) == [[0], [1, 2]]


def test_splitting_to_a_count_halves_the_largest_micro_batches():
    groups = pack_by_tokens(LENGTHS, 64)
    split = split_to_count(groups, len(groups) + 3)
    assert len(split) == len(groups) + 3
    assert sorted(i for g in split for i in g) == list(range(len(LENGTHS)))
    assert all(g and padded(LENGTHS, g) <= 64 for g in split)
    assert split_to_count(groups, len(groups)) == groups
    with pytest.raises(ValueError, match="cannot cut 12 samples into 13"):
        split_to_count(groups, 13)
