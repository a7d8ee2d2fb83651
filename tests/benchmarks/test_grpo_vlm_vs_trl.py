"""The VLM benchmark gives TRL exactly rljob's prompts (token ids, pixels) and reward, refuses a prompt format it
cannot reproduce, and writes its JSON per side and seed (a tiny run; the TRL side when TRL is installed)."""

from __future__ import annotations

import importlib.util
import json

import pytest

from benchmarks.grpo_vlm_vs_trl import (
    MANIFEST,
    check_trl_prompts,
    conversation,
    conversational_rewards,
    export_initial_policy,
    main,
    prompt_encoder,
    prompt_schedule,
    trl_processor,
)
from benchmarks.grpo_vs_trl import job_data, load_spec
from rljob.runtime.llm.data.rows import PromptStream
from rljob.runtime.llm.episodes.rewards import RewardScorer

SMALL = [
    "spec.task.llm.dataset.size=120",
    "spec.trainer.batchSize=4",
    "spec.algorithm.groupSize=2",
    "spec.evaluation.size=8",
]


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    spec = load_spec(MANIFEST, ["spec.trainer.steps=3", *SMALL]).spec
    directory = tmp_path_factory.mktemp("vlm") / "initial-policy"
    export_initial_policy(spec, directory)
    train_rows, eval_rows = job_data(spec)
    return spec, directory, train_rows, eval_rows


def test_trl_gets_rljobs_prompts_in_rljobs_order_with_identical_ids_and_pixels(vlm):
    spec, directory, train_rows, _ = vlm
    encoder = prompt_encoder(spec, directory)
    schedule = prompt_schedule(spec, train_rows, encoder)
    stream = PromptStream(len(train_rows), spec.trainer.seed)
    assert [entry["row"] for entry in schedule] == stream.take(3 * 4)
    first = schedule[0]
    assert first["answer"] == train_rows[first["row"]]["answer"]
    assert first["prompt"] == [{"role": "user", "content": "<image>" + train_rows[first["row"]]["prompt"]}]
    processor = trl_processor(directory)
    assert check_trl_prompts(spec, schedule, train_rows, encoder, processor) == len({e["row"] for e in schedule})
    image = train_rows[first["row"]]["images"]
    rendered = processor.apply_chat_template(conversation=[conversation(first, image)], tokenize=False)
    assert rendered == [f"<|vision_start|><|image_pad|><|vision_end|>{train_rows[first['row']]['prompt']}"]


def test_a_prompt_format_trls_processor_renders_differently_is_refused(vlm):
    spec, directory, train_rows, _ = vlm
    encoder = prompt_encoder(spec, directory)
    schedule = prompt_schedule(spec, train_rows, encoder)
    processor = trl_processor(directory)
    # a question mark too many (a character the tiny tokenizer knows)
    processor.chat_template = processor.chat_template.replace("{{ part['text']", "{{ '?' + part['text']")
    with pytest.raises(SystemExit, match=r"spec\.task\.llm: TRL's processor tokenizes training row"):
        check_trl_prompts(spec, schedule, train_rows, encoder, processor)


def test_trls_conversational_rewards_sum_to_the_reward_rljobs_scorer_gives(vlm):
    spec = vlm[0]
    functions, weights = conversational_rewards(spec)
    assert [f.__name__ for f in functions] == ["exact_match", "format"]
    answers = ["r", "r", "2", "3", "g"]
    responses = ["r", "g", "2", "33", "x"]
    prompts = [[{"role": "user", "content": "<image>colour?"}]] * len(answers)
    completions = [[{"role": "assistant", "content": r}] for r in responses]
    terms = [f(prompts, completions, answer=answers) for f in functions]
    trl_total = [sum(w * t[i] for w, t in zip(weights, terms, strict=True)) for i in range(len(responses))]
    scorer = RewardScorer(spec.reward, answer_key=spec.task.llm.dataset.answer_key)
    try:
        scored = scorer.score(
            [
                {"prompt": "colour?", "response": r, "row": {"answer": a}, "finish_reason": "stop"}
                | {"response_tokens": 1}
                for r, a in zip(responses, answers, strict=True)
            ]
        )
    finally:
        scorer.close()
    assert trl_total == pytest.approx(scored.rewards)
    assert sorted(set(trl_total)) == pytest.approx([0.0, 0.2, 1.2])  # wrong-and-malformed, wrong, right


@pytest.mark.slow
def test_a_tiny_run_writes_each_sides_figures_per_seed(tmp_path):
    trl = importlib.util.find_spec("trl") is not None  # the bench extra; without it the rljob side alone
    sides = ["rljob_hf", "trl"] if trl else ["rljob_hf"]
    argv = ["--sides", ",".join(sides), "--steps", "2", "--seeds", "0", "--out", str(tmp_path)]
    for override in SMALL:
        argv += ["--set", override]
    main(argv)
    report = json.loads((tmp_path / "grpo_vlm_vs_trl.json").read_text())
    assert (tmp_path / "grpo_vlm_vs_trl.png").stat().st_size > 0
    assert report["settings"]["seeds_done"] == [0] and report["settings"]["steps"] == 2
    assert report["settings"]["prompts_checked_equal_to_rljobs_encoding"] >= 4
    for side in sides:
        (run,) = report["runs"][side]
        assert run["steps"] == 2 and run["samples"] == 2 * 4 * 2
        assert run["completions_per_s"] > 0 and run["heldout_prompts"] == 8
        assert 0.0 <= run["heldout_greedy_accuracy"] <= 1.0
        assert run["initial_heldout_greedy_accuracy"] == report["runs"][sides[0]][0]["initial_heldout_greedy_accuracy"]
        summary = report["summary"][side]
        assert summary["completions_per_s"]["mean"] == pytest.approx(run["completions_per_s"])
        assert set(summary["heldout_greedy_accuracy"]) == {"mean", "std", "min", "max"}
    if trl:
        assert report["summary"]["rljob_hf"]["ratio_completions_per_s_vs_trl"]["mean"] > 0
        assert report["runs"]["trl"][0]["time_s"]["generate"] > 0
