"""The hf engine's compiled decode on a GPU: calls of one batch bucket run one compiled decode.

On CUDA the hf engine generates with a static KV cache, and transformers then compiles the decode step itself
(`torch.compile`, mode reduce-overhead: CUDA graphs); a call whose decode has another shape compiles it again.
The count of graphs dynamo compiled (`torch._dynamo.utils.counters`) says whether a call compiled. Marked `cuda`
(tests/conftest.py skips it without CUDA; `make gpu-check` runs this directory on a GPU machine).
"""

from __future__ import annotations

import pytest
import torch

from rljob.runtime.llm.data.rows import arithmetic_rows
from rljob.runtime.llm.engines.base import Sampling
from rljob.runtime.llm.engines.hf import HFEngine
from rljob.runtime.llm.models.policy import load_policy
from tests.runtime.llm.engines.test_engine import TASK, TINY

pytestmark = pytest.mark.cuda

GPU = torch.device("cuda", 0)
SAMPLING = Sampling(n=2, temperature=1.0, max_tokens=8)


def compiled_graphs() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def engine_on_gpu(buckets: tuple[int, ...] | None) -> HFEngine:
    model, tokenizer = load_policy(TINY, TASK, arithmetic_rows(40, 0), seed=0, device=GPU)
    return HFEngine(
        model.eval(), tokenizer, GPU, batch_buckets=buckets, cache_len=TASK.max_prompt_length + SAMPLING.max_tokens
    )


@pytest.fixture
def prompts():
    _, tokenizer = load_policy(TINY, TASK, arithmetic_rows(40, 0), seed=0, device=torch.device("cpu"))
    # Ragged lengths: each call's prompt width differs too, which the static cache's fixed length absorbs.
    return [tokenizer(text)["input_ids"] for text in ("3+4=", "12+9=", "7+1=5 ", "0+0=", "11+11=")]


def test_calls_of_one_bucket_reuse_the_compiled_decode_and_another_batch_compiles_again(prompts):
    torch._dynamo.reset()
    bucketed = engine_on_gpu((2, 4))
    assert bucketed.cache_implementation == "static"
    bucketed.generate(prompts[:3], SAMPLING)  # compiles the decode for 4 prompts x 2 samples
    compiled = compiled_graphs()
    assert compiled > 0, "transformers did not compile the decode: nothing here is measured"
    for count in (4, 3, 4):  # two real batch sizes, widths of 4 and 6 tokens: one bucket
        out = bucketed.generate(prompts[:count], SAMPLING)
        assert len(out) == count and all(len(group) == 2 for group in out)
    assert compiled_graphs() == compiled

    # Without buckets, the same two batch sizes compile the decode again: what the buckets save.
    torch._dynamo.reset()
    plain = engine_on_gpu(None)
    plain.generate(prompts[:3], SAMPLING)
    before = compiled_graphs()
    plain.generate(prompts[:4], SAMPLING)
    assert compiled_graphs() > before


def test_alternating_buckets_a_b_a_neither_compile_again_nor_grow_gpu_memory(prompts):
    """Issue 33, item 5: a training chunk, an evaluation, the last chunk. Once both buckets ran, going back and forth
    compiles nothing and allocates nothing more: one static cache per bucket, reset between calls."""
    torch._dynamo.reset()
    engine = engine_on_gpu((2, 4))
    engine.generate(prompts[:2], SAMPLING)  # A
    engine.generate(prompts[:4], SAMPLING)  # B
    engine.generate(prompts[:2], SAMPLING)  # A again: CUDA graphs of both buckets exist now
    torch.cuda.synchronize()
    compiled, held = compiled_graphs(), torch.cuda.memory_allocated()
    for count in (4, 2, 3, 1, 4, 2):
        assert len(engine.generate(prompts[:count], SAMPLING)) == count
    torch.cuda.synchronize()
    assert compiled_graphs() == compiled
    assert torch.cuda.memory_allocated() <= held + 2**20
    assert len(engine._static_caches) == 2


def test_a_large_vocabulary_s_log_probs_never_hold_every_step_s_logits():
    """Issue 33, item 4: 64 rows x 64 tokens over a 65,536-token vocabulary would be 1 GiB of fp32 logits kept to the
    end of the call; the engine takes each token's log-prob as it is drawn and holds one step's (16 MiB)."""
    model, tokenizer = load_policy(TINY, TASK, arithmetic_rows(40, 0), seed=0, device=GPU)
    model.resize_token_embeddings(65536)
    engine = HFEngine(model.eval(), tokenizer, GPU)  # eager decode (no cache_len): only the logits are measured
    engine.cache_implementation = None
    sampling = Sampling(n=8, temperature=1.0, max_tokens=64)
    prompts = [tokenizer(text)["input_ids"] for text in ("3+4=", "12+9=", "7+1=", "0+0=")] * 2
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = engine.generate(prompts, sampling)
    torch.cuda.synchronize()
    assert sum(len(c.token_ids) for group in out for c in group) > 0
    assert torch.cuda.max_memory_allocated() - base < 256 * 2**20
