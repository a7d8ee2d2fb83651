"""Desired vs observed -> actions and the new status. Pure: no API, no clock, no kopf.

The controller feeds one `Observation` of a job (its spec or why the spec is invalid, the status it
last wrote, the pods it sees, the pods it has asked for and not seen yet) and carries out the `Plan`.
Every decision is idempotent, so replaying an observation (a stale cache, an operator restart) never
does a thing twice: pods have deterministic names, and the restart budget is charged only on the
transition into Restarting, which is written to status before any pod is touched. The deletions of a
restart are re-derived on every pass while Restarting (every live actor belongs to the old group; every
pod whose config-hash annotation differs from the desired pods' belongs to the old spec), so a failed
DELETE or an operator that died between the status write and the deletes still finishes the restart.

Failure policy (spec.failurePolicy, applied through `rljob.launch.failure_policy.FailurePolicy`, the object
`rljob run` uses too):
- actor pod failed (its code, not the cluster) -> the whole actor group is deleted and recreated and
  resumes from its checkpoint; `restarts` +1; past maxRestarts the job fails (BackoffLimitExceeded).
- an actor pod lost to eviction, preemption or node loss, or gone while the group runs -> the same group
  restart without charging the budget.
- an actor pod that exits EXIT_PREEMPTED (it got SIGTERM, every rank stopped at one step boundary and rank 0
  wrote that step's checkpoint) -> the same group restart, not charged (reason ActorPreempted), once actor
  replica 0 has ended: the new group resumes at the next step. Its pods' terminationGracePeriodSeconds is
  spec.checkpoint.preemptionGraceSeconds.
- rollout / env / reward pod failed or gone -> that pod alone is replaced; training goes on; its role's
  `failed` count grows (disruptions are replaced without counting). A replica that keeps failing is
  replaced after an exponential back-off (1 s, 2 s, 4 s ... 60 s from the failed pod's finish); its failures
  in a row are counted in `status.replicaFailures` (charged once per failed pod uid, so replays count
  nothing twice) and past maxReplacements the job fails (BackoffLimitExceeded). The count is forgotten
  once a replacement stays Ready for the policy's stable time (10 minutes) or exits 0.
- actor replica 0 exits 0 -> Succeeded; pods still running are deleted (finished ones stay for logs).
- a spec edit that changes what pods run (anything but rollout replicas and autoscale, health, suspend,
  failurePolicy, activeDeadlineSeconds, ttlSecondsAfterFinished and isolation) -> controlled restart of every
  pod, not charged.
- spec.roles.rollout.autoscale (llm jobs) -> on each pass the actor's fresh `trainerWait` / `rolloutIdle` are
  added to `status.autoscale.samples` and `rljob.launch.autoscale.decide` picks the rollout count; a change is
  the plan's `scale_rollouts` (written through the scale subresource, after the status that records the
  scaling's time and step, so cooldowns survive an operator restart and a replay never scales twice) and a
  Normal Event ScaledRollouts. What follows is the hand-scaling path below: the actor never restarts.
- llm rollout replicas edited (`kubectl scale`) -> missing rollout pods are created, those past the new count
  (the highest indices) deleted; actor and reward pods are untouched and nothing counts as a restart. The
  plan's `rollout_members` (the Ready rollout pods that stay) is what the actor feeds: the controller
  writes it to the membership ConfigMap (rljob/operator/manifests/members.py). A gym job's rollout count is
  part of its config hash: a new count is a controlled restart, as above.
- quota-aware admission: the pods a pass would create are first charged against the namespace's ResourceQuotas
  (rljob/operator/admission.py, in the controller); when they do not all fit, none is created and Ready says
  QuotaExceeded with the quota and the amounts, retried with back-off (`Observation.admission`).
- a collocated job (`roles.rollout.collocated`) has no rollout pods: its rollout runs in the actor pod, whose
  process restarts it (rljob/runtime/roles/collocated.py); the pod's failure is an actor failure as above, and the
  rollout counts as ready with its actor pod. No membership is kept. An actor pod that ends with
  EXIT_ROLLOUT_GAVE_UP says its rollout could not be kept running (FailJob, or past maxReplacements): the
  job fails (PodFailed, BackoffLimitExceeded) as for a rollout pod of its own, with no group restart.
"""

from __future__ import annotations

import copy
import datetime
from dataclasses import dataclass, field
from typing import Any, Literal

from rljob.api import ROLE_NAMES, InvalidRLJob, RLJob
from rljob.api.status import (
    TERMINAL_PHASES,
    AutoscaleStatus,
    HealthStreak,
    Progress,
    ReplicaFailures,
    RLJobStatus,
    ScaleSample,
)
from rljob.launch.autoscale import SCALED_ROLLOUTS, Sample, decide, record, rewind
from rljob.launch.failure_policy import FailurePolicy, ReplicaRecord
from rljob.launch.health import DIVERGED, HEALTH_TYPES, NON_FINITE_UPDATE, Streak, checks, health_summary, observe
from rljob.launch.stall import PROGRESS_DEADLINE_EXCEEDED, PROGRESSING, STALLED, stalled_message
from rljob.operator.admission import LIMIT_RANGE_EXCEEDED, QUOTA_EXCEEDED
from rljob.operator.manifests.members import elastic_rollouts
from rljob.operator.naming import ANNOTATION_CONFIG_HASH as CONFIG_HASH
from rljob.operator.naming import LABEL_JOB, LABEL_ROLE
from rljob.operator.podstate import SCHEDULING_GATED, PodState
from rljob.operator.status import (
    FAILED,
    READY,
    RESTARTING,
    SCHEDULED,
    SUCCEEDED,
    SUSPENDED,
    clear_condition,
    container_problems,
    describe_pods,
    get_condition,
    parse_rfc3339,
    rfc3339,
    role_counts,
    scheduling_problems,
    set_condition,
)
from rljob.runtime.wire.identity import EXIT_DIVERGED, EXIT_FATAL_CONFIG, EXIT_PREEMPTED, EXIT_ROLLOUT_GAVE_UP

