"""A sequence-classification model as a reward function: batched scores equal the model's one-by-one scores, mixed
with rule rewards by weight; a missing path or a model of the wrong kind is refused naming the field (a function
setting both `model` and `builtin` is tests/api/invalid/reward-builtin-and-model.yaml)."""

from __future__ import annotations

import pytest
import torch

from rljob.api.spec import RewardSpec
from rljob.runtime.llm.episodes.rewards import RewardConfigError, RewardScorer, check_reward_spec
from rljob.runtime.llm.models.policy import build_char_tokenizer

TEXTS = ["0123456789+= abcdefghijklmnopqrstuvwxyz"]


def save_tiny(directory, head: str = "ForSequenceClassification"):
    """A tiny random Qwen2 model with one output (or a causal LM) and a character tokenizer, saved as an export."""
    from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen2ForSequenceClassification

    tokenizer = build_char_tokenizer(TEXTS)
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        num_labels=1,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(0)
    model = Qwen2ForSequenceClassification(config) if head == "ForSequenceClassification" else Qwen2ForCausalLM(config)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def sample(prompt: str, response: str, answer: str) -> dict:
    return {"prompt": prompt, "response": response, "row": {"answer": answer}, "finish_reason": "stop",
            "response_tokens": len(response)}  # fmt: skip


def reward_spec(*functions: dict) -> RewardSpec:
    return RewardSpec.model_validate({"functions": list(functions)})


def test_batched_model_scores_are_the_models_own_scores_mixed_with_rules_by_weight(tmp_path):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    directory = save_tiny(tmp_path / "rm")
    spec = reward_spec(
        {"model": {"path": "rm", "batchSize": 2}, "weight": 0.5},
        {"builtin": "exact_match", "weight": 2.0},
    )
    # Different lengths in one batch: right padding must not change any sequence's score.
    samples = [sample("3+4=", "7", "7"), sample("12+30=", "42 yes", "42"), sample("1+1=", "x", "2")]
    scorer = RewardScorer(spec, base_dir=tmp_path)
    try:
        scored = scorer.score(samples)
    finally:
        scorer.close()

    model = AutoModelForSequenceClassification.from_pretrained(directory).eval()
    tokenizer = AutoTokenizer.from_pretrained(directory)
    alone = []
    for s in samples:
        ids = [*tokenizer(s["prompt"])["input_ids"], *tokenizer(s["response"], add_special_tokens=False)["input_ids"]]
        with torch.no_grad():
            alone.append(float(model(input_ids=torch.tensor([[*ids, tokenizer.eos_token_id]])).logits[0, 0]))
    assert scorer.names == ["reward_model", "exact_match"]
    assert scored.terms["reward_model"] == pytest.approx(alone, abs=1e-5)
    assert len(set(scored.terms["reward_model"])) == 3  # a score per sample, not one constant
    assert scored.rewards == pytest.approx([0.5 * a + 2.0 * e for a, e in zip(alone, [1.0, 1.0, 0.0], strict=True)])
    assert scored.errors == {"reward_model": 0, "exact_match": 0}


def test_a_missing_model_directory_is_refused_naming_the_field(tmp_path):
    problems = check_reward_spec(reward_spec({"model": {"path": "no/such/dir"}}), tmp_path)
    assert problems[0][0] == "spec.reward.functions[0].model.path"
    assert "is not a directory" in problems[0][1] and "reward_model job" in problems[0][1]
    with pytest.raises(RewardConfigError, match=r"spec.reward.functions\[0\].model.path: .*no/such/dir"):
        RewardScorer(reward_spec({"model": {"path": "no/such/dir"}}), base_dir=tmp_path)


def test_a_causal_language_model_is_not_a_reward_model(tmp_path):
    save_tiny(tmp_path / "lm", head="ForCausalLM")
    problems = check_reward_spec(reward_spec({"builtin": "exact_match"}, {"model": {"path": str(tmp_path / "lm")}}))
    assert problems == [
        (
            "spec.reward.functions[1].model.path",
            f"{tmp_path / 'lm'} is a Qwen2ForCausalLM, not a sequence-classification model "
            "(…ForSequenceClassification): train one with algorithm.name reward_model",
        )
    ]
