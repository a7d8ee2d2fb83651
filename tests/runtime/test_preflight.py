"""One preflight: `rljob run`, `rljob validate` (with `--load` for what a run reads and loads), `rljob render` and the
operator refuse the same jobs with the same words, and each entry point checks only what it can."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from typer.testing import CliRunner

from rljob.api import InvalidRLJob, validate_job
from rljob.cli.main import app
from rljob.operator.manifests import build_children
from rljob.operator.settings import OperatorSettings
from rljob.runtime.preflight import PreflightFailed, ensure_startable, preflight
from tests.conftest import REPO

CARTPOLE = yaml.safe_load((REPO / "examples" / "cartpole-ppo.yaml").read_text())
ARITHMETIC = yaml.safe_load((REPO / "examples" / "grpo-tiny-arithmetic.yaml").read_text())


def _merge(base: dict[str, Any], changes: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in changes.items():
        merged[key] = _merge(base.get(key, {}), value) if isinstance(value, dict) else value
    return merged


def manifest(tmp_path: Path, base: dict[str, Any], changes: dict[str, Any]) -> tuple[Path, dict[str, Any]]:
    data = {**base, "spec": _merge(base["spec"], changes)}
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path, data


def cli(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(app, list(args))
    return result.exit_code, result.output


GPU_RANKS = (
    "spec.roles.actor.gpusPerReplica: spec.roles.actor.replicas (1) x 3 ranks per replica = 3 actor ranks, and each "
    "minibatch (spec.trainer.batchSize 512 / spec.algorithm.minibatches 1 = 512 transitions) must split evenly over "
    "them"
)


def test_a_minibatch_its_gpu_ranks_cannot_split_is_refused_everywhere_with_the_same_words(tmp_path):
    """Before the one preflight only `rljob run` said this; the operator made pods whose ranks then failed."""
    path, data = manifest(
        tmp_path, CARTPOLE, {"trainer": {"batchSize": 512}, "roles": {"actor": {"gpusPerReplica": 3}}}
    )
    for command in (["validate"], ["render"], ["run", "--out", str(tmp_path / "out")]):
        code, output = cli(*command, str(path))
        assert code == 1 and GPU_RANKS in output, (command, output)
    assert not (tmp_path / "out").exists()
    with pytest.raises(InvalidRLJob) as refused:  # what the operator builds from, before any child is created
        build_children(validate_job(data), OperatorSettings())
    assert GPU_RANKS in str(refused.value)


@pytest.mark.parametrize(
    ("base", "changes", "said"),
    [
        (
            ARITHMETIC,
            {"task": {"llm": {"dataset": {"builtin": None, "path": "no-such-rows.jsonl"}}}},
            "no-such-rows.jsonl",
        ),
        (
            ARITHMETIC,
            {"reward": {"functions": [{"module": "no_such_rewards.py:score"}]}},
            "spec.reward.functions[0].module",
        ),
        (
            ARITHMETIC,
            {"reward": {"functions": [{"judge": {"path": "no-such-judge", "rubric": "{prompt}{response}"}}]}},
            "spec.reward.functions[0].judge.path",
        ),
        (CARTPOLE, {"task": {"gym": {"envId": "NoSuchEnv-v0"}}}, "NoSuchEnv-v0"),
        (
            CARTPOLE,
            {"model": {"builtin": {"architecture": "tiny-qwen2-vl"}, "vla": {"instruction": "balance the pole"}}},
            "spec.task.gym.envId: the VLA reads camera images",
        ),
    ],
    ids=["missing-dataset", "missing-reward-module", "missing-judge", "unknown-env-id", "vla-without-images"],
)
def test_validate_load_refuses_what_run_refuses_and_plain_validate_leaves_it_to_the_run(tmp_path, base, changes, said):
    """What a job reads and loads is checked where it is read: by `rljob run` before any process starts, and by
    `rljob validate --load` on request; plain `validate` and the operator (whose pod has neither the data nor the
    user's code) accept the manifest."""
    path, data = manifest(tmp_path, base, changes)
    code, output = cli("validate", str(path))
    assert code == 0 and output.startswith("ok "), output
    code, loaded = cli("validate", "--load", str(path))
    assert code == 1 and said in loaded, loaded
    code, ran = cli("run", "--out", str(tmp_path / "out"), str(path))
    assert code == 1 and said in ran, ran
    problem_lines = {line.split(": ", 1)[1] for line in loaded.splitlines() if said in line}
    assert any(line in ran for line in problem_lines), (loaded, ran)  # the same words
    assert build_children(validate_job(data), OperatorSettings())  # the operator builds its children


def test_the_data_is_not_read_for_a_job_whose_spec_is_already_wrong(tmp_path):
    """Checks run shallow to deep: a spec problem is reported alone, without reading a dataset or loading code."""
    _, data = manifest(
        tmp_path,
        ARITHMETIC,
        {
            "task": {"llm": {"dataset": {"builtin": None, "path": "no-such-rows.jsonl"}}},
            "trainer": {"batchSize": 30},
            "roles": {"actor": {"gpusPerReplica": 4}},
        },
    )
    problems = preflight(validate_job(data), load=True)
    assert [p.path for p in problems] == ["spec.roles.actor.gpusPerReplica"]
    with pytest.raises(PreflightFailed) as refused:
        ensure_startable(validate_job(data), load=True)
    assert str(refused.value) == problems[0].render()


def test_a_gpu_job_on_a_machine_without_gpus_is_refused_only_where_the_roles_start_here(tmp_path):
    _, data = manifest(tmp_path, CARTPOLE, {"roles": {"actor": {"gpusPerReplica": 1}}})
    job = validate_job(data)
    assert preflight(job, load=True) == []  # validate --load, the operator and a Ray run: not this machine's GPUs
    (problem,) = preflight(job, local_gpus=True, visible_gpus=[], cuda_visible_devices="")
    assert problem.path == "spec.roles.actor.gpusPerReplica" and "torch sees no GPU" in problem.message
