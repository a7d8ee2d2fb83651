"""Reward functions for llm tasks: the builtin registry, user functions, and a scorer that runs them.

Every reward function, builtin or user, scores one sample:

    def my_reward(prompt: str, response: str, row: dict, **args) -> float

`prompt` is the rendered prompt text, `response` the decoded response, `row` the dataset row (e.g.
`row["answer"]`), `args` the function's `spec.reward.functions[i].args`. A function that also declares
a `finish_reason` ("stop" or "length") or `response_tokens` (int) keyword parameter, or `**kwargs`,
receives those too. User functions are named `path/to/file.py:fn` (a relative path is resolved against
the role's working directory) or `package.module:fn` (importable by the reward role).

The reward of a sample is the weighted sum of its terms. A call that raises, runs past
`spec.reward.sandbox.timeoutSeconds`, or returns something other than a finite number scores 0 and
counts one error under the function's name; it never stops the job. Calls run on
`sandbox.maxConcurrency` threads.

User functions run confined, under the same `spec.reward.sandbox` limits as `code_exec`, in a pool of
at most `maxConcurrency` sandboxed worker processes per function that each import the module once
(`rljob.runtime.sandbox.confined_module`): a call past its timeout kills its worker (every process of it) and
the next sample gets a fresh one; module state is kept per worker, not shared between workers. The
module is also loaded once in the reward role's own process before start, for the checks that name the
spec field (missing file or function, wrong signature). Builtins other than `code_exec` run in the
reward role's process (they are rljob's own code); a builtin past its timeout is abandoned, not killed
(Python cannot stop a thread): its thread is replaced and keeps running until the function returns.
The code of `code_exec` runs in a fresh sandboxed process per sample (`rljob.runtime.sandbox.runner`).
A reward model (`model: {path, batchSize}`) or a generative judge (`judge: {path, rubric, ...}`) is no per-sample
function: it scores the whole batch in the scorer's own thread, before the other functions run
(`rljob.runtime.llm.episodes.reward_model`, `rljob.runtime.llm.episodes.judge`); if it fails, every sample of the
batch scores 0 on its term and counts as an error. A judge's output without a score is no error: the sample scores
the judge's `onUnparsed` and is counted in `ScoredBatch.unparsed`.

Builtins:
- `exact_match`: 1.0 when the final answer of the response equals `row[answer_key]`, after `final_answer`
  normalisation (last number, commas dropped, "19.0" == "19"; else last line, lowercased, no trailing ".").
- `math_verify`: 1.0 when the math-verify package finds the response equivalent to `row[answer_key]`
  ("\\frac{1}{2}" == "0.5"); `format` reads the gold answer as GSM8K ships it (`#### 72`), as MATH does
  (the last `\\boxed{}` of the solution), or plain; `auto` (default) tells them apart
  (`rljob.runtime.llm.data.benchmark_rows`).
- `format`: 1.0 when the stripped response fully matches the regex `pattern` (`search: true`: when the
  pattern occurs anywhere in the response).
- `code_exec`: runs the code of the response (its last fenced ``` block, else the whole text) in the sandbox
  against the row's tests (the column named by `tests`, default "tests": Python asserts, or a list of
  {input, output} pairs for a program reading stdin) and scores the fraction that pass. `format` takes rows as
  HumanEval (`test` + `entry_point`), MBPP (`test_setup_code` + `test_list`) or APPS/CodeContests stdin/stdout
  sets (`input_output`) ship them; `auto` (default) detects them (`rljob.runtime.llm.data.benchmark_rows`). A run
  the sandbox had to stop (time, memory, processes) or that broke a rule (network, writes outside its
  directory) scores 0 and counts as an error; a wrong or crashing program just scores what passed.
- `length_penalty`: without `max_tokens`, -1.0 for a response cut at the length limit (finish_reason
  "length"), else 0. With `max_tokens`, DAPO's soft overlong penalty on `response_tokens`: 0 up to
  `max_tokens - buffer_tokens`, then linear down to -1.0 at `max_tokens`, -1.0 beyond.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import logging
import math
import numbers
import os
import queue
import re
import stat
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Any, TypedDict

from rljob.api.spec import RewardFunction, RewardSpec
from rljob.runtime.llm.data.benchmark_rows import (
    CODE_FORMATS,
    MATH_FORMATS,
    RowFormatError,
    code_for_row,
    code_tests,
    detect_code_format,
    gold_answer,
)
from rljob.runtime.llm.episodes.judge import Judge, check_judge
from rljob.runtime.llm.episodes.reward_model import RewardModel, check_reward_model
from rljob.runtime.sandbox.confined_module import (
    WORKER_START_SECONDS,
    ModuleCallError,
    ModuleLoadError,
    SandboxedFunction,
)
from rljob.runtime.sandbox.runner import (
    STARTUP_ALLOWANCE_SECONDS,
    Isolation,
    Sandbox,
    SandboxError,
    SandboxLimits,
    UnrunnableTestsError,
    check_sandbox,
)
from rljob.runtime.sandbox.user_code import describe_exception, load_user_module

RewardFn = Callable[..., float]

SAMPLE_FIELDS = ("finish_reason", "response_tokens")
"""Keyword arguments a function receives when its signature asks for them."""

CODE_EXEC_TIMEOUT_MARGIN = 5.0
"""Seconds the scorer waits for a code_exec call beyond the sandbox's own wall clock, which kills the run
first: the scorer's abandonment is only a backstop."""