Manifest = dict[str, Any]
EventType = Literal["Normal", "Warning"]

SPEC_ACCEPTED = "SpecAccepted"
"""False with reason InvalidSpec while a started job's latest edit is refused and it runs on its last valid spec."""
STUCK_TERMINATING = "PodStuckTerminating"
"""Ready's reason while a pod terminates well past its grace period (a lost node)."""
STUCK_MARGIN_SECONDS = 30
"""A pod is stuck terminating once its grace period and as long again (at most this, at least 1 s) are over."""
CHECKPOINT_STORAGE = "CheckpointStorage"
"""False with reason NoDefaultStorageClass while the checkpoint claim the operator made cannot bind."""
NO_DEFAULT_STORAGE_CLASS = "NoDefaultStorageClass"
CHILDREN_CREATED = "ChildrenCreated"
"""False with reason FailedCreate while the server refuses one of the job's other children."""
FAILED_CHILDREN_RETRY_SECONDS = 5.0
"""How soon a job whose children the server refused tries again."""
FOREIGN_CHILDREN_RETRY_SECONDS = 2.0
"""How soon a job whose children's names are still held by a deleted namesake looks again."""

STOPPED_FOR_GOOD = (EXIT_FATAL_CONFIG, EXIT_DIVERGED, EXIT_ROLLOUT_GAVE_UP)
"""Actor exit codes that say why the whole group stopped and that no group restart would fix."""


def policy_of(job: RLJob) -> FailurePolicy:
    """The job's failure policy: the same object, and so the same bounds, as `rljob run` applies."""
    return FailurePolicy.from_spec(job.spec.failure_policy)


def _record(failures: ReplicaFailures) -> ReplicaRecord:
    """The policy's view of a `status.replicaFailures` entry (times as epoch seconds)."""
    at = parse_rfc3339(failures.last_failure_time)
    return ReplicaRecord(failures.count, failures.last_pod_uid, at.timestamp() if at is not None else None)


def _store(record: ReplicaRecord, failures: ReplicaFailures) -> None:
    failures.count = record.count
    failures.last_pod_uid = record.last_failure_id
    if record.last_failure_at is not None:
        failures.last_failure_time = rfc3339(datetime.datetime.fromtimestamp(record.last_failure_at, datetime.UTC))


@dataclass(frozen=True)
class JobEvent:
    """A Kubernetes Event to post on the RLJob."""

    type: EventType
    reason: str
    message: str


@dataclass
class Observation:
    """Everything the reconciler knows about one job at one moment."""

    job: RLJob | None
    """The validated, resolved job; None when `invalid` says why it is not."""
    invalid: InvalidRLJob | None
    generation: int
    status: RLJobStatus
    pods: list[PodState]
    desired_pods: dict[str, Manifest]
    """Name -> manifest of every pod the spec asks for (empty when the spec is invalid). Only the names and each
    manifest's metadata are read (the operator passes just those: `PackedChildren.heads`), and nothing is changed."""
    now: datetime.datetime
    expected: set[str] = field(default_factory=set)
    """Pods created recently that the watch has not delivered yet: not missing, just not seen."""
    spec_changed: bool = False
    """The spec changed in a way that needs new pods (see module docstring)."""
    progress: Progress | None = None
    """Fresh progress from actor 0, when it answered."""
    deleted: set[str] = field(default_factory=set)
    """uids of pods this operator deleted (still listed, or recently): any other terminating pod was deleted by
    someone else (a drain, a preemption, `kubectl delete pod`)."""
    refused_edit: InvalidRLJob | None = None
    """The latest spec edit passed the CRD but not rljob's validation; `job` is the last valid spec, which the
    started job keeps running on."""
    failed_children: list[str] = field(default_factory=list)
    """`Kind/name: why` of children the server refused to create (the PodGroup of `gang: volcano` on a cluster
    without Volcano, a quota, an admission webhook)."""
    foreign_children: list[str] = field(default_factory=list)
    """`Kind/name` of children (ConfigMap, Service, PodGroup, NetworkPolicy) whose name another owner still
    holds, typically a deleted namesake's that the garbage collector has not removed yet."""
    admission: tuple[str, str] | None = None
    """(reason, message) why the pods this pass would create may not be created now: the namespace's
    ResourceQuotas or LimitRanges (rljob/operator/admission.py), or the server refused one of them. None of them
    is created (never a partial gang); Ready says why."""
    storage_problem: str | None = None
    """Why the job's checkpoint claim will not bind (no StorageClass named, no default one in the cluster)."""
    admission_retry_seconds: float = 1.0
    """How soon a job waiting for admission looks again (the controller's back-off)."""


@dataclass
class Plan:
    status: RLJobStatus
    create: list[str] = field(default_factory=list)
    delete: list[str] = field(default_factory=list)
    events: list[JobEvent] = field(default_factory=list)
    delete_job: bool = False
    requeue_after: float | None = None
    """Seconds until the plan changes on its own (deadline, TTL), if nothing else happens first."""
    replaced: list[tuple[str, str]] = field(default_factory=list)
    """(role, why) of every pod deleted to be replaced: for metrics."""
    restart_counted: bool = False
    rollout_members: list[int] | None = None
    """llm jobs that run: the rollout replicas (indices) the actor may feed now, Ready and not being deleted.
    None where there is no membership to keep (gym jobs, finished jobs)."""
    scale_rollouts: int | None = None
    """The rollout count the autoscaler set (spec.roles.rollout.autoscale), to write through the scale
    subresource; None when it stays."""


