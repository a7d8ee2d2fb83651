"""`--set path.to.key=value`: edit a manifest by YAML key path before it is validated."""

from __future__ import annotations

import copy
from typing import Any

import yaml

from rljob.api.loading import Edit, read_yaml_value
from rljob.api.problems import InvalidRLJob, Problem


class OverrideError(ValueError):
    """A `--set` argument that cannot be applied; the message names it and says why."""


def _yaml_kind(value: Any) -> str:
    if isinstance(value, list):
        return "list"
    if isinstance(value, str):
        return "string"
    return "scalar"


def parse_override(text: str) -> tuple[list[str], Any]:
    """`spec.trainer.steps=10` -> (["spec", "trainer", "steps"], 10); the value is read as YAML, as a manifest is."""
    path, sep, raw = text.partition("=")
    if not sep or not path.strip():
        raise OverrideError(f"--set {text!r}: expected path.to.key=value, e.g. --set spec.trainer.steps=20")
    keys = path.strip().split(".")
    if any(not k for k in keys):
        raise OverrideError(f"--set {text!r}: empty key in path {path!r}")
    try:
        value = read_yaml_value(raw) if raw.strip() else ""
    except yaml.YAMLError as exc:
        raise OverrideError(f"--set {text!r}: the value is not valid YAML ({exc})") from None
    return keys, value


def apply_overrides(document: Any, overrides: list[str]) -> Any:
    """A copy of `document` with every `--set` applied in order; missing mappings on the way are created."""
    if overrides and not isinstance(document, dict):
        kind = "an empty document" if document is None else f"a YAML {_yaml_kind(document)}"
        raise OverrideError(
            f"--set {overrides[0]!r}: the manifest is {kind}, not a mapping; --set edits an RLJob manifest, "
            "a mapping with apiVersion, kind, metadata and spec"
        )
    result = copy.deepcopy(document)
    for text in overrides:
        keys, value = parse_override(text)
        node: Any = result
        for depth, key in enumerate(keys[:-1]):
            child = node.get(key)
            if child is None:
                child = node[key] = {}
            elif not isinstance(child, dict):
                where = ".".join(keys[: depth + 1])
                raise OverrideError(f"--set {text!r}: {where} is a {type(child).__name__}, not a mapping")
            node = child
        node[keys[-1]] = value
    return result


def overrides_edit(overrides: list[str]) -> Edit | None:
    """The `--set` arguments as an edit of each manifest document (see `rljob.api.loading.load_jobs`)."""
    if not overrides:
        return None

    def edit(document: Any) -> Any:
        try:
            return apply_overrides(document, overrides)
        except OverrideError as exc:
            raise InvalidRLJob([Problem("", str(exc))]) from None

    return edit