class RewardInput(TypedDict):
    prompt: str
    response: str
    row: dict[str, Any]
    finish_reason: str
    response_tokens: int


class RewardConfigError(ValueError):
    """A reward function that cannot be used; the message starts with the spec field path."""

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"{field}: {problem}")
        self.field = field
        self.problem = problem


# --- builtins ------------------------------------------------------------------------------------

_NUMBER = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?|-?\d+(?:\.\d+)?")


def final_answer(text: str) -> str:
    """The last number of `text` in canonical form ("1,234.50" -> "1234.5"), else its last line,
    lowercased, without trailing periods or spaces."""
    numbers_found = _NUMBER.findall(text)
    if numbers_found:
        try:
            value = Decimal(numbers_found[-1].replace(",", ""))
        except InvalidOperation:  # cannot happen for what _NUMBER matches; keep the text then
            return numbers_found[-1]
        return format(value.normalize(), "f") if value != value.to_integral() else str(int(value))
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1].strip().lower().rstrip(". ") if lines else ""


def _gold(row: dict[str, Any], answer_key: str) -> str:
    if answer_key not in row:
        raise KeyError(f"the dataset row has no {answer_key!r} (keys: {', '.join(map(str, row)) or 'none'})")
    return str(row[answer_key])


def exact_match(prompt: str, response: str, row: dict[str, Any], *, answer_key: str = "answer") -> float:
    return float(final_answer(response) == final_answer(_gold(row, answer_key)))


# math-verify warns once that it runs without its own timeout, as asked below: the scorer times every call.
for _logger in ("math_verify.parser", "math_verify.grader"):
    logging.getLogger(_logger).addFilter(lambda record: "Timeout is disabled" not in record.getMessage())


def math_verify(
    prompt: str, response: str, row: dict[str, Any], *, answer_key: str = "answer", format: str = "auto"
) -> float:
    from math_verify import parse, verify

    # math-verify's own timeouts use signal.alarm, which only works on the main thread: the scorer times calls.
    gold = parse(gold_answer(_gold(row, answer_key), format), parsing_timeout=None)
    return float(verify(gold, parse(response, parsing_timeout=None), timeout_seconds=None))


_LETTERS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
_BOXED_LETTER = re.compile(r"\\boxed\{\s*\(?([A-Z])\)?\s*\}")
_STATED_LETTER = re.compile(r"(?i:answer)(?: is)?\s*:?\s*\(?([A-Z])\)?(?![A-Za-z])")
_LONE_LETTER = re.compile(r"(?<![A-Za-z])\(?([A-Z])\)?(?![A-Za-z])")


