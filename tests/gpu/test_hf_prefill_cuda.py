"""The hf engine's shared prefill on a GPU, where it runs when collocated (a dynamic KV cache there).

Marked `cuda` (tests/conftest.py skips it without CUDA; `make gpu-check` runs this directory on a GPU machine);
the CPU suite checks the same in tests/runtime/llm/engines/test_engine.py. It has not run on a GPU yet.
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


def test_a_collocated_engine_prefills_each_prompt_once_with_the_per_row_prefill_s_completions():
    model, tokenizer = load_policy(TINY, TASK, arithmetic_rows(40, 0), seed=0, device=GPU)
    engine = HFEngine(model.eval(), tokenizer, GPU, collocated=True)
    assert engine.cache_implementation is None
    forwards: list[tuple[int, ...]] = []
    engine.model.register_forward_pre_hook(
        lambda _, args, kwargs: forwards.append(tuple(kwargs["input_ids"].shape)), with_kwargs=True
    )
    prompts = [tokenizer(text)["input_ids"] for text in ("3+4=", "12+9=", "7+1=5 ")]
    width = max(len(p) for p in prompts)
    greedy = Sampling(n=3, greedy=True, max_tokens=8)
    shared = engine.generate(prompts, greedy)
    assert forwards[:2] == [(len(prompts), width - 1), (len(prompts) * 3, 1)]  # prefilled once, then the rows
    per_row = engine.generate([p for p in prompts for _ in range(3)], Sampling(n=1, greedy=True, max_tokens=8))
    assert [c.token_ids for group in shared for c in group] == [c.token_ids for [c] in per_row]
    for c_shared, [c_row] in zip((c for group in shared for c in group), per_row, strict=True):
        assert c_shared.logprobs == pytest.approx(c_row.logprobs, abs=1e-4)
