"""The hf generation engine: n completions per prompt, why each ended, and logprobs the trainer agrees with."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from rljob.api.loading import load_job_file
from rljob.api.spec import BuiltinNetwork, DatasetSpec, LLMTask, ModelSpec
from rljob.runtime.llm.data.rows import arithmetic_rows
from rljob.runtime.llm.engines.base import Completion, Sampling, chunk_size, job_cache_len
from rljob.runtime.llm.engines.hf import HFEngine, batch_bucket, compiles_decode, generate_buckets
from rljob.runtime.llm.models.policy import load_policy
from rljob.runtime.llm.rollout_engine import build_engine
from rljob.runtime.llm.training.learner import collate, token_logprobs
from tests.runtime.llm.training.test_logprobs import qwen3_5

TASK = LLMTask(dataset=DatasetSpec(builtin="arithmetic", size=40), max_prompt_length=16, max_response_length=12)
TINY = ModelSpec(source="builtin", builtin=BuiltinNetwork(architecture="tiny-qwen2", hidden_size=32, num_layers=2))
CPU = torch.device("cpu")
EXAMPLE = Path(__file__).parents[4] / "examples" / "grpo-tiny-arithmetic.yaml"


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


@pytest.mark.parametrize("n", [1, 4])  # 4: each prompt's rows decode from its shared prefill
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_engine_logprobs_match_the_trainers_recomputation(policy, prompts, temperature, n):
    """The mismatch bound for the hf engine: the trainer sees the distribution the engine sampled from."""
    model, tokenizer = policy
    torch.manual_seed(2)
    out = engine_for(policy).generate(prompts, Sampling(n=n, temperature=temperature, max_tokens=10))
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


@pytest.mark.parametrize("n", [1, 3])  # 3: the rows decode from the prompt's shared prefill
def test_a_stop_string_ends_a_completion(policy, prompts, n):
    _, tokenizer = policy
    engine = engine_for(policy)
    torch.manual_seed(5)
    free = engine.generate(prompts[:1], Sampling(n=n, max_tokens=12))[0]
    text = [tokenizer.decode([t]) for t in free[0].token_ids if t != tokenizer.eos_token_id]
    # A character the continuation produces after its first token: stopping there cuts it short.
    cut = next(i for i in range(1, len(text)) if text[i].strip() and text[i] not in text[:i])
    torch.manual_seed(5)  # the same draws: the same tokens up to the stop string
    stopped = engine.generate(prompts[:1], Sampling(n=n, max_tokens=12, stop=(text[cut],)))[0]
    assert stopped[0].finish_reason == "stop"
    assert stopped[0].token_ids == free[0].token_ids[: cut + 1]
    assert stopped[0].logprobs == pytest.approx(free[0].logprobs[: cut + 1], abs=1e-6)
    for row_stopped, row_free in zip(stopped[1:], free[1:], strict=True):  # each row cut at its own stop string
        assert row_stopped.token_ids == row_free.token_ids[: len(row_stopped.token_ids)]
        if len(row_stopped.token_ids) < len(row_free.token_ids):
            assert row_stopped.finish_reason == "stop"


# --- the shared prefill (each prompt's tokens run once, not once per sample) -------------------------------------


class ForwardCountingEngine(HFEngine):
    """The hf engine, writing down the rows and tokens of every forward pass the model runs."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.forwards: list[tuple[int, int]] = []
        self.model.register_forward_pre_hook(lambda _, args, kwargs: self._count(kwargs), with_kwargs=True)

    def _count(self, kwargs) -> None:
        self.forwards.append(tuple(kwargs["input_ids"].shape))


@pytest.mark.parametrize("temperature", [1.0, 0.0])
def test_each_prompt_is_prefilled_once_and_its_rows_decode_from_copies(policy, prompts, temperature):
    model, tokenizer = policy
    engine = ForwardCountingEngine(copy.deepcopy(model), tokenizer, CPU)
    width = max(len(p) for p in prompts)
    torch.manual_seed(6)
    out = engine.generate(prompts, Sampling(n=3, temperature=temperature, max_tokens=6, greedy=temperature == 0.0))
    assert [len(group) for group in out] == [3] * len(prompts)
    # The prompts but their last token, one row each; then every row runs its last prompt token, then decodes.
    assert engine.forwards[0] == (len(prompts), width - 1)
    assert engine.forwards[1:] == [(len(prompts) * 3, 1)] * (len(engine.forwards) - 1)
    prompt_tokens = len(prompts) * (width - 1) + len(prompts) * 3
    assert prompt_tokens < len(prompts) * 3 * width  # what the prefill of every row would cost


