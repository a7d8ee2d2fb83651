"""Training metrics: one record per step to `metrics.jsonl`, TensorBoard, Prometheus, and `curve.png`.

A record is a flat dict of numbers keyed by the names below; the driver builds one per step and
hands it to `RunMetrics.log` (files) and `RoleMetrics.observe` (Prometheus), so every figure has
one source line.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge

log = logging.getLogger(__name__)

# --- record keys (metrics.jsonl, TensorBoard tags) ----------------------------------------------
STEP = "step"
WALL_TIME = "wall_time"
"""Seconds of training: from just before actor 0's loop starts, cumulative across resumes."""
TIMESTAMP = "timestamp"
"""Unix time (seconds) the record was written: lines it up with logs, and with other programs' clocks."""
ENV_STEPS = "env_steps"
"""Environment transitions (gym) or generated samples (llm) consumed so far."""
RETURN_MEAN = "return_mean"
"""Mean episodic return over the episodes that finished in this step's rollouts (gym)."""
LENGTH_MEAN = "length_mean"
SUCCESS_RATE = "success_rate"
"""Share of this step's finished episodes the environment reported solved (`info["success"]`; gym envs that say)."""
EPISODES = "episodes"
REWARD_MEAN = "reward_mean"
"""Mean sequence reward of this step's samples (llm)."""
ACCURACY = "accuracy"
"""Share of this step's samples the correctness reward (exact_match, math_verify) scored right (llm)."""
EVAL_ACCURACY = "eval_accuracy"
"""The same on held-out prompts (llm, every evaluation.interval steps)."""
SAMPLES = "samples"
"""Generated responses trained on so far (llm)."""
POLICY_LOSS = "policy_loss"
VALUE_LOSS = "value_loss"
ENTROPY = "entropy"
MISMATCH_KL = "mismatch_kl"
APPROX_KL = "approx_kl"
CLIP_FRACTION = "clip_fraction"
EXPLAINED_VARIANCE = "explained_variance"
LEARNING_RATE = "learning_rate"
ENV_STEPS_PER_S = "env_steps_per_s"
STALENESS_MEAN = "staleness_mean"
"""Policy versions between the weights that generated the step's data and the weights trained."""
STALENESS_MAX = "staleness_max"
TOKENS_PER_S = "tokens_per_s"
"""Response tokens trained on per second of the whole step (llm)."""
TRAINER_WAIT = "trainer_wait"
"""Share of the step actor 0 waited for generations (llm): the rollout autoscaler's signal."""
ROLLOUT_IDLE = "rollout_idle"
"""Share of the rollout replicas' time in the step without generation work (llm)."""
ROLLOUT_RESTARTS = "rollout_restarts"
"""Rollout replicas actor 0 saw come back as a new process so far: in a pod, where no metrics.jsonl is written,
the way to see a collocated rollout restarted in place."""
PHASES: tuple[str, ...] = ("rollout", "generate", "reward", "train", "sync", "waiting")
"""Timing breakdown of a step (gym: rollout/train/sync/waiting; llm: generate/reward/train/sync); recorded as
`time_<phase>_s`."""


def phase_key(phase: str) -> str:
    return f"time_{phase}_s"


LOSS_KEYS: tuple[str, ...] = (POLICY_LOSS, VALUE_LOSS, ENTROPY, APPROX_KL, CLIP_FRACTION)


