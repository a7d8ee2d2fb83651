"""Chunked log-probs and entropy: the full-logits numbers and gradients, a fallback for transformed logits,
gradient checkpointing, and a peak memory far below the full logits of a 151,936-token vocabulary."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from transformers import Gemma2Config, Gemma2ForCausalLM, Qwen2Config, Qwen2ForCausalLM

from rljob.runtime.llm.models.policy import enable_gradient_checkpointing
from rljob.runtime.llm.training.batch import collate_shared
from rljob.runtime.llm.training.learner import MicroBatch, collate, token_logprobs
from rljob.runtime.llm.training.logprobs import chunked_logprobs, full_logprobs, shares_prompts

VOCAB = 53
PAD = 0


def qwen2(tied: bool, layers: int = 2) -> torch.nn.Module:
    config = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=tied,
        pad_token_id=PAD,
    )
    torch.manual_seed(0)
    return Qwen2ForCausalLM(config)


def samples(count: int = 6, seed: int = 0, loss_mask: bool = False) -> list[dict]:
    """Ragged prompts and responses; with `loss_mask`, some response tokens are an environment's (not trained)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for k in range(count):
        prompt, response = int(torch.randint(1, 6, (1,), generator=g)), int(torch.randint(1, 9, (1,), generator=g))
        ids = torch.randint(1, VOCAB, (prompt + response,), generator=g).tolist()
        sample = {
            "prompt_ids": ids[:prompt],
            "response_ids": ids[prompt:],
            "rollout_logprobs": [-2.0] * response,
            "advantage": float(k) - 2.5,
        }
        if loss_mask:
            sample["loss_mask"] = [float(i % 3 != 1) for i in range(response)]
        out.append(sample)
    return out


def groups(prompts: int = 3, size: int = 3, seed: int = 0) -> list[dict]:
    """`size` responses to each of `prompts` prompts of ragged lengths (2 to 6 tokens), the groups interleaved."""
    g = torch.Generator().manual_seed(seed)
    heads = [torch.randint(1, VOCAB, (2 + k % 5,), generator=g).tolist() for k in range(prompts)]
    tails = samples(prompts * size, seed, loss_mask=True)
    return [{**tail, "prompt_ids": heads[k % prompts]} for k, tail in enumerate(tails)]


def loss_and_grads(model: torch.nn.Module, batch: MicroBatch, chunk: int | None, entropy_grad: bool = True):
    """Per-position log-probs and entropy (response positions), and the gradients of a loss using both."""
    model.zero_grad(set_to_none=True)
    logprobs, entropy = token_logprobs(model, batch, 0.7, True, entropy_grad=entropy_grad, chunk_tokens=chunk)
    assert entropy is not None
    mask = batch.response_mask
    loss = ((logprobs * batch.advantages + 0.1 * entropy) * mask).sum()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return (logprobs * mask).detach(), (entropy * mask).detach(), grads


def assert_same(a, b) -> None:
    assert torch.allclose(a[0], b[0], atol=1e-5, rtol=1e-5)
    assert torch.allclose(a[1], b[1], atol=1e-5, rtol=1e-5)
    assert a[2].keys() == b[2].keys()
    for name in a[2]:
        assert torch.allclose(a[2][name], b[2][name], atol=1e-5, rtol=1e-4), name


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("chunk", [1, 4, 1000])
def test_chunked_logprobs_entropy_and_gradients_equal_the_full_logits(tied, chunk):
    model = qwen2(tied)
    batch = collate(samples(loss_mask=True), PAD)
    full = loss_and_grads(model, batch, None)
    chunked = loss_and_grads(model, batch, chunk)
    assert_same(chunked, full)
    assert "lm_head.weight" in full[2] or tied  # an untied head gets its own gradient, a tied one the embedding's
    # Response positions only: the prompt and padding are never projected.
    assert torch.equal(chunked[0] != 0, batch.response_mask > 0)


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("chunk", [None, 1, 1000])
def test_a_shared_prompt_prefix_gives_the_log_probs_entropy_and_gradients_of_whole_rows(tied, chunk):
    model = qwen2(tied)
    rows = groups()
    whole, shared = collate(rows, PAD), collate_shared(rows, PAD)
    assert shared is not None and shared.prefix is not None and shared.prefix.input_ids.shape[0] == 3
    plain, cached = loss_and_grads(model, whole, chunk), loss_and_grads(model, shared, chunk)
    # The same numbers, read out of each layout's grid in sample order.
    for a, b in ((cached[0], plain[0]), (cached[1], plain[1])):
        assert torch.allclose(a[shared.response_mask > 0], b[whole.response_mask > 0], atol=1e-5, rtol=1e-5)
    assert_same((plain[0], plain[1], cached[2]), plain)


