"""Preemption on a cluster: actor pods get spec.checkpoint.preemptionGraceSeconds to checkpoint after SIGTERM, and an
actor that exits EXIT_PREEMPTED (it checkpointed its last step) restarts the group without charging maxRestarts."""

from __future__ import annotations

from typing import Any

from rljob.api import load_job_file, validate_job
from rljob.api.status import RLJobStatus
from rljob.operator.manifests import build_children
from rljob.operator.reconcile import plan
from rljob.operator.settings import OperatorSettings
from rljob.runtime.wire.identity import EXIT_PREEMPTED
from tests.operator.test_reconcile import ALL, EXAMPLE, job, observe, pod


def exited(name: str, code: int) -> Any:
    terminated = {"exitCode": code, "reason": "Error", "message": ""}
    return pod(name, "Failed", False, containerStatuses=[{"name": "main", "state": {"terminated": terminated}}])


def with_spec(**changes: Any):
    data = job().model_dump(mode="json", by_alias=True, exclude_none=True)
    for path, value in changes.items():
        where = data["spec"]
        *parents, leaf = path.split(".")
        for key in parents:
            where = where.setdefault(key, {})
        where[leaf] = value
    return validate_job(data)


def test_the_actor_pods_grace_period_is_the_jobs_preemption_grace_and_the_others_keep_the_operators(
    settings, validate_manifest
) -> None:
    default = load_job_file(EXAMPLE)
    assert default.spec.checkpoint.preemption_grace_seconds == 300
    the_job = with_spec(**{"checkpoint.preemptionGraceSeconds": 900, "roles.actor.replicas": 2})
    the_job.metadata.uid = "5f0c3b2e-1d7a-4a52-9d43-2f8a3c1b9e70"
    pods = [c for c in build_children(the_job, settings) if c["kind"] == "Pod"]
    graces = {p["metadata"]["name"]: p["spec"]["terminationGracePeriodSeconds"] for p in pods}
    assert graces == {
        "cp-actor-0": 900,
        "cp-actor-1": 900,
        "cp-rollout-0": settings.termination_grace_period_seconds,
        "cp-env-0": settings.termination_grace_period_seconds,
        "cp-env-1": settings.termination_grace_period_seconds,
    }
    assert settings.termination_grace_period_seconds != 900
    for manifest in build_children(the_job, settings):
        validate_manifest(manifest)
    # Another operator-wide grace leaves the actor's alone.
    other = OperatorSettings(termination_grace_period_seconds=5)
    pods = {c["metadata"]["name"]: c for c in build_children(the_job, other) if c["kind"] == "Pod"}
    assert pods["cp-actor-0"]["spec"]["terminationGracePeriodSeconds"] == 900
    assert pods["cp-env-0"]["spec"]["terminationGracePeriodSeconds"] == 5


def test_a_preempted_actor_restarts_the_group_without_charging_max_restarts() -> None:
    the_job = with_spec(**{"failurePolicy.maxRestarts": 0})
    pods = [exited("cp-actor-0", EXIT_PREEMPTED)] + [pod(n) for n in ALL[1:]]
    result = plan(observe(RLJobStatus(phase="Running"), pods, the_job=the_job))
    assert result.status.phase == "Restarting" and result.status.restarts == 0 and not result.restart_counted
    assert result.delete == ["cp-actor-0"]
    assert "ActorPreempted" in [e.reason for e in result.events]
    restarting = next(c for c in result.status.conditions if c.type == "Restarting")
    assert restarting.reason == "ActorPreempted" and "not counted against maxRestarts" in restarting.message
    # The same pod exiting 1 is a failure: with maxRestarts 0 the job fails.
    failed = plan(observe(RLJobStatus(phase="Running"), [exited("cp-actor-0", 1), *pods[1:]], the_job=the_job))
    assert failed.status.phase == "Failed"


def test_a_preempted_replica_waits_for_actor_replica_0_to_finish_its_checkpoint() -> None:
    the_job = with_spec(**{"roles.actor.replicas": 2})
    others = [pod(n) for n in ALL[1:]]
    # Replica 1 stopped at the agreed step; replica 0 still writes the checkpoint: nothing is deleted yet.
    writing = plan(
        observe(
            RLJobStatus(phase="Running"),
            [pod("cp-actor-0"), exited("cp-actor-1", EXIT_PREEMPTED), *others],
            the_job=the_job,
        )
    )
    assert writing.status.phase != "Restarting" and writing.delete == [] and writing.status.restarts == 0
    # Replica 0 is done too: the group restarts from the checkpoint, uncharged.
    done = [exited("cp-actor-0", EXIT_PREEMPTED), exited("cp-actor-1", EXIT_PREEMPTED), *others]
    result = plan(observe(RLJobStatus(phase="Running"), done, the_job=the_job))
    assert result.status.phase == "Restarting" and result.status.restarts == 0 and not result.restart_counted
    assert sorted(result.delete) == ["cp-actor-0", "cp-actor-1"]
    # A replica that really failed beside a preempted one is charged.
    mixed = [exited("cp-actor-0", 1), exited("cp-actor-1", EXIT_PREEMPTED), *others]
    result = plan(observe(RLJobStatus(phase="Running"), mixed, the_job=the_job))
    assert result.status.phase == "Restarting" and result.status.restarts == 1 and result.restart_counted
