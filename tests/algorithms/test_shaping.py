import pytest
import torch

from rljob.algorithms.shaping import overlong_penalty


def test_overlong_penalty_ramps_linearly_over_the_buffer():
    # max 20, buffer 5: free up to 15 tokens, then (15 - len) / 5 * penalty, and -penalty from 20 on
    lengths = torch.tensor([10, 15, 16, 18, 20, 25])
    expected = torch.tensor([0.0, 0.0, -0.2, -0.6, -1.0, -1.0])
    torch.testing.assert_close(overlong_penalty(lengths, max_length=20, buffer=5, penalty=1.0), expected)
    # the penalty scales the ramp: 16 tokens with penalty 0.5 -> (15 - 16) / 5 * 0.5 = -0.1
    half = overlong_penalty(lengths, max_length=20, buffer=5, penalty=0.5)
    torch.testing.assert_close(half, torch.tensor([0.0, 0.0, -0.1, -0.3, -0.5, -0.5]))


def test_overlong_penalty_of_integer_lengths_is_a_float_reward_and_keeps_a_float_dtype():
    assert overlong_penalty(torch.tensor([18]), 20, 5).dtype == torch.get_default_dtype()
    lengths = torch.tensor([17.0], dtype=torch.float64)
    out = overlong_penalty(lengths, 20, 5, 2.0)
    assert out.dtype == torch.float64 and out.item() == pytest.approx(-0.8)  # (15 - 17) / 5 * 2


@pytest.mark.parametrize(
    ("buffer", "penalty", "match"),
    [(0, 1.0, "buffer"), (20, 1.0, "buffer"), (5, -1.0, "penalty")],
)
def test_overlong_penalty_rejects_a_buffer_outside_the_response_and_a_negative_penalty(buffer, penalty, match):
    with pytest.raises(ValueError, match=match):
        overlong_penalty(torch.tensor([1]), max_length=20, buffer=buffer, penalty=penalty)