def _json_value(value: Any) -> Any:
    """Plain JSON numbers: tensors and numpy scalars become floats, NaN/inf become null."""
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class RunMetrics:
    """Per-run metric files under `run_dir`: metrics.jsonl, TensorBoard events (tb/), curve.png."""

    def __init__(self, run_dir: str | Path, tensorboard: bool = True, start_time: float | None = None) -> None:
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.jsonl_path = self.run_dir / "metrics.jsonl"
        self.curve_path = self.run_dir / "curve.png"
        self.start_time = time.time() if start_time is None else start_time
        self._jsonl = self.jsonl_path.open("a", encoding="utf-8")
        self._writer = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(log_dir=str(self.run_dir / "tb"))

    def log(self, step: int, record: Mapping[str, Any], tensorboard_step: int | None = None) -> dict[str, Any]:
        """Append one record (a JSON object line) and its numeric scalars to TensorBoard (at `tensorboard_step`,
        default `step`: an llm job's warm-up records are all step 0, each at its own `sft_step`); return what
        was written."""
        now = time.time()
        line = {STEP: int(step), WALL_TIME: round(now - self.start_time, 4), TIMESTAMP: round(now, 3)}
        line.update({key: _json_value(value) for key, value in record.items()})
        line[STEP] = int(step)
        self._jsonl.write(json.dumps(line) + "\n")
        self._jsonl.flush()
        if self._writer is not None:
            at = step if tensorboard_step is None else tensorboard_step
            for key, value in line.items():
                if key not in (STEP, TIMESTAMP) and isinstance(value, int | float) and not isinstance(value, bool):
                    self._writer.add_scalar(key, value, global_step=at)
        return line

    def close(self) -> Path | None:
        """Flush files and draw curve.png from metrics.jsonl; returns the curve's path (None without records)."""
        self._jsonl.close()
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        records = read_metrics(self.jsonl_path)
        if not records:
            return None
        plot_curve(records, self.curve_path)
        return self.curve_path

    def __enter__(self) -> RunMetrics:
        return self

    def __exit__(self, *exc: object) -> None:
        if not self._jsonl.closed:
            self.close()


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """Records of a metrics.jsonl; a torn last line (a killed writer) is ignored."""
    records = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            log.warning("ignoring an incomplete line in %s", path)
    return records


def keep_records_until(path: str | Path, step: int) -> float:
    """After a resume from `step`: drop later records (they are redone); return the last kept wall time.

    The file is replaced in one rename of a fully written copy: a crash at any point leaves either the
    old records or the kept ones, never a truncated file.
    """
    path = Path(path)
    for leftover in path.parent.glob(f".{path.name}.rewrite-*"):  # from a rewrite a crash cut off
        leftover.unlink(missing_ok=True)
    if not path.exists():
        return 0.0
    kept = [r for r in read_metrics(path) if r.get(STEP, 0) <= step]
    rewrite = path.with_name(f".{path.name}.rewrite-{os.getpid()}")
    with rewrite.open("w", encoding="utf-8") as f:
        f.write("".join(json.dumps(r) + "\n" for r in kept))
        f.flush()
        os.fsync(f.fileno())
    os.replace(rewrite, path)
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)
    return float(kept[-1].get(WALL_TIME, 0.0)) if kept else 0.0


