"""The reconciler's training-health conditions: entropy and mismatch windows kept in status, and Diverged."""

from __future__ import annotations

from rljob.api import validate_job
from rljob.api.status import Progress, RLJobStatus
from rljob.operator.reconcile import plan
from rljob.runtime.wire.identity import EXIT_DIVERGED
from tests.operator.test_reconcile import ALL, job, observe, pod

HEALTH = {"entropyFloor": 0.1, "windowSteps": 3, "mismatchKlThreshold": 0}


def _look(status: RLJobStatus, step: int, entropy: float | None):
    progress = Progress(step=step, total_steps=150, entropy=entropy)
    return plan(observe(status, [pod(n) for n in ALL], progress=progress, the_job=job(health=HEALTH)))


def _condition(status: RLJobStatus, kind: str):
    return next((c for c in status.conditions if c.type == kind), None)


def test_entropy_below_the_floor_for_the_window_sets_the_condition_once_and_recovery_clears_it() -> None:
    status = RLJobStatus(phase="Running")
    for step in (4, 5):
        status = _look(status, step, 0.02).status
        assert _condition(status, "EntropyCollapsed") is None
    result = _look(status, 6, 0.02)
    condition = _condition(result.status, "EntropyCollapsed")
    assert condition is not None and condition.status == "True" and condition.reason == "EntropyBelowFloor"
    assert condition.message == (
        "policy entropy 0.02 at step 6, below spec.health.entropyFloor (0.1) for 3 steps (since step 4)"
    )
    assert [(e.type, e.reason) for e in result.events] == [("Warning", "EntropyBelowFloor")]
    assert result.status.health == "EntropyCollapsed"

    again = _look(result.status, 7, 0.01)
    assert not again.events and again.status.health == "EntropyCollapsed"  # one Event per transition

    back = _look(again.status, 8, 0.4)
    condition = _condition(back.status, "EntropyCollapsed")
    assert condition is not None and condition.status == "False" and condition.reason == "Recovered"
    assert [(e.type, e.reason) for e in back.events] == [("Normal", "Recovered")]
    assert back.status.health == ""


def test_a_replayed_read_of_the_same_step_counts_once() -> None:
    status = RLJobStatus(phase="Running")
    for _ in range(5):  # an operator restart or a fast requeue reads step 4 again and again
        status = _look(status, 4, 0.02).status
    assert _condition(status, "EntropyCollapsed") is None
    assert status.health_streaks["EntropyCollapsed"].since == 4
    assert status.health_streaks["EntropyCollapsed"].step == 4


def test_an_actor_that_diverged_fails_the_job_with_the_values_and_is_not_restarted() -> None:
    said = "step 12: non-finite loss nan, grad_norm inf; last good checkpoint: /checkpoints/step-00000010"
    terminated = {"exitCode": EXIT_DIVERGED, "reason": "Error", "message": said}
    statuses = [{"name": "main", "state": {"terminated": terminated}}]
    diverged = pod("cp-actor-0", "Failed", False, containerStatuses=statuses)
    result = plan(observe(RLJobStatus(phase="Running"), [pod(n) for n in ALL[1:]] + [diverged]))
    assert result.status.phase == "Failed" and result.status.restarts == 0
    failed = _condition(result.status, "Failed")
    assert failed is not None and failed.reason == "Diverged" and said in failed.message
    condition = _condition(result.status, "Diverged")
    assert condition is not None and condition.status == "True" and condition.reason == "NonFiniteUpdate"
    assert said in condition.message
    assert ("Warning", "Diverged") in [(e.type, e.reason) for e in result.events]
    assert result.status.health == "Diverged"
    assert "cp-actor-0" not in result.create


def test_of_two_failed_actor_ranks_the_one_that_diverged_names_the_failure() -> None:
    """Rank 1 diverged; rank 0 failed only because its peer went: the job is Diverged, not an ActorFailed restart."""
    two_actors = job(health=HEALTH)
    data = two_actors.model_dump(mode="json", by_alias=True, exclude_none=True)
    data["spec"]["roles"]["actor"]["replicas"] = 2
    the_job = validate_job(data)
    peer_gone = {"exitCode": 1, "reason": "Error", "message": "rank 1 left the group"}
    said = {"exitCode": EXIT_DIVERGED, "reason": "Error", "message": "step 7: non-finite loss nan"}
    failed = [
        pod(name, "Failed", False, containerStatuses=[{"name": "main", "state": {"terminated": terminated}}])
        for name, terminated in (("cp-actor-0", peer_gone), ("cp-actor-1", said))
    ]
    result = plan(observe(RLJobStatus(phase="Running"), [pod(n) for n in ALL[1:]] + failed, the_job=the_job))
    assert result.status.phase == "Failed" and result.status.restarts == 0
    assert _condition(result.status, "Failed").reason == "Diverged"
