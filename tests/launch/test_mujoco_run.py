"""A MuJoCo job as a user runs it: examples/ppo-hopper.yaml through `rljob run`, cut to a few PPO updates."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import yaml

pytest.importorskip("mujoco", reason="MuJoCo tasks need the mujoco wheel (rljob's env extra)")

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "ppo-hopper.yaml"

IN_BOUNDS_ONLY = '''\
import gymnasium


class InBoundsOnly(gymnasium.Wrapper):
    """Fails the env role if an action outside the Box bounds ever reaches the simulator."""

    def step(self, action):
        if not self.env.action_space.contains(action.astype(self.env.action_space.dtype)):
            raise AssertionError(f"action {action} outside {self.env.action_space}")
        return self.env.step(action)
'''


@pytest.mark.slow
def test_hopper_example_trains_with_in_bounds_actions_and_returns_in_hoppers_units(tmp_path, start_run):
    wrapper = tmp_path / "in_bounds.py"
    wrapper.write_text(IN_BOUNDS_ONLY)
    job = yaml.safe_load(EXAMPLE.read_text())
    # Innermost, so it sees the actions as MuJoCo gets them; the example's normalising wrappers stay around it.
    job["spec"]["task"]["gym"]["wrappers"].insert(0, {"module": f"{wrapper}:InBoundsOnly"})
    job["spec"]["trainer"].update(steps=3, batchSize=512)
    job["spec"]["algorithm"].update(epochs=2, minibatches=8)
    manifest = tmp_path / "hopper.yaml"
    manifest.write_text(yaml.safe_dump(job))

    run = start_run(manifest)
    output = run.finish()
    assert run.process.returncode == 0, output
    records = run.metrics()
    assert [r["env_steps"] for r in records] == [512, 1024, 1536]
    lengths = [r["length_mean"] for r in records if r["length_mean"] is not None]
    returns = [r["return_mean"] for r in records if r["return_mean"] is not None]
    assert returns and all(math.isfinite(x) for x in returns)
    assert all(math.isfinite(r[key]) for r in records for key in ("policy_loss", "value_loss", "entropy"))
    # Hopper pays about 1 per step alive (less the falls and the control cost): with random-ish actions a batch's
    # episodes return 0.6-0.8 per step. Summed from the normalised rewards PPO trains on, they would return ~0.15.
    per_step = [ret / length for ret, length in zip(returns, lengths, strict=True)]
    assert all(0.35 < x < 1.5 for x in per_step), per_step
