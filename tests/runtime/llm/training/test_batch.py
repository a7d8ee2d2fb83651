"""Micro-batch layouts: whole prompt+response rows, and a shared prompt prefix with each row only its tail."""

from __future__ import annotations

import torch

from rljob.runtime.llm.training.batch import by_prompt, collate, collate_shared

PAD = 0


def group_samples() -> list[dict]:
    """Three prompts of 4, 2 and 3 tokens, interleaved, with ragged responses; one response has a loss mask."""
    prompts = [[5, 6, 7, 8], [9, 10], [11, 12, 13]]
    responses = [[20], [21, 22, 23], [24, 25], [26, 27], [28], [29, 30, 31], [32, 33]]
    samples = []
    for k, response in enumerate(responses):
        samples.append(
            {
                "prompt_ids": prompts[k % 3],
                "response_ids": response,
                "rollout_logprobs": [-1.0 - k - 0.1 * t for t in range(len(response))],
                "advantage": 0.5 * k - 1.0,
            }
        )
    samples[1]["loss_mask"] = [1.0, 0.0, 1.0]
    return samples


def test_shared_layout_runs_each_prompt_but_its_last_token_once_left_padded():
    samples = group_samples()
    batch = collate_shared(samples, PAD)
    assert batch is not None and batch.prefix is not None
    prefix = batch.prefix
    # Prompts in order of first appearance, without their last token, padded on the left to end together.
    assert prefix.input_ids.tolist() == [[5, 6, 7], [PAD, PAD, 9], [PAD, 11, 12]]
    assert prefix.attention_mask.tolist() == [[1, 1, 1], [0, 0, 1], [0, 1, 1]]
    assert prefix.position_ids.tolist() == [[0, 1, 2], [0, 0, 0], [0, 0, 1]]
    assert prefix.rows.tolist() == [0, 1, 2, 0, 1, 2, 0]
    # Each row: its prompt's last token, then its response, right-padded; positions continue the prompt's.
    assert batch.input_ids.tolist() == [
        [8, 20, PAD, PAD],
        [10, 21, 22, 23],
        [13, 24, 25, PAD],
        [8, 26, 27, PAD],
        [10, 28, PAD, PAD],
        [13, 29, 30, 31],
        [8, 32, 33, PAD],
    ]
    assert batch.position_ids is not None
    assert batch.position_ids[:3].tolist() == [[3, 4, 5, 6], [1, 2, 3, 4], [2, 3, 4, 5]]
    assert batch.attention_mask[1].tolist() == [0, 0, 1, 1, 1, 1, 1]
    assert batch.attention_mask[4].tolist() == [0, 0, 1, 1, 1, 0, 0]
    assert batch.attention_mask[2].tolist() == [0, 1, 1, 1, 1, 1, 0]


def test_shared_layout_puts_the_same_response_values_on_its_grid_as_whole_rows():
    samples = group_samples()
    whole, shared = collate(samples, PAD), collate_shared(samples, PAD)
    assert shared is not None
    assert shared.response_mask.shape == (7, 3)  # the longest response: no prompt columns
    # Read out in row-major order, both layouts hold the same targets, masks, advantages and rollout logprobs.
    for field in ("targets", "advantages", "rollout_logprobs"):
        mine, theirs = getattr(shared, field), getattr(whole, field)
        assert torch.equal(mine[shared.response_mask > 0], theirs[whole.response_mask > 0])
    assert shared.response_mask.sum() == whole.response_mask.sum() == 14 - 1  # one token masked out
    assert shared.response_mask[1].tolist() == [1.0, 0.0, 1.0]


def test_nothing_to_share_keeps_whole_rows():
    samples = group_samples()
    assert collate_shared(samples[:3], PAD) is None  # three prompts, once each
    one_token = [{**s, "prompt_ids": [7]} if k == 0 else s for k, s in enumerate(samples)]
    assert collate_shared(one_token, PAD) is None  # a prompt with nothing before its last token


def test_a_layout_that_saves_too_little_keeps_whole_rows():
    samples = group_samples()
    # Whole rows: 7 x 6 = 42 positions; shared: 3 prefixes x 3 + 7 rows x (1 + 3) = 37, a saving of 12%.
    assert collate_shared(samples, PAD, min_saving=0.1) is not None
    assert collate_shared(samples, PAD, min_saving=0.2) is None
    # A long prompt asked once beside a short one with long responses: the padded prefix costs more than it saves.
    base = {"rollout_logprobs": [], "advantage": 0.0}
    ragged = [
        {**base, "prompt_ids": [1, 2, 3, 4, 5, 6], "response_ids": [7], "rollout_logprobs": [-1.0]},
        *({**base, "prompt_ids": [8, 9], "response_ids": [10, 11, 12, 13, 14], "rollout_logprobs": [-1.0] * 5},) * 2,
    ]
    assert collate_shared(ragged, PAD) is None  # 2 x 5 + 3 x 6 = 28 positions against 3 x 7 = 21


def test_by_prompt_puts_a_prompts_responses_together_in_order():
    samples = group_samples()
    ordered = by_prompt(samples)
    assert [s["response_ids"][0] for s in ordered] == [20, 26, 32, 21, 28, 24, 29]
    assert sorted(map(id, ordered)) == sorted(map(id, samples))


def test_a_micro_batch_moves_with_its_prefix():
    batch = collate_shared(group_samples(), PAD)
    assert batch is not None
    moved = batch.to(torch.device("meta"))
    assert moved.prefix is not None and moved.prefix.rows.device.type == "meta"
    assert moved.position_ids is not None and moved.position_ids.device.type == "meta"
    assert collate(group_samples(), PAD).to(torch.device("meta")).prefix is None
