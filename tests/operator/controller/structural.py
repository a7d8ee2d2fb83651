"""What a real API server does with a custom resource whose CRD has a structural schema, for the emulator.

In the order kube-apiserver applies them on create and update (and to `/status` writes for `status`):

1. pruning: fields the schema does not declare are dropped (unless `x-kubernetes-preserve-unknown-fields`);
   `metadata` is ObjectMeta, not pruned by the CRD schema;
2. defaulting: a missing field with a `default` gets it, wherever its parent object exists;
3. validation: types, `required`, `enum`, bounds, lengths, patterns; every violation becomes one
   `details.causes[]` entry of a 422 `Invalid` Status (`field`, `reason`, `message`), in the server's words.

CEL rules (`x-kubernetes-validations`) are not evaluated here: the operator's own validation covers them.
The behaviours are checked against transcribed server responses in `recorded/` (test_recorded_behaviour.py).
"""

from __future__ import annotations

import copy
import json
import re
from typing import Any

Schema = dict[str, Any]
Cause = dict[str, str]

_GO_TYPES = {"integer": "integer", "number": "number", "string": "string", "boolean": "boolean"}


def _render(value: Any) -> str:
    """A value as the server quotes it in messages: strings in double quotes, numbers bare."""
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    if isinstance(value, (dict, list)):
        return json.dumps(value)
    return str(value)


def _type_name(value: Any) -> str:
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    if isinstance(value, dict):
        return "object"
    return "null"


def _type_ok(value: Any, kind: str) -> bool:
    if kind == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind == "string":
        return isinstance(value, str)
    if kind == "boolean":
        return isinstance(value, bool)
    if kind == "array":
        return isinstance(value, list)
    if kind == "object":
        return isinstance(value, dict)
    return True


def prune_and_default(value: Any, schema: Schema) -> Any:
    """Steps 1 and 2 on a copy of `value`."""
    if isinstance(value, dict) and (schema.get("type") == "object" or "properties" in schema):
        properties: dict[str, Schema] = schema.get("properties") or {}
        extra = schema.get("additionalProperties")
        keep_unknown = schema.get("x-kubernetes-preserve-unknown-fields") or extra is True
        result: dict[str, Any] = {}
        for key, item in value.items():
            if key in properties:
                result[key] = prune_and_default(item, properties[key])
            elif isinstance(extra, dict):
                result[key] = prune_and_default(item, extra)
            elif keep_unknown:
                result[key] = copy.deepcopy(item)
        for key, sub in properties.items():
            if key not in result and "default" in sub:
                result[key] = prune_and_default(copy.deepcopy(sub["default"]), sub)
        return result
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        return [prune_and_default(item, schema["items"]) for item in value]
    return copy.deepcopy(value)


