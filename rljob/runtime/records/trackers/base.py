"""What every tracker module implements, which module and package each tracker needs, and how a run is named."""

from __future__ import annotations

import importlib
import importlib.util
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from rljob.api import Problem
from rljob.api.spec import RLJobSpec, TrackerName, TrackerSpec

RESTART_ENV = "RLJOB_RESTART"
"""How many times the actor group restarted before this one (the launchers set it): each restart is a run of its
own in the trackers, `<namespace>-<job>-r<N>`, so a redone step never overwrites the earlier run's."""

SKIPPED_KEYS = frozenset({"step", "timestamp"})
"""Record keys that are not metrics: the step is each tracker's own x axis, the timestamp each tracker's own."""


@dataclass(frozen=True)
class RunInfo:
    """What names a run and what it logs as config."""

    namespace: str
    job: str
    restart: int
    config: dict[str, Any]
    """The resolved spec (JSON-ready, camelCase as in the manifest)."""
    run_dir: str = ""
    """`rljob run`'s run directory (default parent of the trackers' local files); empty in pods."""

    @property
    def name(self) -> str:
        return run_name(self.namespace, self.job, self.restart)

    @property
    def group(self) -> str:
        """Every restart of a job shares it (W&B's group, SwanLab's group, an MLflow tag)."""
        return f"{self.namespace}-{self.job}"


class Tracker(Protocol):
    """One run in one tracker. Any method may raise: the fan-out warns once and retries with back-off."""

    def start(self) -> None: ...

    def log(self, step: int, metrics: Mapping[str, float]) -> None: ...

    def log_model(self, path: str) -> None: ...

    def finish(self) -> None: ...


@dataclass(frozen=True)
class Backend:
    module: str
    """The rljob module implementing it (imported when a job lists it)."""
    package: str
    """The module the tracker's library installs, checked before anything starts."""
    pip: str
    """What to install for it."""
    key_env: str | None
    """The variable its library reads the credential from: the operator fills it from `apiKeySecret`."""


_MODULES = "rljob.runtime.records.trackers"
_EXTRA = "pip install 'rljob[trackers]'"
BACKENDS: dict[TrackerName, Backend] = {
    "tensorboard": Backend(f"{_MODULES}.tensorboard_tracker", "tensorboard", "pip install 'rljob[train]'", None),
    "wandb": Backend(f"{_MODULES}.wandb_tracker", "wandb", _EXTRA, "WANDB_API_KEY"),
    "mlflow": Backend(f"{_MODULES}.mlflow_tracker", "mlflow", _EXTRA, "MLFLOW_TRACKING_TOKEN"),
    "swanlab": Backend(f"{_MODULES}.swanlab_tracker", "swanlab", _EXTRA, "SWANLAB_API_KEY"),
}


def run_name(namespace: str, job: str, restart: int) -> str:
    return f"{namespace}-{job}-r{restart}"


def restart_number(env: Mapping[str, str] | None = None) -> int:
    """RLJOB_RESTART as a number; 0 when unset or not a whole number (a run name is no reason to stop)."""
    raw = (os.environ if env is None else env).get(RESTART_ENV, "")
    return int(raw) if raw.isdigit() else 0


def tracker_problems(spec: RLJobSpec) -> list[Problem]:
    """Each listed tracker whose library is not installed here, with the field and what to install."""
    problems = []
    for i, tracker in enumerate(spec.logging.trackers):
        backend = BACKENDS[tracker.name]
        if importlib.util.find_spec(backend.package) is None:
            problems.append(
                Problem(
                    f"spec.logging.trackers[{i}].name",
                    f"tracker {tracker.name} needs the {backend.package} package where the actor runs: "
                    f"{backend.pip}, or remove the entry",
                )
            )
    return problems


def build_tracker(spec: TrackerSpec, run: RunInfo) -> Tracker:
    """The tracker of one `logging.trackers` entry (its module imported here, not before)."""
    module = importlib.import_module(BACKENDS[spec.name].module)
    return module.make(spec, run)  # type: ignore[no-any-return]


def local_dir(spec: TrackerSpec, run: RunInfo) -> str | None:
    """Where the tracker's own files go: `dir`, else `<run dir>/<tracker>` under `rljob run`, else the library's
    default (None)."""
    if spec.dir:
        path = Path(spec.dir)
    elif run.run_dir:
        path = Path(run.run_dir) / spec.name
    else:
        return None
    path.mkdir(parents=True, exist_ok=True)
    return str(path)


def scalars(record: Mapping[str, Any]) -> dict[str, float]:
    """The record's finite numbers (no bools, lists or missing values): what every tracker plots."""
    out = {}
    for key, value in record.items():
        if key in SKIPPED_KEYS or isinstance(value, bool) or not isinstance(value, int | float):
            continue
        if math.isfinite(value):
            out[key] = float(value)
    return out


def flatten(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """`{"a": {"b": 1}}` -> `{"a.b": 1}`: MLflow's params are flat."""
    out: dict[str, Any] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            out.update(flatten(value, f"{name}."))
        else:
            out[name] = value
    return out
