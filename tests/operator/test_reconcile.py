"""The pure reconciler: one observation in, one plan out; replays never do a thing twice."""

from __future__ import annotations

import datetime
from dataclasses import replace
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from rljob.api import InvalidRLJob, load_job_file, validate_job
from rljob.api.crd import build_crd
from rljob.api.problems import Problem
from rljob.api.status import ReplicaFailures, RLJobStatus
from rljob.launch.failure_policy import STABLE_SECONDS, FailurePolicy
from rljob.operator.manifests import build_children, config_hash
from rljob.operator.podstate import PodState, observe_pod
from rljob.operator.reconcile import Observation, plan
from rljob.operator.settings import OperatorSettings
from rljob.operator.status import rfc3339
from rljob.runtime.wire.identity import EXIT_FATAL_CONFIG

NOW = datetime.datetime(2026, 1, 1, 12, 0, tzinfo=datetime.UTC)
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "cartpole-ppo.yaml"
LLM_EXAMPLE = EXAMPLE.with_name("grpo-tiny-arithmetic.yaml")


def job(**spec: Any):
    data = load_job_file(EXAMPLE).model_dump(mode="json", by_alias=True, exclude_none=True)
    data["metadata"] = {"name": "cp", "namespace": "ns", "uid": "u-1", "generation": 1}
    data["spec"]["roles"]["env"]["replicas"] = 2  # two env pods, whatever the example is tuned to
    data["spec"].update(spec)
    return validate_job(data)


def arithmetic_job(rollout_replicas: int = 1, engine: str = "hf", parallelism: str = "ddp"):
    """The tiny GRPO arithmetic example (1 actor, rollout and reward pod): an llm task."""
    data = load_job_file(LLM_EXAMPLE).model_dump(mode="json", by_alias=True, exclude_none=True)
    data["metadata"] = {"name": "ar", "namespace": "ns", "uid": "u-2", "generation": 1}
    data["spec"]["roles"]["rollout"]["replicas"] = rollout_replicas
    data["spec"]["rollout"]["engine"] = engine
    data["spec"]["trainer"]["parallelism"] = parallelism
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
    # What the operator passes: each desired pod's metadata only (PackedChildren.heads).
    desired = {
        c["metadata"]["name"]: {"metadata": c["metadata"]}
        for c in build_children(the_job, OperatorSettings())
        if c["kind"] == "Pod"
    }
    kwargs.setdefault("now", NOW)
    kwargs.setdefault("generation", 1)
    return Observation(job=the_job, invalid=None, status=status, pods=pods, desired_pods=desired, **kwargs)


def failed_pod(name: str, uid: str, finished: datetime.datetime | None = None, **status: Any) -> PodState:
    """A pod whose container exited 1 (at `finished`, when given)."""
    terminated: dict[str, Any] = {"exitCode": 1, "reason": "Error"}
    if finished is not None:
        terminated["finishedAt"] = rfc3339(finished)
    state = pod(name, "Failed", False, containerStatuses=[{"name": "main", "state": {"terminated": terminated}}])
    return replace(state, uid=uid, **status)


def ready_pod(name: str, uid: str, since: datetime.datetime) -> PodState:
    return replace(pod(name), uid=uid, ready_since=rfc3339(since))


def seconds(n: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=n)


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


def test_a_failed_rollout_pod_is_counted_once_and_replaced_after_the_backoff() -> None:
    pods = [pod(n) for n in ALL if n != "cp-rollout-0"] + [failed_pod("cp-rollout-0", "r1", finished=NOW)]
    first = plan(observe(RLJobStatus(phase="Running"), pods))
    assert first.status.phase == "Running" and first.status.restarts == 0
    assert first.status.roles.rollout.failed == 1
    assert first.status.replica_failures["rollout-0"].count == 1
    assert first.delete == [] and first.requeue_after == 1.0  # the first back-off: 1 s after it finished
    assert [e.reason for e in first.events] == ["PodFailed"] and "exit code 1" in first.events[0].message
    # Replayed (stale cache, operator restart): the same failed pod is charged nothing more.
    again = plan(observe(first.status, pods))
    assert again.status.roles.rollout.failed == 1 and again.status.replica_failures["rollout-0"].count == 1
    assert again.events == [] and again.delete == []
    due = plan(observe(again.status, pods, now=NOW + seconds(1)))
    assert due.delete == ["cp-rollout-0"] and due.status.replica_failures["rollout-0"].count == 1
    assert due.replaced == [("rollout", "PodFailed")] and due.events == []
    gone = plan(observe(due.status, [p for p in pods if p.name != "cp-rollout-0"], now=NOW + seconds(2)))
    assert gone.create == ["cp-rollout-0"]


