"""The GRPO-family update: the same step whatever the micro-batch split or rank count; KL, off-policy, shapes."""

from __future__ import annotations

import copy
import json
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from rljob.algorithms.losses import AGGREGATIONS
from rljob.api.spec import AlgorithmSpec, BuiltinNetwork, ModelSpec, OffPolicyCorrection, TrainerSpec
from rljob.runtime.llm.models.policy import build_char_tokenizer, build_tiny_qwen2
from rljob.runtime.llm.training.batch import collate_shared
from rljob.runtime.llm.training.learner import BatchShapeError, LLMLearner, collate, token_logprobs
from rljob.runtime.optim.divergence import Diverged
from tests.runtime.llm.training.test_logprobs import qwen3_5

TOKENIZER = build_char_tokenizer(["0123456789+=-*/ abcdefgh"])
VOCAB = len(TOKENIZER)
FIRST_TOKEN = 4  # after <pad> <s> </s> <unk>
TINY = ModelSpec(source="builtin", builtin=BuiltinNetwork(architecture="tiny-qwen2", hidden_size=32, num_layers=1))
SAMPLES = 16
MAX_RESPONSE = 7
STAT_KEYS = ("policy_loss", "entropy", "kl", "clip_fraction", "mismatch_kl", "mismatch_max_gap", "grad_norm")


def make_model() -> torch.nn.Module:
    return build_tiny_qwen2(TINY, TOKENIZER, max_length=32, seed=0)


def make_samples(seed: int, count: int = SAMPLES) -> list[dict]:
    """Random prompts and responses of ragged lengths, advantages and (made-up) rollout logprobs."""
    g = torch.Generator().manual_seed(seed)
    samples = []
    for _ in range(count):
        prompt_len = int(torch.randint(2, 7, (1,), generator=g))
        response_len = int(torch.randint(1, MAX_RESPONSE + 1, (1,), generator=g))
        tokens = torch.randint(FIRST_TOKEN, VOCAB, (prompt_len + response_len,), generator=g).tolist()
        samples.append(
            {
                "prompt_ids": [TOKENIZER.bos_token_id, *tokens[:prompt_len]],
                "response_ids": tokens[prompt_len:],
                "rollout_logprobs": (-3.0 + 0.3 * torch.randn(response_len, generator=g)).tolist(),
                "advantage": float(torch.randn(1, generator=g)),
                "reward": 0.0,
                "version": 0,
            }
        )
    return samples


def make_learner(
    algorithm: AlgorithmSpec,
    micro_batch_size: int | None = None,
    rank: int = 0,
    world: int = 1,
    reference: torch.nn.Module | None = None,
    model: torch.nn.Module | None = None,
    **trainer_fields,
) -> LLMLearner:
    # Plain SGD: parameters then differ exactly as gradients do. Adam would hide a gradient scaled by a wrong
    # normalizer (its step is scale-free) and blow float noise on zero-gradient parameters (a key bias) up to lr.
    trainer = TrainerSpec(
        steps=10,
        optimizer="sgd",
        learning_rate=0.05,
        micro_batch_size=micro_batch_size,
        seed=3,
        grad_clip=None,
        **trainer_fields,
    )
    return LLMLearner(
        make_model() if model is None else model,
        algorithm,
        trainer,
        pad_id=TOKENIZER.pad_token_id,
        temperature=0.9,
        max_response_tokens=MAX_RESPONSE,
        reference=reference,
        rank=rank,
        world_size=world,
    )


def flat_params(learner: LLMLearner) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in learner.model.parameters()])


