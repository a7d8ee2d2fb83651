"""The MuJoCo benchmark's bookkeeping: final returns over the last episodes, ranges and whether they overlap, and
the SB3 settings it derives from the example manifest."""

from __future__ import annotations

import pytest

from benchmarks.cartpole_vs_sb3 import sb3_settings
from benchmarks.mujoco_vs_sb3 import ROOT, WINDOW, curve, final_return, overlap, summarise


def run(final: float | None) -> dict:
    return {"final_return": final, "env_steps": 4096, "wall_s": 10.0, "cpu_s": 9.0}


def test_final_return_is_the_mean_of_the_last_episodes():
    assert final_return([0.0] * 5 + [10.0] * WINDOW) == 10.0
    assert final_return([]) is None
    assert curve([(100, [1.0, 3.0]), (200, []), (300, [5.0])]) == [(100, 2.0), (300, 3.0)]


def test_summary_and_overlap_of_the_seed_ranges():
    a = summarise([run(100.0), run(300.0), run(200.0)])
    assert (a["final_return_mean"], a["final_return_std"], a["final_return_range"]) == (200.0, 100.0, [100.0, 300.0])
    assert overlap(a, summarise([run(290.0), run(500.0)])) is True
    assert overlap(a, summarise([run(301.0), run(500.0)])) is False
    assert overlap(a, summarise([run(None)])) is None


def test_sb3_gets_the_examples_settings():
    settings = sb3_settings(ROOT / "examples" / "ppo-hopper.yaml")
    assert settings["n_steps"] == 2048 and settings["batch_size"] == 64 and settings["n_epochs"] == 10
    assert settings["vf_coef"] == pytest.approx(0.5)  # rljob's 0.5 * MSE at valueCoef 1 is SB3's MSE at 0.5
    assert (settings["max_grad_norm"], settings["adam_eps"], settings["linear_lr"]) == (0.5, 1e-5, False)