def gold_choice(row: dict[str, Any], answer_key: str, choices_key: str) -> str:
    """The row's correct option as a letter: its answer is a letter (`B`), an option's index (1) or an option's text
    (looked up in the row's choices)."""
    gold = row.get(answer_key) if answer_key in row else _gold(row, answer_key)
    choices = row.get(choices_key)
    if isinstance(gold, int) and not isinstance(gold, bool):
        return _LETTERS[gold]
    text = str(gold).strip()
    if len(text.strip("()")) == 1 and text.strip("()").upper() in _LETTERS:
        return text.strip("()").upper()
    if isinstance(choices, list | tuple):
        for index, choice in enumerate(choices):
            if str(choice).strip() == text:
                return _LETTERS[index]
    raise KeyError(f"the row's {answer_key!r} ({text!r}) is neither an option letter nor one of its {choices_key!r}")


def chosen_letter(response: str, options: int) -> str | None:
    """The option a response picks: `\\boxed{B}`, else "answer: B" / "the answer is (B)", else the last lone capital
    letter among the options (A up to the option count)."""
    valid = _LETTERS[: max(options, 1)]
    for pattern in (_BOXED_LETTER, _STATED_LETTER):
        found = [m.upper() for m in pattern.findall(response) if m.upper() in valid]
        if found:
            return found[-1]
    found = [m for m in _LONE_LETTER.findall(response) if m in valid]
    return found[-1] if found else None


def multiple_choice(
    prompt: str, response: str, row: dict[str, Any], *, answer_key: str = "answer", choices_key: str = "choices"
) -> float:
    """1 when the response picks the row's correct option by its letter (or states that option's exact text)."""
    gold = gold_choice(row, answer_key, choices_key)
    choices = row.get(choices_key)
    options = len(choices) if isinstance(choices, list | tuple) else len(_LETTERS)
    picked = chosen_letter(response, options)
    if picked is None and isinstance(choices, list | tuple):
        said = [i for i, choice in enumerate(choices) if str(choice).strip() and str(choice).strip() in response]
        picked = _LETTERS[said[0]] if len(said) == 1 else None
    return float(picked == gold)


def format_match(prompt: str, response: str, row: dict[str, Any], *, pattern: str, search: bool = False) -> float:
    if search:
        return float(re.search(pattern, response) is not None)
    return float(re.fullmatch(pattern, response.strip()) is not None)


def length_penalty(
    prompt: str,
    response: str,
    row: dict[str, Any],
    *,
    finish_reason: str = "stop",
    response_tokens: int = 0,
    max_tokens: int | None = None,
    buffer_tokens: int = 0,
) -> float:
    if max_tokens is None:
        return -1.0 if finish_reason == "length" else 0.0
    free = max_tokens - buffer_tokens
    if response_tokens <= free:
        return 0.0
    return -min(1.0, (response_tokens - free) / max(buffer_tokens, 1))


_FENCED = re.compile(r"```[^\n`]*\n(.*?)(?:```|\Z)", re.S)


def extract_code(response: str) -> str:
    """The last fenced block of the response (an unclosed last fence runs to the end), else the whole text."""
    blocks = _FENCED.findall(response)
    return blocks[-1] if blocks else response


class CodeExec:
    """The `code_exec` builtin bound to the job's sandbox."""

    def __init__(self, sandbox: Sandbox) -> None:
        self.sandbox = sandbox

    def __call__(
        self, prompt: str, response: str, row: dict[str, Any], *, tests: str = "tests", format: str = "auto"
    ) -> float:
        code = code_for_row(extract_code(response), row, format)
        run = self.sandbox.run(code, code_tests(row, format, tests))
        if run.error is not None:
            raise SandboxError(run.error)
        return run.score


def code_exec(prompt: str, response: str, row: dict[str, Any], *, tests: str = "tests", format: str = "auto") -> float:
    """`code_exec` with the default sandbox limits (the scorer binds the job's `spec.reward.sandbox`)."""
    return CodeExec(Sandbox(SandboxLimits()))(prompt, response, row, tests=tests, format=format)


BUILTINS: dict[str, RewardFn] = {
    "exact_match": exact_match,
    "math_verify": math_verify,
    "format": format_match,
    "multiple_choice": multiple_choice,
    "length_penalty": length_penalty,
    "code_exec": code_exec,
}