def test_models_whose_cache_rows_cannot_be_copied_prefill_every_row(policy, prompts):
    model, tokenizer = policy
    configured = copy.deepcopy(model)
    configured.generation_config.cache_implementation = "dynamic"  # generate refuses a cache passed beside it
    hybrid = qwen3_5(len(tokenizer), tokenizer.pad_token_id, tokenizer.eos_token_id).eval()  # linear attention
    for candidate in (hybrid, configured):
        engine = ForwardCountingEngine(candidate, tokenizer, CPU)
        assert not engine.shares_prefill
        torch.manual_seed(8)
        out = engine.generate(prompts, Sampling(n=3, max_tokens=4))
        assert [len(group) for group in out] == [3] * len(prompts)
        assert engine.forwards[0] == (len(prompts) * 3, max(len(p) for p in prompts))  # every row prefilled
    assert engine_for(policy).shares_prefill


@pytest.mark.parametrize(
    ("n", "calls", "first"),
    [
        (1, [[1, 8, 4, 9, 15], [1, 6, 7]], (2, 5)),  # one row per prompt: nothing to share
        (3, [[1], [8]], (6, 1)),  # one-token prompts: nothing to prefill before their last token
    ],
)
def test_calls_with_nothing_to_share_generate_as_before(policy, n, calls, first):
    model, tokenizer = policy
    engine = ForwardCountingEngine(copy.deepcopy(model), tokenizer, CPU)
    torch.manual_seed(7)
    out = engine.generate(calls, Sampling(n=n, max_tokens=4))
    assert [len(group) for group in out] == [n] * len(calls)
    assert engine.forwards[0] == first


def test_the_shared_prefill_gives_the_completions_and_logprobs_of_the_per_row_prefill(policy, prompts):
    """Greedy, so both paths pick the same tokens: one call of n rows per prompt (the shared prefill) against the
    prompts repeated n times with one row each (every row prefilled on its own, as `generate` does). Ragged
    prompts, one of a single token (its whole prefix is padding), and a decode several tokens long."""
    model, tokenizer = policy
    engine = engine_for(policy)
    ragged = [*prompts, [tokenizer.bos_token_id]]
    shared = engine.generate(ragged, Sampling(n=3, greedy=True, max_tokens=8))
    per_row = engine.generate([p for p in ragged for _ in range(3)], Sampling(n=1, greedy=True, max_tokens=8))
    assert [c.token_ids for group in shared for c in group] == [c.token_ids for [c] in per_row]
    assert [c.finish_reason for group in shared for c in group] == [c.finish_reason for [c] in per_row]
    assert max(len(c.token_ids) for [c] in per_row) > 2
    for c_shared, [c_row] in zip((c for group in shared for c in group), per_row, strict=True):
        assert c_shared.logprobs == pytest.approx(c_row.logprobs, abs=1e-5)
    for prompt, group in zip(ragged, shared, strict=True):  # and the argmax continuation, computed unbatched
        assert group[0].token_ids == greedy_reference(model, prompt, tokenizer.eos_token_id, 8)


def test_sampling_travels_over_the_wire_unchanged():
    sampling = Sampling(n=3, temperature=0.5, top_p=0.9, top_k=5, max_tokens=7, stop=("\n", "##"), greedy=False)
    assert Sampling.from_wire(sampling.to_wire()) == sampling


# --- batch buckets (the compiled decode's shapes) ---------------------------------------------------------------


