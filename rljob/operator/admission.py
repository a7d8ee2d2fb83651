"""Quota-aware admission: whether a set of pods fits the namespace's ResourceQuotas, before any is created. Pure.

The API server admits pods one at a time: with a quota of 2 pods, 2 of a job's 3 pods are created and hold their
nodes (their GPUs) while the third is refused for as long as the job exists: a partial gang. The operator charges
the whole set of pods it is about to create against what each quota has left (`status.hard - status.used`),
after the namespace's LimitRange defaults fill the requests and limits a container leaves out (the LimitRanger
admission plugin does the same before the quota plugin counts), and creates none of them when one does not fit.

What a pod charges follows kube-apiserver's pod quota evaluator: `pods` and `count/pods` 1 each; `requests.X` and
plain `X` (cpu, memory, ephemeral-storage) the sum of its containers' requests, `limits.X` of their limits, each
at least the largest init container's; extended resources (`nvidia.com/gpu`) as `requests.<name>`. Quota scopes
(Terminating, NotTerminating, BestEffort, NotBestEffort, PriorityClass) select which quotas a pod counts against.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from typing import Any

Raw = dict[str, Any]

QUOTA_EXCEEDED = "QuotaExceeded"
"""Ready's reason while the job's pods wait for quota (none of them is created)."""
LIMIT_RANGE_EXCEEDED = "LimitRangeExceeded"
"""Ready's reason while a container's requests or limits break the namespace's LimitRange."""

STANDARD = ("cpu", "memory", "ephemeral-storage")
"""Resources a quota names plainly (`cpu`) or as `requests.cpu` / `limits.cpu`."""

_SUFFIXES = {
    "Ki": Decimal(2**10),
    "Mi": Decimal(2**20),
    "Gi": Decimal(2**30),
    "Ti": Decimal(2**40),
    "Pi": Decimal(2**50),
    "Ei": Decimal(2**60),
    "n": Decimal("1e-9"),
    "u": Decimal("1e-6"),
    "m": Decimal("1e-3"),
    "": Decimal(1),
    "k": Decimal("1e3"),
    "M": Decimal("1e6"),
    "G": Decimal("1e9"),
    "T": Decimal("1e12"),
    "P": Decimal("1e15"),
    "E": Decimal("1e18"),
}
_QUANTITY = re.compile(r"^([+-]?[0-9.]+(?:[eE][+-]?[0-9]+)?)([a-zA-Z]*)$")


class QuantityError(ValueError):
    """A string that is not a Kubernetes quantity."""


def parse_quantity(value: Any) -> Decimal:
    """A Kubernetes quantity (`500m`, `16Gi`, `1e3`, 2) as an exact number."""
    if isinstance(value, bool):
        raise QuantityError(f"{value!r} is not a quantity")
    if isinstance(value, int | float | Decimal):
        return Decimal(str(value))
    match = _QUANTITY.match(str(value).strip())
    if match is None or match[2] not in _SUFFIXES:
        raise QuantityError(f"{value!r} is not a quantity")
    try:
        return Decimal(match[1]) * _SUFFIXES[match[2]]
    except InvalidOperation:
        raise QuantityError(f"{value!r} is not a quantity") from None


def format_quantity(resource: str, amount: Decimal) -> str:
    """An amount as people write it for that resource: `16Gi` of memory, `500m` or `2` of cpu, `8` GPUs."""
    bytes_like = any(word in resource for word in ("memory", "storage"))
    if bytes_like and amount > 0:
        for suffix in ("Ti", "Gi", "Mi", "Ki"):
            unit = _SUFFIXES[suffix]
            if amount >= unit and amount % unit == 0:
                return f"{amount / unit:f}".rstrip("0").rstrip(".") + suffix
    if amount != amount.to_integral_value():
        return f"{(amount * 1000).to_integral_value():f}m"
    return f"{amount.to_integral_value():f}"


def _quantities(mapping: Mapping[str, Any] | None) -> dict[str, Decimal]:
    out = {}
    for key, value in (mapping or {}).items():
        try:
            out[key] = parse_quantity(value)
        except QuantityError:
            continue  # the server refuses such a pod itself, with its own message
    return out


