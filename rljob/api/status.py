"""Observed state of an RLJob, written by the operator from pods and the actor's progress."""

from __future__ import annotations

from typing import Literal

from pydantic import ConfigDict, Field

from rljob.api.base import SpecModel

Phase = Literal["Pending", "Starting", "Running", "Restarting", "Suspended", "Succeeded", "Failed"]
PHASES: tuple[Phase, ...] = (
    "Pending",
    "Starting",
    "Running",
    "Restarting",
    "Suspended",
    "Succeeded",
    "Failed",
)
TERMINAL_PHASES: tuple[Phase, ...] = ("Succeeded", "Failed")


class StatusModel(SpecModel):
    # Status is written by the operator, never typed by hand: accept what the server returns.
    model_config = ConfigDict(strict=False)


class Condition(StatusModel):
    """A Kubernetes-style condition."""

    type: str
    """`Scheduled`, `Ready`, `Restarting`, `Suspended`, `Succeeded` or `Failed` (see docs/troubleshooting.md)."""
    status: Literal["True", "False", "Unknown"]
    """Whether the condition holds."""
    reason: str = ""
    """Why, in one CamelCase word (e.g. `Unschedulable`, `BackoffLimitExceeded`)."""
    message: str = ""
    """Why, for people: the pods, fields and limits concerned."""
    last_transition_time: str | None = None
    """RFC 3339 time of the last status change."""
    observed_generation: int | None = None
    """The job generation the condition was set for."""


class RoleCounts(StatusModel):
    """Pods of one role."""

    desired: int = 0
    """Pods the spec asks for."""
    ready: int = 0
    """Pods that are Ready."""
    failed: int = 0
    """Pods replaced after failing, since the job started."""


class RoleStatuses(StatusModel):
    """Pod counts of every role."""

    actor: RoleCounts = Field(default_factory=RoleCounts)
    rollout: RoleCounts = Field(default_factory=RoleCounts)
    env: RoleCounts = Field(default_factory=RoleCounts)
    reward: RoleCounts = Field(default_factory=RoleCounts)


class Progress(StatusModel):
    """RL progress as reported by the actor."""

    step: int = 0
    """Training steps done."""
    total_steps: int = 0
    """trainer.steps."""
    reward_mean: float | None = None
    """Mean return (gym) or reward (llm) of the latest step."""
    accuracy: float | None = None
    """llm jobs: share of the step's samples the correctness reward scored right."""
    updated_at: str | None = None
    """When the actor reached `step` (when it started, before its first step), RFC 3339."""
    issue: str = ""
    """What keeps the actor from its next step, as it reports it (a weight round refused, a rollout not
    answering); empty while all is well."""
    trainer_wait: float | None = None
    """llm jobs: share of the latest step the trainer spent waiting for generations (0..1)."""
    rollout_idle: float | None = None
    """llm jobs: share of the rollout replicas' time in the latest step without generation work (0..1)."""
    entropy: float | None = None
    """Mean policy entropy of the latest step (nats); spec.health.entropyFloor is checked against it."""
    mismatch_kl: float | None = None
    """llm jobs: KL between the rollout engine's and the trainer's token log-probs at the latest step (nats
    per token); spec.health.mismatchKlThreshold is checked against it."""


class HealthStreak(StatusModel):
    """A run of steps whose value was past its spec.health threshold, kept between reconciles."""

    since: int | None = None
    """First step of the run; none while the value is within its threshold."""
    step: int = 0
    """Latest step looked at: a step seen again (an operator restart, a replayed read) counts nothing."""


class ReplicaFailures(StatusModel):
    """Failures in a row of one rollout, env or reward replica, bounded by failurePolicy.maxReplacements."""

    count: int = 0
    """Failures in a row; reset once a replacement stays Ready for a while or exits 0."""
    last_pod_uid: str = ""
    """The failed pod last counted: a failure is counted once, however often it is observed."""
    last_failure_time: str | None = None
    """When that pod finished (RFC 3339): its replacement is created a backoff later."""


class ScaleSample(StatusModel):
    """One training step's autoscaling signal, as the actor reported it."""

    step: int
    """The training step."""
    trainer_wait: float
    """Share of the step the trainer waited for generations."""
    rollout_idle: float | None = None
    """Share of the rollouts' time in the step without generation work."""


class AutoscaleStatus(StatusModel):
    """What the rollout autoscaler (spec.roles.rollout.autoscale) last saw and did; kept here so its cooldowns
    survive an operator restart."""

    replicas: int | None = None
    """The rollout count the autoscaler wants now."""
    reason: str = ""
    """Why it last scaled, for people."""
    last_scale_time: str | None = None
    """When it last scaled (RFC 3339); the cooldowns count from it."""
    last_scale_direction: Literal["Up", "Down"] | None = None
    """Whether it last added or removed rollouts."""
    last_scale_step: int = 0
    """The training step at that scaling: only steps after it speak for the new count."""
    samples: list[ScaleSample] = Field(default_factory=list)
    """The latest steps' signal (a few), averaged before deciding."""


class RLJobStatus(StatusModel):
    """Observed state of an RLJob, written by the operator."""

    phase: Phase = "Pending"
    """Where the job is in its life (see docs/troubleshooting.md)."""
    conditions: list[Condition] = Field(default_factory=list)
    """What holds and why: scheduling, readiness, restarts, suspension, success, failure."""
    roles: RoleStatuses = Field(default_factory=RoleStatuses)
    """Pod counts per role."""
    restarts: int = 0
    """Actor-group restarts that counted against failurePolicy.maxRestarts."""
    replica_failures: dict[str, ReplicaFailures] = Field(default_factory=dict)
    """Rollout, env and reward replicas that failed recently, by `<role>-<replica>` (e.g. `env-1`)."""
    start_time: str | None = None
    """When the job (last) started, RFC 3339; activeDeadlineSeconds counts from it."""
    running_since: str | None = None
    """When the job last became Running: the Stalled clock never starts before it."""
    completion_time: str | None = None
    """When the job succeeded or failed, RFC 3339; ttlSecondsAfterFinished counts from it."""
    progress: Progress = Field(default_factory=Progress)
    rollout_selector: str | None = None
    """Label selector of the job's rollout pods, the scale subresource's `selector` (an HPA needs it). A collocated
    job has no rollout pods: it selects the actor pods, which run the rollout replicas (and cannot be scaled)."""
    autoscale: AutoscaleStatus | None = None
    """The rollout autoscaler's state, for jobs with spec.roles.rollout.autoscale."""
    health: str = ""
    """The training-health conditions that are True, comma-separated (`kubectl get rljobs` HEALTH column):
    Diverged, EntropyCollapsed, MismatchHigh; empty while training is healthy."""
    health_streaks: dict[str, HealthStreak] = Field(default_factory=dict)
    """By condition type: the steps past a spec.health threshold so far."""
    observed_generation: int | None = None
    """The job generation (spec edit) this status was written for."""
