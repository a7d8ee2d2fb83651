"""Code and math rows as benchmarks ship them (HumanEval, MBPP, APPS-style stdin/stdout, GSM8K, MATH) plug into
code_exec and math_verify as they come: the fixture files are written here in their published column layout."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rljob.api.spec import LLMTask, RewardSpec
from rljob.runtime.llm.data.benchmark_rows import RowFormatError, code_tests, gold_answer, last_boxed
from rljob.runtime.llm.data.rows import load_rows
from rljob.runtime.llm.episodes.rewards import (
    RewardInput,
    RewardScorer,
    check_reward_columns,
    check_reward_spec,
    math_verify,
)

HUMANEVAL_PROMPT = 'def add(a: int, b: int) -> int:\n    """Add two numbers."""\n'
HUMANEVAL_ROW = {
    "task_id": "HumanEval/0",
    "prompt": HUMANEVAL_PROMPT,
    "canonical_solution": "    return a + b\n",
    "test": (
        "METADATA = {'author': 'jt', 'dataset': 'test'}\n\n\n"
        "def check(candidate):\n    assert candidate(2, 3) == 5\n    assert candidate(-1, 1) == 0\n"
    ),
    "entry_point": "add",
}
MBPP_ROW = {
    "task_id": 2,
    "text": "Write a function to square a number, offset by OFFSET.",
    "code": "def square(x):\n    return x * x + OFFSET",
    "test_setup_code": "OFFSET = 0",
    "test_list": ["assert square(2) == 4", "assert square(3) == 9", "assert square(0) == 0"],
    "challenge_test_list": [],
}
APPS_ROW = {
    "problem_id": 7,
    "question": "Read n, print 1..n on one line, then n on its own line.",
    "solutions": json.dumps(["n = int(input())\nprint(*range(1, n + 1))\nprint(n)"]),
    "input_output": json.dumps({"inputs": ["3\n", "1\n"], "outputs": ["1 2 3\n3\n", "1\n1\n"]}),
}


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def rows_from(path: Path, prompt_key: str, answer_key: str) -> list[dict[str, Any]]:
    task = LLMTask.model_validate({"dataset": {"path": str(path), "promptKey": prompt_key, "answerKey": answer_key}})
    return load_rows(task)


def sample(row: dict[str, Any], response: str) -> RewardInput:
    return {"prompt": "", "response": response, "row": row, "finish_reason": "stop", "response_tokens": 10}


def code_exec(**args: Any) -> RewardSpec:
    return RewardSpec.model_validate(
        {"functions": [{"builtin": "code_exec", "args": args}], "sandbox": {"timeoutSeconds": 5, "maxConcurrency": 2}}
    )


@pytest.fixture
def score():
    scorers: list[RewardScorer] = []

    def run(spec: RewardSpec, samples: list[RewardInput]) -> list[float]:
        scorer = RewardScorer(spec)
        scorers.append(scorer)
        scored = scorer.score(samples)
        assert scored.errors == {"code_exec": 0}, scored.error_messages
        return scored.terms["code_exec"]

    yield run
    for scorer in scorers:
        scorer.close()


def fenced(code: str) -> str:
    return f"Here it is:\n```python\n{code}```\n"


@pytest.mark.parametrize("args", [{"format": "humaneval"}, {}], ids=["format-humaneval", "detected"])
def test_humaneval_rows_run_check_on_the_entry_point(tmp_path, score, args):
    (row,) = rows_from(write_jsonl(tmp_path / "humaneval.jsonl", [HUMANEVAL_ROW]), "prompt", "canonical_solution")
    full = HUMANEVAL_PROMPT + "    return a + b\n"
    body_only = "    return a + b\n"  # HumanEval's own convention: the completion of the prompt
    wrong = HUMANEVAL_PROMPT + "    return a - b\n"
    assert score(
        code_exec(**args), [sample(row, fenced(full)), sample(row, body_only), sample(row, fenced(wrong))]
    ) == [
        1.0,
        1.0,
        0.0,
    ]


def test_mbpp_rows_run_the_setup_code_then_each_assert_of_test_list(tmp_path, score):
    path = tmp_path / "mbpp.parquet"
    pq.write_table(pa.Table.from_pylist([MBPP_ROW]), path)
    (row,) = rows_from(path, "text", "code")
    right = "def square(x):\n    return x * x + OFFSET\n"  # OFFSET comes from test_setup_code
    plus_one = "def square(x):\n    return x * x + 1 if x == 2 else x * x\n"  # fails one of three
    assert score(code_exec(format="mbpp"), [sample(row, fenced(right)), sample(row, fenced(plus_one))]) == [
        1.0,
        pytest.approx(2 / 3),
    ]


def test_stdio_rows_feed_each_input_on_stdin_and_compare_whitespace_normalised_output(tmp_path, score):
    (row,) = rows_from(write_jsonl(tmp_path / "apps.jsonl", [APPS_ROW]), "question", "solutions")
    right = json.loads(APPS_ROW["solutions"])[0] + "\n"
    spaced = "n = int(input())\nprint('  '.join(map(str, range(1, n + 1))), ' ')\nprint()\nprint(n)\n"
    off_by_one = "n = int(input())\nprint(*range(n))\nprint(n)\n"
    samples = [sample(row, fenced(right)), sample(row, fenced(spaced)), sample(row, fenced(off_by_one))]
    assert score(code_exec(format="stdio"), samples) == [1.0, 1.0, 0.0]
    assert code_tests(row)["kind"] == "io"  # detected from input_output


def test_a_humaneval_row_given_as_a_tests_column_says_which_format_to_set():
    """Issue 18.4: the asserts sit inside check(), so the row is not a tests string; the error names the fix."""
    spec = code_exec(tests="test", format="tests")
    problems = check_reward_columns(spec, [HUMANEVAL_ROW])
    assert problems == [
        (
            "spec.reward.functions[0].args.tests",
            "row 0: the tests hold no assert statement; the row looks like humaneval: set args.format: humaneval",
        )
    ]
    assert check_reward_columns(code_exec(tests="test"), [HUMANEVAL_ROW]) == []  # detected instead


@pytest.mark.parametrize(
    ("row", "args", "message"),
    [
        ({"prompt": "p", "answer": ""}, {"format": "mbpp"}, "format mbpp reads the column 'test_list'"),
        ({**HUMANEVAL_ROW, "entry_point": "not a name"}, {}, "'entry_point' must be a function name"),
        ({"input_output": "{not json"}, {}, "'input_output' is not JSON"),
        (
            {"input_output": json.dumps({"fn_name": "solve", "inputs": [[1]], "outputs": [[2]]})},
            {},
            "calls the function 'solve' (APPS call-based) instead of reading stdin",
        ),
        ({"input_output": json.dumps({"inputs": ["1"], "outputs": []})}, {}, "two non-empty lists of one length"),
    ],
    ids=["missing-column", "bad-entry-point", "not-json", "call-based", "unequal-lists"],
)
def test_rows_that_do_not_fit_their_format_are_refused_before_start_naming_args_format(row, args, message):
    ((field, problem),) = check_reward_columns(code_exec(**args), [row])
    assert field == "spec.reward.functions[0].args.format" and problem.startswith("row 0: ") and message in problem


@pytest.mark.parametrize(
    ("builtin", "known"),
    [("code_exec", "auto, tests, humaneval, mbpp, stdio"), ("math_verify", "auto, plain, gsm8k, math")],
)
def test_an_unknown_format_is_refused_naming_the_field_and_the_formats(builtin, known):
    spec = RewardSpec.model_validate({"functions": [{"builtin": builtin, "args": {"format": "human-eval"}}]})
    assert (
        "spec.reward.functions[0].args.format",
        f"{builtin} reads rows as one of {known} (got 'human-eval')",
    ) in check_reward_spec(spec)


# --- math ---------------------------------------------------------------------------------------

GSM8K_ROW = {
    "question": "Natalia sold clips to 48 of her friends in April, and then half as many in May. How many in all?",
    "answer": "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = <<48+24=72>>72 clips.\n#### 72",
}
MATH_ROW = {
    "problem": "What is $\\frac{1}{4} + \\frac{1}{4}$?",
    "solution": "We add: $\\frac{1}{4}+\\frac{1}{4} = \\frac{2}{4}$, which is $\\boxed{\\frac{1}{2}}$.",
}


def test_gsm8k_answers_are_read_after_the_hashes(tmp_path):
    (row,) = rows_from(write_jsonl(tmp_path / "gsm8k.jsonl", [GSM8K_ROW]), "question", "answer")
    assert gold_answer(row["answer"]) == "72" and gold_answer("#### 1,234", "gsm8k") == "1234"
    for fmt in ("auto", "gsm8k"):
        assert math_verify("", "She sold 72 clips.", row, format=fmt) == 1.0
        assert math_verify("", "She sold 24 clips.", row, format=fmt) == 0.0


def test_math_solutions_are_read_from_the_last_box(tmp_path):
    path = tmp_path / "math.parquet"
    pq.write_table(pa.Table.from_pylist([MATH_ROW]), path)
    (row,) = rows_from(path, "problem", "solution")
    assert last_boxed(row["solution"]) == "\\frac{1}{2}"
    for fmt in ("auto", "math"):
        assert math_verify("", "The sum is $0.5$.", row, answer_key="solution", format=fmt) == 1.0
        assert math_verify("", "The sum is $\\frac{2}{3}$.", row, answer_key="solution", format=fmt) == 0.0


def test_plain_answers_are_unchanged_and_a_missing_marker_names_the_fix():
    assert gold_answer("19") == "19" and gold_answer("\\frac{1}{2}", "plain") == "\\frac{1}{2}"
    with pytest.raises(RowFormatError, match=r"format gsm8k: the answer has no '#### <answer>' line; set args.format"):
        gold_answer("72", "gsm8k")
    with pytest.raises(RowFormatError, match=r"format math: the answer holds no \\boxed\{\.\.\.\}; set args.format"):
        gold_answer("1/2", "math")
