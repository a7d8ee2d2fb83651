"""The actor's shared prompt prefix on a GPU: in fp32 and under bf16 compute, its update against whole rows.

Marked `cuda` (tests/conftest.py skips it without CUDA; `make gpu-check` runs this directory on a GPU machine);
the CPU suite checks the same in tests/runtime/llm/training/test_learner.py. It has not run on a GPU yet.
"""

from __future__ import annotations

import pytest
import torch

from rljob.api.spec import AlgorithmSpec, BuiltinNetwork, ModelSpec, TrainerSpec
from rljob.runtime.llm.models.policy import build_tiny_qwen2, policy_dtype
from rljob.runtime.llm.training.learner import LLMLearner
from tests.gpu.test_cuda import params
from tests.runtime.llm.training.test_learner import MAX_RESPONSE, TOKENIZER, make_groups

# Two layers: the left-padded prefix rows attend to nothing at their padding, and only from the second layer on do
# their keys and values reach a real row (a kernel giving NaN for a fully masked row would show there).
TWO_LAYERS = ModelSpec(
    source="builtin", builtin=BuiltinNetwork(architecture="tiny-qwen2", hidden_size=32, num_layers=2)
)

pytestmark = pytest.mark.cuda

ALGORITHM = AlgorithmSpec(name="grpo", kl_coef=0.0, loss_aggregation="token-mean", entropy_coef=0.01)


def learner(precision: str, shared: bool) -> LLMLearner:
    trainer = TrainerSpec(
        steps=10,
        optimizer="sgd",
        learning_rate=0.05,
        seed=3,
        grad_clip=None,
        precision=precision,
        shared_prompts=shared,
    )
    dtype = policy_dtype(TWO_LAYERS, precision, torch.device("cuda"))
    model = build_tiny_qwen2(TWO_LAYERS, TOKENIZER, max_length=32, seed=0)
    return LLMLearner(
        model.to(device="cuda", dtype=dtype),
        ALGORITHM,
        trainer,
        pad_id=TOKENIZER.pad_token_id,
        temperature=0.9,
        max_response_tokens=MAX_RESPONSE,
    )


@pytest.mark.parametrize(("precision", "atol"), [("fp32", 1e-5), ("bf16", 2e-3)])
def test_a_shared_prompt_prefix_on_cuda_updates_like_whole_rows(precision, atol):
    whole, shared = learner(precision, shared=False), learner(precision, shared=True)
    assert shared.share_prompts
    for seed in (0, 1):
        stats_whole, stats_shared = whole.update(make_groups(seed)), shared.update(make_groups(seed))
        assert stats_shared["policy_loss"] == pytest.approx(stats_whole["policy_loss"], abs=10 * atol)
        assert stats_shared["entropy"] == pytest.approx(stats_whole["entropy"], rel=1e-2)
        assert all(torch.isfinite(p).all() for p in shared.model.parameters())
    start = params(learner(precision, shared=False))
    assert float((params(whole) - start).abs().max()) > 1e-3  # the updates moved the weights
    assert torch.allclose(params(shared), params(whole), atol=atol)