def test_the_backoff_doubles_with_each_failure_in_a_row_up_to_a_minute() -> None:
    assert [FailurePolicy().backoff(n) for n in range(1, 10)] == [1, 2, 4, 8, 16, 32, 60, 60, 60]
    status = RLJobStatus(
        phase="Running",
        replica_failures={
            "env-1": ReplicaFailures(count=3, last_pod_uid="old", last_failure_time="2026-01-01T11:00:00Z")
        },
    )
    pods = [pod(n) for n in ALL if n != "cp-env-1"] + [failed_pod("cp-env-1", "new", finished=NOW - seconds(5))]
    result = plan(observe(status, pods))
    assert result.status.replica_failures["env-1"].count == 4
    assert result.delete == [] and result.requeue_after == 3.0  # 8 s from its finish, 5 s ago
    assert plan(observe(result.status, pods, now=NOW + seconds(3))).delete == ["cp-env-1"]


def test_a_replica_failing_again_and_again_is_a_crash_loop_then_fails_the_job() -> None:
    the_job = job(failurePolicy={"maxReplacements": 2})
    others = [pod(n) for n in ALL if n != "cp-env-0"]
    status = RLJobStatus(phase="Running")
    for attempt in (1, 2):
        status = plan(observe(status, [*others, failed_pod("cp-env-0", f"e{attempt}")], the_job=the_job)).status
        ready = next(c for c in status.conditions if c.type == "Ready")
        assert status.phase == "Running" and status.replica_failures["env-0"].count == attempt
        assert (ready.reason == "CrashLoopBackOff") == (attempt == 2)
    assert "env replica 0 (cp-env-0) failed 2 times in a row" in ready.message
    result = plan(observe(status, [*others, failed_pod("cp-env-0", "e3")], the_job=the_job))
    failed = next(c for c in result.status.conditions if c.type == "Failed")
    assert result.status.phase == "Failed" and failed.reason == "BackoffLimitExceeded"
    assert "env replica 0 (pod cp-env-0) failed 3 times in a row" in failed.message
    assert "spec.failurePolicy.maxReplacements is 2" in failed.message
    assert result.status.roles.env.failed == 3 and result.status.restarts == 0


def test_max_replacements_zero_fails_on_the_first_failure() -> None:
    pods = [pod(n) for n in ALL if n != "cp-rollout-0"] + [failed_pod("cp-rollout-0", "r1")]
    result = plan(observe(RLJobStatus(phase="Running"), pods, the_job=job(failurePolicy={"maxReplacements": 0})))
    assert result.status.phase == "Failed" and result.create == []


def test_evictions_are_replaced_at_once_and_not_counted_as_failures_in_a_row() -> None:
    status = RLJobStatus(phase="Running", replica_failures={"env-0": ReplicaFailures(count=2, last_pod_uid="e2")})
    evicted = replace(pod("cp-env-0", "Failed", False, reason="Evicted"), uid="e3")
    result = plan(observe(status, [*(pod(n) for n in ALL if n != "cp-env-0"), evicted]))
    assert result.delete == ["cp-env-0"] and result.status.replica_failures["env-0"].count == 2
    assert result.status.roles.env.failed == 0 and result.status.phase == "Running"


