"""Validation problems a user can act on: the field path, what is wrong, and how to fix it."""

from __future__ import annotations

import difflib
import json
import types
from dataclasses import dataclass, field
from typing import Any, Union, get_args, get_origin

from pydantic import BaseModel, ValidationError
from pydantic.alias_generators import to_camel


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a manifest. `path` uses YAML keys: `spec.roles.actor.replicas`."""

    path: str
    message: str
    line: int | None = None
    column: int | None = None

    def render(self, source: str | None = None) -> str:
        where = ""
        if source is not None:
            where = f"{source}:{self.line}: " if self.line is not None else f"{source}: "
        return f"{where}{self.path}: {self.message}" if self.path else f"{where}{self.message}"


@dataclass
class InvalidRLJob(Exception):
    """A manifest that is not a valid RLJob; carries every problem found, not just the first."""

    problems: list[Problem]
    source: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def __str__(self) -> str:
        return "\n".join(p.render(self.source) for p in self.problems)


def show(value: Any) -> str:
    """A short YAML-flavoured rendering of a user's value for error messages."""
    if isinstance(value, str):
        text = repr(value)
    elif value is None:
        text = "null"
    elif isinstance(value, bool):
        text = "true" if value else "false"
    elif isinstance(value, dict | list):
        text = json.dumps(value, default=str)
    else:
        text = str(value)
    return text if len(text) <= 60 else text[:57] + "..."


def join_path(loc: tuple[str | int, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out


def suggest(word: str, candidates: list[str]) -> str | None:
    """The closest candidate to a misspelt key or value, if one is close enough to be useful."""
    if to_camel(word) in candidates and to_camel(word) != word:
        return to_camel(word)
    lowered = {c.lower(): c for c in candidates}
    if word.lower() in lowered:
        return lowered[word.lower()]
    close = difflib.get_close_matches(word, candidates, n=1, cutoff=0.6)
    return close[0] if close else None


def _unwrap(annotation: Any, key: str | int) -> Any:
    """The type found one step further along a path (through Optional, list and dict)."""
    origin = get_origin(annotation)
    if origin in (Union, types.UnionType):
        for arg in get_args(annotation):
            if arg is not type(None):
                return _unwrap(arg, key)
    if origin is list and isinstance(key, int):
        return get_args(annotation)[0]
    if origin is dict:
        return get_args(annotation)[1]
    if get_origin(annotation) is not None and hasattr(annotation, "__metadata__"):
        return _unwrap(get_args(annotation)[0], key)
    return annotation


def _model_at(root: type[BaseModel], loc: tuple[str | int, ...]) -> type[BaseModel] | None:
    current: Any = root
    for key in loc:
        if isinstance(current, type) and issubclass(current, BaseModel):
            fields = {(f.alias or name): f for name, f in current.model_fields.items()}
            if key not in fields:
                return None
            current = fields[key].annotation
            continue
        current = _unwrap(current, key)
    while not (isinstance(current, type) and issubclass(current, BaseModel)):
        unwrapped = _unwrap(current, 0)
        if unwrapped is current:
            return None
        current = unwrapped
    return current


def _field_keys(model: type[BaseModel]) -> list[str]:
    return [f.alias or name for name, f in model.model_fields.items()]


def _expected_values(ctx: dict[str, Any]) -> list[str]:
    return [part.strip().strip("'") for part in ctx.get("expected", "").replace(" or ", ",").split(",")]


def _message(error: dict[str, Any], root: type[BaseModel]) -> str:
    kind = error["type"]
    ctx = error.get("ctx") or {}
    got = show(error.get("input"))
    loc = tuple(error["loc"])
    if kind == "extra_forbidden":
        parent = _model_at(root, loc[:-1])
        hint = suggest(str(loc[-1]), _field_keys(parent)) if parent else None
        fix = f"did you mean '{hint}'?" if hint else "remove it (see `rljob crd` for the schema)"
        return f"unknown field: {fix}"
    if kind == "missing":
        return "required field is missing"
    if kind == "literal_error":
        allowed = _expected_values(ctx)
        hint = suggest(str(error.get("input")), allowed) if isinstance(error.get("input"), str) else None
        tail = f"; did you mean '{hint}'?" if hint else ""
        return f"must be one of {ctx.get('expected')} (got {got}){tail}"
    bounds = {
        "greater_than_equal": (">=", "ge"),
        "greater_than": (">", "gt"),
        "less_than_equal": ("<=", "le"),
        "less_than": ("<", "lt"),
    }
    if kind in bounds:
        sign, key = bounds[kind]
        return f"must be {sign} {ctx.get(key)} (got {got})"
    simple = {
        "int_type": "must be an integer",
        "int_parsing": "must be an integer",
        "int_from_float": "must be a whole number",
        "float_type": "must be a number",
        "float_parsing": "must be a number",
        "bool_type": "must be true or false",
        "bool_parsing": "must be true or false",
        "string_type": "must be a string",
        "dict_type": "must be a mapping of keys to values",
        "model_type": "must be a mapping of keys to values",
        "model_attributes_type": "must be a mapping of keys to values",
        "list_type": "must be a list",
    }
    if kind in simple:
        return f"{simple[kind]} (got {got}){_unquote_hint(kind, error.get('input'))}"
    if kind == "too_short":
        return f"must have at least {ctx.get('min_length')} item(s) (got {got})"
    if kind == "too_long":
        return f"must have at most {ctx.get('max_length')} item(s) (got {got})"
    if kind == "string_too_short":
        return "must not be empty"
    if kind == "string_pattern_mismatch":
        return f"has the wrong form (got {got}); expected text matching {ctx.get('pattern')}"
    if kind in ("quantity", "function_ref"):
        return str(error["msg"])
    if kind == "value_error":
        return str(ctx.get("error", error["msg"]))
    return f"{error['msg']} (got {got})"


def _unquote_hint(kind: str, value: Any) -> str:
    """How to write a number that arrived as text: quotes make YAML read it as a string."""
    if not isinstance(value, str) or kind not in ("int_type", "int_parsing", "float_type", "float_parsing"):
        return ""
    if kind.startswith("int"):
        return ": write a whole number without quotes, e.g. 20"
    return ": write a number without quotes, e.g. 0.0003 or 3e-4"


def problems_from_validation_error(exc: ValidationError, root: type[BaseModel]) -> list[Problem]:
    problems: list[Problem] = []
    seen: set[tuple[str, str]] = set()
    for error in exc.errors(include_url=False):
        path = join_path(tuple(error["loc"]))
        message = _message(dict(error), root)
        if (path, message) not in seen:
            seen.add((path, message))
            problems.append(Problem(path, message))
    return problems
