"""Multi-turn text environments for llm jobs: the interface, the tool-call format, and loading `task.llm.env`.

A text environment answers the model between its turns. It runs in the env role (its own processes or pods,
never in the trainer), and the rollout replicas call it over the transport (`rljob.runtime.roles.textenv`):

    class MyEnv(TextEnv):
        def __init__(self, **args): ...                       # task.llm.env.args
        def reset(self, row) -> list[Message]: ...            # messages that open the episode, after the prompt
        def step(self, messages, response) -> tuple[list[Message], float, bool, dict]: ...

A `Message` is `{"role": str, "content": str}`. `reset(row)` gets the dataset row and returns the messages
the model reads after the task's prompt before its first turn (the base class returns none). `step(messages,
response)` gets the episode's messages so far (the opening, then alternately `{"role": "assistant"}` turns
and the environment's own messages) and the model's new turn as text, and returns `(messages, reward, done,
info)`: the messages to append (e.g. tool results, role `tool`), a reward for this step, whether the episode
is over, and a small JSON-able `info` dict. An environment whose `step` also declares a `row` parameter
receives the row as a keyword argument, so environments stay stateless: any env replica can answer any step,
and a replaced replica loses nothing. `info["tool_calls"]` (an int), when reported, counts the tool calls of
the step (the `tool_call_rate` metric).

Tool-call format (one for every builtin, and what `parse_tool_calls` reads for user environments):
`NAME(ARGUMENT)` anywhere in a model turn, e.g. `calc(2+3*4)`. The name must not follow a letter, digit or
`_` (so `recalc(1)` is no call), and the argument runs to the parenthesis that balances the opening one, so
`calc((2+3)*4)` is one call with argument `(2+3)*4`. A call left open at the end of the turn is not a call.
A turn with no call is the model's final answer: the calculator ends the episode there.

How an episode becomes a training sample, and how its reward is made, is `rljob.runtime.llm.episodes.multiturn`'s.
"""

from __future__ import annotations

import abc
import importlib
import importlib.util
import inspect
import math
import numbers
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rljob.api.spec import TextEnvSpec
from rljob.runtime.sandbox.user_code import load_user_module

Message = dict[str, str]
Row = dict[str, Any]
FIELD = "spec.task.llm.env"

BUILTIN_ENVS: dict[str, str] = {"calculator": "rljob.runtime.llm.episodes.calculator:Calculator"}
"""`task.llm.env.builtin` -> the class that implements it."""


class TextEnv(abc.ABC):
    """Base class of text environments (see the module docstring); subclasses implement `step`, maybe `reset`."""

    def reset(self, row: Row) -> list[Message]:
        return []

    @abc.abstractmethod
    def step(self, messages: list[Message], response: str) -> tuple[list[Message], float, bool, dict[str, Any]]:
        """The environment's reply to `response` (appended to `messages`), its reward, done, and info."""


class TextEnvConfigError(ValueError):
    """A text environment that cannot be used; the message starts with the spec field path."""

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"{field}: {problem}")
        self.field = field
        self.problem = problem


class TextEnvOutputError(ValueError):
    """An environment returned something other than what the interface promises."""


# --- the tool-call format -----------------------------------------------------------------------


@dataclass(frozen=True)
class ToolCall:
    name: str
    argument: str
    start: int
    """Offset of the call's first character in the turn."""
    end: int
    """Offset just past its closing parenthesis."""


def parse_tool_calls(text: str, names: tuple[str, ...]) -> list[ToolCall]:
    """Every complete `NAME(ARGUMENT)` call of one of `names` in `text`, in order (see the module docstring)."""
    if not names:
        return []
    pattern = re.compile(r"(?<![A-Za-z0-9_])(" + "|".join(re.escape(n) for n in names) + r")\(")
    calls: list[ToolCall] = []
    position = 0
    while (match := pattern.search(text, position)) is not None:
        depth, index = 1, match.end()
        while index < len(text) and depth:
            depth += {"(": 1, ")": -1}.get(text[index], 0)
            index += 1
        if depth:  # never closed: the rest of the turn holds no complete call either
            break
        calls.append(ToolCall(match.group(1), text[match.end() : index - 1], match.start(), index))
        position = index
    return calls