def test_the_count_is_forgotten_once_a_replacement_stays_ready_or_exits_0() -> None:
    status = RLJobStatus(phase="Running", replica_failures={"env-0": ReplicaFailures(count=3, last_pod_uid="e3")})
    others = [pod(n) for n in ALL if n != "cp-env-0"]
    recent = plan(observe(status, [*others, ready_pod("cp-env-0", "e4", since=NOW - seconds(100))]))
    assert recent.status.replica_failures["env-0"].count == 3 and recent.requeue_after == STABLE_SECONDS - 100
    # Ready again: the Ready condition no longer reports a crash loop although the count is kept.
    assert next(c for c in recent.status.conditions if c.type == "Ready").reason == "AllPodsReady"
    stable = plan(observe(status, [*others, ready_pod("cp-env-0", "e4", since=NOW - seconds(STABLE_SECONDS))]))
    assert stable.status.replica_failures == {}
    exited = replace(pod("cp-env-0", "Succeeded", False), uid="e4")
    assert plan(observe(status, [*others, exited])).status.replica_failures == {}


def test_a_spec_change_restart_starts_the_replicas_with_a_clean_record() -> None:
    status = RLJobStatus(phase="Running", replica_failures={"env-0": ReplicaFailures(count=3, last_pod_uid="e3")})
    result = plan(observe(status, [pod(n) for n in ALL], spec_changed=True))
    assert result.status.phase == "Restarting" and result.status.replica_failures == {}


@pytest.mark.parametrize("engine", ["hf", "vllm"])
def test_an_llm_job_on_either_engine_gets_its_actor_rollout_and_reward_pods(engine: str) -> None:
    result = plan(observe(RLJobStatus(), [], the_job=arithmetic_job(engine=engine)))
    assert sorted(result.create) == ["ar-actor-0", "ar-reward-0", "ar-rollout-0"]
    assert result.status.phase != "Failed"


def test_an_fsdp2_llm_job_gets_its_pods_like_a_ddp_one() -> None:
    result = plan(observe(RLJobStatus(), [], the_job=arithmetic_job(parallelism="fsdp2")))
    assert sorted(result.create) == ["ar-actor-0", "ar-reward-0", "ar-rollout-0"]
    assert result.status.phase != "Failed" and result.events == []


def test_llm_rollouts_scale_in_place() -> None:
    """A running llm job's rollout count changes: new rollout replicas only, actors untouched."""
    scaled = arithmetic_job(rollout_replicas=3)
    names = ["ar-actor-0", "ar-rollout-0", "ar-reward-0"]
    running = [replace(pod(n), uid=f"uid-{n}") for n in names]
    result = plan(observe(RLJobStatus(phase="Running"), running, the_job=scaled))
    assert sorted(result.create) == ["ar-rollout-1", "ar-rollout-2"] and result.delete == []
    assert result.status.phase == "Running"


def running_llm_pods(rollouts: int) -> list[PodState]:
    names = ["ar-actor-0", "ar-reward-0"] + [f"ar-rollout-{i}" for i in range(rollouts)]
    return [replace(pod(n), uid=f"uid-{n}") for n in names]


def test_llm_rollouts_scaled_from_2_to_3_get_one_new_rollout_pod_and_nothing_else() -> None:
    result = plan(observe(RLJobStatus(phase="Running"), running_llm_pods(2), the_job=arithmetic_job(3)))
    assert result.create == ["ar-rollout-2"] and result.delete == []
    assert result.status.phase == "Running" and result.status.restarts == 0 and not result.restart_counted
    assert result.rollout_members == [0, 1]  # the new one joins once Ready
    ready = plan(observe(result.status, [*running_llm_pods(3)], the_job=arithmetic_job(3)))
    assert ready.create == [] and ready.delete == [] and ready.rollout_members == [0, 1, 2]


def test_llm_rollouts_scaled_from_3_to_1_lose_the_two_highest_replicas_and_nothing_else() -> None:
    result = plan(observe(RLJobStatus(phase="Running"), running_llm_pods(3), the_job=arithmetic_job(1)))
    assert sorted(result.delete) == ["ar-rollout-1", "ar-rollout-2"] and result.create == []
    assert result.status.phase == "Running" and result.status.restarts == 0 and not result.restart_counted
    assert [e.reason for e in result.events] == []
    assert result.rollout_members == [0]  # the deleted ones have left the membership already


