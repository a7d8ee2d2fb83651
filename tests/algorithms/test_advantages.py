import pytest
import torch

from rljob.algorithms.advantages import (
    GROUP_ADVANTAGES,
    dr_grpo_advantages,
    gae_advantages,
    group_advantages,
    grpo_advantages,
    normalize,
    reinforce_pp_advantages,
    rloo_advantages,
)


def t(*rows: list[float]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float64)


def test_gae_matches_hand_computed_values_with_truncation_and_termination():
    # Two environments, three steps, gamma 0.9, lambda 0.5 (so gamma * lambda = 0.45).
    # env 0: step 0 continues; step 1 is TRUNCATED (bootstrap from the final observation's value 4.0);
    #        a new episode starts at step 2 and TERMINATES there (its next value 7.0 must be ignored).
    # env 1: nothing ends; the last step bootstraps from next_values = 2.0.
    rewards = t([1.0, 1.0], [2.0, 1.0], [3.0, 1.0])
    values = t([0.5, 0.0], [1.0, 0.0], [2.0, 0.0])
    next_values = t([1.0, 0.0], [4.0, 0.0], [7.0, 2.0])
    terminated = t([0, 0], [0, 0], [1, 0])
    ended = t([0, 0], [1, 0], [1, 0])
    # env 0: d0 = 1 + 0.9*1.0 - 0.5 = 1.4 ; d1 = 2 + 0.9*4.0 - 1.0 = 4.6 ; d2 = 3 + 0 - 2.0 = 1.0
    #        A2 = 1.0 ; A1 = 4.6 (ended: no A2 leak) ; A0 = 1.4 + 0.45*4.6 = 3.47
    # env 1: d = 1, 1, 1 + 0.9*2 = 2.8 ; A2 = 2.8 ; A1 = 1 + 0.45*2.8 = 2.26 ; A0 = 1 + 0.45*2.26 = 2.017
    expected_adv = t([3.47, 2.017], [4.6, 2.26], [1.0, 2.8])
    adv, ret = gae_advantages(rewards, values, next_values, terminated, ended, gamma=0.9, lam=0.5)
    torch.testing.assert_close(adv, expected_adv)
    # returns = advantages + values: env 0 -> 3.97, 5.6, 3.0
    torch.testing.assert_close(ret, expected_adv + values)
    torch.testing.assert_close(ret[:, 0], torch.tensor([3.97, 5.6, 3.0], dtype=torch.float64))


def test_gae_with_lambda_one_is_monte_carlo_return_minus_value():
    g = torch.Generator().manual_seed(0)
    steps, gamma = 6, 0.95
    rewards = torch.rand(steps, 3, generator=g, dtype=torch.float64)
    values = torch.rand(steps, 3, generator=g, dtype=torch.float64)
    next_values = torch.cat([values[1:], torch.rand(1, 3, generator=g, dtype=torch.float64)])
    terminated = torch.zeros(steps, 3, dtype=torch.float64)
    terminated[-1] = 1.0  # every episode terminates at the last step: no bootstrap
    adv, ret = gae_advantages(rewards, values, next_values, terminated, terminated, gamma=gamma, lam=1.0)
    mc = torch.zeros_like(rewards)
    running = torch.zeros(3, dtype=torch.float64)
    for step in reversed(range(steps)):
        running = rewards[step] + gamma * running
        mc[step] = running
    torch.testing.assert_close(ret, mc)
    torch.testing.assert_close(adv, mc - values)


def test_gae_with_lambda_zero_is_the_one_step_td_error():
    g = torch.Generator().manual_seed(1)
    rewards, values, next_values = (torch.rand(5, 2, generator=g, dtype=torch.float64) for _ in range(3))
    none = torch.zeros(5, 2, dtype=torch.float64)
    adv, _ = gae_advantages(rewards, values, next_values, none, none, gamma=0.9, lam=0.0)
    torch.testing.assert_close(adv, rewards + 0.9 * next_values - values)


def test_gae_does_not_leak_across_an_episode_boundary():
    rewards = torch.zeros(4, 1)
    values = torch.zeros(4, 1)
    ended = t([0], [1], [0], [0]).float()
    before, _ = gae_advantages(rewards, values, values, ended, ended, gamma=0.99, lam=0.95)
    rewards[2:] = 100.0  # rewards of the next episode
    after, _ = gae_advantages(rewards, values, values, ended, ended, gamma=0.99, lam=0.95)
    torch.testing.assert_close(after[:2], before[:2])


