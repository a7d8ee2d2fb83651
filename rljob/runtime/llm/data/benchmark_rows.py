"""Dataset rows as benchmarks ship them, mapped to what the rewards check: tests for `code_exec`, a gold answer
for `math_verify`. The mapping is chosen by `reward.functions[i].args.format`, or detected from the row.

Code (`code_exec`):
- `tests`: the column named by `args.tests` (default `tests`): Python asserts or `{input, output}` pairs
  (`rljob.runtime.sandbox.runner.parse_tests`).
- `humaneval`: `test` defines `check(candidate)`, `entry_point` names the function: the row passes when
  `check(<entry_point>)` returns. A response without `def <entry_point>` is taken as the body that completes
  the row's `prompt` (HumanEval's own convention), so the prompt is put in front of it.
- `mbpp`: `test_setup_code` (may be empty) runs first, then each assert of `test_list` is one test.
- `stdio`: `input_output` (APPS, CodeContests-derived sets) is JSON `{"inputs": [...], "outputs": [...]}`: the
  program runs once per input on stdin and passes when its stdout equals the output, whitespace-normalised.
- `auto` (default): `humaneval` when the row has `test` and `entry_point`, `mbpp` with `test_list`, `stdio`
  with `input_output`, else `tests`.

Math (`math_verify`):
- `plain`: the answer column as it is.
- `gsm8k`: the answer after the last `####` (GSM8K's `answer` ends with `#### 72`), thousands commas dropped.
- `math`: the last `\\boxed{...}` of the answer column (MATH's `solution`).
- `auto` (default): `gsm8k` when the answer holds `####`, `math` when it holds `\\boxed`, else `plain`.
"""

from __future__ import annotations

import json
import re
from typing import Any

from rljob.runtime.sandbox.runner import UnrunnableTestsError, parse_tests

CODE_FORMATS = ("auto", "tests", "humaneval", "mbpp", "stdio")
MATH_FORMATS = ("auto", "plain", "gsm8k", "math")

_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class RowFormatError(ValueError):
    """A row that does not hold what its format needs; the message names the column and the fix."""


# --- code ---------------------------------------------------------------------------------------


def detect_code_format(row: dict[str, Any]) -> str:
    if "test" in row and "entry_point" in row:
        return "humaneval"
    if "test_list" in row:
        return "mbpp"
    if "input_output" in row:
        return "stdio"
    return "tests"


def code_tests(row: dict[str, Any], format: str = "auto", tests_column: str = "tests") -> dict[str, Any]:
    """The sandbox tests of a row (see `parse_tests` for their shape) in the given format."""
    chosen = detect_code_format(row) if format == "auto" else format
    if chosen == "humaneval":
        return _humaneval_tests(row)
    if chosen == "mbpp":
        return _mbpp_tests(row)
    if chosen == "stdio":
        return _stdio_tests(row)
    if chosen == "tests":
        return _column_tests(row, tests_column)
    raise RowFormatError(f"code_exec format {format!r} is not one of {', '.join(CODE_FORMATS)}")


def code_for_row(code: str, row: dict[str, Any], format: str = "auto") -> str:
    """The program to run: for a HumanEval row whose response only completes the prompt, prompt + response."""
    chosen = detect_code_format(row) if format == "auto" else format
    if chosen == "humaneval" and isinstance(row.get("prompt"), str):
        entry_point = str(row.get("entry_point", ""))
        if not re.search(rf"^\s*(async\s+)?def\s+{re.escape(entry_point)}\s*\(", code, re.M):
            return row["prompt"] + code
    return code


def _require(row: dict[str, Any], column: str, format: str) -> Any:
    if column not in row:
        raise RowFormatError(
            f"format {format} reads the column {column!r}, which the row lacks (columns: {', '.join(map(str, row))});"
            f" set args.format to the dataset's format ({', '.join(CODE_FORMATS[1:])})"
        )
    return row[column]


def _humaneval_tests(row: dict[str, Any]) -> dict[str, Any]:
    test = _require(row, "test", "humaneval")
    entry_point = _require(row, "entry_point", "humaneval")
    if not isinstance(test, str) or "def check" not in test:
        raise RowFormatError("format humaneval: the row's 'test' must be Python defining check(candidate)")
    if not isinstance(entry_point, str) or not _IDENTIFIER.match(entry_point):
        raise RowFormatError(f"format humaneval: the row's 'entry_point' must be a function name (got {entry_point!r})")
    return {"kind": "asserts", "setup": [test], "asserts": [f"check({entry_point})"]}


