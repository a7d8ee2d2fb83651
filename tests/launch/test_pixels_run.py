"""`rljob run` on pixel tasks: MiniGrid from RGB views learns with the builtin cnn; a network that cannot read the
observations is refused before any process. (Atari's wrappers and the Nature cnn acting on Pong's stacked frames:
tests/runtime/gym/test_pixel_wrappers.py; the whole pixel path through the roles is the MiniGrid run's.)"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.launch.test_local_run import assert_every_step_once

pytest.importorskip("minigrid", reason="the pixels extra is not installed: pip install 'rljob[pixels]'")
pytest.importorskip("ale_py", reason="the pixels extra is not installed: pip install 'rljob[pixels]'")

EXAMPLES = Path(__file__).parents[2] / "examples"
MINIGRID = EXAMPLES / "minigrid-pixels-ppo.yaml"


def test_minigrid_from_pixels_reaches_the_goal_faster_after_training(start_run):
    run = start_run(MINIGRID, "--set", "spec.trainer.steps=30", "--set", "spec.checkpoint.interval=30")
    output = run.finish()
    assert run.process.returncode == 0, output
    records = run.metrics()
    assert_every_step_once(records, 30)
    episodes = [ret for r in records for ret in r["episode_returns"]]
    first, last = sum(episodes[:20]) / 20, sum(episodes[-20:]) / 20
    # A random walk finds the goal late (return 1 - 0.9 * steps / 100); the trained policy walks straight to it.
    assert last > 0.85 and last >= first + 0.3, (first, last)
    assert records[-1]["length_mean"] < records[0]["length_mean"]
    assert not run.roles()


def test_a_network_that_cannot_read_the_pixels_fails_before_any_process_starts(tmp_path):
    """The env is created and checked against the network before any role starts (the other bad inputs are
    unit-tested: tests/runtime/gym/test_pixel_wrappers.py, tests/api/test_pixel_rules.py)."""
    out = tmp_path / "out"
    override = "spec.model.builtin.architecture=mlp"
    result = subprocess.run(
        [sys.executable, "-m", "rljob.cli.main", "run", str(MINIGRID), "--quiet", "--out", str(out), "--set", override],
        capture_output=True,
        text=True,
        timeout=120,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 1, output
    assert "images, which the builtin mlp does not read; set spec.model.builtin.architecture: cnn" in output
    assert "Traceback" not in output
    assert not out.exists()
