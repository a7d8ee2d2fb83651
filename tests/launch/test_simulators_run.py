"""Robot-manipulation simulators served by real env replicas: the shipped MetaWorld example, run briefly.

One short run per module (a few updates): the env role creates MetaWorld's Sawyer arm in MuJoCo, the job
finishes, and every update where episodes ended reports a success rate. Whether the rate rises is measured by
`make figures` (benchmarks/example_figures.py), not here: that takes minutes.
"""

from __future__ import annotations

import pytest

from rljob.api.spec import GymTask
from rljob.runtime.gym.envs import GymConfigError, make_env
from tests.conftest import REPO
from tests.launch.conftest import Run

EXAMPLE = "examples/metaworld-reach-ppo.yaml"
STEPS = 3


@pytest.fixture(scope="module")
def reach_run(tmp_path_factory):
    run = Run(
        REPO / EXAMPLE,
        tmp_path_factory.mktemp("metaworld") / "run",
        "--quiet",
        f"--set=spec.trainer.steps={STEPS}",
        "--set=spec.task.gym.maxEpisodeSteps=64",  # 16 episodes end per update: a success rate every update
        split_streams=True,
    )
    output = run.finish()
    return run, output


@pytest.mark.slow
def test_metaworld_env_replicas_serve_a_job_to_its_end(reach_run):
    run, output = reach_run
    assert run.process.returncode == 0, output + run.errors
    assert output.startswith(f"done: reached trainer.steps ({STEPS})"), output
    records = run.metrics()
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert not run.roles()


@pytest.mark.slow
def test_metaworld_success_reaches_the_metrics(reach_run):
    run, _ = reach_run
    rates = [r["success_rate"] for r in run.metrics()]
    assert all(rate is not None and 0.0 <= rate <= 1.0 for rate in rates), rates


def test_a_metaworld_task_that_does_not_exist_names_the_field():
    task = GymTask.model_validate(
        {"envId": "metaworld:Meta-World/goal_observable", "envKwargs": {"env_name": "reech-v3", "seed": None}}
    )
    with pytest.raises(GymConfigError, match=r"spec\.task\.gym\.envKwargs"):
        make_env(task)


def test_a_simulator_that_is_not_installed_names_the_env_id_whatever_the_kwargs():
    task = GymTask.model_validate({"envId": "no_such_simulator:Reach-v0", "envKwargs": {"env_name": "reach-v3"}})
    expected = r"spec\.task\.gym\.envId .* not installed here \(No module named 'no_such_simulator'\)"
    with pytest.raises(GymConfigError, match=expected):
        make_env(task)
