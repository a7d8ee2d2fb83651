"""Text environments: the tool-call format, the safe calculator, loading task.llm.env, and its errors."""

from __future__ import annotations

import pytest

from rljob.api.spec import TextEnvSpec
from rljob.runtime.llm.episodes.calculator import Calculator, CalculatorError, evaluate
from rljob.runtime.llm.episodes.textenv import (
    TextEnvConfigError,
    TextEnvOutputError,
    ToolCall,
    check_step,
    check_text_env,
    load_text_env,
    parse_tool_calls,
    wants_row,
)

# --- the tool-call format ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "calls"),
    [
        ("calc(2+3)", [("calc", "2+3")]),
        ("let me see: calc(2+3) then calc(4*5).", [("calc", "2+3"), ("calc", "4*5")]),
        ("calc((2+3)*4)", [("calc", "(2+3)*4")]),  # the argument runs to the balancing parenthesis
        ("calc()", [("calc", "")]),
        ("recalc(1) my_calc(2) calc2(3)", []),  # the name must stand on its own
        ("calc (1)", []),  # no space between name and parenthesis
        ("calc(1+(2", []),  # left open at the end of the turn: not a call
        ("calc(1) calc(2", [("calc", "1")]),
        ("the answer is 7", []),
        ("search(cats) calc(1)", [("calc", "1")]),  # only the environment's own tool names
    ],
)
def test_tool_calls_are_name_paren_argument_balanced_paren(text, calls):
    assert [(c.name, c.argument) for c in parse_tool_calls(text, ("calc",))] == calls


def test_tool_calls_report_where_they_are_and_read_several_names():
    text = "a calc(1) b search(x)"
    assert parse_tool_calls(text, ("calc", "search")) == [
        ToolCall("calc", "1", 2, 9),
        ToolCall("search", "x", 12, 21),
    ]
    assert text[2:9] == "calc(1)"
    assert parse_tool_calls(text, ()) == []


# --- the calculator ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("expression", "value"),
    [("2+3*4", 14), ("(2+3)*4", 20), ("-7//2", -4), ("7%3", 1), ("2**10", 1024), ("1/4", 0.25), (" 12 - 20 ", -8)],
)
def test_calculator_evaluates_arithmetic(expression, value):
    assert evaluate(expression) == value


@pytest.mark.parametrize(
    ("expression", "why"),
    [
        ("__import__('os').system('true')", "Call is not allowed"),
        ("open('/etc/passwd')", "Call is not allowed"),
        ("x + 1", "Name is not allowed"),
        ("(1).real", "Attribute is not allowed"),
        ("'a' * 3", "Constant is not allowed"),
        ("True + 1", "Constant is not allowed"),
        ("1 < 2", "Compare is not allowed"),
        ("[1, 2]", "List is not allowed"),
        ("1 / 0", "division by zero"),
        ("9 ** 9 ** 9", "exponent above 64"),
        ("(10 ** 60) ** 64", "result too large"),
        ("1 +", "not an arithmetic expression"),
        ("1" * 300, "longer than 200 characters"),
    ],
)
def test_calculator_refuses_everything_but_bounded_arithmetic(expression, why):
    with pytest.raises(CalculatorError, match=why):
        evaluate(expression)


def test_calculator_step_answers_each_call_and_ends_on_a_turn_without_one():
    calc = Calculator()
    messages, reward, done, info = calc.step([], "calc(23+45) and calc(1/0)")
    assert messages == [
        {"role": "tool", "content": "= 68\n"},
        {"role": "tool", "content": "= error: division by zero\n"},
    ]
    assert (reward, done, info) == (0.0, False, {"tool_calls": 2, "tool_errors": 1})
    assert calc.step([], "calc(1/3)")[0] == [{"role": "tool", "content": "= 0.3333333333\n"}]
    assert calc.step([], "calc(6/2)")[0] == [{"role": "tool", "content": "= 3\n"}]
    assert calc.step([], "68") == ([], 0.0, True, {"tool_calls": 0, "tool_errors": 0})
    assert Calculator(step_reward=0.5).step([], "calc(1)")[1] == 0.5


