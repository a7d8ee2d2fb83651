"""`spec.failurePolicy` as one object, used by the operator's reconciler and by the local launcher alike.

The rules (the same for pods on a cluster and processes on one machine):

- a rollout, env or reward replica that fails is replaced after a back-off that doubles with each failure
  in a row of that replica (1 s, 2 s, 4 s ... at most 60 s, measured from the failure). Its failures in a
  row are counted once per failure (a failure has an id: a pod uid, a process id), so observing the same
  failure again charges nothing. A failure when the count already equals `maxReplacements` fails the job.
- the count is forgotten once a replacement has run healthy for `stable_seconds` (Ready on a cluster,
  alive locally; as the kubelet resets a container's crash-loop back-off after 10 minutes), or exits 0.
- evictions, preemptions and node loss are not the replica's fault: they are replaced at once and neither
  count nor reset anything (only a cluster has them).
- a failed actor restarts the whole actor group, at most `maxRestarts` times over the job's life.
- `failurePolicy.<role>: FailJob` fails the job on that role's first failure instead.

Times are seconds on the caller's clock (epoch seconds in the operator, which keeps its state in the
RLJob status; `time.monotonic()` in the launcher): the policy only ever subtracts them.
"""

from __future__ import annotations

from dataclasses import dataclass

from rljob.api.spec import FailurePolicySpec

BACKOFF_BASE_SECONDS = 1.0
"""The back-off after a replica's first failure in a row; it doubles with each further one."""
BACKOFF_MAX_SECONDS = 60.0
STABLE_SECONDS = 600.0
"""A replacement healthy this long clears its replica's failure count."""
CRASH_LOOP_FAILURES = 2
"""Failures in a row of one replica that make it a crash loop (reported, still replaced)."""


@dataclass
class ReplicaRecord:
    """Failures in a row of one replica (the operator keeps it in `status.replicaFailures`)."""

    count: int = 0
    last_failure_id: str = ""
    """The failure last counted (pod uid, process id): each failure is counted once."""
    last_failure_at: float | None = None
    """When it happened, on the caller's clock: the replacement is due a back-off later."""


@dataclass(frozen=True)
class ReplicaFailure:
    """The policy's answer to one failure of a replica."""

    counted: bool
    """True the first time this failure is seen; False when it was counted before (a replay)."""
    give_up: bool
    """The replica failed more than maxReplacements times in a row: the job fails."""
    count: int
    backoff_seconds: float
    """Replace this long after the failure."""


@dataclass(frozen=True)
class FailurePolicy:
    max_restarts: int = 3
    max_replacements: int = 10
    actor: str = "RestartGroup"
    rollout: str = "Replace"
    env: str = "Replace"
    reward: str = "Replace"
    backoff_base_seconds: float = BACKOFF_BASE_SECONDS
    backoff_max_seconds: float = BACKOFF_MAX_SECONDS
    stable_seconds: float = STABLE_SECONDS
    crash_loop_failures: int = CRASH_LOOP_FAILURES

    @classmethod
    def from_spec(cls, spec: FailurePolicySpec, **overrides: float) -> FailurePolicy:
        """The policy of a job's `spec.failurePolicy`; `overrides` change the timings (tests, benchmarks)."""
        return cls(
            max_restarts=spec.max_restarts,
            max_replacements=spec.max_replacements,
            actor=spec.actor,
            rollout=spec.rollout,
            env=spec.env,
            reward=spec.reward,
            **overrides,  # type: ignore[arg-type]
        )

    # --- every role -------------------------------------------------------------------------------

    def fails_job(self, role: str) -> bool:
        """`failurePolicy.<role>: FailJob`: the role's first failure fails the job."""
        return getattr(self, role, "") == "FailJob"

    # --- the actor group --------------------------------------------------------------------------

    def may_restart_group(self, restarts_so_far: int) -> bool:
        """Whether a failed actor group may restart once more (charged failures only)."""
        return self.actor != "FailJob" and restarts_so_far < self.max_restarts

    # --- rollout, env and reward replicas ---------------------------------------------------------

    def backoff(self, failures_in_a_row: int) -> float:
        """Seconds between a replica's failure number `failures_in_a_row` and its replacement."""
        doubled = self.backoff_base_seconds * 2 ** max(failures_in_a_row - 1, 0)
        return min(doubled, self.backoff_max_seconds)

    def replica_failed(self, record: ReplicaRecord, failure_id: str, at: float) -> ReplicaFailure:
        """Count a failure of the replica once (by `failure_id`) and say what follows."""
        counted = record.last_failure_id != failure_id
        if counted:
            record.count += 1
            record.last_failure_id = failure_id
            record.last_failure_at = at
        return ReplicaFailure(
            counted=counted,
            give_up=record.count > self.max_replacements,
            count=record.count,
            backoff_seconds=self.backoff(record.count),
        )

    def replace_in(self, record: ReplicaRecord, now: float) -> float:
        """Seconds until the failed replica's replacement is due (0 or less: now)."""
        failed_at = now if record.last_failure_at is None else record.last_failure_at
        return failed_at + self.backoff(record.count) - now

    def healthy_left(
        self, record: ReplicaRecord, incarnation_id: str, healthy_since: float, now: float
    ) -> float | None:
        """While a replacement runs healthy: seconds until its replica's count is forgotten (0 or less:
        forget it now, see `forgive`); None when there is nothing to forget or the incarnation is the
        failed one itself."""
        if record.count == 0 or incarnation_id == record.last_failure_id:
            return None
        return healthy_since + self.stable_seconds - now

    def crash_looping(self, record: ReplicaRecord) -> bool:
        return record.count >= self.crash_loop_failures

    @staticmethod
    def forgive(record: ReplicaRecord) -> None:
        """The failures are no longer in a row (a replacement stayed healthy, or exited 0)."""
        record.count = 0
        record.last_failure_id = ""
        record.last_failure_at = None
