"""The builtin `calculator` text environment: the model may write `calc(EXPR)` before it answers.

Each complete call in a turn (format: `rljob.runtime.llm.episodes.textenv`) is evaluated and answered by one `tool`
message per call, `= VALUE\\n` (or `= error: WHY\\n`), after which the model takes another turn; a turn
without a call is the final answer and ends the episode (`done`). Steps give no reward of their own
(`step_reward` 0): the final answer is scored by `spec.reward.functions`.

EXPR is arithmetic only, evaluated from Python's parse tree without `eval`: numbers, `+ - * / // % **`,
unary `+ -` and parentheses. Anything else (names, calls, attributes, strings, comparisons) is an error
message, never executed. Limits keep one call cheap: at most `max_expression_length` characters, exponents
of at most 64 with results of at most 4096 bits, no division by zero.
"""

from __future__ import annotations

import ast
import math
import operator
from typing import Any

from rljob.runtime.llm.episodes.textenv import Message, TextEnv, parse_tool_calls

TOOL_NAME = "calc"
MAX_EXPONENT = 64
MAX_RESULT_BITS = 4096


class CalculatorError(ValueError):
    """An expression the calculator refuses; the message is what the model reads."""


_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


def evaluate(expression: str, max_length: int = 200) -> int | float:
    """The value of an arithmetic expression; CalculatorError for anything that is not one."""
    if len(expression) > max_length:
        raise CalculatorError(f"expression longer than {max_length} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise CalculatorError("not an arithmetic expression") from None
    return _value(tree.body)


def _value(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_value(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Pow):
            _check_power(left, right)
        try:
            result = _BINARY[type(node.op)](left, right)
        except ZeroDivisionError:
            raise CalculatorError("division by zero") from None
        except OverflowError:
            raise CalculatorError("result too large") from None
        if isinstance(result, complex):
            raise CalculatorError("result is not a real number")
        if isinstance(result, int) and result.bit_length() > MAX_RESULT_BITS:
            raise CalculatorError("result too large")
        return result
    raise CalculatorError(f"{type(node).__name__} is not allowed: numbers, + - * / // % ** and parentheses only")


def _check_power(base: int | float, exponent: int | float) -> None:
    if abs(exponent) > MAX_EXPONENT:
        raise CalculatorError(f"exponent above {MAX_EXPONENT}")
    if base and abs(exponent) * math.log2(abs(base)) > MAX_RESULT_BITS:
        raise CalculatorError("result too large")


def show(value: int | float) -> str:
    """Integers as they are; floats with 10 significant digits, integral ones without the `.0`."""
    if isinstance(value, float):
        if not math.isfinite(value):
            raise CalculatorError("result is not finite")
        if value.is_integer() and abs(value) < 1e15:
            return str(int(value))
        return format(value, ".10g")
    return str(value)


class Calculator(TextEnv):
    """See the module docstring. `args`: `max_expression_length` (default 200), `step_reward` (default 0)."""

    def __init__(self, max_expression_length: int = 200, step_reward: float = 0.0) -> None:
        if not isinstance(max_expression_length, int) or max_expression_length < 1:
            raise ValueError(f"max_expression_length must be a positive integer (got {max_expression_length!r})")
        self.max_expression_length = max_expression_length
        self.step_reward = float(step_reward)

    def step(self, messages: list[Message], response: str) -> tuple[list[Message], float, bool, dict[str, Any]]:
        calls = parse_tool_calls(response, (TOOL_NAME,))
        if not calls:
            return [], 0.0, True, {"tool_calls": 0, "tool_errors": 0}
        replies: list[Message] = []
        errors = 0
        for call in calls:
            try:
                text = show(evaluate(call.argument, self.max_expression_length))
            except CalculatorError as exc:
                text, errors = f"error: {exc}", errors + 1
            replies.append({"role": "tool", "content": f"= {text}\n"})
        return replies, self.step_reward, False, {"tool_calls": len(calls), "tool_errors": errors}
