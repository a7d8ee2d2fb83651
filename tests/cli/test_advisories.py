"""Valid but doubtful settings are accepted with a warning that names the field and the fix."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from rljob.cli.main import app
from tests.conftest import REPO

STALE_WITHOUT_CORRECTION = (
    "spec.algorithm.offPolicy.type: none trains on batches up to 2 policy versions old "
    "(rollout.async.maxStaleness) without importance weighting: set tis or icepop"
)


def cartpole(tmp_path: Path, max_staleness: int, off_policy: str | None = None) -> Path:
    manifest = yaml.safe_load((REPO / "examples" / "cartpole-ppo.yaml").read_text())
    manifest["spec"]["rollout"]["async"]["maxStaleness"] = max_staleness
    if off_policy is not None:
        manifest["spec"]["algorithm"]["offPolicy"] = {"type": off_policy}
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(manifest))
    return path


@pytest.mark.parametrize("command", ["validate", "render"])
def test_stale_data_without_off_policy_correction_is_accepted_with_a_warning(tmp_path, command):
    path = cartpole(tmp_path, max_staleness=2)
    result = CliRunner().invoke(app, [command, str(path)])
    assert result.exit_code == 0, result.output
    assert f"warning: {path}: {STALE_WITHOUT_CORRECTION}" in result.output


@pytest.mark.parametrize(("max_staleness", "off_policy"), [(2, "tis"), (2, "icepop"), (0, None)])
def test_no_warning_with_a_correction_or_on_policy(tmp_path, max_staleness, off_policy):
    result = CliRunner().invoke(app, ["validate", str(cartpole(tmp_path, max_staleness, off_policy))])
    assert result.exit_code == 0, result.output
    assert "warning:" not in result.output
