"""Weights & Biases: one run per actor-group start, grouped by job; the exported model as a `file://` reference
artifact (nothing uploaded: the model stays where it was written). Offline mode writes the run under `dir`."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from rljob.api.spec import TrackerSpec
from rljob.runtime.records.trackers.base import RunInfo, local_dir

INIT_TIMEOUT_S = 30.0
"""W&B's own wait for its server at init (WANDB_INIT_TIMEOUT overrides it); the fan-out retries after it. It also
bounds how long a process whose W&B server is out of reach takes to exit: W&B waits for its init at exit."""


class WandbTracker:
    def __init__(self, spec: TrackerSpec, run: RunInfo) -> None:
        self.spec = spec
        self.run = run
        self._run: Any = None

    def start(self) -> None:
        import wandb

        timeout = float(os.environ.get("WANDB_INIT_TIMEOUT") or INIT_TIMEOUT_S)
        settings = wandb.Settings(init_timeout=timeout, console="off", silent=True)
        if self.spec.uri:
            settings.base_url = self.spec.uri
        self._run = wandb.init(
            project=self.spec.project,
            entity=self.spec.entity,
            name=self.run.name,
            group=self.run.group,
            job_type="train",
            config=self.run.config,
            dir=local_dir(self.spec, self.run),
            mode="offline" if self.spec.offline else "online",
            settings=settings,
            reinit="create_new",
        )

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        self._run.log(dict(metrics), step=step)

    def log_model(self, path: str) -> None:
        import wandb

        artifact = wandb.Artifact(re.sub(r"[^A-Za-z0-9._-]", "-", f"{self.run.group}-model"), type="model")
        # A reference without checksums: W&B records where the model is and reads none of its bytes.
        artifact.add_reference(Path(path).resolve().as_uri(), checksum=False)
        self._run.log_artifact(artifact)

    def finish(self) -> None:
        self._run.finish()


def make(spec: TrackerSpec, run: RunInfo) -> WandbTracker:
    return WandbTracker(spec, run)
