"""On a CUDA GPU: the policy computes in bf16 by default with fp32 log-probs, the chunked loss matches the full
one, an update trains, and GPU memory stays far below the full logits of a large vocabulary.

Skipped without CUDA; `make gpu-check` runs them on a GPU machine."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from rljob.api.spec import AlgorithmSpec, TrainerSpec
from rljob.runtime.llm.models.policy import policy_dtype
from rljob.runtime.llm.training.learner import LLMLearner, MicroBatch, collate, token_logprobs
from tests.runtime.llm.training.test_learner import MAX_RESPONSE, TINY, TOKENIZER, make_model, make_samples

pytestmark = pytest.mark.cuda  # skipped without CUDA (tests/conftest.py); `make gpu-check` runs it
CUDA = torch.device("cuda")


def bf16_model() -> torch.nn.Module:
    dtype = policy_dtype(TINY, TrainerSpec(steps=1, precision="auto").precision, CUDA)
    assert dtype == torch.bfloat16
    return make_model().to(device=CUDA, dtype=dtype)


def test_precision_auto_computes_in_bf16_with_fp32_log_probs_and_chunks_match_the_full_logits():
    model = bf16_model()
    batch = collate(make_samples(0), TOKENIZER.pad_token_id).to(CUDA)
    mask = batch.response_mask
    results = []
    for chunk in (None, 5):
        model.zero_grad(set_to_none=True)
        logprobs, entropy = token_logprobs(model, batch, 0.9, True, chunk_tokens=chunk)
        assert logprobs.dtype == torch.float32 and entropy is not None and entropy.dtype == torch.float32
        ((logprobs * batch.advantages + 0.1 * entropy) * mask).sum().backward()
        grads = [p.grad.float() for p in model.parameters()]
        assert all(p.grad.dtype == torch.bfloat16 for p in model.parameters())
        results.append(((logprobs * mask).detach(), (entropy * mask).detach(), grads))
    (full_lp, full_ent, full_grads), (lp, ent, grads) = results
    # The same bf16 projections, then the same fp32 maths: equal up to summation order.
    assert torch.allclose(lp, full_lp, atol=1e-4) and torch.allclose(ent, full_ent, atol=1e-4)
    # Gradients are bf16: the tied head's sums its chunks' shares in bf16, a few units in the last place apart.
    for mine, theirs in zip(grads, full_grads, strict=True):
        assert float((mine - theirs).abs().max()) <= 0.02 * float(theirs.abs().max())


def test_a_bf16_update_on_cuda_moves_the_policy_with_finite_statistics():
    model = bf16_model()
    before = torch.cat([p.detach().float().reshape(-1) for p in model.parameters()])
    trainer = TrainerSpec(steps=10, learning_rate=1e-3, micro_batch_tokens=40, seed=3)
    learner = LLMLearner(
        model,
        AlgorithmSpec(name="grpo", kl_coef=0.0, clip_ratio_high=0.28),
        trainer,
        pad_id=TOKENIZER.pad_token_id,
        temperature=0.9,
        max_response_tokens=MAX_RESPONSE,
    )
    stats = learner.update(make_samples(0))
    assert all(math.isfinite(v) for v in stats.values())
    after = torch.cat([p.detach().float().reshape(-1) for p in model.parameters()])
    assert float((after - before).abs().max()) > 0


def test_the_loss_of_a_large_vocabulary_peaks_far_below_its_full_logits_in_gpu_memory():
    vocab, rows, prompt, response = 151_936, 8, 16, 1024
    config = Qwen2Config(
        vocab_size=vocab,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).to(device=CUDA, dtype=torch.bfloat16)
    ids = torch.randint(0, vocab, (rows, prompt + response), device=CUDA)
    mask = torch.zeros(rows, prompt + response - 1, device=CUDA)
    mask[:, prompt - 1 :] = 1
    batch = MicroBatch(ids, torch.ones_like(ids), mask, ids[:, 1:].clone(), torch.randn_like(mask), mask * 0)
    full_logits = rows * response * vocab * 4  # 4.6 GiB in fp32
    peaks = {}
    for chunk in (128, None):
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
        logprobs, entropy = token_logprobs(model, batch, 1.0, True, chunk_tokens=chunk)
        assert entropy is not None
        ((logprobs * batch.advantages + 0.01 * entropy) * mask).sum().backward()
        torch.cuda.synchronize()
        peaks[chunk] = torch.cuda.max_memory_allocated() - start
        del logprobs, entropy
    assert peaks[128] < full_logits / 4, peaks
    assert peaks[None] > full_logits  # the full path does hold them: the bound above is not vacuous


def test_a_collocated_update_leaves_no_gradient_and_no_cached_block_for_the_rollout_to_wake_into():
    """Issue 33, item 2: after the step only weights and Adam's states are allocated, and the allocator keeps no
    training peak (reserved ≈ allocated), so a rollout beside the actor wakes into the rest of the GPU."""
    base = torch.cuda.memory_allocated()  # what earlier tests left
    model = make_model().to(CUDA)
    trainer = TrainerSpec(steps=10, learning_rate=1e-3, seed=3, precision="fp32")
    learner = LLMLearner(
        model,
        AlgorithmSpec(name="grpo", kl_coef=0.0, clip_ratio_high=0.28),
        trainer,
        pad_id=TOKENIZER.pad_token_id,
        temperature=0.9,
        max_response_tokens=MAX_RESPONSE,
        returns_memory=True,
    )
    learner.update(make_samples(0))
    torch.cuda.synchronize()
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    assert all(p.grad is None for p in model.parameters())
    # Weights + Adam's two moments (and its step counters): 3x the weights, nothing of the gradients' 4th copy.
    assert torch.cuda.memory_allocated() - base <= 3 * weights + 2**20
    assert torch.cuda.memory_reserved() - torch.cuda.memory_allocated() <= 2 * 2**20  # blocks handed back
