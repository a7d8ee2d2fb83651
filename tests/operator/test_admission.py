"""Quota-aware admission, pure: what pods charge a quota, LimitRange defaults, scopes, and the words of the reason."""

from __future__ import annotations

from dataclasses import replace
from decimal import Decimal
from typing import Any

import pytest

from rljob.api.status import RLJobStatus
from rljob.operator.admission import (
    LIMIT_RANGE_EXCEEDED,
    QUOTA_EXCEEDED,
    QuantityError,
    admission_problem,
    format_quantity,
    parse_quantity,
    pod_charge,
    quota_shortfalls,
    with_limit_range_defaults,
)
from rljob.operator.reconcile import plan
from tests.operator.test_reconcile import observe
from tests.operator.test_reconcile import pod as pod_state


def pod(name: str, requests: dict[str, Any] | None = None, limits: dict[str, Any] | None = None, **spec: Any) -> dict:
    resources = {k: v for k, v in (("requests", requests), ("limits", limits)) if v}
    return {"metadata": {"name": name}, "spec": {"containers": [{"name": "main", "resources": resources}], **spec}}


def quota(name: str, hard: dict[str, str], used: dict[str, str] | None = None, **spec: Any) -> dict:
    return {"metadata": {"name": name}, "spec": {"hard": hard, **spec}, "status": {"hard": hard, "used": used or {}}}


@pytest.mark.parametrize(
    ("text", "value"),
    [("500m", "0.5"), ("2", "2"), (3, "3"), ("16Gi", str(16 * 2**30)), ("1e3", "1000"), ("1.5k", "1500")],
)
def test_quantities_parse_exactly(text: Any, value: str) -> None:
    assert parse_quantity(text) == Decimal(value)


def test_a_string_that_is_no_quantity_is_refused() -> None:
    with pytest.raises(QuantityError):
        parse_quantity("lots")


def test_amounts_are_written_as_people_write_them() -> None:
    assert format_quantity("requests.memory", Decimal(16 * 2**30)) == "16Gi"
    assert format_quantity("requests.cpu", Decimal("1.5")) == "1500m"
    assert format_quantity("requests.nvidia.com/gpu", Decimal(8)) == "8"


def test_a_gpu_pod_charges_pods_requests_and_limits() -> None:
    charge = pod_charge(
        with_limit_range_defaults(pod("a", requests={"cpu": "4"}, limits={"nvidia.com/gpu": 8, "memory": "64Gi"}), [])
    )
    assert charge["pods"] == 1 and charge["count/pods"] == 1
    assert charge["requests.nvidia.com/gpu"] == 8  # a limit alone is also the request
    assert charge["cpu"] == charge["requests.cpu"] == 4
    assert charge["limits.memory"] == charge["requests.memory"] == 64 * 2**30
    assert "limits.nvidia.com/gpu" not in charge  # extended resources are quota'd by requests only


def test_the_issue_example_names_the_quota_and_the_amounts() -> None:
    pods = [pod(f"j-actor-{i}", limits={"nvidia.com/gpu": 8}) for i in range(2)]
    gpu_q = quota("gpu-q", {"requests.nvidia.com/gpu": "16"}, {"requests.nvidia.com/gpu": "8"})
    reason, message = admission_problem(pods, [gpu_q], []) or ("", "")
    assert reason == QUOTA_EXCEEDED
    assert message == "2 pods not created: needs requests.nvidia.com/gpu 16, quota gpu-q allows 8 more (hard 16)"


def test_pods_that_fit_every_quota_pass() -> None:
    pods = [pod("a", requests={"cpu": "1"}), pod("b", requests={"cpu": "1"})]
    assert admission_problem(pods, [quota("q", {"pods": "10", "requests.cpu": "2"})], []) is None


