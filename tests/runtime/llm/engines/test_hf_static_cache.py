"""The compiled static-cache decode when call sizes alternate (issue 33, item 5): a training chunk, an evaluation, the
last chunk. One static cache per batch bucket, kept and reset between calls: going back to a bucket compiles nothing
and allocates no new cache. Counted on the CPU with transformers compiling the decode with dynamo's eager backend
(tests/gpu/test_hf_decode_cuda.py counts the same on a GPU, where each new cache also means new CUDA graphs)."""

from __future__ import annotations

import torch
from transformers import StaticCache

from rljob.runtime.llm.engines.base import Sampling
from tests.runtime.llm.engines.test_engine import compiling_engine, policy, prompts  # noqa: F401 (fixtures)


def test_alternating_buckets_a_b_a_compile_and_allocate_nothing_new_on_the_return_to_a(policy, prompts):  # noqa: F811
    from torch._dynamo.utils import counters

    made: list[int] = []
    original = StaticCache.__init__

    def counted(self, *args, **kwargs):
        made.append(id(self))
        original(self, *args, **kwargs)

    sampling = Sampling(n=2, temperature=1.0, max_tokens=8)
    torch._dynamo.reset()
    counters.clear()
    engine = compiling_engine(policy, (2, 4))
    StaticCache.__init__ = counted
    try:
        engine.generate(prompts[:2], sampling)  # bucket A
        engine.generate(prompts[:4], sampling)  # bucket B
        graphs, caches = counters["stats"]["unique_graphs"], len(made)
        assert graphs > 0, "transformers did not compile the decode: nothing here is measured"
        for count in (2, 4, 1, 3):  # back to A, B, A (padded), B (padded)
            assert len(engine.generate(prompts[:count], sampling)) == count
    finally:
        StaticCache.__init__ = original
    assert counters["stats"]["unique_graphs"] == graphs  # no recompilation on the way back
    assert len(made) == caches <= 2  # one cache per bucket, kept
