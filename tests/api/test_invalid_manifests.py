"""Each broken manifest under tests/api/invalid/ yields its specific message with the field path.

The expected messages are written in each file as `# expect: ...` lines, so a reader sees the
manifest and its diagnosis side by side; `# never: ...` lines are text the diagnosis must not contain.
"""

from pathlib import Path

import pytest
from typer.testing import CliRunner

from rljob.cli.main import app

INVALID = sorted((Path(__file__).parent / "invalid").glob("*.yaml"))


def expectations(path: Path, prefix: str = "# expect: ") -> list[str]:
    return [line.removeprefix(prefix).rstrip("\n") for line in path.open() if line.startswith(prefix)]


def test_there_are_at_least_twenty_broken_manifests():
    assert len(INVALID) >= 20


@pytest.mark.parametrize("path", INVALID, ids=[p.stem for p in INVALID])
def test_broken_manifest_is_rejected_with_its_specific_message(path: Path):
    expected = expectations(path)
    assert expected, f"{path.name} has no '# expect:' line"
    result = CliRunner().invoke(app, ["validate", str(path)])
    output = result.output
    assert result.exit_code == 1, output
    assert result.exception is None or isinstance(result.exception, SystemExit), output
    assert "Traceback" not in output
    for message in expected:
        assert message in output
    for message in expectations(path, "# never: "):
        assert message not in output
    # Every problem is located: file name and line number before the field path.
    for line in output.strip().splitlines():
        assert line.startswith(f"{path}:"), line


def test_all_problems_of_a_manifest_are_reported_at_once(tmp_path: Path):
    manifest = tmp_path / "job.yaml"
    manifest.write_text(
        "apiVersion: rljob.io/v1alpha1\nkind: RLJob\nmetadata: {name: two-problems}\n"
        "spec:\n  task: {type: gym, gym: {envId: CartPole-v1}}\n  algorithm: {name: ppo}\n"
        "  trainer: {steps: 0}\n  roles: {actor: {replicas: 0}}\n"
    )
    result = CliRunner().invoke(app, ["validate", str(manifest)])
    assert result.exit_code == 1
    assert "spec.trainer.steps: must be >= 1 (got 0)" in result.output
    assert "spec.roles.actor.replicas: must be >= 1 (got 0)" in result.output


def test_problem_points_at_the_line_of_the_offending_key(tmp_path: Path):
    manifest = tmp_path / "job.yaml"
    manifest.write_text(
        "apiVersion: rljob.io/v1alpha1\nkind: RLJob\nmetadata:\n  name: lines\nspec:\n"
        "  task:\n    type: gym\n    gym:\n      envId: CartPole-v1\n      numEnvs: 0\n"
        "  algorithm:\n    name: ppo\n  trainer:\n    steps: 1\n"
    )
    result = CliRunner().invoke(app, ["validate", str(manifest)])
    assert f"{manifest}:10: spec.task.gym.numEnvs: must be >= 1 (got 0)" in result.output
