"""The supervised warm-up (spec.sft): demonstrations from the rows, a loss on their tokens only, bad input named."""

from __future__ import annotations

import logging

import pytest
import torch

from rljob.api import InvalidRLJob, validate_job
from rljob.api.spec import BuiltinNetwork, ModelSpec
from rljob.runtime.llm.data.rows import arithmetic_rows
from rljob.runtime.llm.engines.base import Sampling
from rljob.runtime.llm.engines.hf import HFEngine
from rljob.runtime.llm.episodes.calculator import Calculator
from rljob.runtime.llm.episodes.multiturn import EpisodeRunner, TextEnvClient
from rljob.runtime.llm.models.policy import build_char_tokenizer, build_tiny_qwen2, load_policy
from rljob.runtime.llm.training.learner import LLMLearner, collate
from rljob.runtime.llm.training.sft import Warmup, check_sft_rows, demonstration_texts, demonstration_turns, sft_loss
from rljob.runtime.wire.context import FatalConfigError
from tests.runtime.llm.episodes.test_multiturn import EnvServer, encode

TOKENIZER = build_char_tokenizer(["0123456789+=()calc"])
TINY = ModelSpec(source="builtin", builtin=BuiltinNetwork(architecture="tiny-qwen2", hidden_size=32, num_layers=1))
LOG = logging.getLogger("test-sft")


def job(env=False, max_turns=2, **sft):
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
            "algorithm": {"name": "grpo", "klCoef": 0.0},
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
    if env:
        manifest["spec"]["task"]["llm"]["env"] = {"builtin": "calculator", "maxTurns": max_turns}
        manifest["spec"]["task"]["llm"]["maxResponseLength"] = 32
        manifest["spec"]["rollout"]["maxTokens"] = 12
        manifest["spec"]["roles"] = {"env": {"replicas": 1}}
    return validate_job(manifest).spec


def warmup(spec, rows=None, env_endpoint=None):
    rows = arithmetic_rows(64, 0) if rows is None else rows
    model, tokenizer = load_policy(
        spec.model, spec.task.llm, rows, 0, torch.device("cpu"), extra_texts=demonstration_texts(spec, rows)
    )
    learner = LLMLearner(
        model, spec.algorithm, spec.trainer, pad_id=tokenizer.pad_token_id, temperature=1.0, max_response_tokens=12
    )
    episodes = episodes_for(spec, tokenizer, env_endpoint) if env_endpoint is not None else None
    return Warmup(spec, learner, tokenizer, rows, LOG, episodes), tokenizer


def test_the_arithmetic_rows_carry_an_expression_for_templates():
    row = arithmetic_rows(1, 0)[0]
    assert row["prompt"] == row["expression"] + "="
    assert demonstration_turns(job().sft, row) == [f"calc({row['expression']})"]
    assert demonstration_turns(job(responseTemplate=None, responseKey="answer").sft, row) == [row["answer"]]
    whole = job(responseTemplate=None, turns=["calc({expression})", "{answer}"], env=True).sft
    assert demonstration_turns(whole, row) == [f"calc({row['expression']})", row["answer"]]


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


# --- whole episodes (sft.turns): the environment's replies come from the env role, as in rollouts -------------

WHOLE = {"responseTemplate": None, "turns": ["calc({expression})", "{answer}"]}


@pytest.fixture
def calculator():
    server = EnvServer(Calculator())
    yield server
    server.close()


def episodes_for(spec, tokenizer, endpoint, engine=None):
    task = spec.task.llm
    client = TextEnvClient([endpoint], timeout=5.0)
    return EpisodeRunner(engine, tokenizer, client, task.env.max_turns, task.max_response_length, False)


def whole_warmup(spec, rows, endpoint):
    return warmup(spec, rows, env_endpoint=endpoint)


def test_a_whole_episode_example_trains_the_turns_and_masks_the_calculators_reply(calculator):
    spec = job(env=True, **WHOLE)
    row = {"prompt": "3+4=", "answer": "7", "expression": "3+4"}
    run, tokenizer = whole_warmup(spec, [row], calculator.endpoint)
    example = run.example(0)
    run.episodes.close()
    eos = [tokenizer.eos_token_id]
    call, reply, answer = encode(tokenizer, "calc(3+4)") + eos, encode(tokenizer, "= 7\n"), encode(tokenizer, "7") + eos
    assert example["prompt_ids"] == tokenizer("3+4=")["input_ids"]
    assert example["response_ids"] == call + reply + answer
    assert example["loss_mask"] == [1] * len(call) + [0] * len(reply) + [1] * len(answer)
    assert calculator.service.steps == 1  # the reply to the call; nothing after the last turn
    batch = collate([example], tokenizer.pad_token_id)
    assert int(batch.response_mask.sum()) == len(call) + len(answer)
    end = tokenizer.eos_token  # what the actor's log shows of the example
    assert run.describe(example) == f"'3+4=' model['calc(3+4){end}'] env['= 7\\n'] model['7{end}']"


def model_turns(completion):
    """The model's turns of a rollout episode: its runs of loss-mask-1 tokens."""
    turns, current = [], []
    for token, trained in zip(completion["token_ids"], completion["loss_mask"], strict=True):
        if trained:
            current.append(token)
        elif current:
            turns, current = [*turns, current], []
    return [*turns, current] if current else turns


