import pytest
import torch

from rljob.algorithms.advantages import grpo_advantages
from rljob.algorithms.sampling import informative_groups


def test_groups_whose_rewards_are_all_equal_are_not_informative():
    rewards = torch.tensor(
        [
            [1.0, 1.0, 1.0, 1.0],  # all solved: zero variance
            [1.0, 0.0, 1.0, 1.0],  # one failure: a signal
            [0.0, 0.0, 0.0, 0.0],  # all failed: zero variance
            [0.5, 0.5, 0.5, 0.5000001],  # a tiny difference is still a non-zero advantage
        ],
        dtype=torch.float64,
    )
    assert informative_groups(rewards).tolist() == [False, True, False, True]


def test_dropped_groups_are_exactly_those_with_zero_advantage():
    rewards = torch.tensor([[1.0, 1.0], [0.0, 1.0], [3.0, 3.0]])
    keep = informative_groups(rewards)
    zero = (grpo_advantages(rewards) == 0).all(dim=1)
    assert keep.tolist() == (~zero).tolist() == [False, True, False]


def test_informative_groups_needs_a_prompt_by_sample_table():
    with pytest.raises(ValueError, match=r"group_size >= 2"):
        informative_groups(torch.ones(4))
    with pytest.raises(ValueError, match=r"group_size >= 2"):
        informative_groups(torch.ones(4, 1))
