"""SwanLab: one experiment per actor-group start, grouped by job; offline mode writes it under `dir` (`swanlab sync`
uploads it later); the exported model's path as the text `exported_model`."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from rljob.api.spec import TrackerSpec
from rljob.runtime.records.trackers.base import RunInfo, local_dir


class SwanlabTracker:
    def __init__(self, spec: TrackerSpec, run: RunInfo) -> None:
        self.spec = spec
        self.run = run
        self._run: Any = None
        self._step = 0

    def start(self) -> None:
        import swanlab

        online = not self.spec.offline and (self.spec.uri or os.environ.get("SWANLAB_API_KEY"))
        if online and not swanlab.login(api_key=os.environ.get("SWANLAB_API_KEY"), host=self.spec.uri):
            raise RuntimeError(f"swanlab login to {self.spec.uri or 'its public host'} failed")
        self._run = swanlab.init(
            project=self.spec.project,
            workspace=self.spec.entity,
            name=self.run.name,
            group=self.run.group,
            job_type="train",
            config=self.run.config,
            log_dir=local_dir(self.spec, self.run),
            mode="offline" if self.spec.offline else "online",
            reinit=True,
        )

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        self._step = step
        self._run.log(dict(metrics), step=step)

    def log_model(self, path: str) -> None:
        self._run.log_text(key="exported_model", data=path, step=self._step)

    def finish(self) -> None:
        self._run.finish()


def make(spec: TrackerSpec, run: RunInfo) -> SwanlabTracker:
    return SwanlabTracker(spec, run)
