"""The preference losses against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from rljob.algorithms.preference import dpo_loss


def sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


def tensors(*values: float) -> list[torch.Tensor]:
    return [torch.tensor([v]) for v in values]


def test_sigmoid_dpo_is_minus_log_sigmoid_of_beta_times_the_log_ratio_gap():
    # policy chosen -3, rejected -5; reference chosen -4, rejected -4: gap (1) - (-1) = 2
    result = dpo_loss(*tensors(-3.0, -5.0, -4.0, -4.0), beta=0.5)
    assert float(result.loss) == pytest.approx(-math.log(sigmoid(1.0)))
    assert float(result.chosen_rewards) == pytest.approx(0.5)
    assert float(result.rejected_rewards) == pytest.approx(-0.5)
    assert float(result.margins) == pytest.approx(1.0) and float(result.correct) == 1.0


def test_label_smoothing_mixes_in_the_flipped_pair_cdpo():
    result = dpo_loss(*tensors(-3.0, -5.0, -4.0, -4.0), beta=0.5, label_smoothing=0.1)
    expected = -0.9 * math.log(sigmoid(1.0)) - 0.1 * math.log(sigmoid(-1.0))
    assert float(result.loss) == pytest.approx(expected)


def test_robust_dpo_divides_the_debiased_loss_by_one_minus_twice_the_smoothing():
    result = dpo_loss(*tensors(-3.0, -5.0, -4.0, -4.0), beta=0.5, loss_type="robust", label_smoothing=0.2)
    expected = (-0.8 * math.log(sigmoid(1.0)) + 0.2 * math.log(sigmoid(-1.0))) / 0.6
    assert float(result.loss) == pytest.approx(expected)


def test_ipo_squares_the_per_token_gap_minus_one_over_two_beta():
    # chosen log-ratio 1 over 2 tokens, rejected -1 over 4 tokens: gap 0.5 + 0.25 = 0.75; 1 / (2 * 0.25) = 2
    result = dpo_loss(
        *tensors(-3.0, -5.0, -4.0, -4.0),
        beta=0.25,
        loss_type="ipo",
        chosen_tokens=torch.tensor([2.0]),
        rejected_tokens=torch.tensor([4.0]),
    )
    assert float(result.loss) == pytest.approx((0.75 - 2.0) ** 2)


def test_ipo_without_token_counts_says_what_it_needs():
    with pytest.raises(ValueError, match="token counts"):
        dpo_loss(*tensors(-3.0, -5.0, -4.0, -4.0), beta=0.1, loss_type="ipo")


def test_a_policy_equal_to_its_reference_ranks_no_pair_right_and_loses_log_2():
    result = dpo_loss(*tensors(-3.0, -5.0, -3.0, -5.0), beta=0.1)
    assert float(result.loss) == pytest.approx(math.log(2.0))
    assert float(result.correct) == 0.0


def test_the_gradient_raises_the_chosen_and_lowers_the_rejected_log_prob():
    chosen = torch.tensor([-3.0], requires_grad=True)
    rejected = torch.tensor([-5.0], requires_grad=True)
    dpo_loss(chosen, rejected, torch.tensor([-4.0]), torch.tensor([-4.0]), beta=0.5).loss.sum().backward()
    assert chosen.grad is not None and rejected.grad is not None
    assert float(chosen.grad) < 0 < float(rejected.grad)  # descent raises chosen, lowers rejected
    assert float(chosen.grad) == pytest.approx(-0.5 * sigmoid(-1.0))


def test_bradley_terry_is_minus_log_sigmoid_of_the_score_gap():
    from rljob.algorithms.preference import bradley_terry_loss

    result = bradley_terry_loss(torch.tensor([2.0, 0.0]), torch.tensor([1.0, 0.5]))
    assert result.loss.tolist() == pytest.approx([-math.log(sigmoid(1.0)), -math.log(sigmoid(-0.5))])
    assert result.correct.tolist() == [1.0, 0.0]
    assert result.margins.tolist() == pytest.approx([1.0, -0.5])