def test_gae_rejects_mismatched_shapes():
    x = torch.zeros(3, 2)
    with pytest.raises(ValueError, match=r"\[T, N\]"):
        gae_advantages(x, x, torch.zeros(3, 1), x, x, gamma=0.9, lam=0.9)


def test_normalize_gives_zero_mean_unit_std_over_masked_entries():
    adv = torch.tensor([1.0, 2.0, 3.0, 100.0])
    out = normalize(adv)
    assert abs(out.mean().item()) < 1e-6 and abs(out.std(correction=0).item() - 1.0) < 1e-5
    masked = normalize(adv, mask=torch.tensor([1.0, 1.0, 1.0, 0.0]))
    # mean 2, population std sqrt(2/3): (1-2)/0.8165 = -1.2247
    torch.testing.assert_close(masked, torch.tensor([-1.224744, 0.0, 1.224744, 0.0]), rtol=0, atol=1e-5)


GROUPS = t([1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0])


def test_grpo_advantages_scale_by_group_std():
    # group 0: mean 0.5, sample std sqrt(4 * 0.25 / 3) = 0.57735 -> +-0.5 / 0.57735 = +-0.866025
    # group 1: all equal -> 0
    adv = grpo_advantages(GROUPS)
    torch.testing.assert_close(adv, t([0.866025, -0.866025, -0.866025, 0.866025], [0, 0, 0, 0]), atol=1e-5, rtol=0)


def test_dr_grpo_drops_the_std():
    torch.testing.assert_close(group_advantages("dr_grpo", GROUPS), t([0.5, -0.5, -0.5, 0.5], [0, 0, 0, 0]))


def test_rloo_uses_the_leave_one_out_mean():
    # r=1: 1 - (1 + 0 + 0) / 3 = 0.6667 ; r=0: 0 - 2/3 = -0.6667
    third = 2.0 / 3.0
    torch.testing.assert_close(rloo_advantages(GROUPS), t([third, -third, -third, third], [0, 0, 0, 0]))


def test_reinforce_pp_normalises_over_the_whole_batch():
    # centred: +-0.5 in group 0, zeros in group 1; batch mean 0, population std sqrt(4 * 0.25 / 8) = 0.353553
    adv = reinforce_pp_advantages(GROUPS)
    s = 0.5 / 0.353553
    torch.testing.assert_close(adv, t([s, -s, -s, s], [0, 0, 0, 0]), atol=1e-5, rtol=0)


def test_group_registry_covers_every_group_algorithm_and_explains_ppo():
    from rljob.api.spec import GROUP_ALGORITHMS

    assert set(GROUP_ADVANTAGES) == {*GROUP_ALGORITHMS, "distill"}  # distill: the rewards' part of its advantage
    with pytest.raises(ValueError, match="gae_advantages"):
        group_advantages("ppo", GROUPS)
    with pytest.raises(ValueError, match=r"group_size >= 2"):
        grpo_advantages(torch.ones(4))


# A table where every estimator differs: group 0 has one success in four, group 1 has graded rewards.
TABLE = t([1.0, 0.0, 0.0, 0.0], [2.0, 0.0, 1.0, 1.0])


def test_grpo_advantages_on_a_graded_reward_table():
    # group 0: mean 0.25, centred (0.75, -0.25, -0.25, -0.25), sample var (0.5625 + 3 * 0.0625) / 3 = 0.25, std 0.5
    #          -> (1.5, -0.5, -0.5, -0.5)
    # group 1: mean 1, centred (1, -1, 0, 0), sample var 2 / 3, std 0.816497 -> (1.224745, -1.224745, 0, 0)
    expected = t([1.5, -0.5, -0.5, -0.5], [1.224745, -1.224745, 0.0, 0.0])
    torch.testing.assert_close(grpo_advantages(TABLE), expected, atol=1e-5, rtol=0)


def test_dr_grpo_advantages_on_a_graded_reward_table_are_the_centred_rewards():
    expected = t([0.75, -0.25, -0.25, -0.25], [1.0, -1.0, 0.0, 0.0])
    torch.testing.assert_close(group_advantages("dr_grpo", TABLE), expected)


