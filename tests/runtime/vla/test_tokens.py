"""OpenVLA's action tokens: Box dimensions discretized into bins, Discrete actions one token each."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gymnasium import spaces

from rljob.runtime.vla.tokens import ActionSpaceError, ActionTokenizer


def test_box_actions_round_trip_through_their_bins():
    tokens = ActionTokenizer.for_space(spaces.Box(np.array([-1.0, 0.0]), np.array([1.0, 4.0])), bins=5)
    assert (tokens.bins, tokens.dims, tokens.action_shape) == (5, 2, (2,))
    indices = torch.tensor([[0, 4], [2, 1], [4, 0]])
    actions = tokens.to_actions(indices)
    assert torch.allclose(actions, torch.tensor([[-1.0, 4.0], [0.0, 1.0], [1.0, 0.0]]))
    assert torch.equal(tokens.to_indices(actions), indices)


def test_a_box_value_between_bins_goes_to_the_nearest_and_values_outside_to_the_edge():
    tokens = ActionTokenizer.for_space(spaces.Box(-1.0, 1.0, (1,)), bins=3)  # centers -1, 0, 1
    assert tokens.to_indices(torch.tensor([[-0.6], [0.4], [7.0], [-9.0]])).flatten().tolist() == [0, 1, 2, 0]


def test_discrete_actions_map_one_token_each_and_ignore_the_bins_setting():
    tokens = ActionTokenizer.for_space(spaces.Discrete(3), bins=256)
    assert (tokens.bins, tokens.dims, tokens.action_shape, tokens.discrete) == (3, 1, (), True)
    indices = torch.tensor([[0], [2], [1]])
    assert tokens.to_actions(indices).tolist() == [0, 2, 1]
    assert torch.equal(tokens.to_indices(torch.tensor([0, 2, 1])), indices)


@pytest.mark.parametrize(
    ("space", "bins", "field"),
    [
        (spaces.Box(-1.0, 1.0, (2,)), 1, "spec.model.vla.actionBins must be >= 2"),
        (spaces.Box(-np.inf, np.inf, (2,)), 8, "finite bounds"),
        (spaces.Box(-1.0, 1.0, (2, 2)), 8, "Discrete or 1-D Box actions"),
        (spaces.MultiBinary(3), 8, "Discrete or 1-D Box actions"),
        (spaces.Discrete(3, start=1), 8, "Discrete actions from 0"),
    ],
)
def test_a_space_the_policy_cannot_emit_is_refused_naming_the_field(space, bins, field):
    with pytest.raises(ActionSpaceError, match=field) as caught:
        ActionTokenizer.for_space(space, bins)
    assert "spec." in str(caught.value)