def with_limit_range_defaults(pod: Raw, limit_ranges: Iterable[Raw]) -> Raw:
    """The pod as LimitRanger admits it: a container's missing requests and limits from each Container-type
    limit (`defaultRequest`, `default`); a limit alone is also the request (the API server's defaulting)."""
    pod = copy.deepcopy(pod)
    items = [item for lr in limit_ranges for item in (lr.get("spec") or {}).get("limits") or []]
    defaults = [item for item in items if item.get("type") == "Container"]
    for container in _all_containers(pod):
        resources = container.setdefault("resources", {})
        limits = resources.setdefault("limits", {})
        requests = resources.setdefault("requests", {})
        for item in defaults:
            for key, value in (item.get("default") or {}).items():
                limits.setdefault(key, value)
            for key, value in (item.get("defaultRequest") or {}).items():
                requests.setdefault(key, value)
        for key, value in limits.items():
            requests.setdefault(key, value)
    return pod


def limit_range_problems(pod: Raw, limit_ranges: Iterable[Raw]) -> list[str]:
    """What the namespace's Container-type `max`/`min` refuse in a (defaulted) pod, as the server words it."""
    problems = []
    name = pod["metadata"]["name"]
    for lr in limit_ranges:
        for item in (lr.get("spec") or {}).get("limits") or []:
            if item.get("type") != "Container":
                continue
            highest, lowest = _quantities(item.get("max")), _quantities(item.get("min"))
            for container in _all_containers(pod):
                limits = _quantities((container.get("resources") or {}).get("limits"))
                requests = _quantities((container.get("resources") or {}).get("requests"))
                for key, top in highest.items():
                    if key in limits and limits[key] > top:
                        problems.append(
                            f"{name}: maximum {key} usage per Container is {format_quantity(key, top)} "
                            f"(LimitRange {lr['metadata']['name']}), but limit is {format_quantity(key, limits[key])}"
                        )
                for key, bottom in lowest.items():
                    if key in requests and requests[key] < bottom:
                        problems.append(
                            f"{name}: minimum {key} usage per Container is {format_quantity(key, bottom)} "
                            f"(LimitRange {lr['metadata']['name']}), but request is "
                            f"{format_quantity(key, requests[key])}"
                        )
    return problems


def _all_containers(pod: Raw) -> list[Raw]:
    spec = pod.get("spec") or {}
    return list(spec.get("containers") or []) + list(spec.get("initContainers") or [])


def _summed(pod: Raw, kind: str) -> dict[str, Decimal]:
    """Requests or limits of a pod: its containers' sum, at least any one init container's."""
    spec = pod.get("spec") or {}
    total: dict[str, Decimal] = {}
    for container in spec.get("containers") or []:
        for key, value in _quantities((container.get("resources") or {}).get(kind)).items():
            total[key] = total.get(key, Decimal(0)) + value
    for container in spec.get("initContainers") or []:
        for key, value in _quantities((container.get("resources") or {}).get(kind)).items():
            total[key] = max(total.get(key, Decimal(0)), value)
    return total


def pod_charge(pod: Raw) -> dict[str, Decimal]:
    """What one pod counts against a quota, by the quota's resource names."""
    charge = {"pods": Decimal(1), "count/pods": Decimal(1)}
    for key, value in _summed(pod, "requests").items():
        if key in STANDARD:
            charge[key] = value
        charge[f"requests.{key}"] = value
    for key, value in _summed(pod, "limits").items():
        if key in STANDARD:
            charge[f"limits.{key}"] = value
    return charge


def _best_effort(pod: Raw) -> bool:
    return not any(
        (c.get("resources") or {}).get("requests") or (c.get("resources") or {}).get("limits")
        for c in _all_containers(pod)
    )


