"""The hf generation engine: n completions per prompt, why each ended, and logprobs the trainer agrees with."""

from __future__ import annotations

import pytest
import torch

from rljob.api.spec import BuiltinNetwork, DatasetSpec, LLMTask, ModelSpec
from rljob.runtime.llm.data import arithmetic_rows
from rljob.runtime.llm.engine import Completion, HFEngine, Sampling
from rljob.runtime.llm.learner import collate, token_logprobs
from rljob.runtime.llm.policy import load_policy

TASK = LLMTask(dataset=DatasetSpec(builtin="arithmetic", size=40), max_prompt_length=16, max_response_length=12)
TINY = ModelSpec(source="builtin", builtin=BuiltinNetwork(architecture="tiny-qwen2", hidden_size=32, num_layers=2))
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def policy():
    model, tokenizer = load_policy(TINY, TASK, arithmetic_rows(40, 0), seed=0, device=CPU)
    return model.eval(), tokenizer


@pytest.fixture(scope="module")
def prompts(policy):
    _, tokenizer = policy
    # Ragged lengths: generation left-pads them, the trainer right-pads them.
    return [tokenizer(text)["input_ids"] for text in ("3+4=", "12+9=", "7+1=5 ", "0+0=")]


def engine_for(policy) -> HFEngine:
    model, tokenizer = policy
    return HFEngine(model, tokenizer, CPU)


def assert_well_formed(completion: Completion, eos: int, max_tokens: int) -> None:
    assert 1 <= len(completion.token_ids) <= max_tokens
    assert len(completion.logprobs) == len(completion.token_ids)
    assert all(lp <= 0.0 for lp in completion.logprobs)
    assert eos not in completion.token_ids[:-1]  # a completion ends at its first end-of-sequence token
    if completion.finish_reason == "stop":
        assert completion.token_ids[-1] == eos
    else:
        assert completion.finish_reason == "length"
        assert len(completion.token_ids) == max_tokens and completion.token_ids[-1] != eos


def test_generate_returns_n_completions_per_prompt_ended_by_eos_or_length(policy, prompts):
    eos = policy[1].eos_token_id
    torch.manual_seed(0)
    out = engine_for(policy).generate(prompts, Sampling(n=6, temperature=1.0, max_tokens=12))
    assert len(out) == len(prompts)
    assert all(len(group) == 6 for group in out)
    reasons = set()
    for group in out:
        for completion in group:
            assert_well_formed(completion, eos, 12)
            reasons.add(completion.finish_reason)
    assert reasons == {"stop", "length"}  # a random policy over a few dozen tokens samples </s> now and then


def test_max_tokens_bounds_every_completion(policy, prompts):
    torch.manual_seed(1)
    out = engine_for(policy).generate(prompts, Sampling(n=3, max_tokens=2))
    for group in out:
        for completion in group:
            assert_well_formed(completion, policy[1].eos_token_id, 2)
    assert engine_for(policy).generate([], Sampling()) == []


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_engine_logprobs_match_the_trainers_recomputation(policy, prompts, temperature):
    """The mismatch bound for the hf engine: the trainer sees the distribution the engine sampled from."""
    model, tokenizer = policy
    torch.manual_seed(2)
    out = engine_for(policy).generate(prompts, Sampling(n=4, temperature=temperature, max_tokens=10))
    samples = [
        {"prompt_ids": p, "response_ids": c.token_ids, "rollout_logprobs": c.logprobs, "advantage": 0.0}
        for p, group in zip(prompts, out, strict=True)
        for c in group
    ]
    batch = collate(samples, tokenizer.pad_token_id)
    with torch.no_grad():
        trainer, _ = token_logprobs(model, batch, temperature, with_entropy=False)
    mask = batch.response_mask.bool()
    assert int(mask.sum()) == sum(len(s["response_ids"]) for s in samples)
    gap = (trainer - batch.rollout_logprobs)[mask]
    assert float(gap.abs().max()) < 1e-4
    k3 = float((gap.exp() - 1.0 - gap).mean())
    assert k3 < 1e-6
    # The rollout logprobs are those of the sampling distribution: at temperature 0.7 they differ from T=1.
    if temperature != 1.0:
        with torch.no_grad():
            untempered, _ = token_logprobs(model, batch, 1.0, with_entropy=False)
        assert float((untempered - batch.rollout_logprobs)[mask].abs().max()) > 1e-2


def greedy_reference(model, prompt: list[int], eos: int, max_tokens: int) -> list[int]:
    ids = list(prompt)
    out: list[int] = []
    with torch.no_grad():
        for _ in range(max_tokens):
            token = int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax())
            out.append(token)
            ids.append(token)
            if token == eos:
                break
    return out


def test_greedy_generation_is_the_argmax_continuation(policy, prompts):
    model, tokenizer = policy
    out = engine_for(policy).generate(prompts, Sampling(n=2, greedy=True, max_tokens=8))
    for prompt, group in zip(prompts, out, strict=True):
        expected = greedy_reference(model, prompt, tokenizer.eos_token_id, 8)
        assert [c.token_ids for c in group] == [expected, expected]


def test_a_stop_string_ends_a_completion(policy, prompts):
    _, tokenizer = policy
    engine = engine_for(policy)
    torch.manual_seed(5)
    free = engine.generate(prompts[:1], Sampling(n=1, max_tokens=12))[0][0]
    text = [tokenizer.decode([t]) for t in free.token_ids if t != tokenizer.eos_token_id]
    # A character the continuation produces after its first token: stopping there cuts it short.
    cut = next(i for i in range(1, len(text)) if text[i].strip() and text[i] not in text[:i])
    torch.manual_seed(5)  # the same draws: the same tokens up to the stop string
    stopped = engine.generate(prompts[:1], Sampling(n=1, max_tokens=12, stop=(text[cut],)))[0][0]
    assert stopped.finish_reason == "stop"
    assert stopped.token_ids == free.token_ids[: cut + 1]
    assert stopped.logprobs == pytest.approx(free.logprobs[: cut + 1], abs=1e-6)


def test_sampling_travels_over_the_wire_unchanged():
    sampling = Sampling(n=3, temperature=0.5, top_p=0.9, top_k=5, max_tokens=7, stop=("\n", "##"), greedy=False)
    assert Sampling.from_wire(sampling.to_wire()) == sampling