def builtin_args(builtin: str) -> list[str]:
    """The `args` a builtin takes: its keyword-only parameters other than the sample fields."""
    parameters = inspect.signature(BUILTINS[builtin]).parameters.values()
    return [p.name for p in parameters if p.kind is p.KEYWORD_ONLY and p.name not in SAMPLE_FIELDS]


def _check_builtin_args(builtin: str, args: dict[str, Any], at: str) -> list[tuple[str, str]]:
    accepted = builtin_args(builtin)
    problems = [
        (f"{at}.{name}", f"{builtin} does not take {name!r} (it takes: {', '.join(accepted)})")
        for name in args
        if name not in accepted
    ]
    if builtin == "format":
        pattern = args.get("pattern")
        if not isinstance(pattern, str):
            problems.append((f"{at}.pattern", "format needs a regex string, e.g. args: {pattern: '^-?[0-9]+$'}"))
        else:
            try:
                re.compile(pattern)
            except re.error as exc:
                problems.append((f"{at}.pattern", f"{pattern!r} is not a valid regex: {exc}"))
        if not isinstance(args.get("search", False), bool):
            problems.append((f"{at}.search", "must be true or false"))
    if builtin == "length_penalty":
        max_tokens, buffer_tokens = args.get("max_tokens"), args.get("buffer_tokens", 0)
        if max_tokens is not None and (not isinstance(max_tokens, int) or max_tokens < 1):
            problems.append((f"{at}.max_tokens", f"must be a positive integer (got {max_tokens!r})"))
        elif not isinstance(buffer_tokens, int) or not 0 <= buffer_tokens < (max_tokens or 1):
            problems.append(
                (f"{at}.buffer_tokens", f"must be an integer from 0 to max_tokens - 1 (got {buffer_tokens!r})")
            )
    if builtin == "code_exec" and not isinstance(args.get("tests", "tests"), str):
        problems.append((f"{at}.tests", f"must name the dataset column holding the tests (got {args['tests']!r})"))
    formats = {"code_exec": CODE_FORMATS, "math_verify": MATH_FORMATS}.get(builtin)
    if formats is not None and args.get("format", "auto") not in formats:
        problems.append(
            (f"{at}.format", f"{builtin} reads rows as one of {', '.join(formats)} (got {args['format']!r})")
        )
    if "answer_key" in args and not isinstance(args["answer_key"], str):
        problems.append((f"{at}.answer_key", f"must be a string (got {args['answer_key']!r})"))
    return problems


# --- user functions ------------------------------------------------------------------------------


def load_user_function(ref: str, base_dir: Path | None = None, field: str = "module") -> RewardFn:
    """`path/to/file.py:fn` (relative to `base_dir`, default the working directory) or `package.module:fn`."""
    module, location, name = load_user_module(
        ref, base_dir, lambda message: RewardConfigError(field, message), "rewards.py", "reward"
    )
    if not hasattr(module, name):
        defined = sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_"))
        raise RewardConfigError(field, f"{location} has no function {name!r} (defines: {', '.join(defined) or 'none'})")
    function = getattr(module, name)
    if not callable(function):
        raise RewardConfigError(field, f"{location}:{name} is not callable (it is a {type(function).__name__})")
    return function


def _resolve(
    reward: RewardSpec, base_dir: Path | None
) -> tuple[list[tuple[RewardFunction, RewardFn | None]], list[tuple[str, str]]]:
    """Each function with its callable (None where it cannot be used) and every problem found."""
    resolved: list[tuple[RewardFunction, RewardFn | None]] = []
    problems: list[tuple[str, str]] = []
    for index, function in enumerate(reward.functions):
        at = f"spec.reward.functions[{index}]"
        callable_: RewardFn | None = None
        if [function.builtin, function.module, function.model, function.judge].count(None) != 3:
            problems.append((at, "set exactly one of builtin, module, model or judge"))
        elif function.judge is not None:
            judged = check_judge(function.judge, base_dir)
            if judged:
                problems.append((f"{at}.judge.{judged[0]}", judged[1]))
        elif function.model is not None:
            problem = check_reward_model(function.model, base_dir)
            if problem:
                problems.append((f"{at}.model.path", problem))
        elif function.builtin is not None:
            found = _check_builtin_args(function.builtin, function.args, f"{at}.args")
            if function.builtin == "math_verify" and importlib.util.find_spec("math_verify") is None:
                found.append((f"{at}.builtin", "math_verify needs the math-verify package: pip install 'rljob[env]'"))
            problems += found
            callable_ = None if found else BUILTINS[function.builtin]
        else:
            try:
                callable_ = load_user_function(function.module or "", base_dir, f"{at}.module")
            except RewardConfigError as exc:
                problems.append((exc.field, exc.problem))
            else:
                problem = _check_call(callable_, function)
                if problem:
                    problems.append((f"{at}.args", problem))
                    callable_ = None
        resolved.append((function, callable_))
    if any(function.builtin == "code_exec" for function in reward.functions):
        problems += check_sandbox(reward.sandbox)
    return resolved, problems


