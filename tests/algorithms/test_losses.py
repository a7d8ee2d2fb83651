import math

import pytest
import torch

from rljob.algorithms.losses import (
    aggregate_loss,
    entropy_bonus,
    explained_variance,
    gspo_policy_loss,
    kl_estimate,
    loss_normalizer,
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
    from rljob.api.spec import OFFLINE_STAGES, AlgorithmName

    # Every RL algorithm has its policy loss; the offline stages (sft, dpo, reward_model) have losses of their own.
    assert set(POLICY_LOSSES) == set(typing.get_args(AlgorithmName)) - set(OFFLINE_STAGES)
    assert policy_loss_for("dapo") is ppo_policy_loss
    with pytest.raises(ValueError, match=r"algorithm\.name"):
        policy_loss_for("trpo")


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_aggregation_without_a_mask_equals_an_all_ones_mask(mode):
    assert aggregate_loss(LOSS, None, mode).item() == pytest.approx(aggregate_loss(LOSS, torch.ones(2, 3), mode).item())
    assert aggregate_loss(LOSS, None, mode, norm_length=6).item() == pytest.approx(
        aggregate_loss(LOSS, torch.ones(2, 3), mode, norm_length=6).item()
    )


# --- global normalisation across micro-batches and ranks -----------------------------------------

AGGREGATION_MODES = ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]


@pytest.mark.parametrize(
    ("mode", "local_count", "expected"),
    [
        # LOSS/MASK as above, as one micro-batch of a minibatch holding 10 valid tokens and 5 sequences
        ("token-mean", 4, (1 + 2 + 3 + 4) / 10),
        ("seq-mean-token-sum", 2, (6 + 4) / 5),
        ("seq-mean-token-mean", 2, (6 / 3 + 4 / 1) / 5),
        # norm_length 4 (the maximum response length), not this micro-batch's width 3
        ("seq-mean-token-sum-norm", 2, (6 / 4 + 4 / 4) / 5),
    ],
)
def test_global_normalizer_replaces_the_local_denominator(mode, local_count, expected):
    assert loss_normalizer(MASK, mode) == local_count
    normalizer = 10.0 if mode == "token-mean" else 5.0
    assert aggregate_loss(LOSS, MASK, mode, norm_length=4, normalizer=normalizer).item() == pytest.approx(expected)
    assert entropy_bonus(LOSS, MASK, mode, norm_length=4, normalizer=normalizer).item() == pytest.approx(expected)


def test_loss_normalizer_of_per_sample_masks_and_bad_inputs():
    per_sample = torch.tensor([1, 0, 1])
    assert loss_normalizer(per_sample, "token-mean") == 2
    assert loss_normalizer(per_sample, "seq-mean-token-mean") == 3
    with pytest.raises(ValueError, match="lossAggregation"):
        loss_normalizer(per_sample, "sum")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="normalizer"):
        aggregate_loss(LOSS, MASK, normalizer=0.0)


def _ragged_batch(rows: int = 8, width: int = 6) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    lengths = torch.tensor([6, 1, 3, 0, 5, 2, 6, 4])[:rows]  # one response without a valid token
    mask = (torch.arange(width).unsqueeze(0) < lengths.unsqueeze(1)).to(torch.float64)
    return torch.randn(rows, width, generator=g, dtype=torch.float64), mask


def _micro_batches(mask: torch.Tensor, parts: int = 4) -> list[tuple[slice, int]]:
    """Row slices with each micro-batch trimmed to its own longest response, as a packing learner does."""
    rows = mask.shape[0] // parts
    out = []
    for i in range(parts):
        rows_slice = slice(i * rows, (i + 1) * rows)
        out.append((rows_slice, max(int(mask[rows_slice].sum(dim=1).max().item()), 1)))
    return out


