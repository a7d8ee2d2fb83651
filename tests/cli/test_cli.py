"""The `rljob` command line as a user drives it: exit codes 0 / 1 / 2 and readable output."""

import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from rljob import __version__
from rljob.api.crd import crd_yaml
from rljob.cli.main import app
from tests.conftest import EXAMPLES, REPO

runner = CliRunner()


def test_validate_accepts_every_example():
    result = runner.invoke(app, ["validate", *map(str, EXAMPLES)])
    assert result.exit_code == 0, result.output
    assert result.output.count("ok ") == len(EXAMPLES)


def test_validate_reports_a_missing_file_without_traceback(tmp_path: Path):
    result = runner.invoke(app, ["validate", str(tmp_path / "nope.yaml")])
    assert result.exit_code == 1
    assert "cannot read the file" in result.output


def test_validate_exits_1_if_any_file_is_invalid_and_still_checks_the_others():
    bad = REPO / "tests" / "api" / "invalid" / "actor-replicas-zero.yaml"
    result = runner.invoke(app, ["validate", str(EXAMPLES[0]), str(bad)])
    assert result.exit_code == 1
    assert f"ok {EXAMPLES[0]}" in result.output
    assert "spec.roles.actor.replicas" in result.output


def test_usage_error_exits_2():
    assert runner.invoke(app, ["validate"]).exit_code == 2
    assert runner.invoke(app, ["no-such-command"]).exit_code == 2


@pytest.mark.parametrize("command", ["validate", "render", "crd", "version"])
def test_every_command_has_help(command: str):
    result = runner.invoke(app, [command, "--help"])
    assert result.exit_code == 0
    assert "Usage" in result.output


def test_crd_prints_the_generated_crd():
    result = runner.invoke(app, ["crd"])
    assert result.exit_code == 0
    assert result.output == crd_yaml()


def test_render_prints_the_resolved_job_with_defaults_filled():
    result = runner.invoke(app, ["render", str(REPO / "examples" / "grpo-tiny-arithmetic.yaml")])
    assert result.exit_code == 0, result.output
    job = next(d for d in yaml.safe_load_all(result.stdout) if d and d.get("kind") == "RLJob")
    assert job["spec"]["algorithm"]["groupSize"] == 8
    assert job["spec"]["rollout"]["maxTokens"] == job["spec"]["task"]["llm"]["maxResponseLength"]
    assert job["spec"]["checkpoint"]["resume"] == "auto"
    assert "status" not in job


def test_render_of_an_invalid_manifest_exits_1():
    bad = REPO / "tests" / "api" / "invalid" / "unknown-field-typo.yaml"
    result = runner.invoke(app, ["render", str(bad)])
    assert result.exit_code == 1
    assert "did you mean 'replicas'?" in result.output


def test_version():
    result = runner.invoke(app, ["version"])
    assert result.output.strip() == f"rljob {__version__}"


def test_console_script_is_installed():
    rljob = Path(sys.executable).parent / "rljob"
    done = subprocess.run([str(rljob), "version"], capture_output=True, text=True, check=False)
    assert done.returncode == 0 and __version__ in done.stdout


def test_cli_starts_without_any_optional_dependency_loaded():
    """Each image installs one extra only (the env image has no torch, no kopf): `rljob` must start there."""
    code = (
        "import sys, rljob.cli.main, rljob.runtime.gym.env; "
        "print(sorted(m for m in ('torch', 'kopf', 'kubernetes_asyncio', 'transformers', 'vllm') if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"


def test_validate_reports_what_only_the_pod_builders_see(tmp_path: Path):
    """`validate` and the operator agree: a port rljob reserves inside pods is refused by both."""
    manifest = yaml.safe_load((REPO / "examples" / "cartpole-ppo.yaml").read_text())
    manifest["spec"]["logging"] = {"prometheusPort": 29600}
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(manifest))
    result = runner.invoke(app, ["validate", str(path)])
    assert result.exit_code == 1
    assert "spec.logging.prometheusPort" in result.output


def test_validate_gives_the_shipped_examples_no_warning_and_only_known_notes():
    for example in EXAMPLES:
        result = runner.invoke(app, ["validate", str(example)])
        notes = [line for line in result.output.splitlines() if "note:" in line]
        # The notes: the checkpoint claim's StorageClass, which only a cluster can tell, and the settings the
        # example departs from its paper with (each explained in a comment beside it); no warning.
        known = ("storageClassName is unset", "depart from grpo's paper defaults")
        assert result.exit_code == 0 and all(any(k in n for k in known) for n in notes), result.output
        assert "warning:" not in result.output


def test_validate_on_a_directory_says_to_pass_the_files(tmp_path: Path):
    result = runner.invoke(app, ["validate", str(tmp_path)])
    assert result.exit_code == 1
    assert f"{tmp_path}/*.yaml" in result.output


