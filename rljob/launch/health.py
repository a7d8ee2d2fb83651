"""Training health: the policy's entropy collapsing, the rollout engine drifting from the trainer, and a
diverged update (a non-finite loss or gradient norm, which stops the actor).

The threshold and window logic behind the operator's EntropyCollapsed / MismatchHigh conditions and
`rljob run`'s lines, in one place: both feed it the actor's latest `/progress` and say the same words.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from rljob.api.spec import HealthSpec

DIVERGED = "Diverged"
"""Condition type, and the reason of a job failed for it."""
NON_FINITE_UPDATE = "NonFiniteUpdate"
"""Reason of a Diverged condition: the actor stopped on a non-finite loss or gradient norm."""
ENTROPY_COLLAPSED = "EntropyCollapsed"
"""Condition type: the policy entropy stayed below spec.health.entropyFloor."""
ENTROPY_BELOW_FLOOR = "EntropyBelowFloor"
"""Reason of an EntropyCollapsed condition that is True."""
MISMATCH_HIGH = "MismatchHigh"
"""Condition type: the rollout/trainer mismatch KL stayed above spec.health.mismatchKlThreshold."""
MISMATCH_ABOVE_THRESHOLD = "MismatchAboveThreshold"
"""Reason of a MismatchHigh condition that is True."""
RECOVERED = "Recovered"
"""Reason of an EntropyCollapsed or MismatchHigh condition that went back to False."""

HEALTH_TYPES = (DIVERGED, ENTROPY_COLLAPSED, MISMATCH_HIGH)
"""The training-health conditions, in the order the HEALTH column lists them."""


@dataclass(frozen=True)
class Check:
    """One windowed threshold on a value the actor reports in `/progress`."""

    type: str
    reason: str
    key: str
    """The `/progress` key (camelCase)."""
    record_key: str
    """The same value's key in metrics.jsonl (snake_case)."""
    what: str
    field: str
    """The spec field, as the message names it."""
    threshold: float
    window: int
    below: bool
    """True: past the threshold means below it (entropy); False: above it (mismatch)."""

    def past(self, value: float) -> bool:
        return value < self.threshold if self.below else value > self.threshold


def checks(health: HealthSpec) -> list[Check]:
    """The checks `spec.health` turns on (a threshold of 0 turns its check off)."""
    out = []
    if health.entropy_floor:
        out.append(
            Check(
                ENTROPY_COLLAPSED,
                ENTROPY_BELOW_FLOOR,
                "entropy",
                "entropy",
                "policy entropy",
                "spec.health.entropyFloor",
                health.entropy_floor,
                health.window_steps,
                below=True,
            )
        )
    if health.mismatch_kl_threshold:
        out.append(
            Check(
                MISMATCH_HIGH,
                MISMATCH_ABOVE_THRESHOLD,
                "mismatchKl",
                "mismatch_kl",
                "rollout/trainer mismatch KL",
                "spec.health.mismatchKlThreshold",
                health.mismatch_kl_threshold,
                health.window_steps,
                below=False,
            )
        )
    return out


@dataclass
class Streak:
    """Steps past a threshold: from step `since` (None: within it) up to the latest step looked at."""

    since: int | None = None
    step: int = 0


@dataclass(frozen=True)
class Verdict:
    """A condition that changed: `active` True (set, with `reason`) or False (Recovered)."""

    type: str
    active: bool
    reason: str
    message: str


def observe(check: Check, streak: Streak, step: int, value: float | None, active: bool) -> Verdict | None:
    """Look at step `step`'s value; update `streak` in place; the Verdict when the condition changes.

    A step already looked at counts nothing, so a replayed read is harmless; an earlier step (an actor resumed
    from an earlier checkpoint) starts the count again from there. Two looks
    past the threshold count every step between them as past it: the window is in steps, however often
    anyone looks.
    """
    if step < streak.step:  # the actor resumed an earlier checkpoint: the steps it trains again count again
        streak.step, streak.since = step, None
        return None
    if step == streak.step or value is None:
        return None
    streak.step = step
    relation = "below" if check.below else "above"
    if not check.past(value):
        streak.since = None
        if active:
            back = "above" if check.below else "below"
            message = f"{check.what} {value:.4g} is back {back} {check.field} ({check.threshold:g}) at step {step}"
            return Verdict(check.type, False, RECOVERED, message)
        return None
    if streak.since is None:
        streak.since = step
    steps = step - streak.since + 1
    if active or steps < check.window:
        return None
    message = (
        f"{check.what} {value:.4g} at step {step}, {relation} {check.field} ({check.threshold:g}) "
        f"for {steps} steps (since step {streak.since})"
    )
    return Verdict(check.type, True, check.reason, message)


def health_summary(active: set[str]) -> str:
    """The HEALTH column: the training-health conditions that are True, comma-separated."""
    return ",".join(t for t in HEALTH_TYPES if t in active)


@dataclass
class HealthWatch:
    """`rljob run`'s view: feed it each `/progress` report; it returns the conditions that changed."""

    health: HealthSpec
    streaks: dict[str, Streak] = field(default_factory=dict)
    active: set[str] = field(default_factory=set)
    reported: set[str] = field(default_factory=set)
    """The `/progress` keys seen with a value: the checks that apply to this policy."""
    llm: bool = False
    """An llm job: every check applies (a token's entropy is a Shannon entropy), reported or not yet."""

    def observe(self, report: dict[str, Any] | None) -> list[Verdict]:
        if not report:
            return []
        self.reported.update(key for key, value in report.items() if value is not None)
        return self._look(int(report["step"]), {check.type: report.get(check.key) for check in checks(self.health)})

    def settle(self, records: Iterable[Mapping[str, Any]]) -> list[Verdict]:
        """After the run: the conditions its metrics.jsonl ends in that the `/progress` looks did not say.

        The looks can miss steps (a tiny job trains 40 steps in a second, between two looks); the records hold
        every step. For a gym job only checks whose value `/progress` reported count: a Gaussian policy's
        differential entropy is in the records, but no floor applies to it.
        """
        full = HealthWatch(self.health, reported=set(self.reported), llm=self.llm)
        latest: dict[str, Verdict] = {}
        for record in records:
            if record.get("step") is None:
                continue
            values = {
                check.type: record.get(check.record_key) if self.llm or check.key in self.reported else None
                for check in checks(self.health)
            }
            latest.update((verdict.type, verdict) for verdict in full._look(int(record["step"]), values))
        changed = [verdict for verdict in latest.values() if verdict.active != (verdict.type in self.active)]
        self.active = set(full.active)
        return changed

    def _look(self, step: int, values: Mapping[str, float | None]) -> list[Verdict]:
        changed = []
        for check in checks(self.health):
            streak = self.streaks.setdefault(check.type, Streak())
            verdict = observe(check, streak, step, values[check.type], check.type in self.active)
            if verdict is None:
                continue
            if verdict.active:
                self.active.add(check.type)
            else:
                self.active.discard(check.type)
            changed.append(verdict)
        return changed