def _check_call(function: RewardFn, spec: RewardFunction) -> str | None:
    """Whether `function(prompt, response, row, **args)` binds, before any sample is scored."""
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError):  # some builtins and C functions have none: find out at the first call
        return None
    reserved = [name for name in SAMPLE_FIELDS if name in spec.args]
    if reserved:
        return f"{', '.join(reserved)} come from the sample, not from args: rename them in {spec.module}"
    try:
        signature.bind("", "", {}, **dict.fromkeys(_sample_fields(function)), **spec.args)
    except TypeError as exc:
        return f"{spec.module} cannot be called as fn(prompt, response, row, **args): {exc}"
    return None


def check_reward_spec(reward: RewardSpec, base_dir: Path | None = None) -> list[tuple[str, str]]:
    """(field path, message) for every reward function that cannot be used; empty when all can."""
    return _resolve(reward, base_dir)[1]


def check_reward_columns(
    reward: RewardSpec, rows: list[dict[str, Any]], answer_key: str = "answer"
) -> list[tuple[str, str]]:
    """(field path, message) for every dataset column a function reads (code_exec's `tests`, a judge rubric's
    `{answer}`) that some row lacks, or whose tests code_exec cannot run."""
    problems: list[tuple[str, str]] = []
    for index, function in enumerate(reward.functions):
        if function.judge is not None and "{answer}" in function.judge.rubric:
            lacking = next((number for number, row in enumerate(rows) if answer_key not in row), None)
            if lacking is not None:
                problems.append(
                    (
                        f"spec.reward.functions[{index}].judge.rubric",
                        f"{{answer}} reads each row's {answer_key!r} column (task.llm.dataset.answerKey), which row "
                        f"{lacking} lacks (columns: {', '.join(sorted(map(str, rows[lacking])))}); drop {{answer}} "
                        "from the rubric or name the column that holds the answers",
                    )
                )
        if function.builtin != "code_exec":
            continue
        column = function.args.get("tests", "tests")
        row_format = function.args.get("format", "auto")
        at = f"spec.reward.functions[{index}].args.tests"
        for number, row in enumerate(rows):
            chosen = detect_code_format(row) if row_format == "auto" else row_format
            if chosen != "tests":
                try:
                    code_tests(row, chosen)
                except RowFormatError as exc:
                    problems.append((f"spec.reward.functions[{index}].args.format", f"row {number}: {exc}"))
                    break
                continue
            if column not in row:
                problems.append(
                    (
                        at,
                        f"row {number} of the dataset has no column {column!r} (columns: {', '.join(sorted(row))}); "
                        "name the column that holds each row's tests",
                    )
                )
                break
            try:
                code_tests(row, "tests", column)
            except UnrunnableTestsError as exc:
                problems.append((at, f"row {number}: {exc}"))
                break
    return problems


# --- scoring -------------------------------------------------------------------------------------


@dataclass
class ScoredBatch:
    rewards: list[float]
    """Weighted sum of the terms, per sample."""
    terms: dict[str, list[float]]
    """Unweighted value of each function, per sample (0 where it failed)."""
    errors: dict[str, int]
    """Failed calls per function in this batch (raised, timed out, not a finite number)."""
    error_messages: dict[str, str] = field(default_factory=dict)
    """The first failure of each function that failed in this batch, for logs."""
    unparsed: dict[str, int] = field(default_factory=dict)
    """Per generative judge: samples whose judge output held no score (they score the judge's `onUnparsed`)."""