def test_the_rollout_membership_lists_ready_rollouts_only_and_only_for_llm_jobs() -> None:
    pods = [p for p in running_llm_pods(3) if p.name != "ar-rollout-1"]
    pods += [replace(pod("ar-rollout-1", ready=False), uid="uid-r1")]
    assert plan(observe(RLJobStatus(phase="Running"), pods, the_job=arithmetic_job(3))).rollout_members == [0, 2]
    assert plan(observe(RLJobStatus(phase="Running"), [pod(n) for n in ALL])).rollout_members is None  # gym
    done = RLJobStatus(phase="Succeeded")
    assert plan(observe(done, running_llm_pods(3), the_job=arithmetic_job(3))).rollout_members is None


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
    crash_looping = [pod(n) for n in ALL if n != "cp-env-0"] + [failed_pod("cp-env-0", "e2", finished=NOW)]
    looping = RLJobStatus(phase="Running", replica_failures={"env-0": ReplicaFailures(count=1, last_pod_uid="e1")})
    statuses = [
        plan(observe(RLJobStatus(), [])).status,
        plan(observe(looping, crash_looping)).status,
        plan(observe(RLJobStatus(phase="Running"), pods)).status,
        plan(observe(RLJobStatus(phase="Running", restarts=3), pods)).status,
    ]
    for status in statuses:
        jsonschema.validate(status.model_dump(mode="json", by_alias=True, exclude_none=True), schema)


def _config_error(name: str) -> PodState:
    terminated = {"exitCode": EXIT_FATAL_CONFIG, "reason": "Error", "message": "spec.task.gym.envId: unknown"}
    return pod(name, "Failed", False, containerStatuses=[{"name": "main", "state": {"terminated": terminated}}])


def test_an_actor_configuration_error_fails_the_job_without_using_the_restart_budget() -> None:
    pods = [pod(n) for n in ALL[1:]] + [_config_error("cp-actor-0")]
    result = plan(observe(RLJobStatus(phase="Running"), pods))
    assert result.status.phase == "Failed" and result.status.restarts == 0
    failed = next(c for c in result.status.conditions if c.type == "Failed")
    assert failed.reason == "InvalidConfig" and "cp-actor-0" in failed.message
    assert "cp-actor-0" not in result.create


def test_an_env_configuration_error_fails_the_job_instead_of_replacing_the_pod() -> None:
    pods = [pod(n) for n in ALL if n != "cp-env-1"] + [_config_error("cp-env-1")]
    result = plan(observe(RLJobStatus(phase="Running"), pods))
    assert result.status.phase == "Failed"
    assert next(c for c in result.status.conditions if c.type == "Failed").reason == "InvalidConfig"
    assert "cp-env-1" not in result.create and not result.status.replica_failures


def test_a_restart_interrupted_before_its_deletes_deletes_the_failed_actor_on_the_next_pass() -> None:
    """The status said Restarting, then the DELETE failed (or the operator died): a replay finishes it."""
    pods = [pod(n) for n in ALL[1:]] + [pod("cp-actor-0", "Failed", False)]
    first = plan(observe(RLJobStatus(phase="Running"), pods))
    assert first.status.phase == "Restarting" and first.delete == ["cp-actor-0"]
    # Nothing was deleted: the next pass sees the same pods under the Restarting status it wrote.
    again = plan(observe(first.status, pods))
    assert again.delete == ["cp-actor-0"] and again.status.restarts == 1 and not again.restart_counted
    assert again.create == [] and again.status.phase == "Restarting"
    # A running (not failed) actor left over from the old group is deleted just the same.
    leftover = plan(observe(first.status, [pod(n) for n in ALL]))
    assert leftover.delete == ["cp-actor-0"]


def with_hash(state: PodState, config_hash: str) -> PodState:
    return replace(state, uid=f"uid-{state.name}-{config_hash}", config_hash=config_hash)