@pytest.mark.parametrize("mode", AGGREGATION_MODES)
def test_micro_batches_with_the_global_normalizer_add_up_to_the_full_batch_loss_and_gradient(mode):
    values, mask = _ragged_batch()
    norm_length = values.shape[1]  # the constant maximum response length
    full_leaf = values.clone().requires_grad_()
    full = aggregate_loss(full_leaf, mask, mode, norm_length=norm_length)
    full.backward()

    parts = _micro_batches(mask)
    normalizer = sum(loss_normalizer(mask[rows, :width], mode) for rows, width in parts)  # the all-reduce
    split_leaf = values.clone().requires_grad_()
    total = torch.zeros((), dtype=torch.float64)
    for rows, width in parts:
        micro = aggregate_loss(
            split_leaf[rows, :width], mask[rows, :width], mode, norm_length=norm_length, normalizer=normalizer
        )
        micro.backward()  # gradient accumulation, one backward per micro-batch
        total = total + micro.detach()
    assert abs(total.item() - full.item()) < 1e-6
    torch.testing.assert_close(split_leaf.grad, full_leaf.grad, atol=1e-6, rtol=0)
    # without the global count each micro-batch averages on its own, and the sum is a different loss
    local_sum = sum(aggregate_loss(values[r, :w], mask[r, :w], mode, norm_length=norm_length) for r, w in parts)
    assert abs(local_sum.item() - full.item()) > 1e-3


def test_dr_grpo_micro_batches_need_the_constant_norm_length_not_their_own_width():
    values, mask = _ragged_batch()
    full = aggregate_loss(values, mask, "seq-mean-token-sum-norm", norm_length=values.shape[1])
    parts = _micro_batches(mask)
    own_width = sum(
        aggregate_loss(values[r, :w], mask[r, :w], "seq-mean-token-sum-norm", normalizer=8.0) for r, w in parts
    )
    assert abs(own_width.item() - full.item()) > 1e-3


@pytest.mark.parametrize("mode", AGGREGATION_MODES)
@pytest.mark.parametrize("loss_name", ["ppo", "gspo", "cispo"])
def test_policy_losses_split_into_micro_batches_match_the_full_batch(loss_name, mode):
    from rljob.algorithms.losses import POLICY_LOSSES

    policy_loss = POLICY_LOSSES[loss_name]
    g = torch.Generator().manual_seed(4)
    _, mask = _ragged_batch()
    old = -torch.rand(mask.shape, generator=g, dtype=torch.float64) * 3
    new = old + 0.3 * torch.randn(mask.shape, generator=g, dtype=torch.float64)  # some ratios clip
    adv = torch.randn(mask.shape[0], 1, generator=g, dtype=torch.float64).expand_as(mask)
    norm_length = mask.shape[1]

    def run(rows: slice, width: int, leaf: torch.Tensor, normalizer: float | None) -> torch.Tensor:
        loss, _ = policy_loss(
            leaf[rows, :width],
            old[rows, :width],
            adv[rows, :width],
            0.2,
            0.28,
            dual_clip=3.0 if loss_name == "ppo" else None,
            mask=mask[rows, :width],
            aggregation=mode,
            norm_length=norm_length,
            normalizer=normalizer,
        )
        loss.backward()
        return loss.detach()

    full_leaf = new.clone().requires_grad_()
    full = run(slice(None), norm_length, full_leaf, None)
    parts = _micro_batches(mask)
    normalizer = sum(loss_normalizer(mask[rows, :width], mode) for rows, width in parts)
    split_leaf = new.clone().requires_grad_()
    total = sum(run(rows, width, split_leaf, normalizer) for rows, width in parts)
    assert abs(total.item() - full.item()) < 1e-6
    torch.testing.assert_close(split_leaf.grad, full_leaf.grad, atol=1e-6, rtol=0)


# --- hand-computed values of each policy loss -----------------------------------------------------


