"""Every Kubernetes API call the operator makes, declared once.

The Helm chart's RBAC rules are checked against this list by `tests/operator/test_chart.py`: the
chart grants exactly these (group, resource, verbs), no wildcards. Code that starts calling a new
resource or verb adds it here, with the reason, and the chart follows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Scope = Literal["namespaced", "cluster"]


@dataclass(frozen=True)
class ApiAccess:
    group: str
    """API group; "" is the core group."""
    resource: str
    """Plural resource name, with `/subresource` where one is used."""
    verbs: tuple[str, ...]
    scope: Scope
    why: str
    peering_only: bool = False
    """Needed only when kopf peering (a hot standby) is enabled."""


OPERATOR_API_ACCESS: tuple[ApiAccess, ...] = (
    ApiAccess(
        "rljob.io",
        "rljobs",
        ("list", "watch", "delete"),
        "namespaced",
        "kopf watches jobs (event handlers: no finalizers, no annotations); ttlSecondsAfterFinished deletes",
    ),
    ApiAccess("rljob.io", "rljobs/status", ("patch",), "namespaced", "phase, conditions, counts, progress"),
    ApiAccess(
        "rljob.io",
        "rljobs/scale",
        ("patch",),
        "namespaced",
        "spec.roles.rollout.autoscale: the rollout count, written as `kubectl scale` does",
    ),
    ApiAccess(
        "rljob.io",
        "rljobs/finalizers",
        ("update",),
        "namespaced",
        "children's ownerReferences set blockOwnerDeletion (OwnerReferencesPermissionEnforcement)",
    ),
    ApiAccess(
        "",
        "pods",
        ("list", "watch", "create", "delete"),
        "namespaced",
        "kopf indexes job pods; one pod per role replica, deleted to be replaced or when the job ends",
    ),
    ApiAccess("", "services", ("get", "create"), "namespaced", "headless service for DNS, created if absent"),
    ApiAccess(
        "",
        "configmaps",
        ("get", "create", "patch"),
        "namespaced",
        "resolved job config, created if absent, read back and patched when the spec changes; llm rollout "
        "membership, patched as rollouts become Ready or are scaled away",
    ),
    ApiAccess("", "events", ("create",), "namespaced", "an Event on every transition"),
    ApiAccess(
        "",
        "secrets",
        ("get", "create"),
        "namespaced",
        "the job's transport key, created once if absent; read back only to see whether this job owns it",
    ),
    ApiAccess(
        "",
        "resourcequotas",
        ("list", "watch"),
        "namespaced",
        "quota-aware admission: a job's pods are created only when all fit; a job waiting for quota looks again "
        "when a quota or its usage changes",
    ),
    ApiAccess(
        "", "limitranges", ("list",), "namespaced", "quota-aware admission: the defaults LimitRanger gives containers"
    ),
    ApiAccess(
        "scheduling.volcano.sh",
        "podgroups",
        ("get", "create", "patch"),
        "namespaced",
        "gang: volcano; minMember follows rollout scaling",
    ),
    ApiAccess(
        "scheduling.x-k8s.io",
        "podgroups",
        ("get", "create", "patch"),
        "namespaced",
        "gang: scheduler-plugins; minMember follows rollout scaling",
    ),
    ApiAccess(
        "networking.k8s.io",
        "networkpolicies",
        ("get", "create", "patch", "delete"),
        "namespaced",
        "reward pods running sandboxed code without network may send DNS only: created if absent, patched or "
        "deleted when a spec edit changes what the job needs",
    ),
    ApiAccess(
        "",
        "persistentvolumeclaims",
        ("get", "create"),
        "namespaced",
        "the job's checkpoint claim, created if absent (checkpoints outlive the actor pod); read back to see it bind",
    ),
    ApiAccess("", "namespaces", ("list", "watch"), "cluster", "kopf follows namespaces matching --namespace globs"),
    ApiAccess(
        "storage.k8s.io",
        "storageclasses",
        ("list",),
        "cluster",
        "a checkpoint claim that names no StorageClass binds only where the cluster has a default one: say so",
    ),
    ApiAccess(
        "apiextensions.k8s.io",
        "customresourcedefinitions",
        ("list", "watch"),
        "cluster",
        "kopf notices the RLJob CRD being installed or removed while it runs",
    ),
    ApiAccess(
        "kopf.dev",
        "clusterkopfpeerings",
        ("get", "list", "watch", "patch"),
        "cluster",
        "peering of an all-namespaces operator with its standby",
        peering_only=True,
    ),
    ApiAccess(
        "kopf.dev",
        "kopfpeerings",
        ("get", "list", "watch", "patch"),
        "namespaced",
        "peering of a namespaced operator with its standby",
        peering_only=True,
    ),
)


def required_access(*, peering: bool) -> list[ApiAccess]:
    """The calls an operator makes, with or without peering."""
    return [a for a in OPERATOR_API_ACCESS if peering or not a.peering_only]
