import math

import pytest
import torch

from rljob.algorithms.losses import (
    aggregate_loss,
    entropy_bonus,
    explained_variance,
    gspo_policy_loss,
    kl_estimate,
    off_policy_weights,
    ppo_policy_loss,
    value_loss,
)

RATIOS = torch.tensor([1.5, 0.5, 1.1], dtype=torch.float64)
ADVANTAGES = torch.tensor([1.0, 1.0, -2.0], dtype=torch.float64)


def test_ppo_policy_loss_matches_hand_computed_values():
    old = torch.zeros(3, dtype=torch.float64)
    new = torch.log(RATIOS).requires_grad_()
    loss, stats = ppo_policy_loss(new, old, ADVANTAGES, clip_low=0.2, clip_high=0.2)
    # sample 0: A=1,  r=1.5 -> max(-1.5, -1.2) = -1.2 (clipped)
    # sample 1: A=1,  r=0.5 -> max(-0.5, -0.8) = -0.5 (unclipped: pessimistic bound)
    # sample 2: A=-2, r=1.1 -> max(2.2, 2.2)   =  2.2
    # mean = (-1.2 - 0.5 + 2.2) / 3 = 0.166667
    assert loss.item() == pytest.approx(0.5 / 3)
    assert stats["clip_fraction"].item() == pytest.approx(2 / 3)
    # approx_kl = mean(r - 1 - log r) = (0.094535 + 0.193147 + 0.004690) / 3
    assert stats["approx_kl"].item() == pytest.approx(0.0974573, abs=1e-6)
    loss.backward()
    # d loss / d logprob = -A * r / 3 where the unclipped term is active, 0 where clipping holds it
    torch.testing.assert_close(new.grad, torch.tensor([0.0, -0.5 / 3, 2.2 / 3], dtype=torch.float64))


def test_ppo_policy_loss_clip_higher_is_asymmetric():
    old = torch.zeros(1)
    new = torch.log(torch.tensor([1.25]))
    loss, stats = ppo_policy_loss(new, old, torch.ones(1), clip_low=0.2, clip_high=0.28)
    assert loss.item() == pytest.approx(-1.25)  # 1.25 < 1.28: not clipped
    assert stats["clip_fraction"].item() == 0.0


def test_dual_clip_caps_the_loss_of_negative_advantages():
    old = torch.zeros(2)
    new = torch.log(torch.tensor([5.0, 5.0]))
    adv = torch.tensor([-1.0, 1.0])
    loss, _ = ppo_policy_loss(new, old, adv, 0.2, 0.2, dual_clip=3.0, aggregation="seq-mean-token-sum")
    # A=-1, r=5: max(5, 1.2) = 5, capped at -A * 3 = 3 ; A=1, r=5: max(-5, -1.2) = -1.2 ; mean = 0.9
    assert loss.item() == pytest.approx(0.9)
    with pytest.raises(ValueError, match="dualClip"):
        ppo_policy_loss(new, old, adv, 0.2, 0.2, dual_clip=0.5)


def test_correction_weights_scale_each_tokens_loss():
    old = torch.zeros(2)
    weights = torch.tensor([2.0, 0.0])
    loss, _ = ppo_policy_loss(old.clone(), old, torch.ones(2), 0.2, 0.2, correction_weights=weights)
    assert loss.item() == pytest.approx((-1.0 * 2.0 + 0.0) / 2)


def test_value_loss_clipped_and_unclipped():
    values = torch.tensor([1.0, 2.0])
    old = torch.tensor([0.0, 2.0])
    returns = torch.tensor([2.0, 0.0])
    # unclipped: 0.5 * mean((1-2)^2, (2-0)^2) = 0.5 * 2.5 = 1.25
    assert value_loss(values, old, returns).item() == pytest.approx(1.25)
    # clip 0.5: V_clipped = (0.5, 2.0) -> (0.5-2)^2 = 2.25 > 1 ; 4 = 4 ; 0.5 * mean(2.25, 4) = 1.5625
    assert value_loss(values, old, returns, clip=0.5).item() == pytest.approx(1.5625)


LOSS = torch.tensor([[1.0, 2.0, 3.0], [4.0, 9.0, 9.0]])
MASK = torch.tensor([[1, 1, 1], [1, 0, 0]])


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("token-mean", (1 + 2 + 3 + 4) / 4),
        ("seq-mean-token-sum", (6 + 4) / 2),
        ("seq-mean-token-mean", (2 + 4) / 2),
        ("seq-mean-token-sum-norm", (6 / 3 + 4 / 3) / 2),
    ],
)
def test_loss_aggregation_modes(mode, expected):
    assert aggregate_loss(LOSS, MASK, mode).item() == pytest.approx(expected)


def test_aggregation_of_per_sample_losses_is_the_plain_mean():
    x = torch.tensor([1.0, 2.0, 6.0])
    for mode in ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"):
        assert aggregate_loss(x, None, mode).item() == pytest.approx(3.0)
    assert entropy_bonus(x).item() == pytest.approx(3.0)
    with pytest.raises(ValueError, match="lossAggregation"):
        aggregate_loss(x, None, "sum")  # type: ignore[arg-type]


def test_kl_estimators_hand_computed():
    logp = torch.log(torch.tensor([0.5]))
    ref = torch.log(torch.tensor([0.25]))
    # log_r = log(0.25 / 0.5) = -0.693147
    assert kl_estimate(logp, ref, "k1").item() == pytest.approx(math.log(2))
    assert kl_estimate(logp, ref, "k2").item() == pytest.approx(0.5 * math.log(2) ** 2)
    assert kl_estimate(logp, ref, "k3").item() == pytest.approx(0.5 - 1 + math.log(2))
    with pytest.raises(ValueError, match="klEstimator"):
        kl_estimate(logp, ref, "k4")  # type: ignore[arg-type]