class CountingEngine(HFEngine):
    """The hf engine, writing down the batch of every forward pass the model runs (padding rows included)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.batches: list[int] = []
        self.model.register_forward_pre_hook(lambda _, args, kwargs: self._count(kwargs), with_kwargs=True)

    def _count(self, kwargs) -> None:
        self.batches.append(int(kwargs["input_ids"].shape[0]))


def counting_engine(policy, buckets: tuple[int, ...] | None) -> CountingEngine:
    model, tokenizer = policy
    return CountingEngine(copy.deepcopy(model), tokenizer, CPU, batch_buckets=buckets)


@pytest.mark.parametrize("n", [1, 3])
def test_padding_to_a_bucket_leaves_the_real_prompts_greedy_completions_unchanged(policy, prompts, n):
    sampling = Sampling(n=n, greedy=True, max_tokens=8)
    plain = counting_engine(policy, None)
    padded = counting_engine(policy, (8,))
    for count in (1, 3):
        expected = plain.generate(prompts[:count], sampling)
        got = padded.generate(prompts[:count], sampling)
        assert [[c.token_ids for c in g] for g in got] == [[c.token_ids for c in g] for g in expected]
        assert [[c.finish_reason for c in g] for g in got] == [[c.finish_reason for c in g] for g in expected]
        for g_got, g_expected in zip(got, expected, strict=True):
            for c_got, c_expected in zip(g_got, g_expected, strict=True):
                assert c_got.logprobs == pytest.approx(c_expected.logprobs, abs=1e-5)
    prefill = n > 1  # the prompts' shared prefill: one row per prompt
    assert set(plain.batches) == {1 * n, 3 * n} | ({1, 3} if prefill else set())
    assert set(padded.batches) == {8 * n} | ({8} if prefill else set())  # all on the bucket, padding rows included


def test_padding_rows_never_reach_the_completions_and_end_at_once(policy, prompts):
    engine = counting_engine(policy, (4, 8))
    eos = policy[1].eos_token_id
    torch.manual_seed(3)
    out = engine.generate(prompts[:3], Sampling(n=2, temperature=1.0, max_tokens=12))
    assert engine.batches[:2] == [4, 4 * 2]  # three prompts ran as four: their shared prefill, then their rows
    assert len(out) == 3 and all(len(group) == 2 for group in out)
    for group in out:
        for completion in group:
            assert_well_formed(completion, eos, 12)


def test_padding_rows_end_at_their_first_token_so_the_decode_runs_as_long_as_the_real_rows(policy, prompts):
    """Seven sampled padding rows beside one real row would most likely outlast it; they end at once instead."""
    engine = counting_engine(policy, (8,))
    for seed in range(4):
        torch.manual_seed(seed)
        engine.batches.clear()
        [[completion]] = engine.generate(prompts[:1], Sampling(n=1, temperature=1.0, max_tokens=40))
        assert engine.batches[0] == 8
        # One forward per token of the real row (the prefill gives the first): none for the padding rows.
        assert len(engine.batches) == len(completion.token_ids)


@pytest.mark.parametrize(
    ("prompts", "buckets", "expected"),
    [
        (1, (1, 2, 4, 6), 1),
        (3, (1, 2, 4, 6), 4),
        (5, (1, 2, 4, 6), 6),
        (6, (1, 2, 4, 6), 6),
        (7, (1, 2, 4, 6), 8),  # past the largest bucket: the next power of two
        (33, (1, 2, 4, 6), 64),
        (8, (8,), 8),
    ],
)
def test_a_call_runs_with_the_smallest_bucket_that_holds_it(prompts, buckets, expected):
    assert batch_bucket(prompts, buckets) == expected


@pytest.mark.parametrize(
    ("batch_size", "replicas", "staleness", "expected"),
    [
        (16, 1, 0, (1, 2, 4, 8, 16)),  # one chunk per replica: a power of two already
        (24, 1, 0, (1, 2, 4, 8, 16, 24)),  # unpadded, and the smaller calls by powers of two
        (64, 2, 0, (1, 2, 4, 8, 16, 32)),
        (24, 1, 1, (1, 2, 4, 8, 12)),  # generating ahead: two chunks per replica
        (1, 3, 0, (1,)),
    ],
)
def test_the_buckets_are_the_jobs_training_chunk_and_the_powers_of_two_below_it(
    batch_size, replicas, staleness, expected
):
    job = load_job_file(EXAMPLE)
    spec = job.spec.model_copy(deep=True)
    spec.trainer.batch_size = batch_size
    spec.roles.rollout.replicas = replicas
    spec.rollout.async_.max_staleness = staleness
    assert generate_buckets(spec) == expected


def test_the_actor_sends_one_chunk_per_replica_when_training_waits_and_two_when_generation_runs_ahead():
    assert [chunk_size(32, 1, 0), chunk_size(32, 2, 0), chunk_size(32, 1, 1), chunk_size(33, 2, 1)] == [32, 16, 16, 9]
    assert chunk_size(3, 0, 0) == 3  # no live rollout yet: one chunk, sent when one joins
    assert chunk_size(1, 4, 1) == 1


@pytest.mark.parametrize("collocated", [False, True])
def test_a_rollout_on_the_cpu_builds_an_unbucketed_engine_that_shares_its_prefill(collocated):
    """What `build_engine` gives a rollout process of the example on a CPU: no static cache, no buckets."""
    import logging

    from rljob.launch.local import free_ports
    from rljob.runtime.wire.context import RoleContext
    from rljob.runtime.wire.identity import local_identities, ports_needed

    job = load_job_file(EXAMPLE)
    job.spec.roles.rollout.collocated = collocated
    replicas = {"actor": 1, "rollout": 1}
    identities = local_identities("engine", replicas, str(EXAMPLE), free_ports(ports_needed(replicas)))
    rollout = next(i for i in identities if i.role == "rollout")
    engine = build_engine(RoleContext(identity=rollout, job=job, log=logging.getLogger("rollout")), CPU)
    assert isinstance(engine, HFEngine)
    assert engine.cache_implementation is None and engine.batch_buckets is None and engine.cache_len is None
    assert engine.shares_prefill


def test_only_the_compiled_decode_is_bucketed_and_sized():
    assert compiles_decode(torch.device("cuda"), collocated=False)
    assert not compiles_decode(torch.device("cuda"), collocated=True)  # collocated: no static cache
    assert not compiles_decode(CPU, collocated=False)
    spec = load_job_file(EXAMPLE).spec
    assert job_cache_len(spec) == spec.task.llm.max_prompt_length + spec.task.llm.max_response_length
    spec.rollout.max_tokens = 1
    assert job_cache_len(spec) == spec.task.llm.max_prompt_length + 1  # single turn: one call's response at most


def test_a_multi_turn_job_s_cache_holds_its_later_turns():
    spec = load_job_file(EXAMPLE.parent / "grpo-tiny-calculator.yaml").spec
    spec.rollout.max_tokens = 1  # each turn's response: the later turns' prompts carry the earlier ones
    assert job_cache_len(spec) == spec.task.llm.max_prompt_length + spec.task.llm.max_response_length


def compiling_engine(policy, buckets: tuple[int, ...] | None) -> HFEngine:
    """The engine as it runs on CUDA (static cache, sized for the job), with transformers compiling its decode
    on the CPU too: its `compile_config` flag for that, and dynamo's eager backend (no code generation)."""
    from transformers import CompileConfig

    model, tokenizer = policy
    model = copy.deepcopy(model)
    config = CompileConfig(backend="eager", mode=None)
    config._compile_all_devices = True
    model.generation_config.compile_config = config
    engine = HFEngine(model, tokenizer, CPU, batch_buckets=buckets)
    engine.cache_implementation, engine.cache_len = "static", TASK.max_prompt_length + 8
    return engine