def test_ppo_clip_higher_keeps_a_ratio_symmetric_clipping_would_cut():
    # clip 0.2 low / 0.28 high: ratios are kept inside [0.8, 1.28]
    ratios = torch.tensor([1.25, 1.3, 0.75, 0.85], dtype=torch.float64)
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0], dtype=torch.float64)
    new = torch.log(ratios).requires_grad_()
    loss, stats = ppo_policy_loss(new, torch.zeros(4, dtype=torch.float64), adv, clip_low=0.2, clip_high=0.28)
    # token 0: A=+1, r=1.25 inside (symmetric 0.2 would clip it at 1.2) -> -1.25
    # token 1: A=+1, r=1.3  > 1.28 -> max(-1.3, -1.28) = -1.28 (clipped)
    # token 2: A=-1, r=0.75 < 0.8  -> max(0.75, 0.8)   =  0.8  (clipped)
    # token 3: A=-1, r=0.85 inside -> 0.85
    # mean = (-1.25 - 1.28 + 0.8 + 0.85) / 4 = -0.22
    assert loss.item() == pytest.approx(-0.22)
    assert stats["clip_fraction"].item() == pytest.approx(0.5)
    loss.backward()
    # d/d logp (-A r) / 4 = -A r / 4 where unclipped, 0 where clipped
    torch.testing.assert_close(new.grad, torch.tensor([-0.3125, 0.0, 0.0, 0.2125], dtype=torch.float64))
    symmetric, symmetric_stats = ppo_policy_loss(torch.log(ratios), torch.zeros(4, dtype=torch.float64), adv, 0.2, 0.2)
    # token 0 now clipped at 1.2, token 1 too: (-1.2 - 1.2 + 0.8 + 0.85) / 4 = -0.1875
    assert symmetric.item() == pytest.approx(-0.1875)
    assert symmetric_stats["clip_fraction"].item() == pytest.approx(0.75)


def test_dual_clip_bounds_a_negative_advantage_and_stops_its_gradient():
    adv = torch.full((3,), -2.0, dtype=torch.float64)
    new = torch.log(torch.tensor([5.0, 2.0, 0.5], dtype=torch.float64)).requires_grad_()
    loss, _ = ppo_policy_loss(new, torch.zeros(3, dtype=torch.float64), adv, 0.2, 0.2, dual_clip=3.0)
    # r=5:   max(10, 2.4) = 10, above -A * c = 6 -> 6 (dual-clipped, no gradient)
    # r=2:   max(4, 2.4)  = 4,  below 6          -> 4 (unclipped, gradient -A r / 3 = 4/3)
    # r=0.5: max(1.0, 1.6) = 1.6 (clipped at 0.8) -> 1.6 (no gradient)
    assert loss.item() == pytest.approx((6 + 4 + 1.6) / 3)
    loss.backward()
    torch.testing.assert_close(new.grad, torch.tensor([0.0, 4 / 3, 0.0], dtype=torch.float64))
    plain, _ = ppo_policy_loss(new.detach(), torch.zeros(3, dtype=torch.float64), adv, 0.2, 0.2)
    assert plain.item() == pytest.approx((10 + 4 + 1.6) / 3)  # without dual clip the r=5 token dominates


GSPO_OLD = torch.zeros(2, 3, dtype=torch.float64)
# sequence 0: token log ratios (0.1, -0.2, 0.4), mean 0.1 -> s0 = exp(0.1) = 1.105171
# sequence 1: token log ratios (0.3, 0.1) and a padded token, mean 0.2 -> s1 = exp(0.2) = 1.221403
GSPO_NEW = torch.tensor([[0.1, -0.2, 0.4], [0.3, 0.1, 7.0]], dtype=torch.float64)
GSPO_MASK = torch.tensor([[1, 1, 1], [1, 1, 0]])
GSPO_ADV = torch.tensor([1.0, -1.0], dtype=torch.float64)
S0, S1 = 1.105171, 1.221403