# --- loading task.llm.env ---------------------------------------------------------------------------

USER_ENV = """
from rljob.runtime.llm.episodes.textenv import TextEnv


class Guess(TextEnv):
    def __init__(self, hint="higher"):
        self.hint = hint

    def reset(self, row):
        return [{"role": "user", "content": "guess\\n"}]

    def step(self, messages, response, row):
        right = response.strip() == row["answer"]
        return [] if right else [{"role": "user", "content": self.hint + "\\n"}], float(right), right, {}


def not_a_class():
    pass


class NoStep:
    pass


class ForgotStep(TextEnv):
    def reset(self, row):
        return []
"""


def test_a_user_environment_loads_from_a_file_with_its_args(tmp_path):
    (tmp_path / "tools.py").write_text(USER_ENV)
    env = load_text_env(TextEnvSpec(module="tools.py:Guess", args={"hint": "lower"}), base_dir=tmp_path)
    assert env.reset({"answer": "7"}) == [{"role": "user", "content": "guess\n"}]
    assert env.step([], "3", row={"answer": "7"}) == ([{"role": "user", "content": "lower\n"}], 0.0, False, {})
    assert wants_row(env) and not wants_row(Calculator())
    assert isinstance(load_text_env(TextEnvSpec(builtin="calculator")), Calculator)


@pytest.mark.parametrize(
    ("spec", "field", "message"),
    [
        (
            {"module": "missing.py:Guess"},
            "spec.task.llm.env.module",
            "file missing.py does not exist (relative paths are resolved against",
        ),
        ({"module": "tools.py:Gues"}, "spec.task.llm.env.module", "tools.py has no class 'Gues' (classes defined:"),
        ({"module": "tools.py:not_a_class"}, "spec.task.llm.env.module", "tools.py:not_a_class is a function, not"),
        ({"module": "tools.py:NoStep"}, "spec.task.llm.env.module", "has no step(messages, response) method"),
        ({"module": "tools.py:ForgotStep"}, "spec.task.llm.env.module", "has no step(messages, response) method"),
        ({"module": "no_such_package.envs:Env"}, "spec.task.llm.env.module", "cannot import 'no_such_package.envs'"),
        ({"module": "tools.py:Guess", "args": {"hints": 1}}, "spec.task.llm.env.args", "cannot be built"),
        ({"builtin": "calculator", "args": {"max_expression_length": 0}}, "spec.task.llm.env.args", "building"),
    ],
    ids=[
        "missing-file",
        "missing-class",
        "not-a-class",
        "no-step",
        "abstract-step",
        "missing-package",
        "bad-args",
        "bad-builtin-args",
    ],
)
def test_an_environment_that_cannot_be_built_is_an_error_naming_the_field(tmp_path, spec, field, message):
    (tmp_path / "tools.py").write_text(USER_ENV)
    with pytest.raises(TextEnvConfigError) as caught:
        load_text_env(TextEnvSpec(**spec), base_dir=tmp_path)
    assert caught.value.field == field
    assert message in caught.value.problem
    assert str(caught.value).startswith(f"{field}: ")
    assert check_text_env(TextEnvSpec(**spec), base_dir=tmp_path) == [(field, caught.value.problem)]


@pytest.mark.parametrize(
    ("returned", "why"),
    [
        ("done", "not (messages, reward, done, info)"),
        (([], float("nan"), True, {}), "not a finite number"),
        (([{"role": "tool"}], 0.0, True, {}), "not a {'role': str, 'content': str} message"),
        (([], 0.0, True, None), "not a dict"),
    ],
)
def test_a_malformed_step_result_is_refused(returned, why):
    with pytest.raises(TextEnvOutputError, match=why.replace("(", r"\(").replace(")", r"\)").replace("{", r"\{")):
        check_step(returned)
