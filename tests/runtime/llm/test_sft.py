"""The supervised warm-up (spec.sft): demonstrations from the rows, a loss on their tokens only, bad input named."""

from __future__ import annotations

import logging

import pytest
import torch

from rljob.api import validate_job
from rljob.api.spec import BuiltinNetwork, ModelSpec
from rljob.runtime.llm.data import arithmetic_rows
from rljob.runtime.llm.learner import LLMLearner, collate
from rljob.runtime.llm.policy import build_char_tokenizer, build_tiny_qwen2, load_policy
from rljob.runtime.llm.sft import Warmup, check_sft_rows, demonstration, demonstration_texts, sft_loss
from rljob.runtime.roles.common import FatalConfigError

TOKENIZER = build_char_tokenizer(["0123456789+=()calc"])
TINY = ModelSpec(source="builtin", builtin=BuiltinNetwork(architecture="tiny-qwen2", hidden_size=32, num_layers=1))
LOG = logging.getLogger("test-sft")


def job(**sft):
    manifest = {
        "apiVersion": "rljob.io/v1alpha1",
        "kind": "RLJob",
        "metadata": {"name": "sft"},
        "spec": {
            "task": {
                "type": "llm",
                "llm": {
                    "dataset": {"builtin": "arithmetic", "size": 64, "maxOperand": 9},
                    "maxPromptLength": 8,
                    "maxResponseLength": 12,
                },
            },
            "model": {"source": "builtin", "builtin": {"hiddenSize": 32, "numLayers": 1, "numHeads": 4}},
            "algorithm": {"name": "grpo"},
            "trainer": {"steps": 1, "seed": 0},
            "rollout": {"engine": "hf"},
            "sft": {
                "steps": 30,
                "batchSize": 16,
                "learningRate": 0.01,
                "responseTemplate": "calc({expression})",
                **sft,
            },
            "reward": {"functions": [{"builtin": "exact_match"}]},
        },
    }
    return validate_job(manifest).spec


def warmup(spec, rows=None):
    rows = arithmetic_rows(64, 0) if rows is None else rows
    model, tokenizer = load_policy(
        spec.model, spec.task.llm, rows, 0, torch.device("cpu"), extra_texts=demonstration_texts(spec, rows)
    )
    learner = LLMLearner(
        model, spec.algorithm, spec.trainer, pad_id=tokenizer.pad_token_id, temperature=1.0, max_response_tokens=12
    )
    return Warmup(spec, learner, tokenizer, rows, LOG), tokenizer


def test_the_arithmetic_rows_carry_an_expression_for_templates():
    row = arithmetic_rows(1, 0)[0]
    assert row["prompt"] == row["expression"] + "="
    assert demonstration(job().sft, row) == f"calc({row['expression']})"
    assert demonstration(job(responseTemplate=None, responseKey="answer").sft, row) == row["answer"]


def test_the_loss_is_the_cross_entropy_of_the_demonstration_tokens_only():
    model = build_tiny_qwen2(TINY, TOKENIZER, max_length=16, seed=0)
    ids = TOKENIZER("3+4=calc(3+4)")["input_ids"]
    prompt, response = ids[:5], [*ids[5:], TOKENIZER.eos_token_id]  # <s>3+4= | calc(3+4)</s>
    example = {"prompt_ids": prompt, "response_ids": response, "rollout_logprobs": [0.0] * len(response)}
    batch = collate([{**example, "advantage": 0.0}], TOKENIZER.pad_token_id)
    loss, summed = sft_loss(model, batch, normalizer=float(len(response)))

    # By hand: log p(token | everything before it), for the response tokens and nothing else.
    full = torch.tensor([prompt + response])
    with torch.no_grad():
        log_probs = torch.log_softmax(model(input_ids=full).logits[0].float(), dim=-1)
    by_hand = -sum(float(log_probs[t - 1, full[0, t]]) for t in range(len(prompt), full.shape[1]))
    assert summed == pytest.approx(by_hand, rel=1e-5)
    assert float(loss.detach()) == pytest.approx(by_hand / len(response), rel=1e-5)

    # The mask covers exactly the positions that predict the response: no prompt token is a target.
    assert float(batch.response_mask.sum()) == len(response)
    assert batch.response_mask[0, : len(prompt) - 1].sum() == 0


def test_the_warm_up_lowers_the_loss_and_teaches_the_demonstration():
    spec = job()
    run, tokenizer = warmup(spec)
    records = run.run()
    assert [r["sft_step"] for r in records] == list(range(1, 31))
    assert all(r["phase"] == "sft" for r in records)
    first, last = records[0]["sft_loss"], records[-1]["sft_loss"]
    assert last < 0.5 * first, (first, last)

    model = run.learner.model.eval()
    prompt = tokenizer("3+4=")["input_ids"]
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            max_new_tokens=5,
            do_sample=False,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
    assert tokenizer.decode(out[0, len(prompt) :]).startswith("calc(")


def test_a_template_field_the_rows_lack_is_named():
    spec = job(responseTemplate="calc({expresion})")
    problems = check_sft_rows(spec.sft, arithmetic_rows(4, 0))
    assert len(problems) == 1
    field, message = problems[0]
    assert field == "spec.sft.responseTemplate"
    assert "reads {expresion}, but row 0 of the dataset has no column 'expresion'" in message
    assert "answer, expression, prompt" in message


def test_a_response_key_the_rows_lack_is_named():
    spec = job(responseTemplate=None, responseKey="demo")
    assert check_sft_rows(spec.sft, arithmetic_rows(4, 0))[0][0] == "spec.sft.responseKey"
    assert check_sft_rows(job().sft, arithmetic_rows(4, 0)) == []


def test_demonstrations_longer_than_one_turn_stop_the_job_naming_the_template():
    spec = job(responseTemplate="calc({expression}) and then some more words")
    run, _ = warmup(spec)
    with pytest.raises(FatalConfigError, match=r"spec\.sft\.responseTemplate: no row gives a usable example"):
        run.step()