def test_rloo_advantages_on_a_graded_reward_table():
    # group 0: 1 - (0 + 0 + 0) / 3 = 1 ; 0 - (1 + 0 + 0) / 3 = -1/3
    # group 1: 2 - (0 + 1 + 1) / 3 = 4/3 ; 0 - (2 + 1 + 1) / 3 = -4/3 ; 1 - (2 + 0 + 1) / 3 = 0
    third = 1.0 / 3.0
    expected = t([1.0, -third, -third, -third], [4 * third, -4 * third, 0.0, 0.0])
    torch.testing.assert_close(rloo_advantages(TABLE), expected)


def test_reinforce_pp_advantages_on_a_graded_reward_table():
    # group baseline: centred (0.75, -0.25, -0.25, -0.25 | 1, -1, 0, 0); batch mean 0
    # batch population var (0.5625 + 3 * 0.0625 + 1 + 1) / 8 = 0.34375, std 0.586302
    # 0.75 / 0.586302 = 1.279204 ; 0.25 / 0.586302 = 0.426401 ; 1 / 0.586302 = 1.705606
    expected = t([1.279204, -0.426401, -0.426401, -0.426401], [1.705606, -1.705606, 0.0, 0.0])
    torch.testing.assert_close(reinforce_pp_advantages(TABLE), expected, atol=1e-5, rtol=0)


def test_reinforce_pp_normalises_over_every_token_of_the_batch():
    """Issue 18.3, REINFORCE++ eq. 10: the batch statistics are over tokens, so long responses weigh more."""
    rewards = t([1.0, 0.0], [0.5, 0.5])
    token_counts = t([3.0, 1.0], [2.0, 2.0])
    # centred (0.5, -0.5 | 0, 0) over 8 tokens: mean (3 * 0.5 - 0.5) / 8 = 0.125
    # population var (3 * 0.375^2 + 0.625^2 + 4 * 0.125^2) / 8 = 0.875 / 8 = 0.109375, std 0.330719
    expected = t([0.375 / 0.330719, -0.625 / 0.330719], [-0.125 / 0.330719, -0.125 / 0.330719])
    adv = reinforce_pp_advantages(rewards, token_counts)
    torch.testing.assert_close(adv, expected, atol=1e-5, rtol=0)
    torch.testing.assert_close(group_advantages("reinforce_pp", rewards, token_counts=token_counts), adv)
    # One weight per response (the former definition) gives +-1.414214 and 0: a visibly different update.
    assert not torch.allclose(adv, reinforce_pp_advantages(rewards), atol=1e-2)


def test_reinforce_pp_with_equal_lengths_is_the_per_response_normalisation():
    torch.testing.assert_close(
        reinforce_pp_advantages(TABLE, torch.full_like(TABLE, 7.0)), reinforce_pp_advantages(TABLE)
    )


def test_reinforce_pp_rejects_token_counts_of_another_shape():
    with pytest.raises(ValueError, match="token_counts shaped like rewards"):
        reinforce_pp_advantages(TABLE, torch.ones(8))


def test_normalize_advantages_overrides_the_estimators_own_std_scaling():
    # grpo without the std is Dr. GRPO's advantage, and Dr. GRPO with it is GRPO's.
    torch.testing.assert_close(group_advantages("grpo", TABLE, scale_by_std=False), dr_grpo_advantages(TABLE))
    torch.testing.assert_close(group_advantages("dr_grpo", TABLE, scale_by_std=True), grpo_advantages(TABLE))
    # rloo scaled by the group's sample std: group 0 std 0.5 -> (2, -2/3, ...); group 1 std 0.816497.
    third = 1.0 / 3.0
    expected = t([2.0, -2 * third, -2 * third, -2 * third], [4 * third / 0.816497, -4 * third / 0.816497, 0.0, 0.0])
    torch.testing.assert_close(group_advantages("rloo", TABLE, scale_by_std=True), expected, atol=1e-5, rtol=0)
    # reinforce_pp without normalisation keeps the group-centred rewards.
    expected = t([0.75, -0.25, -0.25, -0.25], [1.0, -1.0, 0.0, 0.0])
    torch.testing.assert_close(group_advantages("reinforce_pp", TABLE, scale_by_std=False), expected)
