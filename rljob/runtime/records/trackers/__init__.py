"""Experiment trackers (`spec.logging.trackers`): TensorBoard, Weights & Biases, MLflow and SwanLab behind one small
interface, each in its own module and imported only when a job lists it; and the fan-out that feeds them from a
thread of their own, so a tracker that is slow or down never holds up training."""

from rljob.runtime.records.trackers.base import (
    BACKENDS,
    RESTART_ENV,
    Backend,
    RunInfo,
    Tracker,
    restart_number,
    run_name,
    tracker_problems,
)
from rljob.runtime.records.trackers.fanout import Trackers, TrackersUnavailable, job_trackers, open_trackers

__all__ = [
    "BACKENDS",
    "RESTART_ENV",
    "Backend",
    "RunInfo",
    "Tracker",
    "Trackers",
    "TrackersUnavailable",
    "job_trackers",
    "open_trackers",
    "restart_number",
    "run_name",
    "tracker_problems",
]
