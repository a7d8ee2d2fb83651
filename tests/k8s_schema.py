"""What a real API server does with a CRD's schema, reproduced for tests: defaulting, OpenAPI
validation and CEL `x-kubernetes-validations`, so that the generated CRD is exercised, not just read.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

import celpy
import jsonschema

Schema = dict[str, Any]


def apply_defaults(schema: Schema, obj: Any) -> Any:
    """Structural defaulting as the API server applies it: missing properties get their defaults,
    then defaulting recurses into objects, maps and arrays."""
    if isinstance(obj, dict):
        obj = dict(obj)
        for name, child in schema.get("properties", {}).items():
            if name not in obj and "default" in child:
                obj[name] = copy.deepcopy(child["default"])
            if name in obj:
                obj[name] = apply_defaults(child, obj[name])
        extra = schema.get("additionalProperties")
        if isinstance(extra, dict):
            for key in obj:
                if key not in schema.get("properties", {}):
                    obj[key] = apply_defaults(extra, obj[key])
        return obj
    if isinstance(obj, list) and "items" in schema:
        return [apply_defaults(schema["items"], item) for item in obj]
    return obj


def _to_jsonschema(node: Any) -> Any:
    """OpenAPI v3.0 (nullable, x- extensions) to JSON Schema draft 4, which shares boolean exclusive bounds."""
    if isinstance(node, list):
        return [_to_jsonschema(n) for n in node]
    if not isinstance(node, dict):
        return node
    out = {k: _to_jsonschema(v) for k, v in node.items() if not k.startswith("x-kubernetes-")}
    if "properties" in node:
        out["properties"] = {k: _to_jsonschema(v) for k, v in node["properties"].items()}
    if node.get("nullable"):
        out.pop("nullable")
        if "type" in out:
            out["type"] = [out["type"], "null"]
        if "enum" in out:
            out["enum"] = [*out["enum"], None]
    return out


def openapi_errors(schema: Schema, obj: Any) -> list[str]:
    validator = jsonschema.Draft4Validator(_to_jsonschema(schema))
    return [f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(obj)]


def _rules(schema: Schema, obj: Any, path: str) -> Iterator[tuple[str, dict[str, str], Any]]:
    for rule in schema.get("x-kubernetes-validations", []):
        yield path, rule, obj
    if isinstance(obj, dict):
        for name, child in schema.get("properties", {}).items():
            if name in obj and obj[name] is not None:
                yield from _rules(child, obj[name], f"{path}.{name}" if path else name)
    if isinstance(obj, list) and "items" in schema:
        for i, item in enumerate(obj):
            yield from _rules(schema["items"], item, f"{path}[{i}]")


def all_rules(schema: Schema, path: str = "") -> Iterator[tuple[str, str]]:
    """Every (schema path, rule) in the schema."""
    for rule in schema.get("x-kubernetes-validations", []):
        yield path, rule["rule"]
    for name, child in schema.get("properties", {}).items():
        yield from all_rules(child, f"{path}.{name}" if path else name)
    if "items" in schema:
        yield from all_rules(schema["items"], f"{path}[]")


_ENV = celpy.Environment()


def cel_violations(schema: Schema, obj: Any) -> list[tuple[str, str, str]]:
    """(object path, rule, message) of every CEL rule that does not hold on a defaulted object."""
    failed = []
    for path, rule, value in _rules(schema, obj, ""):
        program = _ENV.program(_ENV.compile(rule["rule"]))
        result = program.evaluate({"self": celpy.json_to_cel(value)})
        if result is not True and result != celpy.celtypes.BoolType(True):
            failed.append((path, rule["rule"], rule["message"]))
    return failed