def test_k1_and_k3_are_unbiased_estimates_of_the_true_kl():
    p = torch.tensor([0.6, 0.3, 0.1])
    q = torch.tensor([0.3, 0.3, 0.4])
    true_kl = (p * (p / q).log()).sum().item()
    samples = torch.multinomial(p, 200_000, replacement=True, generator=torch.Generator().manual_seed(0))
    logp, logq = p.log()[samples], q.log()[samples]
    assert kl_estimate(logp, logq, "k1").mean().item() == pytest.approx(true_kl, abs=0.01)
    assert kl_estimate(logp, logq, "k3").mean().item() == pytest.approx(true_kl, abs=0.01)
    assert (kl_estimate(logp, logq, "k3") >= 0).all()


def test_off_policy_weights_tis_truncates_and_icepop_masks():
    rollout = torch.zeros(3)
    old = torch.log(torch.tensor([1.0, 3.0, 0.2]))
    tis, tis_stats = off_policy_weights(old, rollout, "tis", low=0.5, high=2.0)
    torch.testing.assert_close(tis, torch.tensor([1.0, 2.0, 0.2]))
    assert tis_stats["corrected_fraction"].item() == pytest.approx(1 / 3)
    icepop, ice_stats = off_policy_weights(old, rollout, "icepop", low=0.5, high=2.0)
    torch.testing.assert_close(icepop, torch.tensor([1.0, 0.0, 0.0]))
    assert ice_stats["corrected_fraction"].item() == pytest.approx(2 / 3)
    none, _ = off_policy_weights(old, rollout, "none", low=0.5, high=2.0)
    torch.testing.assert_close(none, torch.ones(3))


def test_explained_variance():
    target = torch.tensor([1.0, 2.0, 3.0, 4.0])
    assert explained_variance(target, target) == pytest.approx(1.0)
    assert explained_variance(torch.full((4,), 2.5), target) == pytest.approx(0.0)
    assert math.isnan(explained_variance(target, torch.ones(4)))


def test_gspo_uses_one_length_normalised_ratio_per_sequence():
    old = torch.zeros(2, 2, dtype=torch.float64)
    mask = torch.tensor([[1, 1], [1, 0]])
    # sequence 0: token log ratios (ln 2, 0) -> s = exp(ln 2 / 2) = 1.41421, A = +1: clipped at 1.2 -> -1.2
    # sequence 1: one valid token, ratio 0.9 (the padded token's 5.0 is ignored), A = -1 -> 0.9
    new = torch.tensor([[math.log(2), 0.0], [math.log(0.9), 5.0]], dtype=torch.float64, requires_grad=True)
    adv = torch.tensor([1.0, -1.0], dtype=torch.float64)
    loss, stats = gspo_policy_loss(new, old, adv, 0.2, 0.2, mask=mask, aggregation="seq-mean-token-mean")
    assert loss.item() == pytest.approx((-1.2 + 0.9) / 2)
    assert stats["clip_fraction"].item() == pytest.approx(2 / 3)
    loss.backward()
    # sequence 1 unclipped: d/d logp of (1/2) * (-A * s) with s = exp(logp) -> 0.9 / 2; sequence 0 clipped -> 0
    torch.testing.assert_close(new.grad, torch.tensor([[0.0, 0.0], [0.45, 0.0]], dtype=torch.float64))


def test_cispo_keeps_the_gradient_of_clipped_tokens_with_a_capped_weight():
    from rljob.algorithms.losses import cispo_policy_loss

    old = torch.log(torch.tensor([0.2, 0.4], dtype=torch.float64))
    new = torch.log(torch.tensor([0.3, 0.2], dtype=torch.float64)).requires_grad_()  # ratios 1.5, 0.5
    adv = torch.tensor([1.0, -1.0], dtype=torch.float64)
    loss, stats = cispo_policy_loss(new, old, adv, clip_low=0.2, clip_high=0.28)
    # weights: min(1.5, 1.28) = 1.28 and 0.5 (no lower bound)
    # tokens: -1.28 * 1 * ln 0.3 = 1.541083 ; -0.5 * -1 * ln 0.2 = -0.804719 ; mean = 0.368182
    assert loss.item() == pytest.approx((1.28 * -math.log(0.3) + 0.5 * math.log(0.2)) / 2)
    assert stats["clip_fraction"].item() == pytest.approx(0.5)
    loss.backward()
    torch.testing.assert_close(new.grad, torch.tensor([-0.64, 0.25], dtype=torch.float64))


def test_policy_loss_registry_covers_every_algorithm():
    import typing

    from rljob.algorithms.losses import POLICY_LOSSES, policy_loss_for
    from rljob.api.spec import AlgorithmName

    assert set(POLICY_LOSSES) == set(typing.get_args(AlgorithmName))
    assert policy_loss_for("dapo") is ppo_policy_loss
    with pytest.raises(ValueError, match=r"algorithm\.name"):
        policy_loss_for("trpo")


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_aggregation_without_a_mask_equals_an_all_ones_mask(mode):
    assert aggregate_loss(LOSS, None, mode).item() == pytest.approx(aggregate_loss(LOSS, torch.ones(2, 3), mode).item())
    assert aggregate_loss(LOSS, None, mode, norm_length=6).item() == pytest.approx(
        aggregate_loss(LOSS, torch.ones(2, 3), mode, norm_length=6).item()
    )