def test_a_rollout_episode_and_the_warm_up_example_of_the_same_turns_are_the_same_tokens_and_mask(calculator):
    # The warm-up teaches calls and answers; the rollout (real engine, real calculator over the transport) then
    # writes two-turn episodes; demonstrating exactly the turns it wrote gives the same tokens and the same mask.
    spec = job(env=True, steps=60, batchSize=8, **WHOLE)
    rows = arithmetic_rows(4, 3)
    run, tokenizer = whole_warmup(spec, rows, calculator.endpoint)
    run.run()
    run.episodes.close()
    model = run.learner.model.eval()
    rollout = episodes_for(spec, tokenizer, calculator.endpoint, HFEngine(model, tokenizer, torch.device("cpu")))
    prompts = [tokenizer(r["prompt"])["input_ids"] for r in rows]
    groups = rollout.run(prompts, rows, Sampling(n=1, max_tokens=12, greedy=True))
    rollout.close()
    completions = [group[0] for group in groups]
    assert [(c["turns"], c["tool_calls"], c["finish_reason"]) for c in completions] == [(2, 1, "stop")] * 4
    written = []
    for row, completion in zip(rows, completions, strict=True):
        call, answer = model_turns(completion)
        assert call[-1] == answer[-1] == tokenizer.eos_token_id  # each turn ends where the engine ends a turn
        texts = [tokenizer.decode(turn, skip_special_tokens=True) for turn in (call, answer)]
        assert texts[0].startswith("calc(") and completion["response_text"] == texts[1]
        written.append({**row, "call": texts[0], "answer_turn": texts[1]})
    same = job(env=True, responseTemplate=None, turns=["{call}", "{answer_turn}"])
    demonstrated, _ = whole_warmup(same, written, calculator.endpoint)
    for index, completion in enumerate(completions):
        example = demonstrated.example(index)
        assert example["prompt_ids"] == prompts[index]
        assert example["response_ids"] == completion["token_ids"]
        assert example["loss_mask"] == completion["loss_mask"]
    demonstrated.episodes.close()


def test_turns_the_environment_never_reaches_stop_the_job_saying_why(calculator):
    # A first turn without a call is the calculator's final answer: a second turn never comes.
    spec = job(env=True, responseTemplate=None, turns=["{answer}", "{answer}"])
    run, _ = whole_warmup(spec, arithmetic_rows(8, 0), calculator.endpoint)
    with pytest.raises(
        FatalConfigError,
        match=r"spec\.sft\.turns: no row gives a usable example \(8 row\(s\): the "
        r"environment ended the episode after turn 1 of 2\)",
    ):
        run.step()
    run.episodes.close()


def test_a_turn_template_field_the_rows_lack_is_named_with_its_index():
    spec = job(env=True, responseTemplate=None, turns=["calc({expression})", "{result}"])
    ((field, message),) = check_sft_rows(spec.sft, arithmetic_rows(4, 0))
    assert field == "spec.sft.turns[1]"
    assert "reads {result}, but row 0 of the dataset has no column 'result'" in message


@pytest.mark.parametrize(
    ("env", "turns", "message"),
    [
        (True, ["calc({expression})", "{answer}", "{answer}"], "3 turns, but an episode has at most "
         "task.llm.env.maxTurns (2)"),
        (False, ["calc({expression})", "{answer}"], "2 turns need a text environment (task.llm.env)"),
    ],
    ids=["more-turns-than-maxTurns", "no-environment"],
)  # fmt: skip
def test_turns_an_episode_cannot_have_are_refused_before_start(env, turns, message):
    with pytest.raises(InvalidRLJob) as caught:
        job(env=env, responseTemplate=None, turns=turns)
    assert [(p.path, message in p.message) for p in caught.value.problems] == [("spec.sft.turns", True)]


def test_a_turn_that_is_not_a_format_string_is_named_with_its_index():
    with pytest.raises(InvalidRLJob) as caught:
        job(env=True, responseTemplate=None, turns=["calc({expression)", "{answer}"])
    assert [p.path for p in caught.value.problems] == ["spec.sft.turns[0]"]


def test_a_warm_up_batch_fsdp2_ranks_cannot_share_equally_stops_the_job_naming_the_field():
    spec = job(batchSize=10)
    rows = arithmetic_rows(64, 0)
    model, tokenizer = load_policy(
        spec.model, spec.task.llm, rows, 0, torch.device("cpu"), extra_texts=demonstration_texts(spec, rows)
    )
    learner = LLMLearner(
        model, spec.algorithm, spec.trainer, pad_id=tokenizer.pad_token_id, temperature=1.0, max_response_tokens=12
    )
    # As three more fsdp2 ranks would make it; the check runs before any collective.
    learner.world_size, learner.sharded = 4, True
    with pytest.raises(FatalConfigError, match=r"spec.sft.batchSize \(10\) must split into the 4 fsdp2 actor ranks"):
        Warmup(spec, learner, tokenizer, rows, LOG)
    learner.sharded = False  # ddp: unequal shares meet in one gradient sum per step
    Warmup(spec, learner, tokenizer, rows, LOG)