def test_a_spec_change_restart_interrupted_before_its_deletes_deletes_every_old_spec_pod() -> None:
    old_job = job()
    new_job = job(trainer={**old_job.spec.trainer.model_dump(mode="json", by_alias=True), "steps": 7})
    old_hash = config_hash(old_job)
    new_hash = config_hash(new_job)
    assert old_hash != new_hash
    old_pods = [with_hash(pod(n), old_hash) for n in ALL]
    first = plan(observe(RLJobStatus(phase="Running"), old_pods, the_job=new_job, spec_changed=True))
    assert first.status.phase == "Restarting" and sorted(first.delete) == sorted(ALL)
    # The ConfigMap was already patched (spec_changed is False now), no pod was deleted: the config hash
    # on the pods still tells which ones belong to the old spec.
    again = plan(observe(first.status, old_pods, the_job=new_job))
    assert sorted(again.delete) == sorted(ALL) and again.create == []
    # Pods of the new spec that are already up are kept; only the old ones go.
    mixed = [with_hash(pod("cp-env-0"), new_hash)] + [p for p in old_pods if p.name != "cp-env-0"]
    assert sorted(plan(observe(first.status, mixed, the_job=new_job)).delete) == sorted(set(ALL) - {"cp-env-0"})


def test_pods_of_an_older_spec_are_restarted_even_when_the_spec_edit_was_missed() -> None:
    """The config hash catches what the ConfigMap comparison missed (e.g. a ConfigMap edited by hand)."""
    old_job = job()
    new_job = job(trainer={**old_job.spec.trainer.model_dump(mode="json", by_alias=True), "steps": 7})
    old_pods = [with_hash(pod(n), config_hash(old_job)) for n in ALL]
    result = plan(observe(RLJobStatus(phase="Running"), old_pods, the_job=new_job))
    assert result.status.phase == "Restarting" and sorted(result.delete) == sorted(ALL)


def test_restart_free_edits_keep_the_config_hash() -> None:
    base = job()
    for edited in (
        job(failurePolicy={"maxRestarts": 9}),
        job(suspend=True),
        job(activeDeadlineSeconds=600),
        job(ttlSecondsAfterFinished=60),
    ):
        assert config_hash(edited) == config_hash(base)
    llm = arithmetic_job()
    assert config_hash(arithmetic_job(rollout_replicas=3)) == config_hash(llm)
    # In a gym job the rollout count fixes each rollout's env share: a new count is a restart.
    scaled = job(roles={**base.spec.roles.model_dump(mode="json", by_alias=True, exclude_none=True)})
    scaled_doc = scaled.model_dump(mode="json", by_alias=True, exclude_none=True)
    scaled_doc["spec"]["roles"]["rollout"]["replicas"] = 2
    assert config_hash(validate_job(scaled_doc)) != config_hash(base)


def test_editing_health_thresholds_or_rollout_autoscaling_restarts_no_pod() -> None:
    """Both are read by the operator, never by a pod: tuning them on a live job keeps its step and its engines."""
    base = arithmetic_job()
    data = base.model_dump(mode="json", by_alias=True, exclude_none=True)
    data["spec"]["health"] = {"entropyFloor": 0.3, "windowSteps": 5}
    data["spec"]["roles"]["rollout"]["autoscale"] = {"minReplicas": 1, "maxReplicas": 4}
    assert config_hash(validate_job(data)) == config_hash(base)
    data["spec"]["trainer"]["steps"] = base.spec.trainer.steps + 1  # a field pods read still restarts them
    assert config_hash(validate_job(data)) != config_hash(base)


def test_no_pod_is_created_while_a_deleted_namesakes_children_hold_the_names() -> None:
    """A job recreated under its name: its config and service names are still the old job's (the garbage
    collector has not run); pods made now would mount the old config. Nothing is created until they go."""
    held = plan(observe(RLJobStatus(), [], foreign_children=["ConfigMap/cp-config", "Service/cp"]))
    assert held.create == [] and held.requeue_after is not None
    assert len(plan(observe(RLJobStatus(), [])).create) == 4


