"""Where a role's pods run: GPU product affinity merged into the user's affinity, GPU tolerations."""

from __future__ import annotations

import copy
from typing import Any

from rljob.api import Problem, RoleName
from rljob.api.spec import RoleSpec

GPU_RESOURCE = "nvidia.com/gpu"
GPU_PRODUCT_LABEL = "nvidia.com/gpu.product"
"""Node label set by NVIDIA GPU feature discovery, e.g. `NVIDIA-H100-80GB-HBM3`."""
GPU_TOLERATION: dict[str, str] = {"key": GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"}
"""GPU node pools are commonly tainted `nvidia.com/gpu:NoSchedule` so CPU pods stay off them."""


class PlacementProblem(Exception):
    """A placement the builders cannot express; carries the problem for InvalidRLJob."""

    def __init__(self, problem: Problem) -> None:
        super().__init__(problem.message)
        self.problem = problem


def role_affinity(role: RoleName, spec: RoleSpec) -> dict[str, Any] | None:
    """The user's affinity with, when `gpuProduct` is set, a required node term on the product label.

    Required node selector terms are ORed, so the product requirement is added to every term (AND within
    a term); with no terms, it becomes the only one.
    """
    placement = spec.placement
    affinity: dict[str, Any] = (
        copy.deepcopy(placement.affinity.model_dump(mode="json", by_alias=True, exclude_none=True))
        if placement.affinity
        else {}
    )
    if placement.gpu_product and spec.gpus_per_replica > 0:
        base = f"spec.roles.{role}.placement.affinity.nodeAffinity"
        node = _mapping(affinity.setdefault("nodeAffinity", {}), base)
        base += ".requiredDuringSchedulingIgnoredDuringExecution"
        required = _mapping(node.setdefault("requiredDuringSchedulingIgnoredDuringExecution", {}), base)
        terms = _list(required.setdefault("nodeSelectorTerms", []), f"{base}.nodeSelectorTerms")
        if not terms:
            terms.append({})
        product = {"key": GPU_PRODUCT_LABEL, "operator": "In", "values": [placement.gpu_product]}
        for i, term in enumerate(terms):
            path = f"{base}.nodeSelectorTerms[{i}]"
            expressions = _list(_mapping(term, path).setdefault("matchExpressions", []), f"{path}.matchExpressions")
            expressions.append(dict(product, values=list(product["values"])))
    return affinity or None


def _mapping(value: Any, path: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise PlacementProblem(Problem(path, f"must be a mapping, as in a Pod's affinity (got {type(value).__name__})"))
    return value


def _list(value: Any, path: str) -> list[Any]:
    if not isinstance(value, list):
        raise PlacementProblem(Problem(path, f"must be a list, as in a Pod's affinity (got {type(value).__name__})"))
    return value


def role_tolerations(spec: RoleSpec) -> list[dict[str, Any]]:
    """The user's tolerations, plus the GPU taint's toleration for GPU pods unless one already covers it."""
    tolerations = [t.model_dump(mode="json", by_alias=True, exclude_none=True) for t in spec.placement.tolerations]
    if spec.gpus_per_replica > 0 and not any(_tolerates_gpu_taint(t) for t in tolerations):
        tolerations.append(dict(GPU_TOLERATION))
    return tolerations


def _tolerates_gpu_taint(toleration: dict[str, Any]) -> bool:
    """True when the toleration matches any `nvidia.com/gpu` NoSchedule taint, whatever its value."""
    if toleration.get("effect") not in (None, "NoSchedule") or toleration.get("operator") != "Exists":
        return False
    return toleration.get("key") in (None, GPU_RESOURCE)
