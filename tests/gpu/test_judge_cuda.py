"""On a GPU machine: a generative judge runs on the reward role's GPU (hf engine, a dynamic cache: no decode compiled
per prompt length) in the checkpoint's dtype, and writes the verdicts it writes on the CPU (issue 30)."""

from __future__ import annotations

import pytest
import torch

from rljob.api.spec import RewardSpec
from rljob.runtime.llm.episodes.judge import Judge
from rljob.runtime.llm.episodes.rewards import RewardScorer
from tests.runtime.llm.episodes.test_judge import RUBRIC, SAMPLES, judge_dir  # noqa: F401 (the fixture)

pytestmark = pytest.mark.cuda


@pytest.fixture(autouse=True)
def _exact_fp32_matmuls():
    """TF32 would round fp32 matmuls to 10 mantissa bits: compare CUDA with the CPU in true fp32."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def test_a_judge_on_the_gpu_writes_the_verdicts_it_writes_on_the_cpu(judge_dir):  # noqa: F811
    judge = {"path": str(judge_dir), "rubric": RUBRIC, "scorePattern": r"(\d)", "maxScore": 9, "batchSize": 2}
    spec = RewardSpec.model_validate({"functions": [{"judge": {**judge, "maxTokens": 6}}]})
    scored = {}
    for device in ("cpu", "cuda"):
        scorer = RewardScorer(spec, device=torch.device(device))
        try:
            model = scorer._terms[0].model
            assert isinstance(model, Judge)
            weights = next(model.engine.model.parameters())
            assert (weights.device.type, weights.dtype) == (device, torch.float32)  # the tiny checkpoint's fp32
            assert model.engine.cache_implementation is None
            scored[device] = scorer.score(SAMPLES)
        finally:
            scorer.close()
    assert scored["cuda"].terms["judge"] == pytest.approx(scored["cpu"].terms["judge"])
    assert scored["cuda"].unparsed == scored["cpu"].unparsed