@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-mean"])
@pytest.mark.parametrize("name", ["grpo", "gspo", "cispo"])
def test_micro_batch_size_does_not_change_the_update(name, aggregation):
    algorithm = AlgorithmSpec(
        name=name, kl_coef=0.0, loss_aggregation=aggregation, minibatches=2, epochs=2, clip_ratio_high=0.28
    )
    whole, quarters = make_learner(algorithm), make_learner(algorithm, micro_batch_size=SAMPLES // 2 // 4)
    assert torch.equal(flat_params(whole), flat_params(quarters))
    for seed in (0, 1):  # a second step starts from moved weights and a moved optimizer
        stats_whole, stats_quarters = whole.update(make_samples(seed)), quarters.update(make_samples(seed))
        for key in STAT_KEYS:
            assert stats_quarters[key] == pytest.approx(stats_whole[key], rel=1e-5, abs=1e-6), key
        assert stats_whole["response_tokens"] == stats_quarters["response_tokens"]
    moved = flat_params(whole) - flat_params(make_model())
    assert float(moved.abs().max()) > 1e-4  # the update did something
    assert torch.allclose(flat_params(quarters), flat_params(whole), atol=1e-6)


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_micro_batches_by_token_budget_give_the_full_batch_update_in_every_aggregation(aggregation):
    """Packed by length, the micro-batches hold different row counts; the update is still the whole batch's."""
    algorithm = AlgorithmSpec(name="grpo", kl_coef=0.0, loss_aggregation=aggregation, clip_ratio_high=0.28)
    budget = 24  # a sample is at most 1 + 6 + 7 = 14 tokens: one to a few rows per pass
    whole, packed = make_learner(algorithm), make_learner(algorithm, micro_batch_tokens=budget)
    micro = packed._micro(make_samples(0))
    assert len(micro) > 2 and len({mb.input_ids.shape[0] for mb in micro}) > 1
    assert all(mb.input_ids.numel() <= budget for mb in micro)
    for seed in (0, 1):
        stats_whole, stats_packed = whole.update(make_samples(seed)), packed.update(make_samples(seed))
        for key in STAT_KEYS:
            assert stats_packed[key] == pytest.approx(stats_whole[key], rel=1e-5, abs=1e-6), key
    moved = flat_params(whole) - flat_params(make_model())
    assert float(moved.abs().max()) > 1e-4
    assert torch.allclose(flat_params(packed), flat_params(whole), atol=1e-6)


def test_log_probs_in_chunks_give_the_update_of_the_full_logits():
    algorithm = AlgorithmSpec(name="grpo", kl_coef=0.0, entropy_coef=0.01, minibatches=2, clip_ratio_high=0.28)
    full, chunked = make_learner(algorithm, logprob_chunk_tokens=None), make_learner(algorithm, logprob_chunk_tokens=5)
    for seed in (0, 1):
        stats_full, stats_chunked = full.update(make_samples(seed)), chunked.update(make_samples(seed))
        for key in STAT_KEYS:
            assert stats_chunked[key] == pytest.approx(stats_full[key], rel=1e-5, abs=1e-6), key
    assert torch.allclose(flat_params(chunked), flat_params(full), atol=1e-6)


def make_groups(seed: int, prompts: int = 4, size: int = 4) -> list[dict]:
    """`size` responses to each of `prompts` prompts (GRPO's groups), ragged lengths, the groups interleaved."""
    heads = [s["prompt_ids"] for s in make_samples(seed + 1000, prompts)]
    return [{**s, "prompt_ids": heads[k % prompts]} for k, s in enumerate(make_samples(seed, prompts * size))]


def count_forward_tokens(learner: LLMLearner) -> list[int]:
    """Token positions each forward of the learner's policy computes, appended as it runs."""
    seen: list[int] = []
    learner.model.register_forward_pre_hook(lambda _, __, kw: seen.append(kw["input_ids"].numel()), with_kwargs=True)
    return seen


@pytest.mark.parametrize(
    ("micro", "fields"),
    [(None, {}), (4, {}), (None, {"micro_batch_tokens": 30}), (None, {"logprob_chunk_tokens": None})],
)
def test_a_shared_prompt_prefix_gives_the_update_of_whole_rows(micro, fields):
    algorithm = AlgorithmSpec(name="grpo", kl_coef=0.0, entropy_coef=0.01, minibatches=2, clip_ratio_high=0.28)
    whole = make_learner(algorithm, micro, shared_prompts=False, **fields)
    shared = make_learner(algorithm, micro, **fields)
    assert shared.share_prompts and not whole.share_prompts
    for seed in (0, 1):
        stats_whole, stats_shared = whole.update(make_groups(seed)), shared.update(make_groups(seed))
        for key in STAT_KEYS:
            assert stats_shared[key] == pytest.approx(stats_whole[key], rel=1e-5, abs=1e-6), key
    assert float((flat_params(whole) - flat_params(make_model())).abs().max()) > 1e-4
    assert torch.allclose(flat_params(shared), flat_params(whole), atol=1e-6)


def test_a_shared_prefix_keeps_a_micro_batch_within_its_token_budget():
    """Rows attend over their prefix too: a pass shares only where rows x (prefix + row) fits the budget."""
    # A 6-token prompt with 1-token responses beside a 2-token prompt with 5-token responses: every row is 7
    # tokens, but a shared row attends over the longest prefix and the longest response, 5 + 6.
    first, long_prompt, short_prompt = FIRST_TOKEN, list(range(FIRST_TOKEN, FIRST_TOKEN + 6)), [FIRST_TOKEN, 9]
    samples = [
        {"prompt_ids": prompt, "response_ids": [first + 1] * length, "rollout_logprobs": [-1.0] * length}
        | {"advantage": float(k % 3) - 1.0, "reward": 0.0, "version": 0}
        for k, (prompt, length) in enumerate([(long_prompt, 1), (short_prompt, 5)] * 8)
    ]
    budget = 16 * 7  # the whole rows of all 16 samples, in one pass
    shared = collate_shared(samples, TOKENIZER.pad_token_id)
    assert shared is not None and shared.attention_mask.numel() == 16 * 11 > budget
    learner = make_learner(AlgorithmSpec(name="grpo", kl_coef=0.0), micro_batch_tokens=budget)
    micro = learner._micro(samples)
    assert [mb.prefix for mb in micro] == [None] and micro[0].attention_mask.numel() == budget
    roomy = make_learner(AlgorithmSpec(name="grpo", kl_coef=0.0), micro_batch_tokens=16 * 11)
    assert [mb.prefix is not None for mb in roomy._micro(samples)] == [True]


def test_a_reference_that_cannot_take_a_shared_prefix_keeps_whole_rows():
    hybrid = qwen3_5(VOCAB, TOKENIZER.pad_token_id).requires_grad_(False)  # linear attention: no row selection
    learner = make_learner(AlgorithmSpec(name="grpo", kl_coef=0.1), reference=hybrid)
    assert not learner.share_prompts
    assert make_learner(AlgorithmSpec(name="grpo", kl_coef=0.1), reference=make_model()).share_prompts


def test_each_prompt_runs_through_the_policy_once_per_micro_batch_not_once_per_response():
    algorithm = AlgorithmSpec(name="grpo", kl_coef=0.0)
    samples = make_groups(0, prompts=4, size=4)
    whole, shared = make_learner(algorithm, shared_prompts=False), make_learner(algorithm)
    seen_whole, seen_shared = count_forward_tokens(whole), count_forward_tokens(shared)
    whole.update(samples)
    shared.update(samples)
    widest_prompt = max(len(s["prompt_ids"]) for s in samples)
    widest_response = max(len(s["response_ids"]) for s in samples)
    widest = max(len(s["prompt_ids"]) + len(s["response_ids"]) for s in samples)
    assert seen_whole == [16 * widest]  # every response's row carries its whole prompt
    # The 4 prompts but their last token, once each; then 16 rows of that token and the response.
    assert seen_shared == [4 * (widest_prompt - 1), 16 * (1 + widest_response)]


RANK_SCRIPT = textwrap.dedent(
    """
    import json, sys, torch, torch.distributed as dist
    sys.path.insert(0, sys.argv[4])
    from test_learner import TWO_RANK_ALGORITHM, flat_params, make_learner, make_samples
    rank, port, out = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    torch.manual_seed(100 + rank)  # ranks must not depend on their own RNG: rank 0's weights are broadcast
    learner = make_learner(TWO_RANK_ALGORITHM, micro_batch_size=2, rank=rank, world=2)
    stats = [learner.update(make_samples(seed)) for seed in (0, 1)]
    if rank == 0:
        json.dump({"stats": stats, "params": flat_params(learner).tolist()}, open(out, "w"))
    learner.leave_group()
    """
)
TWO_RANK_ALGORITHM = AlgorithmSpec(
    name="grpo", kl_coef=0.0, loss_aggregation="token-mean", minibatches=2, clip_ratio_high=0.28
)


def test_two_ranks_update_like_one(tmp_path):
    single = make_learner(TWO_RANK_ALGORITHM)
    stats = [single.update(make_samples(seed)) for seed in (0, 1)]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "rank0.json"
    here = str(Path(__file__).parent)
    ranks = [
        subprocess.Popen([sys.executable, "-c", RANK_SCRIPT, str(rank), str(port), str(out), here]) for rank in (0, 1)
    ]
    assert [p.wait(timeout=120) for p in ranks] == [0, 0]
    distributed = json.loads(out.read_text())
    # Each rank trains on half of every minibatch; losses divide by the global count and gradients are summed.
    assert torch.allclose(torch.tensor(distributed["params"]), flat_params(single), atol=1e-6)
    for mine, theirs in zip(stats, distributed["stats"], strict=True):
        for key in STAT_KEYS:
            assert theirs[key] == pytest.approx(mine[key], rel=1e-5, abs=1e-6), key


def test_kl_to_the_reference_is_zero_at_the_start_and_then_pulls_the_update():
    with_kl = AlgorithmSpec(name="grpo", kl_coef=0.5)
    model = make_model()
    learner = make_learner(with_kl, model=model, reference=copy.deepcopy(model).requires_grad_(False))
    without = make_learner(AlgorithmSpec(name="grpo", kl_coef=0.0))
    first = learner.update(make_samples(0))
    assert first["kl"] == pytest.approx(0.0, abs=1e-9)  # the policy is its reference before the first step
    assert without.update(make_samples(0))["kl"] == 0.0
    # The k3 gradient vanishes at the reference, so the first steps agree; after that the KL term pulls.
    assert torch.allclose(flat_params(learner), flat_params(without), atol=1e-7)
    second = learner.update(make_samples(1))
    without.update(make_samples(1))
    assert second["kl"] > 0.0
    assert not torch.allclose(flat_params(learner), flat_params(without), atol=1e-7)


def test_tis_corrects_tokens_whose_rollout_logprobs_are_far_off():
    algorithm = AlgorithmSpec(name="grpo", kl_coef=0.0, off_policy=OffPolicyCorrection(type="tis", high=2.0))
    samples = make_samples(0)
    model = make_model()
    with torch.no_grad():
        trainer, _ = token_logprobs(model, collate(samples, TOKENIZER.pad_token_id), 0.9, with_entropy=False)
    batch = collate(samples, TOKENIZER.pad_token_id)
    for i, sample in enumerate(samples):
        start = len(sample["prompt_ids"]) - 1
        sample["rollout_logprobs"] = trainer[i, start : start + len(sample["response_ids"])].tolist()
    assert batch.response_mask.sum() == sum(len(s["response_ids"]) for s in samples)
    close = make_learner(algorithm, model=copy.deepcopy(model)).update(samples)
    assert close["corrected_fraction"] == 0.0
    assert close["mismatch_max_gap"] < 1e-5
    far_samples = [{**s, "rollout_logprobs": [lp - 3.0 for lp in s["rollout_logprobs"]]} for s in samples]
    far = make_learner(algorithm, model=copy.deepcopy(model)).update(far_samples)
    assert far["corrected_fraction"] == pytest.approx(1.0)  # every ratio is e^3 > offPolicy.high
    assert far["mismatch_max_gap"] == pytest.approx(3.0, abs=1e-4)
    assert far["mismatch_kl"] > 1.0


def test_a_batch_that_cannot_split_names_algorithm_minibatches():
    learner = make_learner(AlgorithmSpec(name="grpo", kl_coef=0.0, minibatches=2))
    with pytest.raises(BatchShapeError, match=r"algorithm\.minibatches \(2\) x actor ranks \(1\)"):
        learner.update(make_samples(0, count=15))
    learner.world_size = 3  # 16 samples over 2 minibatches x 3 ranks
    with pytest.raises(BatchShapeError, match=r"algorithm\.minibatches"):
        learner.shard(make_samples(0))


ALL_STAT_KEYS = (*STAT_KEYS, "corrected_fraction", "response_tokens")


@pytest.mark.parametrize(
    "algorithm",
    [
        AlgorithmSpec(name="grpo", kl_coef=0.0, clip_ratio_high=0.28),
        AlgorithmSpec(
            name="grpo", kl_coef=0.0, entropy_coef=0.05, off_policy=OffPolicyCorrection(type="tis", high=2.0)
        ),
        AlgorithmSpec(name="gspo", kl_coef=0.5, loss_aggregation="seq-mean-token-mean"),
        AlgorithmSpec(name="cispo", entropy_coef=0.05, off_policy=OffPolicyCorrection(type="icepop")),
    ],
    ids=["grpo", "grpo-entropy-tis", "gspo-kl", "cispo-entropy-icepop"],
)
def test_one_epoch_of_one_minibatch_skips_the_old_logprob_pass_with_the_same_update_and_statistics(algorithm):
    # The training forward detached is the old policy then: the update and every statistic are those of a
    # learner that still runs the separate no-grad pass, bit for bit, also with a loss mask and micro-batches.
    model = make_model()
    skipping, full = (
        make_learner(algorithm, micro_batch_size=4, model=copy.deepcopy(model), reference=copy.deepcopy(model))
        for _ in range(2)
    )
    assert not skipping.old_logprobs_pass
    full.old_logprobs_pass = True
    for seed in (0, 1, 2):
        samples = make_samples(seed)
        for sample in samples[::3]:
            sample["loss_mask"] = [i % 2 for i in range(len(sample["response_ids"]))]
        stats_skipping, stats_full = skipping.update(samples), full.update(samples)
        for key in ALL_STAT_KEYS:
            assert stats_skipping[key] == stats_full[key], key
    assert stats_full["mismatch_kl"] > 0.1 and stats_full["entropy"] > 0.1
    if algorithm.kl_coef:
        assert stats_full["kl"] > 0.0
    assert torch.equal(flat_params(skipping), flat_params(full))


def test_epochs_minibatches_or_dropout_keep_the_old_logprob_pass():
    assert make_learner(AlgorithmSpec(name="grpo", kl_coef=0.0, epochs=2)).old_logprobs_pass
    assert make_learner(AlgorithmSpec(name="grpo", kl_coef=0.0, minibatches=2)).old_logprobs_pass
    dropout = make_model()
    dropout.config.attention_dropout = 0.1  # a training forward is random: skipping would change its stream
    assert make_learner(AlgorithmSpec(name="grpo", kl_coef=0.0), model=dropout).old_logprobs_pass


def test_a_model_with_dropout_runs_every_prompt_whole():
    # Shared, a prompt's positions would take one dropout mask for all of its responses: another update.
    dropout = make_model()
    dropout.config.attention_dropout = 0.1
    assert not make_learner(AlgorithmSpec(name="grpo", kl_coef=0.0), model=dropout).share_prompts
    assert make_learner(AlgorithmSpec(name="grpo", kl_coef=0.0)).share_prompts


def test_collate_lays_each_sample_out_on_the_next_token_grid():
    samples = make_samples(0, count=5)
    samples[1]["loss_mask"] = [i % 2 for i in range(len(samples[1]["response_ids"]))]
    pad = TOKENIZER.pad_token_id
    batch = collate(samples, pad)
    width = max(len(s["prompt_ids"]) + len(s["response_ids"]) for s in samples)
    assert batch.input_ids.shape == (5, width) and batch.response_mask.shape == (5, width - 1)
    for i, s in enumerate(samples):
        p, r = len(s["prompt_ids"]), len(s["response_ids"])
        tokens = [*s["prompt_ids"], *s["response_ids"]]
        assert batch.input_ids[i].tolist() == tokens + [pad] * (width - p - r)
        assert batch.attention_mask[i].tolist() == [1] * (p + r) + [0] * (width - p - r)
        assert batch.targets[i].tolist() == batch.input_ids[i, 1:].tolist()
        mask = [0.0] * (width - 1)
        mask[p - 1 : p - 1 + r] = [float(m) for m in s.get("loss_mask", [1] * r)]
        assert batch.response_mask[i].tolist() == mask
        rollout = torch.zeros(width - 1)
        rollout[p - 1 : p - 1 + r] = torch.tensor(s["rollout_logprobs"])
        assert torch.equal(batch.rollout_logprobs[i], rollout)
        advantage = torch.zeros(width - 1)
        advantage[p - 1 : p - 1 + r] = s["advantage"]
        assert torch.equal(batch.advantages[i], advantage)
    assert batch.input_ids.dtype == batch.attention_mask.dtype == torch.long
    assert batch.response_mask.dtype == batch.advantages.dtype == torch.float32


def test_an_algorithm_built_in_code_trains_with_its_paper_preset():
    # GSPO averages per sequence; GRPO's preset KL (0.04) needs the reference it is measured against.
    assert make_learner(AlgorithmSpec(name="gspo")).algorithm.loss_aggregation == "seq-mean-token-mean"
    with pytest.raises(ValueError, match=r"spec\.algorithm\.klCoef 0\.04 needs a reference model"):
        make_learner(AlgorithmSpec(name="grpo"))
    model = make_model()
    assert (
        make_learner(AlgorithmSpec(name="grpo"), model=model, reference=copy.deepcopy(model)).algorithm.kl_coef == 0.04
    )


def test_a_non_finite_advantage_stops_the_update_before_the_optimizer_applies_it():
    learner = make_learner(AlgorithmSpec(name="grpo", minibatches=1, epochs=1, kl_coef=0.0))
    learner.update(make_samples(0))
    before = flat_params(learner).clone()
    samples = make_samples(1)
    samples[3]["advantage"] = float("nan")  # e.g. a group whose rewards normalised to nan
    with pytest.raises(Diverged) as raised:
        learner.update(samples)
    assert str(raised.value).startswith("diverged at step 2: non-finite loss and grad_norm (loss nan, grad_norm nan)")
    assert learner.step == 1
    assert torch.equal(flat_params(learner), before)  # nothing applied