@dataclass(eq=False)  # compared and hashed by identity: calls live in a set while they run
class _Call:
    """One function on one sample; fields written under the scorer's condition."""

    term: int
    sample: int
    started: float | None = None
    done: bool = False
    abandoned: bool = False
    value: float = 0.0
    error: str | None = None


@dataclass
class _Term:
    name: str
    function: RewardFn
    weight: float
    kwargs: dict[str, Any]
    sample_fields: tuple[str, ...]
    timeout: float
    model: RewardModel | Judge | None = None
    """A reward model or a judge scores the whole batch at once, in the scorer's own thread, instead of `function`."""


class RewardScorer:
    """Scores batches of samples with `spec.reward.functions`; see the module docstring."""

    def __init__(
        self,
        reward: RewardSpec,
        answer_key: str = "answer",
        base_dir: Path | None = None,
        isolation: Isolation = "auto",
        device: Any = "cpu",
        prompt_key: str = "prompt",
    ) -> None:
        """`device`: where reward models and judges run (the reward role's GPU when it has one); `answer_key`,
        `prompt_key`: the dataset's answer and prompt columns (a judge's `{answer}` and `{question}`)."""
        resolved, problems = _resolve(reward, base_dir)
        if problems:
            raise RewardConfigError(
                problems[0][0], "\n".join([problems[0][1], *(f"{f}: {m}" for f, m in problems[1:])])
            )
        self.timeout = reward.sandbox.timeout_seconds
        self.concurrency = reward.sandbox.max_concurrency
        self._limits = SandboxLimits.from_spec(reward.sandbox)
        self._terms: list[_Term] = []
        labels: dict[str, int] = {}
        sandbox = Sandbox.from_spec(reward.sandbox, isolation)
        self._modules: list[SandboxedFunction] = []
        self._judges: list[Judge] = []
        for index, (spec, function) in enumerate(resolved):
            timeout = self.timeout
            model = None
            if spec.model is not None:
                model = RewardModel(spec.model, base_dir, device)
                function = _scored_by_model
            elif spec.judge is not None:
                try:
                    model = Judge(spec.judge, base_dir, device, answer_key, prompt_key)
                except RuntimeError as exc:  # the engine cannot start: vLLM missing, or refusing its settings
                    raise RewardConfigError(f"spec.reward.functions[{index}].judge.engine", str(exc)) from None
                self._judges.append(model)
                function = _scored_by_model
            assert function is not None  # no problems: every function resolved
            sample_fields = _sample_fields(function)  # of the user's own function, loaded for the checks
            if spec.builtin == "code_exec":
                function = CodeExec(sandbox)
                timeout = self.timeout + STARTUP_ALLOWANCE_SECONDS + CODE_EXEC_TIMEOUT_MARGIN
            elif spec.module is not None:
                function = self._sandboxed(spec.module, f"spec.reward.functions[{index}].module", base_dir, isolation)
                timeout = self.timeout + WORKER_START_SECONDS + CODE_EXEC_TIMEOUT_MARGIN
            label = spec.name or spec.builtin or (spec.module or ("judge" if spec.judge else "reward_model"))
            label = label.rpartition(":")[2]
            labels[label] = labels.get(label, 0) + 1
            kwargs = dict(spec.args)
            if spec.builtin in ("exact_match", "math_verify", "multiple_choice"):
                kwargs.setdefault("answer_key", answer_key)
            self._terms.append(
                _Term(
                    name=label if labels[label] == 1 else f"{label}_{labels[label]}",
                    function=function,
                    weight=spec.weight,
                    kwargs=kwargs,
                    sample_fields=sample_fields,
                    timeout=timeout,
                    model=model,
                )
            )
        self._condition = threading.Condition()
        self._queue: queue.SimpleQueue[tuple[_Call, RewardInput] | None] = queue.SimpleQueue()
        self._running: set[_Call] = set()
        self._pending = 0
        """Calls of the batch being scored that are neither done nor abandoned."""
        self._abandoned_threads = 0
        for _ in range(self.concurrency):
            self._start_worker()

    def _sandboxed(self, ref: str, field: str, base_dir: Path | None, isolation: Isolation) -> SandboxedFunction:
        """The module function in its sandboxed workers; the first worker is started now, so that a module
        the sandbox cannot import (e.g. a file its uid cannot read) is refused before any sample."""
        location, _, name = ref.rpartition(":")
        if location.endswith(".py"):
            path = Path(location) if Path(location).is_absolute() else (base_dir or Path.cwd()) / location
            problem = unreadable_by_the_sandbox(path)
            if problem:
                raise RewardConfigError(field, problem)
            ref = f"{path}:{name}"
        function = SandboxedFunction(ref, self._limits, self.concurrency, isolation)
        self._modules.append(function)
        try:
            function.start()
        except ModuleLoadError as exc:
            for started in self._modules:  # no thread is running yet: the workers are all there is to stop
                started.close()
            raise RewardConfigError(
                field,
                f"the reward sandbox cannot load it: {exc} (see docs/sandbox.md: the module and what it "
                "imports must be readable by the sandbox's uid)",
            ) from None
        return function

    @property
    def names(self) -> list[str]:
        return [term.name for term in self._terms]

    def score(self, samples: list[RewardInput], beat: Callable[[], None] = lambda: None) -> ScoredBatch:
        """`beat()` each time a call of the batch starts, ends or is abandoned (the role's heartbeat: a large batch
        of calls that run into `sandbox.timeoutSeconds` is slow, not hung)."""
        modelled = {t: self._score_with_model(term, samples, beat) for t, term in enumerate(self._terms) if term.model}
        calls = [_Call(t, s) for s in range(len(samples)) for t in range(len(self._terms)) if t not in modelled]
        with self._condition:
            self._pending = len(calls)  # before any call is queued: workers count it down
            for call in calls:
                self._queue.put((call, samples[call.sample]))
            while True:
                beat()
                now = time.monotonic()
                for call in [c for c in self._running if now - (c.started or now) >= self._terms[c.term].timeout]:
                    call.abandoned = True
                    self._pending -= 1
                    call.error = f"no result within sandbox.timeoutSeconds ({self.timeout:g}s); call abandoned"
                    self._running.discard(call)
                    self._abandoned_threads += 1
                    self._start_worker()  # keep maxConcurrency threads serving the queue
                if not self._pending:
                    break
                ends = [c.started + self._terms[c.term].timeout for c in self._running if c.started is not None]
                self._condition.wait(min(ends) - now if ends else None)
        rewards = [0.0] * len(samples)
        terms = {term.name: [0.0] * len(samples) for term in self._terms}
        errors = {term.name: 0 for term in self._terms}
        messages: dict[str, str] = {}
        unparsed: dict[str, int] = {}
        for t, (values, failed, error, not_parsed) in modelled.items():
            term = self._terms[t]
            if isinstance(term.model, Judge):
                unparsed[term.name] = not_parsed
            errors[term.name] += failed
            if error is not None:
                messages[term.name] = error
            terms[term.name] = values
            for index, value in enumerate(values):
                rewards[index] += term.weight * value
        for call in calls:
            term = self._terms[call.term]
            if call.error is not None:
                errors[term.name] += 1
                messages.setdefault(term.name, call.error)
                continue
            terms[term.name][call.sample] = call.value
            rewards[call.sample] += term.weight * call.value
        return ScoredBatch(rewards=rewards, terms=terms, errors=errors, error_messages=messages, unparsed=unparsed)

    @staticmethod
    def _score_with_model(
        term: _Term, samples: list[RewardInput], beat: Callable[[], None]
    ) -> tuple[list[float], int, str | None, int]:
        """The model's (or judge's) scores of the batch, how many samples failed and why (the whole batch when the
        model failed, e.g. out of memory: zeros for all), and how many judge outputs held no score."""
        assert term.model is not None
        beat()
        failed, error, unparsed = 0, None, 0
        try:
            if isinstance(term.model, Judge):
                verdicts = term.model.judge(list(samples), beat)  # type: ignore[arg-type]
                values, unparsed, failed = verdicts.values, verdicts.unparsed, verdicts.too_long
                if failed:
                    error = (
                        f"{failed} judge prompt(s) longer than {verdicts.longest_prompt} tokens, which leave no room "
                        "for judge.maxTokens in the judge's context: scored 0; raise judge.maxModelLen (vllm), shorten "
                        "the rubric, or cap the policy's responses"
                    )
            else:
                values = term.model.score([(sample["prompt"], sample["response"]) for sample in samples])
        except Exception as exc:
            return [0.0] * len(samples), len(samples), describe_exception(exc), 0
        finally:
            beat()
        if not all(math.isfinite(value) for value in values):
            return (
                [0.0] * len(samples),
                len(samples),
                "the reward model returned a score that is not a finite number",
                0,
            )
        return values, failed, error, unparsed

    def _start_worker(self) -> None:
        threading.Thread(target=self._work, name="reward-scorer", daemon=True).start()

    def _work(self) -> None:
        while (item := self._queue.get()) is not None:
            call, sample = item
            with self._condition:
                call.started = time.monotonic()
                self._running.add(call)
                self._condition.notify_all()
            value, error = self._run(self._terms[call.term], sample)
            with self._condition:
                if call.abandoned:
                    return  # the scorer gave up on this call and started another thread in this one's place
                call.value, call.error, call.done = value, error, True
                self._running.discard(call)
                self._pending -= 1
                self._condition.notify_all()

    @staticmethod
    def _run(term: _Term, sample: RewardInput) -> tuple[float, str | None]:
        try:
            extra = {name: sample[name] for name in term.sample_fields}  # type: ignore[literal-required]
            value = term.function(sample["prompt"], sample["response"], sample["row"], **extra, **term.kwargs)
        except ModuleCallError as exc:  # what the sandboxed call raised, or why the sandbox stopped it
            return 0.0, str(exc)
        except (Exception, SystemExit) as exc:  # user code must not take a worker thread down with it
            return 0.0, describe_exception(exc)
        if not isinstance(value, numbers.Real) or not math.isfinite(value):
            return 0.0, f"returned {value!r}, not a finite number"
        return float(value), None

    def close(self) -> None:
        """Stops the worker threads once they finish their current call (abandoned ones are daemons), and every
        sandboxed module worker."""
        for _ in range(self.concurrency):
            self._queue.put(None)
        for module in self._modules:
            module.close()
        for judge in self._judges:
            judge.close()