# --- checking what an environment returns ---------------------------------------------------------


@dataclass
class StepResult:
    messages: list[Message]
    reward: float
    done: bool
    info: dict[str, Any]

    def to_wire(self) -> dict[str, Any]:
        return {"messages": self.messages, "reward": self.reward, "done": self.done, "info": self.info}


def check_messages(value: Any, what: str) -> list[Message]:
    if not isinstance(value, list | tuple):
        raise TextEnvOutputError(f"{what} returned {type(value).__name__}, not a list of messages")
    for message in value:
        if not (
            isinstance(message, dict)
            and isinstance(message.get("role"), str)
            and isinstance(message.get("content"), str)
        ):
            raise TextEnvOutputError(f"{what} returned {message!r}, not a {{'role': str, 'content': str}} message")
    return [{"role": m["role"], "content": m["content"]} for m in value]


def check_step(value: Any) -> StepResult:
    if not isinstance(value, tuple | list) or len(value) != 4:
        raise TextEnvOutputError(f"step returned {type(value).__name__}, not (messages, reward, done, info)")
    messages, reward, done, info = value
    if not isinstance(reward, numbers.Real) or not math.isfinite(reward):
        raise TextEnvOutputError(f"step returned the reward {reward!r}, not a finite number")
    if not isinstance(info, dict):
        raise TextEnvOutputError(f"step returned the info {info!r}, not a dict")
    return StepResult(check_messages(messages, "step"), float(reward), bool(done), dict(info))


# --- loading task.llm.env -------------------------------------------------------------------------


def _load_class(ref: str, base_dir: Path | None, field: str) -> type:
    module, location, name = load_user_module(
        ref, base_dir, lambda message: TextEnvConfigError(field, message), "tools.py", "env"
    )
    found = getattr(module, name, None)
    if found is None:
        classes = sorted(k for k, v in vars(module).items() if isinstance(v, type) and not k.startswith("_"))
        raise TextEnvConfigError(
            field, f"{location} has no class {name!r} (classes defined: {', '.join(classes) or 'none'})"
        )
    if not isinstance(found, type):
        raise TextEnvConfigError(field, f"{location}:{name} is a {type(found).__name__}, not a class")
    if not callable(getattr(found, "step", None)) or "step" in getattr(found, "__abstractmethods__", ()):
        raise TextEnvConfigError(
            field,
            f"{location}:{name} has no step(messages, response) method: subclass rljob.runtime.llm.textenv.TextEnv",
        )
    return found


def load_text_env(spec: TextEnvSpec, base_dir: Path | None = None) -> TextEnv:
    """An instance of the configured environment; every problem is a TextEnvConfigError naming the field."""
    if (spec.builtin is None) == (spec.module is None):
        raise TextEnvConfigError(FIELD, "set exactly one of builtin (e.g. calculator) or module (file.py:ClassName)")
    if spec.builtin is not None:
        module, _, name = BUILTIN_ENVS[spec.builtin].partition(":")
        cls = getattr(importlib.import_module(module), name)
    else:
        cls = _load_class(spec.module or "", base_dir, f"{FIELD}.module")
    label = spec.builtin or spec.module
    try:
        inspect.signature(cls).bind(**spec.args)
    except TypeError as exc:
        raise TextEnvConfigError(f"{FIELD}.args", f"{label} cannot be built with these args: {exc}") from None
    except ValueError:  # no signature to check (a C type): find out by calling it
        pass
    try:
        env = cls(**spec.args)
    except Exception as exc:
        raise TextEnvConfigError(f"{FIELD}.args", f"building {label} failed: {type(exc).__name__}: {exc}") from None
    return env


def check_text_env(spec: TextEnvSpec, base_dir: Path | None = None) -> list[tuple[str, str]]:
    """(field path, message) when the environment cannot be built; empty when it can."""
    try:
        load_text_env(spec, base_dir)
    except TextEnvConfigError as exc:
        return [(exc.field, exc.problem)]
    return []


def wants_row(env: TextEnv) -> bool:
    """Whether `env.step` takes the row as a keyword argument."""
    try:
        parameters = inspect.signature(env.step).parameters
    except (TypeError, ValueError):
        return False
    return "row" in parameters or any(p.kind is p.VAR_KEYWORD for p in parameters.values())
