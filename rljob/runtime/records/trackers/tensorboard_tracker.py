"""TensorBoard: event files under `<dir>/<run name>`; the resolved spec and the exported model's path as text."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from rljob.api.spec import TrackerSpec
from rljob.runtime.records.trackers.base import RunInfo, local_dir


class TensorBoardTracker:
    def __init__(self, spec: TrackerSpec, run: RunInfo) -> None:
        self.spec = spec
        self.run = run
        self._writer: Any = None

    def start(self) -> None:
        from torch.utils.tensorboard import SummaryWriter

        root = local_dir(self.spec, self.run)
        assert root is not None  # the rules require `dir` for tensorboard
        self._writer = SummaryWriter(log_dir=str(Path(root) / self.run.name))
        # Markdown code block: TensorBoard's text tab renders the JSON as written.
        self._writer.add_text("config", "```\n" + json.dumps(self.run.config, indent=2) + "\n```", global_step=0)
        self._writer.flush()

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        for key, value in metrics.items():
            self._writer.add_scalar(key, value, global_step=step)
        self._writer.flush()

    def log_model(self, path: str) -> None:
        self._writer.add_text("exported_model", path)
        self._writer.flush()

    def finish(self) -> None:
        self._writer.close()


def make(spec: TrackerSpec, run: RunInfo) -> TensorBoardTracker:
    return TensorBoardTracker(spec, run)
