"""Rollout autoscaling: how many rollout replicas an llm job should have now (spec.roles.rollout.autoscale).

One pure decision for the operator and `rljob run`. The signal is the actor's, per training step:
`trainerWait` (share of the step actor 0 waited for generations) and `rolloutIdle` (share of the rollouts'
time in the step without generation work). The decision:

- a count outside [minReplicas, maxReplicas] (a hand `kubectl scale`, an edited spec) goes back to the
  nearest bound at once: the bounds are the user's, cooldowns do not delay them;
- only steps completed after the last scaling speak for the current count, averaged over the last
  `WINDOW` of them and at least `MIN_STEPS`: one slow step (the first, compiling) does not scale;
- up when the trainer waits above the target: proportionally, as the HPA does (generation time spreads over
  the rollouts, so `ceil(current * wait / target)` rollouts bring the wait to the target), at least +1 and at
  most doubling per decision, after scaleUpCooldownSeconds;
- down by one replica at a time, after scaleDownCooldownSeconds, only when the rollouts idle above
  `IDLE_SHARE` AND the trainer waits below `DOWN_WAIT_SHARE` (half) of the target. With half, one replica
  fewer (at most doubling the wait, from 2 to 1) is predicted to keep the wait below the target, so the
  scale-down never invites the next scale-up: the band between the two is hysteresis and the count does not
  flap. Down is cautious because a removed rollout's chunks in flight are generated again elsewhere.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from rljob.api.spec import AutoscaleSpec

SCALED_ROLLOUTS = "ScaledRollouts"
"""Reason of the Normal Event posted when the autoscaler changes the rollout count."""
WINDOW = 3
"""Steps averaged per decision."""
MIN_STEPS = 2
"""Steps at the current count needed before deciding again."""
KEEP = 8
"""Samples kept (in status.autoscale.samples)."""
IDLE_SHARE = 0.5
"""Rollouts must idle above this share of their time before one is removed."""
DOWN_WAIT_SHARE = 0.5
"""...and the trainer wait below this share of the target."""
MAX_UP_FACTOR = 2

Direction = Literal["Up", "Down"]


@dataclass(frozen=True)
class Sample:
    """One training step's signal."""

    step: int
    trainer_wait: float
    rollout_idle: float | None = None


@dataclass(frozen=True)
class Decision:
    replicas: int
    """The count wanted now (equal to the current one when nothing changes)."""
    direction: Direction | None
    """Up, Down, or None when the count stays."""
    reason: str
    """Why, for people (the Event's message, `rljob run`'s line)."""


def record(
    samples: Sequence[Sample], step: int, trainer_wait: float | None, rollout_idle: float | None
) -> list[Sample]:
    """`samples` with the actor's latest report added if it is a new step with a signal; the last KEEP kept."""
    kept = list(samples)
    if trainer_wait is None or step <= 0 or (kept and kept[-1].step >= step):
        return kept
    kept.append(Sample(step, trainer_wait, rollout_idle))
    return kept[-KEEP:]


def rewind(samples: Sequence[Sample], step: int, last_scale_step: int) -> tuple[list[Sample], int]:
    """(samples, last scale step) once the actor reports `step`: when it went back (an actor restart resumed an
    earlier checkpoint), the samples of the steps it will train again are dropped and the last scaling is taken
    as at that step, so the steps after the resume decide at once instead of waiting to pass the old ones."""
    if samples and step < samples[-1].step:
        return [s for s in samples if s.step < step], min(last_scale_step, step)
    return list(samples), last_scale_step


def decide(
    spec: AutoscaleSpec,
    current: int,
    samples: Sequence[Sample],
    last_scale_at: float | None,
    last_scale_step: int,
    now: float,
) -> Decision:
    """The rollout count for now. Times are seconds on one clock (epoch or monotonic); `last_scale_at` None:
    never scaled. Pure: the same inputs give the same answer."""
    low, high = spec.min_replicas, spec.max_replicas
    if current < low:
        return Decision(low, "Up", f"{current} rollouts is below autoscale.minReplicas {low}: {current} -> {low}")
    if current > high:
        return Decision(high, "Down", f"{current} rollouts is above autoscale.maxReplicas {high}: {current} -> {high}")
    recent = [s for s in samples if s.step > last_scale_step][-WINDOW:]
    if len(recent) < MIN_STEPS:
        return Decision(current, None, f"waiting for {MIN_STEPS} steps at {current} rollouts")
    wait = sum(s.trainer_wait for s in recent) / len(recent)
    idles = [s.rollout_idle for s in recent if s.rollout_idle is not None]
    idle = sum(idles) / len(idles) if idles else None
    since = math.inf if last_scale_at is None else now - last_scale_at
    target = spec.target_trainer_wait
    said = f"the trainer waited {wait:.0%} of its last {len(recent)} steps for generations (target {target:.0%})"
    if wait > target and current < high:
        if since < spec.scale_up_cooldown_seconds:
            return Decision(current, None, f"{said}; scale-up cooldown ({spec.scale_up_cooldown_seconds}s)")
        wanted = max(current + 1, math.ceil(current * wait / target - 1e-9))
        new = min(high, wanted, current * MAX_UP_FACTOR)
        return Decision(new, "Up", f"{said}: {current} -> {new} rollouts")
    if idle is not None and idle > IDLE_SHARE and wait < target * DOWN_WAIT_SHARE and current > low:
        said = f"{said}, rollouts idled {idle:.0%}"
        if since < spec.scale_down_cooldown_seconds:
            return Decision(current, None, f"{said}; scale-down cooldown ({spec.scale_down_cooldown_seconds}s)")
        return Decision(current - 1, "Down", f"{said}: {current} -> {current - 1} rollouts")
    return Decision(current, None, said)