def test_an_actor_rank_the_cluster_is_deleting_restarts_the_group_uncharged() -> None:
    """A drained or preempted rank terminates (deletionTimestamp, not Ready) before it vanishes: the group is
    restarted at once, not charged, and the survivors' failures that follow charge nothing either."""
    two = job(roles={"actor": {"replicas": 2}, "rollout": {"replicas": 1}, "env": {"replicas": 1}})
    names = ["cp-actor-0", "cp-actor-1", "cp-rollout-0", "cp-env-0"]
    taken = replace(pod("cp-actor-1", ready=False), terminating=True)
    pods = [pod(n) for n in names if n != "cp-actor-1"] + [taken]
    result = plan(observe(RLJobStatus(phase="Running"), pods, the_job=two))
    assert result.status.phase == "Restarting" and result.status.restarts == 0 and not result.restart_counted
    assert result.delete == ["cp-actor-0"] and "ActorDisrupted" in [e.reason for e in result.events]
    survivor_failed = [failed_pod("cp-actor-0", "a0")] + [pod(n) for n in names[2:]] + [taken]
    result = plan(observe(RLJobStatus(phase="Running"), survivor_failed, the_job=two))
    assert result.status.restarts == 0 and result.status.phase == "Restarting"
    # A rank this operator deleted is no disruption.
    result = plan(observe(RLJobStatus(phase="Running"), pods, the_job=two, deleted={taken.uid}))
    assert result.status.phase != "Restarting"


def test_a_running_job_is_not_demoted_when_an_actor_loses_readiness() -> None:
    pods = [pod("cp-actor-0", ready=False)] + [pod(n) for n in ALL[1:]]
    result = plan(observe(RLJobStatus(phase="Running"), pods))
    assert result.status.phase == "Running"
    ready = next(c for c in result.status.conditions if c.type == "Ready")
    assert ready.status == "False" and ready.reason == "PodsNotReady"


def test_a_pod_terminating_long_past_its_grace_period_is_reported_and_a_stuck_restart_stalls() -> None:
    two = job(
        roles={"actor": {"replicas": 2}, "rollout": {"replicas": 1}, "env": {"replicas": 1}},
        failurePolicy={"progressDeadlineSeconds": 600},
    )
    stuck = replace(
        pod("cp-actor-1", ready=False), terminating=True, deleted_at=rfc3339(NOW), grace_seconds=60, node="lost"
    )
    others = [pod(n) for n in ["cp-rollout-0", "cp-env-0"]]
    first = plan(observe(RLJobStatus(phase="Running"), [pod("cp-actor-0"), stuck, *others], the_job=two))
    assert first.status.phase == "Restarting"
    # Within its grace period and half a minute more it is only terminating; the job looks again then.
    later = plan(observe(first.status, [stuck, *others], the_job=two, now=NOW + seconds(80)))
    ready = next(c for c in later.status.conditions if c.type == "Ready")
    assert ready.reason != "PodStuckTerminating" and later.requeue_after == 10
    late = plan(observe(later.status, [stuck, *others], the_job=two, now=NOW + seconds(91)))
    ready = next(c for c in late.status.conditions if c.type == "Ready")
    assert ready.status == "False" and ready.reason == "PodStuckTerminating"
    assert "cp-actor-1 on node lost" in ready.message and "--force" in ready.message
    assert "PodStuckTerminating" in [e.reason for e in late.events] and late.create == []
    # The restart that cannot finish is watched by the progress deadline too.
    stalled = plan(observe(late.status, [stuck, *others], the_job=two, now=NOW + seconds(601)))
    assert next(c for c in stalled.status.conditions if c.type == "Stalled").status == "True"
    assert stalled.status.phase == "Restarting"


def test_a_refused_edit_is_reported_and_the_job_runs_on() -> None:
    refused = InvalidRLJob([Problem("spec.roles.rollout.replicas", "must be <= roles.env.replicas 2 (got 3)")])
    pods = [pod(n) for n in ALL]
    result = plan(observe(RLJobStatus(phase="Running"), pods, refused_edit=refused, generation=2))
    accepted = next(c for c in result.status.conditions if c.type == "SpecAccepted")
    assert accepted.status == "False" and accepted.reason == "InvalidSpec"
    assert "spec.roles.rollout.replicas" in accepted.message and "generation 2" in accepted.message
    assert result.status.phase == "Running" and result.delete == [] and result.create == []
    assert [e.reason for e in result.events] == ["InvalidSpec"]
    again = plan(observe(result.status, pods, refused_edit=refused, generation=2))
    assert again.events == []  # the same refusal is reported once
    fixed = plan(observe(again.status, pods, generation=3))
    assert next(c for c in fixed.status.conditions if c.type == "SpecAccepted").status == "True"
