"""Fixtures for the operator's pure builders: example jobs, settings, and manifest validation.

Core kinds validate against the real Kubernetes 1.33 JSON schemas shipped by `kubernetes-validate`
(strict: unknown fields fail). PodGroups are custom resources that package does not ship; they are
checked against the spec fields of the upstream CRDs (Volcano `scheduling.volcano.sh/v1beta1`,
scheduler-plugins `scheduling.x-k8s.io/v1alpha1`), transcribed below with unknown fields forbidden
(the API server would silently prune them, hiding a typo), and their metadata against the real
ObjectMeta schema.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from rljob.api import RLJob, validate_job
from rljob.operator.settings import OperatorSettings

KUBERNETES_VERSION = "1.33"
EXAMPLES = sorted((Path(__file__).parents[2] / "examples").glob("*.yaml"))

_INT32 = {"type": "integer", "minimum": 0, "maximum": 2**31 - 1}
_QUANTITIES = {"type": "object", "additionalProperties": {"type": ["integer", "string"]}}
PODGROUP_SPEC_SCHEMAS: dict[str, dict[str, Any]] = {
    "scheduling.volcano.sh/v1beta1": {
        "type": "object",
        "additionalProperties": False,
        "required": ["minMember"],
        "properties": {
            "minMember": _INT32,
            "minResources": _QUANTITIES,
            "minTaskMember": {"type": "object", "additionalProperties": _INT32},
            "priorityClassName": {"type": "string"},
            "queue": {"type": "string"},
            "preemptable": {"type": "boolean"},
            "networkTopology": {"type": "object"},
        },
    },
    "scheduling.x-k8s.io/v1alpha1": {
        "type": "object",
        "additionalProperties": False,
        "required": ["minMember"],
        "properties": {
            "minMember": _INT32,
            "minResources": _QUANTITIES,
            "scheduleTimeoutSeconds": _INT32,
        },
    },
}

DNS1123_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")


def check_manifest(manifest: dict[str, Any]) -> None:
    """Raise when the manifest would be rejected by a real API server (schema, names, label values)."""
    metadata = manifest["metadata"]
    assert DNS1123_LABEL.match(metadata["name"]) and len(metadata["name"]) <= 63, metadata["name"]
    for key, value in metadata.get("labels", {}).items():
        assert LABEL_VALUE.match(value) and len(value) <= 63, f"label {key}={value!r}"
    if manifest["kind"] == "PodGroup":
        schema = PODGROUP_SPEC_SCHEMAS[manifest["apiVersion"]]
        assert set(manifest) == {"apiVersion", "kind", "metadata", "spec"}
        jsonschema.validate(manifest["spec"], schema)
        holder = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": metadata}
        kubernetes_validate.validate(holder, KUBERNETES_VERSION, strict=True)
        return
    kubernetes_validate.validate(copy.deepcopy(manifest), KUBERNETES_VERSION, strict=True)
    if manifest["kind"] == "Pod":
        spec = manifest["spec"]
        assert DNS1123_LABEL.match(spec["hostname"]) and len(spec["hostname"]) <= 63
        assert DNS1123_LABEL.match(spec["subdomain"]) and len(spec["subdomain"]) <= 63
        for container in spec["containers"]:
            names = [p["name"] for p in container["ports"]]
            assert len(names) == len(set(names)) and all(len(n) <= 15 for n in names)
            mounts = [m["mountPath"] for m in container["volumeMounts"]]
            assert len(mounts) == len(set(mounts)), mounts
        volumes = [v["name"] for v in spec["volumes"]]
        assert len(volumes) == len(set(volumes)), volumes


@pytest.fixture(scope="session")
def validate_manifest() -> Callable[[dict[str, Any]], None]:
    return check_manifest


@pytest.fixture(scope="session")
def settings() -> OperatorSettings:
    return OperatorSettings()


@pytest.fixture(scope="session")
def example_documents() -> dict[str, dict[str, Any]]:
    """Each example manifest as a plain dict (copy before changing it), by file stem.

    CartPole gets two env replicas whatever the example is tuned to, so that per-replica behaviour
    of a non-actor role stays visible in these tests.
    """
    documents = {path.stem: yaml.safe_load(path.read_text()) for path in EXAMPLES}
    documents["cartpole-ppo"]["spec"]["roles"]["env"]["replicas"] = 2
    return documents


@pytest.fixture
def job_from() -> Callable[..., RLJob]:
    """`job_from(document, **changes)`: a resolved job from an example dict with dotted-path changes."""

    def make(document: dict[str, Any], **changes: Any) -> RLJob:
        data = copy.deepcopy(document)
        for dotted, value in changes.items():
            node = data
            *parents, last = dotted.split("__")
            for key in parents:
                node = node.setdefault(key, {})
            node[last] = value
        return validate_job(data)

    return make