def test_calls_of_one_bucket_reuse_the_compiled_decode_and_another_batch_compiles_again(policy, prompts):
    """What the buckets are for, counted in the graphs dynamo compiled (tests/gpu/test_hf_decode_cuda.py counts
    them on a GPU, where each new batch also records new CUDA graphs)."""
    from torch._dynamo.utils import counters

    sampling = Sampling(n=2, temperature=1.0, max_tokens=8)
    torch._dynamo.reset()
    counters.clear()
    bucketed = compiling_engine(policy, (2, 4))
    bucketed.generate(prompts[:3], sampling)
    compiled = counters["stats"]["unique_graphs"]
    assert compiled > 0, "transformers did not compile the decode: nothing here is measured"
    for count in (4, 3, 4):  # two real batch sizes, prompts of 4 and 6 tokens: one bucket
        assert len(bucketed.generate(prompts[:count], sampling)) == count
    assert counters["stats"]["unique_graphs"] == compiled

    torch._dynamo.reset()  # forget the bucket's decode: the same two batch sizes without buckets compile again
    plain = compiling_engine(policy, None)
    plain.generate(prompts[:3], sampling)
    before = counters["stats"]["unique_graphs"]
    plain.generate(prompts[:4], sampling)
    assert counters["stats"]["unique_graphs"] > before


@pytest.mark.parametrize("shipped", [{"repetition_penalty": 3.0}, {"no_repeat_ngram_size": 2}])
def test_a_models_own_sampling_defaults_never_change_what_the_engine_generates(policy, prompts, shipped):
    """Instruct checkpoints ship sampling defaults in generation_config.json (Qwen2.5-Instruct: repetition_penalty
    1.05), which transformers applies to every setting a `generate` call leaves unset. vLLM ignores them, and the
    reported log-probs leave them out: the job's rollout settings are the engine's only ones."""
    model, tokenizer = policy
    checkpoint = copy.deepcopy(model)
    for key, value in shipped.items():
        setattr(checkpoint.generation_config, key, value)
    engine = HFEngine(checkpoint, tokenizer, CPU)
    out = engine.generate(prompts, Sampling(n=1, greedy=True, max_tokens=12))
    for prompt, group in zip(prompts, out, strict=True):
        assert group[0].token_ids == greedy_reference(model, prompt, tokenizer.eos_token_id, 12)


def test_every_end_of_sequence_id_of_the_model_s_generation_config_ends_a_completion(policy, prompts):
    """Qwen2.5/Qwen3 instruct: the tokenizer's eos is <|im_end|>, generation_config.eos_token_id also lists
    <|endoftext|> (the pad token). The engine keeps them when it drops the sampling defaults of that config."""
    model, tokenizer = policy
    first = greedy_reference(model, prompts[0], tokenizer.eos_token_id, 1)[0]  # made an end-of-sequence id here
    checkpoint = copy.deepcopy(model)
    checkpoint.generation_config.eos_token_id = [tokenizer.eos_token_id, first]
    out = HFEngine(checkpoint, tokenizer, CPU).generate(prompts[:1], Sampling(n=2, greedy=True, max_tokens=8))
    assert [(c.token_ids, c.finish_reason) for c in out[0]] == [([first], "stop")] * 2