class _Planner:
    def __init__(self, obs: Observation) -> None:
        self.obs = obs
        self.status = copy.deepcopy(obs.status)
        self.plan = Plan(status=self.status)
        self.now = obs.now
        self.pods = {p.name: p for p in obs.pods}
        self.live = [p for p in obs.pods if not p.terminating]
        self.new_failures: dict[str, int] = {}
        self.waiting_admission: tuple[str, str] | None = None
        self.desired_hash = next(
            (h for m in obs.desired_pods.values() if (h := m["metadata"].get("annotations", {}).get(CONFIG_HASH))),
            "",
        )

    # --- helpers --------------------------------------------------------------------------------

    def event(self, kind: EventType, reason: str, message: str) -> None:
        self.plan.events.append(JobEvent(kind, reason, message))

    def transition(self, phase: str, reason: str, message: str) -> None:
        if self.status.phase == phase:
            return
        kind: EventType = "Warning" if phase in ("Failed", "Restarting") else "Normal"
        self.event(kind, reason, f"{self.status.phase} -> {phase}: {message}")
        self.status.phase = phase  # type: ignore[assignment]
        self.status.running_since = rfc3339(self.now) if phase == "Running" else None

    def delete(self, pod: PodState) -> None:
        if not pod.terminating and pod.name not in self.plan.delete:
            self.plan.delete.append(pod.name)

    def delete_active(self) -> None:
        """Delete pods still running or waiting; finished pods stay for `kubectl logs`."""
        for pod in self.live:
            if not pod.finished:
                self.delete(pod)

    def finish(self, succeeded: bool, reason: str, message: str) -> None:
        self.status.completion_time = self.status.completion_time or rfc3339(self.now)
        set_condition(self.status, SUCCEEDED if succeeded else FAILED, True, reason, message, self.now)
        clear_condition(self.status, RESTARTING, reason, message, self.now)
        self.transition("Succeeded" if succeeded else "Failed", reason, message)
        self.delete_active()
        self.schedule_ttl()

    def requeue(self, seconds: float) -> None:
        seconds = max(seconds, 0.0)
        current = self.plan.requeue_after
        self.plan.requeue_after = seconds if current is None else min(current, seconds)

    def schedule_ttl(self) -> None:
        job = self.obs.job
        ttl = job.spec.ttl_seconds_after_finished if job is not None else None
        finished = parse_rfc3339(self.status.completion_time)
        if ttl is None or finished is None:
            return
        left = (finished - self.now).total_seconds() + ttl
        if left <= 0:
            self.plan.delete_job = True
        else:
            self.requeue(left)

    # --- the decision ---------------------------------------------------------------------------

    def run(self) -> Plan:
        obs = self.obs
        self.retry_fixed_spec()
        if self.status.phase in TERMINAL_PHASES:
            self.delete_active()
            self.schedule_ttl()
            return self.finalize()
        if obs.invalid is not None or obs.job is None:
            problems = obs.invalid.problems if obs.invalid else []
            message = "; ".join(p.render() for p in problems) or "the spec is not a valid RLJob"
            self.finish(False, "InvalidSpec", message)
            return self.finalize()
        job = obs.job
        self.report_refused_edit()
        if self.deadline_exceeded(job):
            return self.finalize()
        if job.spec.suspend:
            self.suspend()
            return self.finalize()
        if self.status.phase == "Suspended":
            set_condition(self.status, SUSPENDED, False, "Resumed", "spec.suspend is false", self.now)
            self.transition("Pending", "Resumed", "pods are recreated; the actor resumes from its checkpoint")
        if self.status.start_time is None:
            self.status.start_time = rfc3339(self.now)
            if job.spec.active_deadline_seconds:
                self.requeue(job.spec.active_deadline_seconds)
        if self.succeeded(job):
            return self.finalize()
        if self.status.phase != "Restarting" and (obs.spec_changed or any(self.stale(p) for p in self.actors())):
            self.restart_all()
        if self.status.phase == "Restarting":
            self.continue_restart()
        else:
            self.check_actors(job)
        if self.status.phase in TERMINAL_PHASES:
            return self.finalize()
        self.replace_other_roles(job)
        if self.status.phase in TERMINAL_PHASES:
            return self.finalize()
        self.create_missing()
        self.update_phase()
        self.check_stalled(job)
        self.check_health(job)
        if self.status.phase not in TERMINAL_PHASES:
            self.autoscale(job)
        return self.finalize()

    def retry_fixed_spec(self) -> None:
        """A job failed for an invalid spec gets another chance once its spec is edited (and valid)."""
        failed = get_condition(self.status, FAILED)
        edited = self.obs.generation != (self.status.observed_generation or 0)
        if (
            self.status.phase == "Failed"
            and failed is not None
            and failed.reason == "InvalidSpec"
            and edited
            and self.obs.job is not None
        ):
            self.status.conditions = [c for c in self.status.conditions if c.type != FAILED]
            self.status.completion_time = None
            self.transition("Pending", "SpecFixed", "the edited spec is valid")

    def report_refused_edit(self) -> None:
        """SpecAccepted: False (InvalidSpec, every problem, a Warning Event for each new refusal) while the
        latest edit is refused and the job runs on its last valid spec; True once an edit is valid again."""
        refused = self.obs.refused_edit
        current = get_condition(self.status, SPEC_ACCEPTED)
        if refused is not None:
            problems = "; ".join(p.render() for p in refused.problems) or "the spec is not a valid RLJob"
            message = f"generation {self.obs.generation} refused: {problems}; the job runs on its last valid spec"
            if current is None or current.status != "False" or current.message != message:
                self.event("Warning", "InvalidSpec", message)
            set_condition(self.status, SPEC_ACCEPTED, False, "InvalidSpec", message, self.now)
        elif current is not None and current.status == "False":
            message = f"generation {self.obs.generation} is valid"
            set_condition(self.status, SPEC_ACCEPTED, True, "Accepted", message, self.now)
            self.event("Normal", "SpecAccepted", message)

    def deadline_exceeded(self, job: RLJob) -> bool:
        limit = job.spec.active_deadline_seconds
        started = parse_rfc3339(self.status.start_time)
        if not limit or started is None or self.status.phase == "Suspended":
            return False
        left = (started - self.now).total_seconds() + limit
        if left > 0:
            self.requeue(left)
            return False
        self.finish(False, "DeadlineExceeded", f"the job ran longer than activeDeadlineSeconds ({limit}s)")
        return True

    def check_stalled(self, job: RLJob) -> None:
        """Stalled when a Running job completed no training step within progressDeadlineSeconds.

        The clock starts at the actor's last step (`progress.updatedAt`), and never before the job became
        Running: pods that are still starting are Pending/Starting, with their own reasons.
        """
        policy = job.spec.failure_policy
        deadline = policy.progress_deadline_seconds
        stalled = get_condition(self.status, STALLED)
        if not deadline:
            return
        progress = self.obs.progress or self.status.progress
        if self.status.phase == "Running":
            running_since = parse_rfc3339(self.status.running_since)
        elif self.status.phase == "Restarting":
            # A restart that never ends (an old rank stuck terminating on a lost node) makes no progress either:
            # measured from the moment the restart began.
            restarting = get_condition(self.status, RESTARTING)
            began = restarting.last_transition_time if restarting and restarting.status == "True" else None
            running_since = parse_rfc3339(began)
        else:
            return
        if running_since is None:
            return
        last_step = parse_rfc3339(progress.updated_at)
        since = max(running_since, last_step) if last_step is not None else running_since
        idle = (self.now - since).total_seconds()
        if idle < deadline:
            if stalled is not None and stalled.status == "True":
                message = f"training resumed: step {progress.step} of {job.spec.trainer.steps}"
                set_condition(self.status, STALLED, False, PROGRESSING, message, self.now)
                self.event("Normal", PROGRESSING, message)
            self.requeue(deadline - idle)
            return
        message = stalled_message(idle, deadline, progress.step, job.spec.trainer.steps, progress.issue)
        flipped = set_condition(self.status, STALLED, True, PROGRESS_DEADLINE_EXCEEDED, message, self.now)
        if flipped:
            self.event("Warning", STALLED, message)
        if policy.on_stalled == "FailJob":
            self.finish(False, STALLED, f"{message} (spec.failurePolicy.onStalled: FailJob)")
        else:
            self.requeue(min(deadline, 60))  # keep the message's idle time and the actor's reason current

    def autoscale(self, job: RLJob) -> None:
        """spec.roles.rollout.autoscale: the rollout count for the actor's latest signal (module docstring)."""
        spec = job.spec.roles.rollout.autoscale
        if spec is None or not elastic_rollouts(job):
            self.status.autoscale = None
            return
        state = self.status.autoscale or AutoscaleStatus()
        progress = self.obs.progress
        samples = [Sample(s.step, s.trainer_wait, s.rollout_idle) for s in state.samples]
        if progress is not None and self.status.phase == "Running":
            samples, state.last_scale_step = rewind(samples, progress.step, state.last_scale_step)
            samples = record(samples, progress.step, progress.trainer_wait, progress.rollout_idle)
        last = parse_rfc3339(state.last_scale_time)
        current = job.spec.roles.rollout.replicas
        # Outside Running (a restart, a resume from suspend) the signal is old: only the bounds apply.
        decision = decide(
            spec,
            current,
            samples if self.status.phase == "Running" else [],
            last.timestamp() if last is not None else None,
            state.last_scale_step,
            self.now.timestamp(),
        )
        state.samples = [
            ScaleSample(step=s.step, trainer_wait=s.trainer_wait, rollout_idle=s.rollout_idle) for s in samples
        ]
        state.replicas = decision.replicas
        if decision.direction is not None:
            state.reason = decision.reason
            state.last_scale_time = rfc3339(self.now)
            state.last_scale_direction = decision.direction
            state.last_scale_step = samples[-1].step if samples else state.last_scale_step
            self.plan.scale_rollouts = decision.replicas
            self.event("Normal", SCALED_ROLLOUTS, decision.reason)
        self.status.autoscale = state

    def check_health(self, job: RLJob) -> None:
        """EntropyCollapsed / MismatchHigh from the actor's latest step, against spec.health's windows.

        The streaks live in status (keyed by condition type, with the last step looked at), so an operator
        restart or a replayed read counts no step twice. Each transition posts one Event.
        """
        progress = self.obs.progress
        if progress is None or self.status.phase != "Running":
            return
        values = {"entropy": progress.entropy, "mismatchKl": progress.mismatch_kl}
        for check in checks(job.spec.health):
            stored = self.status.health_streaks.get(check.type, HealthStreak())
            streak = Streak(stored.since, stored.step)
            condition = get_condition(self.status, check.type)
            active = condition is not None and condition.status == "True"
            verdict = observe(check, streak, progress.step, values[check.key], active)
            self.status.health_streaks[check.type] = HealthStreak(since=streak.since, step=streak.step)
            if verdict is None:
                continue
            set_condition(self.status, check.type, verdict.active, verdict.reason, verdict.message, self.now)
            self.event("Warning" if verdict.active else "Normal", verdict.reason, verdict.message)
        self.update_health()

    def update_health(self) -> None:
        """The HEALTH column: the training-health conditions that are True."""
        self.status.health = health_summary(
            {c.type for c in self.status.conditions if c.type in HEALTH_TYPES and c.status == "True"}
        )

    def fail_diverged(self, pod: PodState) -> None:
        """The actor stopped on a non-finite update: a restart from the same checkpoint would diverge again."""
        detail = pod.message.strip() or f"the actor exited with code {EXIT_DIVERGED} (see `kubectl logs {pod.name}`)"
        message = f"{pod.name}: {detail}"
        set_condition(self.status, DIVERGED, True, NON_FINITE_UPDATE, message, self.now)
        self.event("Warning", DIVERGED, message)
        self.update_health()
        self.count_roles()
        self.finish(False, DIVERGED, f"{message}; not restarted (it would diverge again from the same checkpoint)")

    def suspend(self) -> None:
        for pod in self.live:
            self.delete(pod)
        set_condition(self.status, SUSPENDED, True, "Suspended", "spec.suspend is true: pods deleted", self.now)
        clear_condition(self.status, RESTARTING, "Suspended", "the job is suspended", self.now)
        # Like a Kubernetes Job: the deadline counts running time, so it starts again on resume.
        self.status.start_time = None
        self.transition("Suspended", "Suspended", "pods deleted; status kept")
        self.count_roles()

    def succeeded(self, job: RLJob) -> bool:
        actor0 = self.pods.get(_pod_name(self.obs, "actor", 0))
        if actor0 is None or not (actor0.succeeded or (actor0.exit_code == 0 and actor0.finished)):
            return False
        total = job.spec.trainer.steps
        self.status.progress.total_steps = self.status.progress.total_steps or total
        # The contract: actor 0 exits 0 only once trainer.steps are done.
        self.status.progress.step = self.status.progress.total_steps
        self.count_roles()
        self.finish(True, "TrainingCompleted", f"actor 0 exited 0 after {total} steps")
        return True

    def actors(self) -> list[PodState]:
        return [p for p in self.live if p.role == "actor"]

    def stale(self, pod: PodState) -> bool:
        """The pod was built from an older spec: its config hash differs from the desired pods' hash.

        A pod without the annotation (not built by this operator) is never taken for stale."""
        return bool(pod.config_hash) and bool(self.desired_hash) and pod.config_hash != self.desired_hash

    def continue_restart(self) -> None:
        """Re-derive a restart's deletions on every pass while Restarting.

        The transition is written to status before any pod is deleted, so a failed DELETE or an operator
        that died in between leaves old pods behind: every actor still alive belongs to the old group (the
        new one is created only once no actor is left, in the pass that leaves Restarting), and every pod
        with another config hash belongs to the old spec. Deleting them again is idempotent."""
        for pod in self.live:
            if pod.role == "actor" or self.stale(pod):
                self.delete(pod)

    def restart_all(self) -> None:
        for pod in self.live:
            self.delete(pod)
        message = "the spec changed: every pod is recreated; the actor resumes from its checkpoint"
        # New pods from a new spec (a fixed image, say) start with a clean record.
        self.status.replica_failures = {}
        set_condition(self.status, RESTARTING, True, "SpecChanged", message, self.now)
        self.transition("Restarting", "SpecChanged", message)

    def check_actors(self, job: RLJob) -> None:
        """Decide whether the actor group must restart, and whether that is charged to maxRestarts."""
        actors = [p for p in self.live if p.role == "actor"]
        # Ranks other than 0 may exit 0 a moment before rank 0 does at the end: only failures count.
        failed = [p for p in actors if p.failed]
        # A vanished actor matters once the group runs; while it starts, the missing rank is just created
        # (its peers still wait in the rendezvous), and a refused creation does not loop through restarts.
        group_started = self.status.phase == "Running"
        missing = [
            name
            for name in _role_pod_names(self.obs, "actor")
            if name not in self.pods and name not in self.obs.expected and group_started
        ]
        # A rank deleted by someone else (drain, preemption, a hand delete) terminates through its grace period,
        # no longer Ready, then vanishes: the group is broken from the moment it is deleted.
        taken = [
            p
            for p in self.obs.pods
            if p.role == "actor" and p.terminating and p.uid not in self.obs.deleted and not p.finished
        ]
        if not failed and not missing and not taken:
            return
        # An actor that stopped on SIGTERM at a step boundary (EXIT_PREEMPTED) wrote its checkpoint: not a failure.
        # Its group agreed to stop, so while replica 0 (which writes the checkpoint) still runs, it is waited for.
        preempted = [p for p in failed if p.exit_code == EXIT_PREEMPTED]
        failed_for_real = [p for p in failed if p.exit_code != EXIT_PREEMPTED]
        writer = next((p for p in actors if p.replica == 0), None)
        if preempted and not failed_for_real and not missing and not taken and writer and not writer.finished:
            return
        charged = [p for p in failed_for_real if p.failed and not p.disrupted]
        if taken:
            # The survivors' failures are the loss of their peer, not their own: only a stop for good counts.
            charged = [p for p in charged if p.exit_code in STOPPED_FOR_GOOD]
        if charged:
            # A rank that diverged or found the config unusable says why the group stopped; the others only
            # saw their peer go (ranks in one observation can have failed either way).
            pod = next((p for p in charged if p.exit_code in STOPPED_FOR_GOOD), charged[0])
            why = f"actor pod {pod.name} failed" + (f" (exit code {pod.exit_code})" if pod.exit_code else "")
            if pod.reason or pod.message:
                why += f": {' '.join(x for x in (pod.reason, pod.message) if x)}"
            if pod.exit_code == EXIT_FATAL_CONFIG:
                self.fail_on_config_error(pod)
                return
            if pod.exit_code == EXIT_DIVERGED:
                self.fail_diverged(pod)
                return
            if pod.exit_code == EXIT_ROLLOUT_GAVE_UP and job.spec.roles.rollout.collocated:
                self.fail_collocated_rollout(job, pod)
                return
            policy = policy_of(job)
            if policy.fails_job("actor"):
                self.finish(False, "PodFailed", f"{why}; failurePolicy.actor is FailJob")
                return
            if not policy.may_restart_group(self.status.restarts):
                self.finish(
                    False,
                    "BackoffLimitExceeded",
                    f"{why}; the actor group already restarted {self.status.restarts} times "
                    f"(failurePolicy.maxRestarts {policy.max_restarts})",
                )
                return
            self.status.restarts += 1
            self.plan.restart_counted = True
            reason = "ActorFailed"
            message = f"{why}; restarting the actor group ({self.status.restarts}/{policy.max_restarts})"
        elif preempted and not taken:
            pod = next((p for p in preempted if p.replica == 0), preempted[0])
            reason = "ActorPreempted"
            message = (
                f"actor pod {pod.name} stopped on SIGTERM after checkpointing its last step (exit code "
                f"{EXIT_PREEMPTED}); restarting the actor group from that checkpoint (not counted against maxRestarts)"
            )
        elif taken:
            pod = taken[0]
            reason = "ActorDisrupted"
            message = (
                f"actor pod {pod.name} is being deleted by the cluster (a drain, a preemption or a hand delete); "
                "restarting the actor group (not counted against maxRestarts)"
            )
        elif any(p.disrupted for p in failed):
            pod = next(p for p in failed if p.disrupted)
            reason = "ActorDisrupted"
            message = f"actor pod {pod.name} was disrupted" + (f" ({pod.reason})" if pod.reason else "")
            message += "; restarting the actor group (not counted against maxRestarts)"
        else:
            reason = "ActorLost"
            message = f"actor pod {missing[0]} disappeared; restarting the actor group (not counted)"
        for pod in actors:
            self.delete(pod)
            self.plan.replaced.append(("actor", reason))
        set_condition(self.status, RESTARTING, True, reason, message, self.now)
        self.transition("Restarting", reason, message)

    def replace_other_roles(self, job: RLJob) -> None:
        desired = set(self.obs.desired_pods)
        policy = policy_of(job)
        for pod in self.live:
            if pod.name not in desired or self.stale(pod):
                self.delete(pod)  # scaled down, or left over from an older spec
                continue
            if pod.role == "actor":
                continue
            key = _replica_key(pod.role, pod.replica)
            if not pod.finished:
                self.forgive_if_stable(policy, key, pod)
                continue
            if pod.failed and not pod.disrupted:
                if pod.exit_code == EXIT_FATAL_CONFIG:
                    self.fail_on_config_error(pod)
                    return
                if policy.fails_job(pod.role):
                    self.finish(
                        False, "PodFailed", f"{pod.role} pod {pod.name} failed; failurePolicy.{pod.role} is FailJob"
                    )
                    return
                if not self.replace_failed(policy, key, pod):
                    return
                continue
            if pod.disrupted:
                reason, kind = "PodDisrupted", "Normal"  # not the replica's fault: its count stays as it is
            else:
                reason, kind = "PodExited", "Normal"
                self.status.replica_failures.pop(key, None)  # exited 0: the failures are no longer in a row
            self.event(kind, reason, f"{pod.name}{_detail(pod)} is replaced; training goes on")
            self.plan.replaced.append((pod.role, reason))
            self.delete(pod)
        wanted = {
            _replica_key(_role_of(m), int(m["metadata"]["labels"]["rljob.io/replica"]))
            for m in self.obs.desired_pods.values()
        }
        for key in [k for k in self.status.replica_failures if k not in wanted]:
            del self.status.replica_failures[key]  # scaled away

    def fail_collocated_rollout(self, job: RLJob, pod: PodState) -> None:
        """A collocated actor pod ended because the rollout beside the actor could not be kept running: the job
        fails as it would for a rollout pod of its own. A group restart would only start the count again."""
        replica = pod.replica
        what = pod.message.strip() or f"rollout[{replica}] failed (exit code {EXIT_ROLLOUT_GAVE_UP})"
        where = f"rollout replica {replica} (in actor pod {pod.name}): {what}"
        self.new_failures["rollout"] = self.new_failures.get("rollout", 0) + 1
        self.count_roles()
        policy = policy_of(job)
        if policy.fails_job("rollout"):
            self.finish(False, "PodFailed", f"{where}; failurePolicy.rollout is FailJob")
            return
        self.finish(
            False,
            "BackoffLimitExceeded",
            f"{where}; fix the cause (`rollout[{replica}] |` lines in kubectl logs {pod.name}) or raise "
            f"spec.failurePolicy.maxReplacements",
        )

    def fail_on_config_error(self, pod: PodState) -> None:
        """A role that exited EXIT_FATAL_CONFIG would fail the same way again: no restart, no replacement."""
        self.count_roles()
        self.finish(
            False,
            "InvalidConfig",
            f"{pod.role} pod {pod.name} stopped on a configuration error{_detail(pod)}; it is not retried: "
            f"fix the spec (the reason is in `kubectl logs {pod.name}`)",
        )

    def replace_failed(self, policy: FailurePolicy, key: str, pod: PodState) -> bool:
        """Count a failed rollout/env/reward pod once, then replace it after the back-off; False when
        the replica is out of replacements and the job failed."""
        limit = policy.max_replacements
        failures = self.status.replica_failures.setdefault(key, ReplicaFailures())
        record = _record(failures)
        failed_at = parse_rfc3339(pod.finished_at) or self.now
        # The count is written to status before the pod is deleted, and the uid makes a replayed
        # observation (stale cache, operator restart) charge nothing again.
        verdict = policy.replica_failed(record, pod.uid, failed_at.timestamp())
        _store(record, failures)
        if verdict.counted:
            self.new_failures[pod.role] = self.new_failures.get(pod.role, 0) + 1
            if verdict.give_up:
                self.count_roles()
                self.finish(
                    False,
                    "BackoffLimitExceeded",
                    f"{pod.role} replica {pod.replica} (pod {pod.name}) failed {record.count} times in a row"
                    f"{_detail(pod)}; spec.failurePolicy.maxReplacements is {limit}: fix the cause "
                    f"(kubectl logs {pod.name}) or raise spec.failurePolicy.maxReplacements",
                )
                return False
            self.event(
                "Warning",
                "PodFailed",
                f"{pod.name}{_detail(pod)} is replaced in {verdict.backoff_seconds:g}s "
                f"(failure {record.count} in a row; spec.failurePolicy.maxReplacements {limit}); training goes on",
            )
        left = policy.replace_in(record, self.now.timestamp())
        if left > 0:
            self.requeue(left)  # the failed pod (and its logs) stays until then; no sleeping here
            return True
        self.plan.replaced.append((pod.role, "PodFailed"))
        self.delete(pod)
        return True

    def forgive_if_stable(self, policy: FailurePolicy, key: str, pod: PodState) -> None:
        """Clear a replica's failure count once its replacement has been Ready for the policy's stable time."""
        failures = self.status.replica_failures.get(key)
        since = parse_rfc3339(pod.ready_since)
        if failures is None or not pod.ready or since is None:
            return  # without a transition time to measure from, the count stays until the next exit 0
        left = policy.healthy_left(_record(failures), pod.uid, since.timestamp(), self.now.timestamp())
        if left is None:
            return
        if left <= 0:
            del self.status.replica_failures[key]
        else:
            self.requeue(left)

    def crash_looping_replicas(self) -> list[str]:
        """Replicas that failed often enough in a row to be a crash loop and are not Ready now."""
        if self.obs.job is None:
            return []
        policy = policy_of(self.obs.job)
        looping = []
        for key, failures in sorted(self.status.replica_failures.items()):
            role, replica = key.rsplit("-", 1)
            name = _pod_name(self.obs, role, int(replica))
            current = self.pods.get(name)
            if not policy.crash_looping(_record(failures)) or (
                current is not None and current.ready and not current.finished
            ):
                continue
            looping.append(f"{role} replica {replica} ({name}) failed {failures.count} times in a row")
        return looping

    def report_children(self) -> None:
        """The ChildrenCreated condition: False (FailedCreate, and a Warning Event when new) while the server
        refuses a ConfigMap, Service, PodGroup or NetworkPolicy; True again once they exist."""
        failed = self.obs.failed_children
        if failed:
            self.warn_condition(CHILDREN_CREATED, "FailedCreate", describe_pods(failed))
            self.requeue(FAILED_CHILDREN_RETRY_SECONDS)
        elif not self.obs.foreign_children:
            clear = get_condition(self.status, CHILDREN_CREATED)
            if clear is not None and clear.status == "False":
                message = "the ConfigMap, Service and every other child exist"
                set_condition(self.status, CHILDREN_CREATED, True, "Created", message, self.now)
                self.event("Normal", "Created", message)

    def report_storage(self) -> None:
        """CheckpointStorage: False (NoDefaultStorageClass, a Warning Event when new) while the job's checkpoint
        claim cannot bind; True again once it can."""
        problem = self.obs.storage_problem
        current = get_condition(self.status, CHECKPOINT_STORAGE)
        if problem is not None:
            self.warn_condition(CHECKPOINT_STORAGE, NO_DEFAULT_STORAGE_CLASS, problem)
        elif current is not None and current.status == "False":
            message = "the checkpoint claim can bind"
            set_condition(self.status, CHECKPOINT_STORAGE, True, "StorageClassFound", message, self.now)
            self.event("Normal", "StorageClassFound", message)

    def create_missing(self) -> None:
        self.report_children()
        self.report_storage()
        if self.obs.failed_children:
            return  # pods would wait on what is missing (their config volume, their PodGroup)
        if self.obs.foreign_children:
            # Pods would mount the namesake's config and run beside its policy: wait until those are gone
            # and this job's own children exist.
            self.requeue(FOREIGN_CHILDREN_RETRY_SECONDS)
            return
        restarting = self.status.phase == "Restarting"
        actors_present = any(p.role == "actor" for p in self.obs.pods)
        for name, manifest in self.obs.desired_pods.items():
            if name in self.pods or name in self.obs.expected:
                continue
            if restarting and _role_of(manifest) == "actor" and actors_present:
                continue  # the new group starts only when every old actor is gone
            self.plan.create.append(name)
        if self.plan.create and self.obs.admission is not None:
            self.plan.create = []  # all or nothing: created pods would hold their nodes waiting for the rest
            self.waiting_admission = self.obs.admission
            self.requeue(self.obs.admission_retry_seconds)
        elif self.plan.create:
            before = get_condition(self.status, READY)
            if before is not None and before.reason in (QUOTA_EXCEEDED, LIMIT_RANGE_EXCEEDED):
                self.event("Normal", "Admitted", f"{len(self.plan.create)} pods fit the namespace's quotas now")
        if restarting and not actors_present:
            set_condition(self.status, RESTARTING, False, "Recreated", "the actor group was recreated", self.now)
            self.transition("Starting", "Recreated", "the actor group was recreated")

    def update_phase(self) -> None:
        obs = self.obs
        self.count_roles()
        unschedulable = scheduling_problems(obs.pods)
        gated = [f"{p.name}: {p.gated}" for p in obs.pods if p.gated and not p.terminating]
        if unschedulable:
            self.warn_condition(SCHEDULED, "Unschedulable", describe_pods(unschedulable))
        elif gated:
            # The queue's admission decides (Kueue gates a group's pods until it admits them all): say so, quoting
            # the server; the queue's own reason is on its Workload.
            message = (
                f"{describe_pods(gated)}; the pods wait for the queue to admit the whole group "
                "(Kueue: `kubectl describe workloads` in the job's namespace names the quota it waits for)"
            )
            set_condition(self.status, SCHEDULED, False, SCHEDULING_GATED, message, self.now)
        else:
            scheduled = all(name in self.pods and self.pods[name].scheduled for name in obs.desired_pods)
            if scheduled:
                set_condition(self.status, SCHEDULED, True, "AllPodsScheduled", "every pod has a node", self.now)
        reason, problems = container_problems(obs.pods)
        stuck = self.stuck_terminating()
        if stuck:
            reason, problems = STUCK_TERMINATING, stuck
        if not problems:
            # Pods never restart in place (restartPolicy Never), so the kubelet reports no crash loop:
            # replicas the operator keeps replacing are the crash loops here.
            looping = self.crash_looping_replicas()
            if looping:
                reason, problems = "CrashLoopBackOff", looping
        ready_pods = [n for n in obs.desired_pods if n in self.pods and self.pods[n].ready]
        all_ready = len(ready_pods) == len(obs.desired_pods)
        if self.waiting_admission is not None:
            self.warn_condition(READY, *self.waiting_admission)
        elif problems:
            self.warn_condition(READY, reason, describe_pods(problems))
        elif all_ready:
            set_condition(self.status, READY, True, "AllPodsReady", f"{len(ready_pods)} pods ready", self.now)
        else:
            message = f"{len(ready_pods)}/{len(obs.desired_pods)} pods ready"
            set_condition(self.status, READY, False, "PodsNotReady", message, self.now)
        if self.status.phase == "Restarting":
            return
        actors = _role_pod_names(obs, "actor")
        # Once Running, an actor that loses readiness (a probe failing for a while, a collocated rollout
        # restarting in place) does not demote the job: its group still runs, the Ready condition says
        # PodsNotReady, and Stalled keeps watching. Only a rank that is gone, terminating or finished ends the
        # group, and check_actors restarts it.
        actors_running = all(
            n in self.pods and self.pods[n].phase == "Running" and not self.pods[n].terminating for n in actors
        )
        every_scheduled = all(n in self.pods and self.pods[n].scheduled for n in obs.desired_pods)
        if all_ready or (self.status.phase == "Running" and actors_running):
            self.transition("Running", "Running", "every pod is ready; training")
        elif every_scheduled and not unschedulable:
            self.transition("Starting", "Starting", "every pod is placed; waiting for readiness")
        elif self.status.phase not in ("Pending", "Starting"):
            self.transition("Pending", "Pending", "waiting for pods to be created and scheduled")

    def stuck_terminating(self) -> list[str]:
        """Pods terminating well past their grace period: their kubelet does not confirm (a lost node). They
        keep their names (and a restart waits for its old ranks) until the node comes back or someone force-
        deletes them; the job says so instead of waiting silently."""
        stuck = []
        for pod in self.obs.pods:
            deleted = parse_rfc3339(pod.deleted_at) if pod.terminating else None
            if deleted is None:
                continue
            grace = pod.grace_seconds if pod.grace_seconds is not None else 30
            overdue = grace + max(min(grace, STUCK_MARGIN_SECONDS), 1)
            waited = (self.now - deleted).total_seconds()
            if waited < overdue:
                self.requeue(overdue - waited)
                continue
            stuck.append(
                f"{pod.name} on node {pod.node or '(none)'} has been terminating for {waited:.0f}s (grace period "
                f"{grace}s): its kubelet does not confirm; if the node is gone for good, "
                f"`kubectl delete pod {pod.name} --grace-period=0 --force` lets the job go on"
            )
        return stuck

    def warn_condition(self, kind: str, reason: str, message: str) -> None:
        """Set a condition False for a problem; post a Warning when the problem is new."""
        before = get_condition(self.status, kind)
        new = before is None or before.status != "False" or before.reason != reason
        set_condition(self.status, kind, False, reason, message, self.now)
        if new:
            self.event("Warning", reason, message)

    def count_roles(self) -> None:
        desired: dict[str, int] = {role: 0 for role in ROLE_NAMES}
        for manifest in self.obs.desired_pods.values():
            role = _role_of(manifest)
            desired[role] = desired.get(role, 0) + 1
        job = self.obs.job
        collocated = job is not None and job.spec.roles.rollout.collocated
        role_counts(self.status, desired, self.obs.pods, self.new_failures, collocated=collocated)
        self.new_failures = {}

    def finalize(self) -> Plan:
        obs = self.obs
        if obs.progress is not None and self.status.phase not in TERMINAL_PHASES:
            self.status.progress = obs.progress
        if obs.job is not None and not self.status.progress.total_steps:
            self.status.progress.total_steps = obs.job.spec.trainer.steps
        self.status.observed_generation = obs.generation
        if obs.job is not None:
            # A collocated job's rollout replicas are in its actor pods (the scale's replicas are theirs too).
            hosts = "actor" if obs.job.spec.roles.rollout.collocated else "rollout"
            self.status.rollout_selector = f"{LABEL_JOB}={obs.job.name},{LABEL_ROLE}={hosts}"
        if obs.job is not None and elastic_rollouts(obs.job) and self.status.phase not in TERMINAL_PHASES:
            self.plan.rollout_members = sorted(
                p.replica
                for p in self.live
                if p.role == "rollout"
                and p.ready
                and not p.finished
                and p.name in obs.desired_pods
                and p.name not in self.plan.delete
            )
        return self.plan


def _role_of(manifest: Manifest) -> str:
    return manifest["metadata"]["labels"]["rljob.io/role"]


def _replica_key(role: str, replica: int) -> str:
    """The key of a replica in `status.replicaFailures`, e.g. `env-1`."""
    return f"{role}-{replica}"


def _detail(pod: PodState) -> str:
    """` (exit code 1: Error ...)`: how a finished pod ended, or nothing."""
    parts = [f"exit code {pod.exit_code}"] if pod.exit_code else []
    words = " ".join(x for x in (pod.reason, pod.message) if x)
    if words:
        parts.append(words)
    return f" ({': '.join(parts)})" if parts else ""


def _role_pod_names(obs: Observation, role: str) -> list[str]:
    return [name for name, m in obs.desired_pods.items() if _role_of(m) == role]


def _pod_name(obs: Observation, role: str, replica: int) -> str:
    for name, manifest in obs.desired_pods.items():
        labels = manifest["metadata"]["labels"]
        if labels["rljob.io/role"] == role and labels["rljob.io/replica"] == str(replica):
            return name
    return ""


def plan(obs: Observation) -> Plan:
    """What to do about one job now: pods to create and delete, the status to write, events to post."""
    return _Planner(obs).run()
