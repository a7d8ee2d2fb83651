"""Kubernetes structures embedded in an RLJob, with the real Kubernetes field names.

Small structures (tolerations, resources, env vars, volume mounts) are modelled field by field.
Deep ones (affinity terms, volume sources, `valueFrom`) keep their known top-level keys and carry
the rest through untouched; the operator validates the pods it builds against the real Kubernetes
schemas, so nothing malformed reaches the API server.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, ConfigDict, Field, WithJsonSchema
from pydantic_core import PydanticCustomError

from rljob.api.base import SpecModel

# The pattern Kubernetes itself publishes for resource.Quantity.
_QUANTITY = re.compile(r"^([+-]?[0-9.]+)([eEinumkKMGTP]*[-+]?[0-9]*)$")


def _check_quantity(value: object) -> int | str:
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise PydanticCustomError(
            "quantity",
            "must be an integer or a quantity string such as '500m', '0.5' or '16Gi' (got {got})",
            {"got": repr(value)},
        )
    if isinstance(value, str) and not _QUANTITY.match(value):
        raise PydanticCustomError(
            "quantity",
            "is not a Kubernetes quantity: write it like '500m', '2', '0.5' or '16Gi' (got {got})",
            {"got": repr(value)},
        )
    return value


Quantity = Annotated[
    int | str,
    BeforeValidator(_check_quantity),
    WithJsonSchema({"anyOf": [{"type": "integer"}, {"type": "string"}], "x-kubernetes-int-or-string": True}),
]

FreeForm = Annotated[
    dict[str, Any],
    WithJsonSchema({"type": "object", "x-kubernetes-preserve-unknown-fields": True}),
]
"""A nested Kubernetes structure passed through as written (validated when manifests are built)."""


class ResourceRequirements(SpecModel):
    """Compute resources per container, as in a Pod's `resources`."""

    limits: dict[str, Quantity] = Field(default_factory=dict)
    """Maximum resources, e.g. `{cpu: '8', memory: 64Gi}`. GPUs come from `gpusPerReplica`."""
    requests: dict[str, Quantity] = Field(default_factory=dict)
    """Resources the scheduler reserves, e.g. `{cpu: '4', memory: 32Gi}`."""


class Toleration(SpecModel):
    """A Kubernetes toleration."""

    key: str | None = None
    operator: Literal["Exists", "Equal"] | None = None
    value: str | None = None
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None
    toleration_seconds: int | None = None


class EnvVar(SpecModel):
    """An environment variable for the role's container."""

    name: str = Field(min_length=1)
    value: str | None = None
    value_from: FreeForm | None = None
    """`secretKeyRef`, `configMapKeyRef`, `fieldRef` or `resourceFieldRef`, as in a Pod."""


class VolumeMount(SpecModel):
    """Where a volume appears in the role's container."""

    name: str = Field(min_length=1)
    mount_path: str = Field(min_length=1)
    read_only: bool | None = None
    sub_path: str | None = None
    sub_path_expr: str | None = None
    mount_propagation: Literal["None", "HostToContainer", "Bidirectional"] | None = None


class Volume(SpecModel):
    """A pod volume: a name and exactly one volume source, as in a Pod's `volumes`."""

    name: str = Field(min_length=1)
    persistent_volume_claim: FreeForm | None = None
    config_map: FreeForm | None = None
    secret: FreeForm | None = None
    empty_dir: FreeForm | None = None
    host_path: FreeForm | None = None
    nfs: FreeForm | None = None
    csi: FreeForm | None = None
    ephemeral: FreeForm | None = None
    projected: FreeForm | None = None
    downward_api: FreeForm | None = Field(default=None, alias="downwardAPI")
    image: FreeForm | None = None


class Affinity(SpecModel):
    """Pod scheduling constraints, as in a Pod's `affinity`."""

    node_affinity: FreeForm | None = None
    pod_affinity: FreeForm | None = None
    pod_anti_affinity: FreeForm | None = None


class ObjectMeta(SpecModel):
    """The subset of Kubernetes ObjectMeta an RLJob uses; server-set fields are accepted as read."""

    model_config = ConfigDict(strict=False)

    name: str
    """The job's name: a DNS-1123 label, at most 47 characters so that pod names fit."""
    namespace: str | None = None
    labels: dict[str, str] | None = None
    annotations: dict[str, str] | None = None
    uid: str | None = None
    resource_version: str | None = None
    generation: int | None = None
    creation_timestamp: str | None = None
    deletion_timestamp: str | None = None
    deletion_grace_period_seconds: int | None = None
    finalizers: list[str] | None = None
    owner_references: list[dict[str, Any]] | None = None
    managed_fields: list[dict[str, Any]] | None = None
    generate_name: str | None = None
    self_link: str | None = None
