"""The launcher refuses exactly what `rljob validate`, `rljob render` and the operator refuse, in the same words.

A job that the local launcher refused but `validate` accepted became, on a cluster, pods that crash-looped
through the restart budget; now every rule lives in the API's rule set and every entry point reads it.
"""

from __future__ import annotations

import datetime
from pathlib import Path
from typing import Any

import pytest
import yaml
from typer.testing import CliRunner

from rljob.api import RLJob
from rljob.api.rules import resolve_defaults
from rljob.api.status import RLJobStatus
from rljob.cli.main import app
from rljob.launch.local import LaunchError, LocalRun
from rljob.operator.controller import parse_job
from rljob.operator.reconcile import Observation, plan
from tests.conftest import REPO

CARTPOLE = yaml.safe_load((REPO / "examples" / "cartpole-ppo.yaml").read_text())

# (rule, spec changes, the problem every entry point reports)
RULES = [
    (
        "rollout-replicas-above-env-replicas",
        {"roles": {"env": {"replicas": 2}, "rollout": {"replicas": 3}}},
        "spec.roles.rollout.replicas: each rollout replica drives its own env replicas: "
        "must be <= roles.env.replicas 2 (got 3)",
    ),
    (
        "batch-not-divisible-by-minibatches",
        {"trainer": {"steps": 5, "batchSize": 512}, "algorithm": {"name": "ppo", "minibatches": 3}},
        "spec.algorithm.minibatches: must divide the 512 samples of a step (trainer.batchSize 512) into equal "
        "minibatches: use a divisor of 512 (got 3)",
    ),
    (
        "minibatch-not-divisible-by-actor-ranks",
        {"trainer": {"steps": 5, "batchSize": 512}, "roles": {"actor": {"replicas": 3}}},
        "spec.roles.actor.replicas: every actor rank trains an equal share of each minibatch of 512 samples "
        "(512 / algorithm.minibatches 1): use a divisor of 512 (got 3)",
    ),
    (
        "fsdp2-on-a-gym-job",
        {"trainer": {"parallelism": "fsdp2"}, "roles": {"actor": {"replicas": 2}}},
        "spec.trainer.parallelism: is used by llm tasks only; a gym job would ignore it: remove it or set 'ddp' "
        "(got 'fsdp2')",
    ),
]
IDS = [rule for rule, _, _ in RULES]


def _merge(base: dict[str, Any], changes: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in changes.items():
        merged[key] = _merge(base.get(key, {}), value) if isinstance(value, dict) else value
    return merged


def manifest_with(tmp_path: Path, changes: dict[str, Any]) -> tuple[Path, dict[str, Any]]:
    data = {**CARTPOLE, "spec": _merge(CARTPOLE["spec"], changes)}
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path, data


@pytest.mark.parametrize(("changes", "problem"), [r[1:] for r in RULES], ids=IDS)
def test_validate_render_run_and_the_operator_refuse_the_job_with_the_same_words(tmp_path, changes, problem):
    path, data = manifest_with(tmp_path, changes)
    for command in (["validate"], ["render"], ["run", "--out", str(tmp_path / "out")]):
        result = CliRunner().invoke(app, [*command, str(path)])
        assert result.exit_code == 1, (command, result.output)
        assert problem in result.output, (command, result.output)
    assert not (tmp_path / "out").exists()  # refused before the run directory or any process
    job, invalid = parse_job(data)
    assert job is None and invalid is not None
    observation = Observation(
        job=None,
        invalid=invalid,
        generation=1,
        status=RLJobStatus(),
        pods=[],
        desired_pods={},
        now=datetime.datetime(2026, 1, 1, tzinfo=datetime.UTC),
    )
    failed = next(c for c in plan(observation).status.conditions if c.type == "Failed")
    assert failed.reason == "InvalidSpec" and problem in failed.message


@pytest.mark.parametrize(("changes", "problem"), [r[1:] for r in RULES], ids=IDS)
def test_the_launcher_itself_refuses_a_job_that_skipped_validation(tmp_path, changes, problem):
    """LocalRun given a job built without `validate_job` (as a library user might) says the same."""
    _, data = manifest_with(tmp_path, changes)
    job = resolve_defaults(RLJob.model_validate(data, by_alias=True, by_name=False))
    with pytest.raises(LaunchError) as refused:
        LocalRun(job, tmp_path / "out", lambda name, line: None)
    assert problem in str(refused.value)
    assert not (tmp_path / "out").exists()