def test_a_sliding_window_shorter_than_the_prefix_gives_the_numbers_of_whole_rows():
    from transformers import MistralConfig, MistralForCausalLM

    config = MistralConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        sliding_window=3,  # prompts of 2 to 6 tokens: the longer prefixes reach past it
        pad_token_id=PAD,
    )
    torch.manual_seed(0)
    model = MistralForCausalLM(config)
    rows = groups(prompts=5, seed=2)
    whole, shared = collate(rows, PAD), collate_shared(rows, PAD)
    assert shared is not None and shared.prefix is not None and shared.prefix.input_ids.shape[1] > 3
    plain, cached = loss_and_grads(model, whole, 4), loss_and_grads(model, shared, 4)
    assert torch.allclose(cached[0][shared.response_mask > 0], plain[0][whole.response_mask > 0], atol=1e-5)
    assert_same((plain[0], plain[1], cached[2]), plain)


def test_a_softcapped_model_shares_its_prompt_prefix_on_the_full_logits_too():
    model = gemma2()
    rows = groups(seed=1)
    whole, shared = collate(rows, PAD), collate_shared(rows, PAD)
    assert shared is not None and shares_prompts(model)
    plain, cached = loss_and_grads(model, whole, 4), loss_and_grads(model, shared, 4)
    assert torch.allclose(cached[0][shared.response_mask > 0], plain[0][whole.response_mask > 0], atol=1e-5)
    assert_same((plain[0], plain[1], cached[2]), plain)


def qwen3_5(vocab: int = VOCAB, pad: int = PAD, eos: int | None = None) -> torch.nn.Module:
    """A hybrid model: linear-attention layers keep convolution and recurrent states in their cache."""
    from transformers import AutoModelForCausalLM
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig

    config = Qwen3_5TextConfig(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        pad_token_id=pad,
        eos_token_id=eos,
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config)


def test_a_model_whose_cache_holds_more_than_keys_and_values_runs_whole_rows():
    model = qwen3_5()
    assert "linear_attention" in model.config.layer_types
    assert not shares_prompts(model)  # its cache rows cannot be selected: the learner never lays out a prefix
    whole = collate(groups(), PAD)
    logprobs, _ = token_logprobs(model, whole, 1.0, False, chunk_tokens=4)
    assert torch.isfinite(logprobs).all()


def test_an_entropy_statistic_without_gradient_and_a_no_grad_pass_equal_the_full_logits():
    model = qwen2(tied=True)
    batch = collate(samples(), PAD)
    assert_same(loss_and_grads(model, batch, 3, entropy_grad=False), loss_and_grads(model, batch, None, False))
    with torch.no_grad():
        chunked = chunked_logprobs(model, batch, 0.7, True, chunk_tokens=3)
        full = full_logprobs(model, batch, 0.7, True)
    mask = batch.response_mask
    assert chunked[1] is not None and full[1] is not None
    assert torch.allclose(chunked[0] * mask, full[0] * mask, atol=1e-6)
    assert torch.allclose(chunked[1] * mask, full[1] * mask, atol=1e-6)


def test_a_micro_batch_without_response_tokens_still_backpropagates_zero_gradients():
    model = qwen2(tied=True)
    batch = collate(samples(count=2, loss_mask=True), PAD)
    batch.response_mask.zero_()  # every token an environment's: nothing to train on
    logprobs, _ = token_logprobs(model, batch, 1.0, False, chunk_tokens=4)
    (logprobs * batch.response_mask).sum().backward()
    grads = [p.grad for p in model.parameters()]
    assert all(g is not None and not g.any() for g in grads)


def gemma2() -> torch.nn.Module:
    config = Gemma2Config(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        final_logit_softcapping=2.0,  # small: the capped numbers differ clearly from the head's
        pad_token_id=PAD,
    )
    torch.manual_seed(0)
    return Gemma2ForCausalLM(config)


