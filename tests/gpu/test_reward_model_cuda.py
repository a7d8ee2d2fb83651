"""On a GPU machine: a reward model term runs on the reward role's GPU and scores as it does on the CPU (issue 30,
item 3)."""

from __future__ import annotations

import pytest
import torch

from rljob.api.spec import RewardSpec
from rljob.runtime.llm.episodes.rewards import RewardScorer
from tests.runtime.llm.episodes.test_reward_model import sample, save_tiny

pytestmark = pytest.mark.cuda


def test_a_reward_model_on_the_gpu_scores_as_on_the_cpu(tmp_path):
    save_tiny(tmp_path / "rm")
    spec = RewardSpec.model_validate({"functions": [{"model": {"path": str(tmp_path / "rm"), "batchSize": 2}}]})
    samples = [sample("3+4=", "7", "7"), sample("12+30=", "42 yes", "42"), sample("1+1=", "x", "2")]
    scores = {}
    for device in ("cpu", "cuda"):
        scorer = RewardScorer(spec, device=torch.device(device))
        try:
            model = scorer._terms[0].model
            assert model is not None and next(model.model.parameters()).device.type == device
            scores[device] = scorer.score(samples).terms["reward_model"]
        finally:
            scorer.close()
    assert scores["cuda"] == pytest.approx(scores["cpu"], abs=1e-4)