def test_gspo_sequence_ratio_on_a_ragged_pair():
    new = GSPO_NEW.clone().requires_grad_()
    loss, stats = gspo_policy_loss(new, GSPO_OLD, GSPO_ADV, 0.3, 0.3, mask=GSPO_MASK, aggregation="seq-mean-token-mean")
    # both inside [0.7, 1.3]: per sequence -A s -> (-1.105171 + 1.221403) / 2 = 0.058116
    assert loss.item() == pytest.approx((-S0 + S1) / 2, abs=1e-6)
    # every valid token carries its sequence's ratio: (3 * 1.105171 + 2 * 1.221403) / 5 = 1.151664
    assert stats["ratio_mean"].item() == pytest.approx(1.151664, abs=1e-6)
    loss.backward()
    # sequence-level gradient: d/d logp_it of (1/2)(-A_i s_i) = -A_i s_i / (2 |y_i|),
    # since d s_i / d logp_it = s_i / |y_i|
    # sequence 0: -1.105171 / 6 = -0.184195 on each token ; sequence 1: 1.221403 / 4 = 0.305351 ; padding 0
    expected = torch.tensor([[-0.184195] * 3, [0.305351, 0.305351, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(new.grad, expected, atol=1e-6, rtol=0)
    # the same as differentiating the sequence objective mean_i(-A_i exp(mean_t log ratio_it)) directly
    direct = GSPO_NEW.clone().requires_grad_()
    valid = GSPO_MASK.to(torch.float64)
    seq_ratio = torch.exp((direct * valid).sum(dim=1) / valid.sum(dim=1))
    (-GSPO_ADV * seq_ratio).mean().backward()
    torch.testing.assert_close(new.grad, direct.grad)


def test_gspo_token_mean_weighs_each_token_by_its_sequence_ratio():
    loss, _ = gspo_policy_loss(GSPO_NEW, GSPO_OLD, GSPO_ADV, 0.3, 0.3, mask=GSPO_MASK, aggregation="token-mean")
    # (3 * -1.105171 + 2 * 1.221403) / 5 = -0.174541
    assert loss.item() == pytest.approx(-0.174541, abs=1e-6)


def test_gspo_clips_whole_sequences_not_tokens():
    _, stats = gspo_policy_loss(GSPO_NEW, GSPO_OLD, GSPO_ADV, 0.15, 0.15, mask=GSPO_MASK)
    # range [0.85, 1.15]: s0 = 1.105 inside, s1 = 1.221 outside -> both of sequence 1's tokens: 2 / 5.
    # (Token ratios would give 3 / 5: exp(-0.2) = 0.819, exp(0.4) = 1.492, exp(0.3) = 1.350 are outside.)
    assert stats["clip_fraction"].item() == pytest.approx(0.4)


def test_kl_estimators_when_the_reference_is_more_likely():
    logp = torch.log(torch.tensor([0.2], dtype=torch.float64))
    ref = torch.log(torch.tensor([0.6], dtype=torch.float64))
    # log_r = ln(0.6 / 0.2) = ln 3 = 1.098612
    assert kl_estimate(logp, ref, "k1").item() == pytest.approx(-1.098612, abs=1e-6)  # k1 can be negative
    assert kl_estimate(logp, ref, "k2").item() == pytest.approx(0.5 * 1.098612**2, abs=1e-6)  # 0.603474
    assert kl_estimate(logp, ref, "k3").item() == pytest.approx(3 - 1 - 1.098612, abs=1e-6)  # 0.901388


def test_off_policy_weights_carry_no_gradient_and_count_only_valid_tokens():
    rollout = torch.zeros(2, 2)
    old = torch.log(torch.tensor([[1.5, 4.0], [0.25, 1.0]])).requires_grad_()
    mask = torch.tensor([[1, 1], [1, 0]])
    weights, stats = off_policy_weights(old, rollout, "icepop", low=0.5, high=2.0, mask=mask)
    # ratios 1.5 (kept), 4.0 (dropped), 0.25 (dropped), 1.0 (padding, not counted): 2 of 3 valid tokens touched
    torch.testing.assert_close(weights, torch.tensor([[1.5, 0.0], [0.0, 1.0]]))
    assert not weights.requires_grad
    assert stats["corrected_fraction"].item() == pytest.approx(2 / 3)
    assert stats["rollout_ratio_mean"].item() == pytest.approx((1.5 + 4.0 + 0.25) / 3)
    tis, tis_stats = off_policy_weights(old, rollout, "tis", low=0.5, high=2.0, mask=mask)
    # tis only caps from above: 1.5, min(4, 2) = 2, 0.25 kept as is
    torch.testing.assert_close(tis, torch.tensor([[1.5, 2.0], [0.25, 1.0]]))
    assert tis_stats["corrected_fraction"].item() == pytest.approx(1 / 3)
