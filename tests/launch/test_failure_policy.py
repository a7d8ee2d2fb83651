"""The one failure policy of `spec.failurePolicy`, shared by the operator and `rljob run`."""

from __future__ import annotations

from rljob.api.spec import FailurePolicySpec
from rljob.launch.failure_policy import STABLE_SECONDS, FailurePolicy, ReplicaRecord


def test_the_policy_comes_from_the_spec() -> None:
    spec = FailurePolicySpec(max_restarts=1, max_replacements=4, env="FailJob")
    policy = FailurePolicy.from_spec(spec)
    assert policy.max_restarts == 1 and policy.max_replacements == 4
    assert policy.fails_job("env") and not policy.fails_job("rollout") and not policy.fails_job("actor")


def test_failures_in_a_row_are_counted_once_each_and_back_off_exponentially() -> None:
    policy = FailurePolicy(max_replacements=3)
    record = ReplicaRecord()
    first = policy.replica_failed(record, "pid-1", at=100.0)
    assert first.counted and first.count == 1 and first.backoff_seconds == 1 and not first.give_up
    assert policy.replace_in(record, now=100.5) == 0.5 and policy.replace_in(record, now=101.0) == 0
    replay = policy.replica_failed(record, "pid-1", at=200.0)
    assert not replay.counted and record.count == 1 and record.last_failure_at == 100.0
    assert policy.replica_failed(record, "pid-2", at=110.0).backoff_seconds == 2
    assert policy.crash_looping(record)
    assert policy.replica_failed(record, "pid-3", at=120.0).backoff_seconds == 4
    assert policy.replica_failed(record, "pid-4", at=130.0).give_up  # the 4th in a row with maxReplacements 3
    assert [policy.backoff(n) for n in (1, 6, 7, 30)] == [1, 32, 60, 60]


def test_max_replacements_zero_gives_up_on_the_first_failure() -> None:
    assert FailurePolicy(max_replacements=0).replica_failed(ReplicaRecord(), "a", at=0.0).give_up


def test_the_count_is_forgotten_after_a_healthy_stretch_of_another_incarnation() -> None:
    policy = FailurePolicy()
    record = ReplicaRecord()
    policy.replica_failed(record, "pid-1", at=0.0)
    # The failed incarnation itself never clears the count; a healthy replacement does, after a while.
    assert policy.healthy_left(record, "pid-1", healthy_since=0.0, now=10_000.0) is None
    assert policy.healthy_left(record, "pid-2", healthy_since=5.0, now=105.0) == STABLE_SECONDS - 100
    assert policy.healthy_left(record, "pid-2", healthy_since=5.0, now=5.0 + STABLE_SECONDS) == 0
    policy.forgive(record)
    assert record == ReplicaRecord()
    assert policy.healthy_left(record, "pid-2", healthy_since=5.0, now=5.0 + STABLE_SECONDS) is None
    # After forgiveness the next failure is the first in a row again.
    assert policy.replica_failed(record, "pid-2", at=700.0).backoff_seconds == 1


def test_the_actor_group_restarts_at_most_max_restarts_times_and_never_under_fail_job() -> None:
    policy = FailurePolicy(max_restarts=2)
    assert [policy.may_restart_group(n) for n in range(4)] == [True, True, False, False]
    assert not FailurePolicy(actor="FailJob").may_restart_group(0)


def test_timings_can_be_tuned_for_tests() -> None:
    policy = FailurePolicy.from_spec(FailurePolicySpec(), backoff_base_seconds=0.1, backoff_max_seconds=0.3)
    assert [policy.backoff(n) for n in (1, 2, 3)] == [0.1, 0.2, 0.3]
