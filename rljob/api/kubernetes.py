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
    """The taint key matched; every key when empty with operator Exists."""
    operator: Literal["Exists", "Equal"] | None = None
    """`Equal` (Kubernetes' default) matches `value`; `Exists` any value."""
    value: str | None = None
    """The taint value matched with operator Equal."""
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None
    """The taint effect matched; every effect when unset."""
    toleration_seconds: int | None = None
    """With NoExecute: how long the pod stays bound after the taint appears."""


class EnvVar(SpecModel):
    """An environment variable for the role's container."""

    name: str = Field(min_length=1)
    """The variable's name."""
    value: str | None = None
    """Its value; or take it from `valueFrom`."""
    value_from: FreeForm | None = None
    """`secretKeyRef`, `configMapKeyRef`, `fieldRef` or `resourceFieldRef`, as in a Pod."""


class VolumeMount(SpecModel):
    """Where a volume appears in the role's container."""

    name: str = Field(min_length=1)
    """The name of a volume in `volumes`."""
    mount_path: str = Field(min_length=1)
    """Path in the container where the volume appears."""
    read_only: bool | None = None
    """Mount it read-only."""
    sub_path: str | None = None
    """A path inside the volume to mount instead of its root."""
    sub_path_expr: str | None = None
    """Like subPath, with `$(VAR)` expanded from the container's environment."""
    mount_propagation: Literal["None", "HostToContainer", "Bidirectional"] | None = None
    """How mounts propagate between the host and the container."""


class Volume(SpecModel):
    """A pod volume: a name and exactly one volume source, as in a Pod's `volumes`."""

    name: str = Field(min_length=1)
    """The name `volumeMounts` refer to."""
    persistent_volume_claim: FreeForm | None = None
    """A PersistentVolumeClaim (`claimName`, `readOnly`)."""
    config_map: FreeForm | None = None
    """A ConfigMap's keys as files."""
    secret: FreeForm | None = None
    """A Secret's keys as files."""
    empty_dir: FreeForm | None = None
    """A scratch directory that lives as long as the pod."""
    host_path: FreeForm | None = None
    """A directory of the node."""
    nfs: FreeForm | None = None
    """An NFS export."""
    csi: FreeForm | None = None
    """A volume of a CSI driver."""
    ephemeral: FreeForm | None = None
    """A generic ephemeral volume: a claim created and deleted with the pod."""
    projected: FreeForm | None = None
    """Several sources (Secrets, ConfigMaps, service account tokens) in one directory."""
    downward_api: FreeForm | None = Field(default=None, alias="downwardAPI")
    """Pod fields (labels, annotations, resources) as files."""
    image: FreeForm | None = None
    """The contents of an OCI image (Kubernetes 1.31 and newer)."""


class Affinity(SpecModel):
    """Pod scheduling constraints, as in a Pod's `affinity`."""

    node_affinity: FreeForm | None = None
    """Rules on node labels; `placement.gpuProduct` is added to every node selector term."""
    pod_affinity: FreeForm | None = None
    """Rules to run near pods with given labels."""
    pod_anti_affinity: FreeForm | None = None
    """Rules to run away from pods with given labels."""


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
