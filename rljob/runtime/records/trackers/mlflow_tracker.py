"""MLflow (the `mlflow-skinny` client): a run in experiment `project` on `uri` (a tracking server, or a local
`file://` store); the resolved spec as flat params and as an artifact `rljob-spec.json`; the exported model's path
as the tag `rljob.model_path` (the model itself is not copied into MLflow's artifact store)."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from rljob.api.spec import TrackerSpec
from rljob.runtime.records.trackers.base import RunInfo, flatten, local_dir

PARAM_VALUE_LIMIT = 6000
"""MLflow refuses longer param values."""
BATCH_LIMIT = 100
"""Params per `log_batch` call MLflow accepts."""


class MlflowTracker:
    def __init__(self, spec: TrackerSpec, run: RunInfo) -> None:
        self.spec = spec
        self.run = run
        self._client: Any = None
        self._run_id: str | None = None

    def start(self) -> None:
        # The fan-out retries with back-off of its own: MLflow's (7 retries, minutes) would only delay the warning.
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "30")
        # mlflow-skinny has no SQL store: a local `file://` store is MLflow's file store, which MLflow 3 keeps
        # behind this switch.
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        client = MlflowClient(tracking_uri=self.tracking_uri())
        experiment = client.get_experiment_by_name(self.spec.project)
        experiment_id = (
            experiment.experiment_id if experiment is not None else client.create_experiment(self.spec.project)
        )
        run = client.create_run(
            experiment_id,
            run_name=self.run.name,
            tags={
                "rljob.job": self.run.job,
                "rljob.namespace": self.run.namespace,
                "rljob.restart": str(self.run.restart),
                "rljob.group": self.run.group,
            },
        )
        params = [
            Param(key, json.dumps(value) if not isinstance(value, str) else value)
            for key, value in flatten(self.run.config).items()
        ]
        params = [Param(p.key, p.value[:PARAM_VALUE_LIMIT]) for p in params]
        for i in range(0, len(params), BATCH_LIMIT):
            client.log_batch(run.info.run_id, params=params[i : i + BATCH_LIMIT])
        client.log_dict(run.info.run_id, self.run.config, "rljob-spec.json")
        self._client, self._run_id = client, run.info.run_id

    def tracking_uri(self) -> str | None:
        """`uri`, else MLFLOW_TRACKING_URI, else `<run dir>/mlflow` under `rljob run` (MLflow's own default, `./mlruns`,
        in pods)."""
        if self.spec.uri or os.environ.get("MLFLOW_TRACKING_URI"):
            return self.spec.uri or os.environ["MLFLOW_TRACKING_URI"]
        root = local_dir(self.spec, self.run)
        return Path(root).resolve().as_uri() if root else None

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self._client.log_batch(self._run_id, metrics=[Metric(k, v, now, step) for k, v in metrics.items()])

    def log_model(self, path: str) -> None:
        self._client.set_tag(self._run_id, "rljob.model_path", path)

    def finish(self) -> None:
        self._client.set_terminated(self._run_id)


def make(spec: TrackerSpec, run: RunInfo) -> MlflowTracker:
    return MlflowTracker(spec, run)