def test_a_quota_of_something_the_pods_do_not_use_does_not_hold_them() -> None:
    full = quota("gpu-q", {"requests.nvidia.com/gpu": "0"}, {"requests.nvidia.com/gpu": "0"})
    assert admission_problem([pod("a", requests={"cpu": "1"})], [full], []) is None


def test_limit_range_defaults_fill_what_a_container_leaves_out() -> None:
    ranges = [
        {
            "metadata": {"name": "lr"},
            "spec": {
                "limits": [{"type": "Container", "default": {"memory": "1Gi"}, "defaultRequest": {"cpu": "250m"}}]
            },
        }
    ]
    shortfalls = quota_shortfalls(
        [pod("a"), pod("b")], [quota("q", {"requests.cpu": "400m", "limits.memory": "4Gi"})], ranges
    )
    assert [(s.resource, s.needed) for s in shortfalls] == [("requests.cpu", Decimal("0.5"))]


def test_a_container_over_the_limit_range_maximum_is_named() -> None:
    ranges = [{"metadata": {"name": "lr"}, "spec": {"limits": [{"type": "Container", "max": {"cpu": "2"}}]}}]
    reason, message = admission_problem([pod("a", limits={"cpu": "4"})], [], ranges) or ("", "")
    assert reason == LIMIT_RANGE_EXCEEDED
    assert "maximum cpu usage per Container is 2 (LimitRange lr), but limit is 4" in message


def test_scoped_quotas_count_only_the_pods_in_their_scope() -> None:
    high = {"matchExpressions": [{"scopeName": "PriorityClass", "operator": "In", "values": ["high"]}]}
    scoped = quota("high-q", {"pods": "1"}, scopeSelector=high)
    low = [pod("a", requests={"cpu": "1"}), pod("b", requests={"cpu": "1"})]
    assert admission_problem(low, [scoped], []) is None
    urgent = [pod("a", requests={"cpu": "1"}, priorityClassName="high"), pod("b", priorityClassName="high")]
    assert admission_problem(urgent, [scoped], []) is not None
    best_effort = quota("be-q", {"pods": "0"}, scopes=["BestEffort"])
    assert admission_problem(low, [best_effort], []) is None
    assert admission_problem([pod("c")], [best_effort], []) is not None


def test_a_plan_waiting_for_admission_creates_nothing_and_says_why_in_ready() -> None:
    why = (QUOTA_EXCEEDED, "4 pods not created: needs pods 4, quota pod-q allows 3 more (hard 3)")
    result = plan(observe(RLJobStatus(), [], admission=why, admission_retry_seconds=2.0))
    assert result.create == []
    ready = next(c for c in result.status.conditions if c.type == "Ready")
    assert (ready.status, ready.reason, ready.message) == ("False", QUOTA_EXCEEDED, why[1])
    assert result.status.phase == "Pending"
    assert result.requeue_after is not None and result.requeue_after <= 2.0
    assert [e.reason for e in result.events if e.type == "Warning"] == [QUOTA_EXCEEDED]

    admitted = plan(observe(result.status, []))
    assert len(admitted.create) == 4 and "Admitted" in [e.reason for e in admitted.events]


def test_pods_gated_by_a_queue_say_so_in_scheduled_quoting_the_server() -> None:
    gate = "Scheduling is blocked due to non-empty scheduling gates"
    names = ["cp-actor-0", "cp-rollout-0", "cp-env-0", "cp-env-1"]
    condition = {"type": "PodScheduled", "status": "False", "reason": "SchedulingGated", "message": gate}
    gated = [replace(pod_state(name, "Pending", False, conditions=[condition]), scheduled=False) for name in names]
    result = plan(observe(RLJobStatus(), gated))
    scheduled = next(c for c in result.status.conditions if c.type == "Scheduled")
    assert (scheduled.status, scheduled.reason) == ("False", "SchedulingGated")
    assert gate in scheduled.message and "kubectl describe workloads" in scheduled.message
    assert result.status.phase == "Pending" and result.create == []
