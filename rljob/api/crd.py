"""The RLJob CustomResourceDefinition, generated from the pydantic models (never written by hand).

Pydantic emits JSON Schema (draft 2020-12); Kubernetes wants a *structural* OpenAPI v3 schema:
every node typed, no `$ref`, `nullable` instead of `anyOf [..., null]`, boolean exclusive bounds,
no `additionalProperties: false` next to `properties`. This module does that translation.
"""

from __future__ import annotations

import copy
from typing import Any

import yaml

from rljob.api.job import GROUP, KIND, MAX_NAME_LENGTH, PLURAL, SHORT_NAMES, SINGULAR, VERSION, RLJob

Schema = dict[str, Any]

PRINTER_COLUMNS: list[dict[str, Any]] = [
    {"name": "Phase", "type": "string", "jsonPath": ".status.phase"},
    {"name": "Step", "type": "integer", "jsonPath": ".status.progress.step"},
    {"name": "Reward", "type": "number", "jsonPath": ".status.progress.rewardMean"},
    {"name": "Restarts", "type": "integer", "jsonPath": ".status.restarts"},
    {"name": "Stalled", "type": "string", "jsonPath": '.status.conditions[?(@.type=="Stalled")].status'},
    {"name": "Health", "type": "string", "jsonPath": ".status.health"},
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
    {"name": "Accuracy", "type": "number", "jsonPath": ".status.progress.accuracy", "priority": 1},
    {"name": "Total", "type": "integer", "jsonPath": ".status.progress.totalSteps", "priority": 1},
    {"name": "Actors", "type": "integer", "jsonPath": ".status.roles.actor.ready", "priority": 1},
    {"name": "Rollouts", "type": "integer", "jsonPath": ".status.roles.rollout.ready", "priority": 1},
]

ROOT_RULES: list[dict[str, str]] = [
    {
        "rule": f"self.metadata.name.size() <= {MAX_NAME_LENGTH}",
        "message": f"metadata.name must be at most {MAX_NAME_LENGTH} characters so pod names fit in 63",
    },
]
# The DNS-1123 *label* rule on the name (stricter than the server's subdomain rule) is checked by
# `rljob validate` and the operator (InvalidSpec): a regex in CEL would cost more than the budget allows.

_DROP_KEYS = {"title", "$defs", "discriminator"}


def _resolve(node: Any, defs: dict[str, Schema]) -> Any:
    """Inline every `$ref`, keeping the referring node's own description and default."""
    if isinstance(node, list):
        return [_resolve(item, defs) for item in node]
    if not isinstance(node, dict):
        return node
    if "$ref" in node:
        target = copy.deepcopy(defs[node["$ref"].rsplit("/", 1)[-1]])
        siblings = {k: v for k, v in node.items() if k != "$ref"}
        return _resolve({**target, **siblings}, defs)
    return {k: _resolve(v, defs) for k, v in node.items()}


def _structural(node: Schema) -> Schema:
    """One schema node in Kubernetes' structural dialect (children converted recursively)."""
    if "anyOf" in node and not node.get("x-kubernetes-int-or-string"):
        everything = node.pop("anyOf")
        options = [o for o in everything if o.get("type") != "null"]
        if len(options) < len(everything):
            node["nullable"] = True
        if len(options) != 1:
            raise ValueError(f"cannot express a union of {options} in a structural schema")
        node = {**options[0], **node}
        if node.get("default", 0) is None:
            del node["default"]
    node = {k: v for k, v in node.items() if k not in _DROP_KEYS}
    if "const" in node:
        node["enum"] = [node.pop("const")]
    for bound, key in (("exclusiveMinimum", "minimum"), ("exclusiveMaximum", "maximum")):
        if isinstance(node.get(bound), int | float) and not isinstance(node.get(bound), bool):
            node[key] = node[bound]
            node[bound] = True
    if node.get("additionalProperties") is False:
        del node["additionalProperties"]
    if "properties" in node:
        node["properties"] = {name: _property(child) for name, child in node["properties"].items()}
        if not node.get("required"):
            node.pop("required", None)
    if isinstance(node.get("additionalProperties"), dict):
        node["additionalProperties"] = _structural(node["additionalProperties"])
    if "items" in node:
        node["items"] = _structural(node["items"])
    if "properties" in node or "additionalProperties" in node:
        node.setdefault("type", "object")
    return node


def _property(raw: Schema) -> Schema:
    defaults_to_null = "default" in raw and raw["default"] is None
    node = _structural(raw)
    # Sections whose fields all have defaults are defaulted to {} so the API server fills them in,
    # unless the section's absence means something (a None default in the model).
    is_section = node.get("type") == "object" and "properties" in node and not node.get("required")
    if is_section and "default" not in node and not defaults_to_null:
        node["default"] = {}
    if is_section and not defaults_to_null:
        node.pop("nullable", None)
    return node


def openapi_schema() -> Schema:
    """The structural openAPIV3Schema of an RLJob."""
    raw = RLJob.model_json_schema(by_alias=True, mode="validation")
    defs = raw.get("$defs", {})
    resolved = _resolve(raw, defs)
    schema = _structural(resolved)
    schema["properties"]["metadata"] = {"type": "object"}
    schema["properties"]["apiVersion"] = {"type": "string"}
    schema["properties"]["kind"] = {"type": "string"}
    schema["required"] = ["spec"]
    schema["x-kubernetes-validations"] = ROOT_RULES
    return schema


def build_crd() -> Schema:
    """The full apiextensions.k8s.io/v1 CustomResourceDefinition for RLJob."""
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {
            "name": f"{PLURAL}.{GROUP}",
            "labels": {"app.kubernetes.io/name": "rljob", "app.kubernetes.io/component": "crd"},
        },
        "spec": {
            "group": GROUP,
            "names": {
                "kind": KIND,
                "listKind": f"{KIND}List",
                "plural": PLURAL,
                "singular": SINGULAR,
                "shortNames": SHORT_NAMES,
            },
            "scope": "Namespaced",
            "versions": [
                {
                    "name": VERSION,
                    "served": True,
                    "storage": True,
                    "subresources": {
                        "status": {},
                        "scale": {
                            "specReplicasPath": ".spec.roles.rollout.replicas",
                            "statusReplicasPath": ".status.roles.rollout.ready",
                            # The HPA (and KEDA, through one) needs the scaled pods' selector.
                            "labelSelectorPath": ".status.rolloutSelector",
                        },
                    },
                    "additionalPrinterColumns": PRINTER_COLUMNS,
                    "schema": {"openAPIV3Schema": openapi_schema()},
                }
            ],
        },
    }


def crd_yaml() -> str:
    header = "# Generated by `rljob crd` from rljob/api. Do not edit: run `make crds`.\n"
    return header + yaml.safe_dump(build_crd(), sort_keys=False, width=100, allow_unicode=True)
