"""The generated CRD: committed copies match the model, it is a valid structural v1 CRD, and it
accepts and rejects the same manifests as `rljob validate`."""

from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from rljob.api.crd import build_crd, crd_yaml
from tests.conftest import EXAMPLES, REPO
from tests.k8s_schema import apply_defaults, openapi_errors

COMMITTED = [
    REPO / "crds" / "rljob.io_rljobs.yaml",
    REPO / "charts" / "rljob-operator" / "crds" / "rljob.io_rljobs.yaml",
]


def schema() -> dict[str, Any]:
    return build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


@pytest.mark.parametrize("path", COMMITTED, ids=["crds", "chart"])
def test_committed_crd_matches_the_model(path: Path):
    assert path.read_text() == crd_yaml(), f"{path} drifted from rljob/api: run `make crds`"


def test_crd_validates_against_the_apiextensions_v1_schema():
    kubernetes_validate.validate(yaml.safe_load(crd_yaml()), "1.33", strict=True)


def test_crd_names_subresources_and_printer_columns():
    spec = build_crd()["spec"]
    assert spec["group"] == "rljob.io"
    assert spec["names"]["plural"] == "rljobs"
    assert spec["names"]["shortNames"] == ["rlj"]
    version = spec["versions"][0]
    assert version["name"] == "v1alpha1"
    assert version["subresources"]["status"] == {}
    assert version["subresources"]["scale"]["specReplicasPath"] == ".spec.roles.rollout.replicas"
    columns = [c["name"] for c in version["additionalPrinterColumns"] if not c.get("priority")]
    assert columns == ["Phase", "Step", "Reward", "Restarts", "Stalled", "Health", "Age"]


def _nodes(node: dict[str, Any], path: str = "") -> list[tuple[str, dict[str, Any]]]:
    found = [(path, node)]
    for name, child in node.get("properties", {}).items():
        found += _nodes(child, f"{path}.{name}")
    if isinstance(node.get("additionalProperties"), dict):
        found += _nodes(node["additionalProperties"], f"{path}.*")
    if "items" in node:
        found += _nodes(node["items"], f"{path}[]")
    return found


def test_schema_is_structural():
    """The rules the API server enforces for structural schemas (apiextensions.k8s.io/v1)."""
    for path, node in _nodes(schema()):
        where = path or "<root>"
        int_or_string = node.get("x-kubernetes-int-or-string") is True
        assert "type" in node or int_or_string, f"{where}: no type"
        assert "$ref" not in node and "$defs" not in node and "title" not in node, where
        assert "oneOf" not in node and "allOf" not in node and "not" not in node, where
        if "anyOf" in node:
            assert int_or_string and "type" not in node, f"{where}: anyOf only for int-or-string"
        assert not ("properties" in node and "additionalProperties" in node), f"{where}: both properties kinds"
        assert node.get("additionalProperties") is not False, where
        if node.get("type") == "array":
            assert "items" in node, f"{where}: array without items"
        if node.get("type") == "object" and "properties" not in node and "additionalProperties" not in node:
            assert node.get("x-kubernetes-preserve-unknown-fields") or path == ".metadata", f"{where}: empty object"
        for bound in ("exclusiveMinimum", "exclusiveMaximum"):
            assert isinstance(node.get(bound, True), bool), f"{where}: {bound} must be boolean in OpenAPI v3.0"
        if "enum" in node:
            assert node["enum"] and all(isinstance(v, str) for v in node["enum"]), where
        for key in node:
            assert key in ALLOWED_KEYS, f"{where}: {key} is not an OpenAPI v3 schema keyword"


ALLOWED_KEYS = {
    "type", "properties", "additionalProperties", "items", "required", "description", "default", "enum",
    "nullable", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "minLength", "maxLength",
    "pattern", "minItems", "maxItems", "anyOf", "format",
    "x-kubernetes-validations", "x-kubernetes-int-or-string", "x-kubernetes-preserve-unknown-fields",
}  # fmt: skip


def test_defaults_are_valid_values_of_their_own_schema():
    for path, node in _nodes(schema()):
        if "default" in node:
            assert not openapi_errors(node, node["default"]), f"{path}: default {node['default']!r} is invalid"


def test_schema_carries_bounds_enums_and_defaults_over_from_the_model():
    spec = schema()["properties"]["spec"]["properties"]
    replicas = spec["roles"]["properties"]["actor"]["properties"]["replicas"]
    assert (replicas["type"], replicas["minimum"], replicas["default"]) == ("integer", 1, 1)
    assert spec["algorithm"]["properties"]["name"]["enum"][0] == "ppo"
    assert spec["algorithm"]["required"] == ["name"]
    top_p = spec["rollout"]["properties"]["topP"]
    assert (top_p["minimum"], top_p["exclusiveMinimum"], top_p["maximum"]) == (0.0, True, 1.0)
    assert spec["rollout"]["properties"]["async"]["properties"]["maxStaleness"]["default"] == 0


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_examples_are_accepted_by_the_crd_schema(path: Path):
    manifest = yaml.safe_load(path.read_text())
    assert openapi_errors(schema(), apply_defaults(schema(), manifest)) == []


@pytest.mark.parametrize(
    ("mutation", "field"),
    [
        ({"roles": {"actor": {"replicas": 0}}}, "spec.roles.actor.replicas"),
        ({"rollout": {"topP": 1.5}}, "spec.rollout.topP"),
        ({"algorithm": {"name": "grop"}}, "spec.algorithm.name"),
        ({"roles": {"rollout": {"replicas": "2"}}}, "spec.roles.rollout.replicas"),
        ({"roles": {"env": {"gpusPerReplica": -1}}}, "spec.roles.env.gpusPerReplica"),
    ],
)
def test_crd_schema_rejects_what_validate_rejects(mutation: dict[str, Any], field: str):
    manifest = yaml.safe_load((REPO / "examples" / "cartpole-ppo.yaml").read_text())
    _merge(manifest["spec"], mutation)
    errors = openapi_errors(schema(), apply_defaults(schema(), manifest))
    assert any(e.startswith(field) for e in errors), errors


def _merge(target: dict[str, Any], patch: dict[str, Any]) -> None:
    for key, value in patch.items():
        if isinstance(value, dict) and isinstance(target.get(key), dict):
            _merge(target[key], value)
        else:
            target[key] = value