def unreadable_by_the_sandbox(path: Path) -> str | None:
    """Why a sandboxed worker cannot import the module file at `path`, or None. Run as root, the worker drops to
    a uid of its own before it imports the module: the file must be readable, and its directory searchable, by
    other users (the directories above it need not be: see `sandbox_child.hold_open_directories`)."""
    if os.geteuid() != 0:
        return None  # the worker keeps this process's uid (mapped to itself in a user namespace)
    directory = path.resolve().parent
    if not directory.stat().st_mode & stat.S_IXOTH:
        return (
            f"the reward sandbox imports {path} as an unprivileged uid of its own, which cannot enter {directory} "
            f"(mode {stat.filemode(directory.stat().st_mode)}): chmod o+rx {directory}"
        )
    if not path.stat().st_mode & stat.S_IROTH:
        return (
            f"the reward sandbox imports {path} as an unprivileged uid of its own, which cannot read it "
            f"(mode {stat.filemode(path.stat().st_mode)}): chmod o+r {path}"
        )
    return None


def _scored_by_model(prompt: str, response: str, row: dict[str, Any]) -> float:
    """Never called: a reward model's term scores whole batches (`RewardScorer._score_with_model`)."""
    raise AssertionError("a reward model scores batches, not single samples")


def _sample_fields(function: RewardFn) -> tuple[str, ...]:
    try:
        parameters = inspect.signature(function).parameters
    except (TypeError, ValueError):
        return ()
    if any(p.kind is p.VAR_KEYWORD for p in parameters.values()):
        return SAMPLE_FIELDS
    return tuple(name for name in SAMPLE_FIELDS if name in parameters)