def test_validate_notes_the_checkpoint_claim_needs_a_storage_class_unless_one_is_named(tmp_path: Path):
    example = next(p for p in EXAMPLES if p.name == "cartpole-ppo.yaml")
    result = runner.invoke(app, ["validate", str(example)])
    assert result.exit_code == 0
    assert "note:" in result.stderr and "cartpole-ppo-checkpoints" in result.stderr
    assert "the cluster's default one" in result.stderr and "Not checked here" in result.stderr
    named = runner.invoke(app, ["validate", str(example)], env={"RLJOB_OPERATOR_CHECKPOINT_STORAGE_CLASS": "fast"})
    assert named.exit_code == 0 and "note:" not in named.stderr
    own = tmp_path / "own.yaml"
    own.write_text(example.read_text().replace("checkpoint:", "checkpoint:\n    volumeClaim: mine", 1))
    mine = runner.invoke(app, ["validate", str(own)])
    assert mine.exit_code == 0 and "note:" not in mine.stderr, mine.stderr


def test_validate_and_render_take_the_same_set_overrides_as_run(tmp_path: Path):
    example = str(REPO / "examples" / "cartpole-ppo.yaml")
    result = CliRunner().invoke(app, ["render", example, "--only", "job", "--set", "spec.trainer.learningRate=1e-4"])
    assert result.exit_code == 0, result.output
    assert yaml.safe_load(result.stdout)["spec"]["trainer"]["learningRate"] == 0.0001
    result = CliRunner().invoke(app, ["validate", example, "--set", "spec.trainer.learningRate=1e-4"])
    assert result.exit_code == 0 and result.stdout.startswith(f"ok {example}"), result.output
    result = CliRunner().invoke(app, ["validate", example, "--set", "spec.trainer.stepz=2"])
    assert result.exit_code == 1
    assert f"{example}: spec.trainer.stepz: unknown field: did you mean 'steps'?" in result.output
    assert "(after --set spec.trainer.stepz=2)" in result.output
    result = CliRunner().invoke(app, ["render", example, "--set", "spec.trainer=3"])
    assert result.exit_code == 1 and "spec.trainer: must be a mapping" in result.output


def test_a_manifest_reads_exponent_numbers_as_kubectl_does(tmp_path: Path):
    from rljob.api import load_jobs

    text = (REPO / "examples" / "cartpole-ppo.yaml").read_text()
    text = re.sub(r"learningRate: \S+", "learningRate: 3e-4", text)
    (job,) = load_jobs(text)
    assert job.spec.trainer.learning_rate == 3e-4
    assert yaml.safe_load("3e-4") == "3e-4"  # PyYAML's own loader is left as it is for everyone else


def test_a_tracker_whose_library_is_missing_is_a_note_for_the_cluster_and_an_error_for_a_local_run(
    tmp_path: Path, monkeypatch
):
    import importlib.util

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "wandb" else real_find_spec(n, *a))
    manifest = yaml.safe_load((REPO / "examples" / "cartpole-ppo.yaml").read_text())
    manifest["spec"]["logging"] = {"trackers": [{"name": "tensorboard", "dir": "/tb"}, {"name": "wandb"}]}
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(manifest))
    cluster = runner.invoke(app, ["validate", str(path)])
    assert cluster.exit_code == 0, cluster.output
    assert "note:" in cluster.stderr and "spec.logging.trackers[1].name: tracker wandb needs" in cluster.stderr
    local = runner.invoke(app, ["validate", "--load", str(path)])
    assert local.exit_code == 1
    assert "spec.logging.trackers[1].name: tracker wandb needs the wandb package" in local.output
    assert "pip install 'rljob[trackers]'" in local.output


def test_validate_load_names_the_preference_row_missing_a_side(tmp_path):
    rows = [
        '{"prompt": "1+1=", "chosen": "2", "rejected": "3"}',
        '{"prompt": "2+2=", "chosen": "4"}',
    ]
    data = tmp_path / "pairs.jsonl"
    data.write_text("\n".join(rows) + "\n")
    job = yaml.safe_load((REPO / "examples" / "dpo-tiny.yaml").read_text())
    job["spec"]["task"]["llm"]["dataset"]["path"] = str(data)
    job["spec"]["evaluation"]["size"] = 1
    manifest = tmp_path / "job.yaml"
    manifest.write_text(yaml.safe_dump(job))
    result = runner.invoke(app, ["validate", "--load", str(manifest)])
    assert result.exit_code == 1, result.output
    assert "spec.task.llm.dataset: 1 of 2 rows are not dpo rows: row 1 has no 'rejected'" in result.output
