"""`rljob operator` refuses contradictory or invalid flags before touching any cluster."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from rljob.cli.main import app


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ([], "--namespace NS (repeatable) or --all-namespaces"),
        (["-n", "a", "--all-namespaces"], "not both"),
        (["-A", "--peering", "x", "--standalone"], "exclude each other"),
        (["-A", "--log-level", "loud"], "--log-level must be one of"),
        (["-A", "--resync-seconds", "0"], "--resync-seconds must be positive"),
    ],
)
def test_operator_flags_are_checked(args: list[str], message: str) -> None:
    result = CliRunner().invoke(app, ["operator", *args])
    assert result.exit_code == 2
    assert message in result.output


def test_bad_operator_settings_name_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RLJOB_OPERATOR_IMAGE_PULL_POLICY", "Sometimes")
    result = CliRunner().invoke(app, ["operator", "-A"])
    assert result.exit_code == 1
    assert "RLJOB_OPERATOR_IMAGE_PULL_POLICY" in result.output