def validate(value: Any, schema: Schema, path: str) -> list[Cause]:
    """Step 3: the causes the server would list, for `value` at field path `path`."""
    if value is None:
        if schema.get("nullable"):
            return []
        return [
            _cause(
                path,
                "FieldValueTypeInvalid",
                f'Invalid value: "null": {path} in body must be of type {schema.get("type", "object")}: "null"',
            )
        ]
    if schema.get("x-kubernetes-int-or-string"):
        if _type_ok(value, "integer") or _type_ok(value, "string"):
            return []
        return [
            _cause(
                path,
                "FieldValueTypeInvalid",
                f"Invalid value: {_render(value)}: {path} in body must be "
                f"of type integer or string: {json.dumps(_type_name(value))}",
            )
        ]
    kind = schema.get("type")
    if kind and not _type_ok(value, kind):
        return [
            _cause(
                path,
                "FieldValueTypeInvalid",
                f"Invalid value: {json.dumps(_type_name(value))}: {path} in body must be of type {kind}: "
                f"{json.dumps(_type_name(value))}",
            )
        ]
    causes: list[Cause] = []
    if "enum" in schema and value not in schema["enum"]:
        supported = ", ".join(_render(v) for v in schema["enum"])
        causes.append(
            _cause(
                path, "FieldValueNotSupported", f"Unsupported value: {_render(value)}: supported values: {supported}"
            )
        )
    if _type_ok(value, "number"):
        causes += _bounds(value, schema, path)
    if isinstance(value, str):
        if "minLength" in schema and len(value) < schema["minLength"]:
            causes.append(_invalid(path, value, f"should be at least {schema['minLength']} chars long"))
        if "pattern" in schema and not re.search(schema["pattern"], value):
            causes.append(_invalid(path, value, f"should match '{schema['pattern']}'"))
    if isinstance(value, list):
        if "minItems" in schema and len(value) < schema["minItems"]:
            causes.append(
                _cause(
                    path,
                    "FieldValueInvalid",
                    f"Invalid value: {len(value)}: {path} in body should have at least {schema['minItems']} items",
                )
            )
        if "maxItems" in schema and len(value) > schema["maxItems"]:
            causes.append(
                _cause(path, "TooMany", f"Too many: {len(value)}: must have at most {schema['maxItems']} items")
            )
        for index, item in enumerate(value):
            causes += validate(item, schema.get("items") or {}, f"{path}[{index}]")
    if isinstance(value, dict):
        properties: dict[str, Schema] = schema.get("properties") or {}
        for key in schema.get("required") or []:
            if key not in value:
                causes.append(_cause(f"{path}.{key}" if path else key, "FieldValueRequired", "Required value"))
        extra = schema.get("additionalProperties")
        for key, item in value.items():
            sub = properties.get(key) or (extra if isinstance(extra, dict) else None)
            if sub is not None:
                causes += validate(item, sub, f"{path}.{key}" if path else key)
    return causes


def _bounds(value: float, schema: Schema, path: str) -> list[Cause]:
    causes = []
    if "minimum" in schema:
        low = schema["minimum"]
        if schema.get("exclusiveMinimum") and value <= low:
            causes.append(_invalid(path, value, f"should be greater than {_render(low)}"))
        elif value < low:
            causes.append(_invalid(path, value, f"should be greater than or equal to {_render(low)}"))
    if "maximum" in schema:
        high = schema["maximum"]
        if schema.get("exclusiveMaximum") and value >= high:
            causes.append(_invalid(path, value, f"should be less than {_render(high)}"))
        elif value > high:
            causes.append(_invalid(path, value, f"should be less than or equal to {_render(high)}"))
    return causes


def _invalid(path: str, value: Any, rule: str) -> Cause:
    return _cause(path, "FieldValueInvalid", f"Invalid value: {_render(value)}: {path} in body {rule}")


def _cause(path: str, reason: str, message: str) -> Cause:
    return {"reason": reason, "message": message, "field": path}


def invalid_status(kind: str, group: str, name: str, causes: list[Cause]) -> dict[str, Any]:
    """The 422 Status body kube-apiserver answers for an object that fails its schema."""
    parts = [f"{c['field']}: {c['message']}" for c in causes]
    detail = parts[0] if len(parts) == 1 else "[" + ", ".join(parts) + "]"
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": f'{kind}.{group} "{name}" is invalid: {detail}',
        "reason": "Invalid",
        "details": {"name": name, "group": group, "kind": kind, "causes": causes},
        "code": 422,
    }


def apply_schema(raw: dict[str, Any], schema: Schema, parts: tuple[str, ...]) -> tuple[dict[str, Any], list[Cause]]:
    """Prune, default and validate the top-level `parts` of an object (spec on writes, status on /status)."""
    result = dict(raw)
    causes: list[Cause] = []
    properties = schema.get("properties") or {}
    for part in parts:
        if part in result and part in properties:
            result[part] = prune_and_default(result[part], properties[part])
            causes += validate(result[part], properties[part], part)
    for key in [k for k in result if k not in properties and k not in ("apiVersion", "kind", "metadata")]:
        del result[key]  # unknown top-level fields are pruned too
    return result, causes