def plot_curve(records: list[dict[str, Any]], path: str | Path) -> None:
    """Learning curve (return or reward vs env steps) above the losses vs training step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 7), constrained_layout=True)
    x_key = SAMPLES if any(SAMPLES in r for r in records) else ENV_STEPS
    curves = ((RETURN_MEAN, "mean episodic return"), (REWARD_MEAN, "mean reward"), (ACCURACY, "accuracy"))
    for key, label in (*curves, (EVAL_ACCURACY, "held-out accuracy")):
        points = [(r.get(x_key, r[STEP]), r[key]) for r in records if r.get(key) is not None]
        if points:
            xs, ys = zip(*points, strict=True)
            top.plot(xs, ys, label=label, marker="o" if key == EVAL_ACCURACY else None)
    top.set_xlabel({SAMPLES: "samples", ENV_STEPS: "env steps"}[x_key] if any(x_key in r for r in records) else "step")
    top.set_title("learning curve")
    top.grid(alpha=0.3)
    if top.lines:
        top.legend()
    for key in LOSS_KEYS:
        points = [(r[STEP], r[key]) for r in records if r.get(key) is not None]
        if points:
            xs, ys = zip(*points, strict=True)
            bottom.plot(xs, ys, label=key)
    bottom.set_xlabel("training step")
    bottom.set_title("losses and update statistics")
    bottom.grid(alpha=0.3)
    if bottom.lines:
        bottom.legend()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# --- Prometheus ---------------------------------------------------------------------------------

_GAUGES: dict[str, tuple[str, str]] = {
    STEP: ("rljob_train_step", "Training steps completed."),
    ENV_STEPS: ("rljob_env_steps", "Environment transitions (or samples) consumed so far."),
    RETURN_MEAN: ("rljob_episodic_return", "Mean episodic return of the episodes finished in the last step."),
    LENGTH_MEAN: ("rljob_episodic_length", "Mean episode length of the episodes finished in the last step."),
    REWARD_MEAN: ("rljob_reward_mean", "Mean sample reward of the last step."),
    ACCURACY: ("rljob_accuracy", "Share of the last step's samples scored right by the correctness reward (llm)."),
    EVAL_ACCURACY: ("rljob_eval_accuracy", "Accuracy on held-out prompts at the last evaluation (llm)."),
    POLICY_LOSS: ("rljob_policy_loss", "Policy (surrogate) loss of the last step."),
    VALUE_LOSS: ("rljob_value_loss", "Value loss of the last step."),
    ENTROPY: ("rljob_policy_entropy", "Mean policy entropy of the last step."),
    MISMATCH_KL: ("rljob_mismatch_kl", "KL between the rollout engine's and the trainer's token log-probs (llm)."),
    APPROX_KL: ("rljob_approx_kl", "Approximate KL between the rollout and the updated policy."),
    CLIP_FRACTION: ("rljob_clip_fraction", "Share of samples whose probability ratio was clipped."),
    EXPLAINED_VARIANCE: ("rljob_explained_variance", "Explained variance of the value function."),
    LEARNING_RATE: ("rljob_learning_rate", "Learning rate of the last step."),
    ENV_STEPS_PER_S: ("rljob_env_steps_per_second", "Environment transitions per second over the last step."),
    STALENESS_MEAN: ("rljob_policy_staleness", "Mean policy versions between the data and the trained weights."),
    STALENESS_MAX: ("rljob_policy_staleness_max", "Largest staleness used in the last step."),
    TOKENS_PER_S: ("rljob_tokens_per_second", "Response tokens trained on per second over the last step (llm)."),
    TRAINER_WAIT: ("rljob_trainer_wait_ratio", "Share of the last step the trainer waited for generations (llm)."),
    ROLLOUT_IDLE: ("rljob_rollout_idle_ratio", "Share of the rollouts' time in the last step without work (llm)."),
    ROLLOUT_RESTARTS: ("rljob_rollout_restarts", "Rollout replicas actor 0 saw restarting so far."),
}


class RoleMetrics:
    """The Prometheus instruments of one role process, in their own registry."""

    def __init__(self, job: str, role: str, replica: int, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        info = Gauge(
            "rljob_role_info",
            "Which job, role and replica this process is.",
            ["job", "role", "replica"],
            registry=self.registry,
        )
        info.labels(job=job, role=role, replica=str(replica)).set(1)
        self.gauges: dict[str, Gauge] = {}
        for key, (name, doc) in _GAUGES.items():
            gauge = Gauge(name, doc, registry=self.registry)
            self.gauges[key] = gauge
        self.phase_seconds = Gauge(
            "rljob_step_phase_seconds", "Seconds of the last step spent per phase.", ["phase"], registry=self.registry
        )
        self.phase_seconds_total = Counter(
            "rljob_phase_seconds",
            "Seconds spent per phase since the process started.",
            ["phase"],
            registry=self.registry,
        )
        self.episodes_total = Counter("rljob_episodes", "Episodes finished.", registry=self.registry)

    def observe(self, record: Mapping[str, Any]) -> None:
        """Update the instruments from one step record (the same dict as metrics.jsonl's line)."""
        for key, gauge in self.gauges.items():
            value = _json_value(record.get(key))
            if isinstance(value, int | float):
                gauge.set(value)
        for phase in PHASES:
            seconds = _json_value(record.get(phase_key(phase)))
            if isinstance(seconds, int | float):
                self.phase_seconds.labels(phase=phase).set(seconds)
                self.phase_seconds_total.labels(phase=phase).inc(max(0.0, seconds))
        episodes = _json_value(record.get(EPISODES))
        if isinstance(episodes, int | float) and episodes > 0:
            self.episodes_total.inc(episodes)