def test_a_model_that_softcaps_its_logits_falls_back_to_the_full_logits_and_says_so(caplog):
    model = gemma2()
    batch = collate(samples(), PAD)
    with caplog.at_level(logging.WARNING, logger="rljob.actor"):
        chunked = loss_and_grads(model, batch, 4)
    assert_same(chunked, loss_and_grads(model, batch, None))
    assert "trainer.logprobChunkTokens does not apply" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="rljob.actor"):
        loss_and_grads(model, batch, 4)
    assert caplog.text == ""  # said once per model


def test_gradient_checkpointing_recomputes_the_layers_with_the_same_gradients():
    plain, checkpointed = qwen2(tied=True), qwen2(tied=True)
    enable_gradient_checkpointing(checkpointed)
    assert checkpointed.is_gradient_checkpointing and not plain.is_gradient_checkpointing
    calls = {"plain": 0, "checkpointed": 0}
    for name, model in (("plain", plain), ("checkpointed", checkpointed)):
        model.train()
        layer = model.model.layers[0]
        layer.register_forward_pre_hook(lambda *_, name=name: calls.__setitem__(name, calls[name] + 1))
    batch = collate(samples(), PAD)
    assert_same(loss_and_grads(checkpointed, batch, 4), loss_and_grads(plain, batch, 4))
    # One forward each; the checkpointed layer started again in backward to rebuild its activations.
    assert calls == {"plain": 1, "checkpointed": 2}
    # Its layers drop a KV cache: no shared prompt prefix for it.
    assert shares_prompts(plain) and not shares_prompts(checkpointed)


PEAK_SCRIPT = textwrap.dedent(
    """
    import json, resource, sys, torch
    from transformers import Qwen2Config, Qwen2ForCausalLM
    from rljob.runtime.llm.training.learner import MicroBatch, token_logprobs

    chunk, vocab, rows, prompt, response = (int(a) for a in sys.argv[1:])
    torch.set_num_threads(2)
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=True,
    )
    model = Qwen2ForCausalLM(config)
    ids = torch.randint(0, vocab, (rows, prompt + response))
    mask = torch.zeros(rows, prompt + response - 1)
    mask[:, prompt - 1 :] = 1
    grid = torch.zeros_like(mask)
    batch = MicroBatch(ids, torch.ones_like(ids), mask, ids[:, 1:].clone(), torch.randn(grid.shape), grid)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    logprobs, entropy = token_logprobs(model, batch, 1.0, True, chunk_tokens=chunk)
    ((logprobs * batch.advantages + 0.01 * entropy) * mask).sum().backward()
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    assert model.lm_head.weight.grad is not None and model.lm_head.weight.grad.abs().sum() > 0
    print(json.dumps({"peak_bytes": (after - before) * 1024}))
    """
)


@pytest.mark.slow
def test_the_loss_of_a_large_vocabulary_peaks_far_below_its_full_logits():
    """Qwen2's vocabulary, 4 x 512 response tokens: their fp32 logits alone are 1.16 GiB (and the full path holds
    about five such blocks in backward: 5.9 GiB measured). Chunks of 32 tokens keep the growth of the peak
    resident memory over forward and backward (a fresh process's ru_maxrss) under a quarter of that one block:
    about 130 MiB measured."""
    vocab, rows, prompt, response, chunk = 151_936, 4, 8, 512, 32
    full_logits = rows * response * vocab * 4
    assert full_logits >= 2**30
    # Blocks of 1 MiB and more are mapped and unmapped (glibc's default threshold adapts upwards to 32 MiB):
    # freed chunks go back to the system, so resident memory follows live memory rather than the heap's
    # fragmentation over 64 chunk-sized allocations.
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(2**20)}
    out = subprocess.run(
        [sys.executable, "-c", PEAK_SCRIPT, *map(str, (chunk, vocab, rows, prompt, response))],
        capture_output=True,
        text=True,
        check=True,
        env=env,
    )
    peak = json.loads(out.stdout.strip().splitlines()[-1])["peak_bytes"]
    assert peak < full_logits / 4, f"peak grew by {peak / 2**20:.0f} MiB; full logits are {full_logits / 2**20:.0f} MiB"
