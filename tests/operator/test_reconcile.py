"""The pure reconciler: one observation in, one plan out; replays never do a thing twice."""

from __future__ import annotations

import datetime
from pathlib import Path
from typing import Any

import jsonschema

from rljob.api import load_job_file, validate_job
from rljob.api.crd import build_crd
from rljob.api.status import RLJobStatus
from rljob.operator.manifests import build_children
from rljob.operator.podstate import PodState, observe_pod
from rljob.operator.reconcile import Observation, plan
from rljob.operator.settings import OperatorSettings

NOW = datetime.datetime(2026, 1, 1, 12, 0, tzinfo=datetime.UTC)
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "cartpole-ppo.yaml"


def job(**spec: Any):
    data = load_job_file(EXAMPLE).model_dump(mode="json", by_alias=True, exclude_none=True)
    data["metadata"] = {"name": "cp", "namespace": "ns", "uid": "u-1", "generation": 1}
    data["spec"]["roles"]["env"]["replicas"] = 2  # two env pods, whatever the example is tuned to
    data["spec"].update(spec)
    return validate_job(data)


def pod(name: str, phase: str = "Running", ready: bool = True, **status: Any) -> PodState:
    role, replica = name.split("-")[1], name.split("-")[2]
    raw = {
        "metadata": {
            "name": name,
            "uid": f"uid-{name}",
            "labels": {"rljob.io/role": role, "rljob.io/replica": replica},
        },
        "spec": {"nodeName": "n1"},
        "status": {"phase": phase, "conditions": [{"type": "Ready", "status": "True" if ready else "False"}], **status},
    }
    state = observe_pod(raw)
    assert state is not None
    return state


def observe(status: RLJobStatus, pods: list[PodState], **kwargs: Any) -> Observation:
    the_job = kwargs.pop("the_job", None) or job()
    desired = {c["metadata"]["name"]: c for c in build_children(the_job, OperatorSettings()) if c["kind"] == "Pod"}
    return Observation(
        job=the_job, invalid=None, generation=1, status=status, pods=pods, desired_pods=desired, now=NOW, **kwargs
    )


ALL = ["cp-actor-0", "cp-rollout-0", "cp-env-0", "cp-env-1"]


def test_a_new_job_creates_every_pod_at_once() -> None:
    result = plan(observe(RLJobStatus(), []))
    assert sorted(result.create) == sorted(ALL)
    assert result.status.phase == "Pending" and result.status.start_time


def test_pods_created_but_not_yet_seen_are_not_created_again() -> None:
    result = plan(observe(RLJobStatus(phase="Starting"), [pod("cp-actor-0")], expected=set(ALL[1:])))
    assert result.create == [] and result.delete == []


def test_replaying_an_actor_failure_charges_the_budget_once() -> None:
    pods = [pod(n) for n in ALL[1:]] + [pod("cp-actor-0", "Failed", False)]
    first = plan(observe(RLJobStatus(phase="Running"), pods))
    assert first.status.phase == "Restarting" and first.status.restarts == 1
    assert first.delete == ["cp-actor-0"] and first.restart_counted
    # The cache still shows the failed pod (its deletion not observed yet): same observation again.
    again = plan(observe(first.status, pods))
    assert again.status.restarts == 1 and not again.restart_counted
    assert "cp-actor-0" not in again.create  # the new group waits for the old one to be gone
    gone = plan(observe(again.status, [pod(n) for n in ALL[1:]]))
    assert gone.create == ["cp-actor-0"] and gone.status.phase == "Starting"


def test_an_actor_that_vanished_from_a_running_group_restarts_it_uncharged() -> None:
    result = plan(observe(RLJobStatus(phase="Running"), [pod(n) for n in ALL[1:]]))
    assert result.status.restarts == 0 and not result.restart_counted
    assert [e.reason for e in result.events][:2] == ["ActorLost", "Recreated"]
    # No old actor is left to wait for: the group is recreated in the same pass.
    assert result.create == ["cp-actor-0"] and result.status.phase == "Starting"


def test_a_failed_rollout_pod_is_replaced_and_counted() -> None:
    pods = [pod(n) for n in ALL if n != "cp-rollout-0"] + [pod("cp-rollout-0", "Failed", False)]
    result = plan(observe(RLJobStatus(phase="Running"), pods))
    assert result.delete == ["cp-rollout-0"] and result.status.phase == "Running"
    assert result.status.roles.rollout.failed == 1 and result.status.restarts == 0


def test_fail_job_policy_fails_on_the_first_rollout_failure() -> None:
    the_job = job(failurePolicy={"rollout": "FailJob"})
    pods = [pod(n) for n in ALL if n != "cp-rollout-0"] + [pod("cp-rollout-0", "Failed", False)]
    result = plan(observe(RLJobStatus(phase="Running"), pods, the_job=the_job))
    assert result.status.phase == "Failed"
    assert sorted(result.delete) == sorted(n for n in ALL if n != "cp-rollout-0")


def test_ttl_deletes_the_finished_job_once_expired() -> None:
    the_job = job(ttlSecondsAfterFinished=60)
    done = RLJobStatus(phase="Succeeded", completion_time="2026-01-01T11:58:00Z")
    assert plan(observe(done, [], the_job=the_job)).delete_job
    recent = RLJobStatus(phase="Succeeded", completion_time="2026-01-01T11:59:30Z")
    result = plan(observe(recent, [], the_job=the_job))
    assert not result.delete_job and result.requeue_after == 30


def test_every_status_the_reconciler_writes_fits_the_crd_schema() -> None:
    schema = build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["status"]
    pods = [pod(n) for n in ALL[1:]] + [pod("cp-actor-0", "Failed", False)]
    statuses = [
        plan(observe(RLJobStatus(), [])).status,
        plan(observe(RLJobStatus(phase="Running"), pods)).status,
        plan(observe(RLJobStatus(phase="Running", restarts=3), pods)).status,
    ]
    for status in statuses:
        jsonschema.validate(status.model_dump(mode="json", by_alias=True, exclude_none=True), schema)