def _mbpp_tests(row: dict[str, Any]) -> dict[str, Any]:
    asserts = _require(row, "test_list", "mbpp")
    if isinstance(asserts, str):  # a column stored as JSON text
        try:
            asserts = json.loads(asserts)
        except json.JSONDecodeError:
            asserts = [asserts]
    if not isinstance(asserts, list) or not asserts or not all(isinstance(a, str) for a in asserts):
        raise RowFormatError("format mbpp: the row's 'test_list' must be a non-empty list of assert statements")
    setup = row.get("test_setup_code") or ""
    if not isinstance(setup, str):
        raise RowFormatError(
            f"format mbpp: the row's 'test_setup_code' must be Python text (got {type(setup).__name__})"
        )
    return {"kind": "asserts", "setup": [setup] if setup.strip() else [], "asserts": list(asserts)}


def _as_text(value: Any) -> str:
    """An APPS input or output: a string, or a list of lines."""
    if isinstance(value, list):
        return "\n".join(str(line) for line in value)
    return str(value)


def _stdio_tests(row: dict[str, Any]) -> dict[str, Any]:
    spec = _require(row, "input_output", "stdio")
    if isinstance(spec, str):
        try:
            spec = json.loads(spec)
        except json.JSONDecodeError as exc:
            raise RowFormatError(f"format stdio: the row's 'input_output' is not JSON ({exc.msg})") from None
    if not isinstance(spec, dict):
        raise RowFormatError('format stdio: the row\'s \'input_output\' must be {"inputs": [...], "outputs": [...]}')
    if spec.get("fn_name"):
        raise RowFormatError(
            f"format stdio: this row calls the function {spec['fn_name']!r} (APPS call-based) instead of reading stdin;"
            " drop such rows, or give them as asserts in a tests column (args.format: tests)"
        )
    inputs, outputs = spec.get("inputs"), spec.get("outputs")
    if not isinstance(inputs, list) or not isinstance(outputs, list) or not inputs or len(inputs) != len(outputs):
        raise RowFormatError(
            "format stdio: the row's 'input_output' needs 'inputs' and 'outputs', two non-empty lists of one length"
        )
    cases = [{"input": _as_text(i), "output": _as_text(o)} for i, o in zip(inputs, outputs, strict=True)]
    return {"kind": "io", "cases": cases, "compare": "whitespace"}


def _column_tests(row: dict[str, Any], column: str) -> dict[str, Any]:
    if column not in row:
        raise RowFormatError(
            f"the row has no tests column {column!r} (columns: {', '.join(map(str, row))}); name the column with "
            "args.tests, or set args.format (humaneval, mbpp, stdio) for a benchmark's own columns"
        )
    try:
        return parse_tests(row[column])
    except UnrunnableTestsError as exc:
        looks_like = detect_code_format(row)
        if looks_like != "tests":
            hint = f"the row looks like {looks_like}: set args.format: {looks_like}"
            raise UnrunnableTestsError(f"{exc}; {hint}") from None
        raise


# --- math ---------------------------------------------------------------------------------------


def detect_math_format(answer: str) -> str:
    if "####" in answer:
        return "gsm8k"
    if "\\boxed" in answer or "\\fbox" in answer:
        return "math"
    return "plain"


def gold_answer(answer: Any, format: str = "auto") -> str:
    """The gold answer of an answer column in the given format (see the module docstring)."""
    text = str(answer)
    chosen = detect_math_format(text) if format == "auto" else format
    if chosen == "plain":
        return text
    if chosen == "gsm8k":
        if "####" not in text:
            raise RowFormatError(
                "format gsm8k: the answer has no '#### <answer>' line; set args.format: plain (or math for \\boxed{})"
            )
        return text.rpartition("####")[2].strip().replace(",", "")
    if chosen == "math":
        boxed = last_boxed(text)
        if boxed is None:
            raise RowFormatError(
                "format math: the answer holds no \\boxed{...}; set args.format: plain (or gsm8k for '#### 42')"
            )
        return f"${boxed}$"  # math-verify reads it as LaTeX
    raise RowFormatError(f"math_verify format {format!r} is not one of {', '.join(MATH_FORMATS)}")


def last_boxed(text: str) -> str | None:
    """The content of the last `\\boxed{...}` (or `\\fbox{...}`), nested braces included; None without one."""
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start < 0:
        return None
    opening = text.index("{", start)
    depth = 0
    for position in range(opening, len(text)):
        if text[position] == "{":
            depth += 1
        elif text[position] == "}":
            depth -= 1
            if depth == 0:
                return text[opening + 1 : position]
    return None  # unbalanced: no answer to read