def _in_scope(pod: Raw, scope: str, operator: str = "Exists", values: Iterable[str] = ()) -> bool:
    spec = pod.get("spec") or {}
    if scope == "Terminating":
        return spec.get("activeDeadlineSeconds") is not None
    if scope == "NotTerminating":
        return spec.get("activeDeadlineSeconds") is None
    if scope == "BestEffort":
        return _best_effort(pod)
    if scope == "NotBestEffort":
        return not _best_effort(pod)
    if scope == "PriorityClass":
        name = spec.get("priorityClassName")
        if operator == "Exists":
            return bool(name)
        if operator == "DoesNotExist":
            return not name
        if operator == "In":
            return name in set(values)
        if operator == "NotIn":
            return name not in set(values)
    return False  # a scope this operator does not know (CrossNamespacePodAffinity, VolumeAttributesClass)


def quota_applies(quota: Raw, pod: Raw) -> bool:
    """Whether a pod counts against a quota: every scope and scope-selector term must match."""
    spec = quota.get("spec") or {}
    if not all(_in_scope(pod, scope) for scope in spec.get("scopes") or []):
        return False
    terms = ((spec.get("scopeSelector") or {}).get("matchExpressions")) or []
    return all(
        _in_scope(pod, t.get("scopeName", ""), t.get("operator", "Exists"), t.get("values") or []) for t in terms
    )


@dataclass(frozen=True)
class Shortfall:
    """One resource of one quota that the pods to create do not fit in."""

    quota: str
    resource: str
    needed: Decimal
    left: Decimal
    hard: Decimal

    def render(self) -> str:
        fmt = format_quantity
        return (
            f"needs {self.resource} {fmt(self.resource, self.needed)}, quota {self.quota} allows "
            f"{fmt(self.resource, max(self.left, Decimal(0)))} more (hard {fmt(self.resource, self.hard)})"
        )


def quota_shortfalls(pods: Iterable[Raw], quotas: Iterable[Raw], limit_ranges: Iterable[Raw] = ()) -> list[Shortfall]:
    """Every (quota, resource) the pods together would exceed; empty when all of them fit."""
    limit_ranges = list(limit_ranges)
    admitted = [with_limit_range_defaults(pod, limit_ranges) for pod in pods]
    shortfalls = []
    for quota in sorted(quotas, key=lambda q: q["metadata"]["name"]):
        status = quota.get("status") or {}
        hard = _quantities(status.get("hard") or (quota.get("spec") or {}).get("hard"))
        used = _quantities(status.get("used"))
        needed: dict[str, Decimal] = {}
        for pod in admitted:
            if not quota_applies(quota, pod):
                continue
            for key, value in pod_charge(pod).items():
                needed[key] = needed.get(key, Decimal(0)) + value
        for key in sorted(hard):
            need = needed.get(key, Decimal(0))
            left = hard[key] - used.get(key, Decimal(0))
            if need > 0 and need > left:
                shortfalls.append(Shortfall(quota["metadata"]["name"], key, need, left, hard[key]))
    return shortfalls


def admission_problem(pods: list[Raw], quotas: Iterable[Raw], limit_ranges: Iterable[Raw]) -> tuple[str, str] | None:
    """(reason, message) why none of `pods` may be created now, or None when they all fit."""
    limit_ranges, quotas = list(limit_ranges), list(quotas)
    if not pods or not (limit_ranges or quotas):
        return None  # nothing to check against (the usual namespace): no copies of the pods
    problems = [
        p for pod in pods for p in limit_range_problems(with_limit_range_defaults(pod, limit_ranges), limit_ranges)
    ]
    if problems:
        return LIMIT_RANGE_EXCEEDED, "; ".join(problems)
    shortfalls = quota_shortfalls(pods, quotas, limit_ranges)
    if not shortfalls:
        return None
    count = f"{len(pods)} pod{'s' if len(pods) != 1 else ''}"
    return QUOTA_EXCEEDED, f"{count} not created: " + "; ".join(s.render() for s in shortfalls)


def refused_for_quota(message: str) -> bool:
    """Whether a 403 on a pod create is the quota admission plugin's (`exceeded quota: NAME, ...`)."""
    return "exceeded quota" in message
