"""Robot-manipulation simulators served by real env replicas: the shipped MetaWorld and ManiSkill examples, run
briefly.

One short run per simulator, shared by its tests (a few updates): the env role creates MetaWorld's Sawyer arm in
MuJoCo, or ManiSkill's Panda arm in SAPIEN's CPU physics; the job finishes, and every update where episodes ended
reports a success rate. Whether the rate rises is measured by `make figures` (benchmarks/example_figures.py), not
here: that takes minutes.
"""

from __future__ import annotations

import functools
import subprocess
import sys

import pytest

from rljob.api.spec import GymTask
from rljob.runtime.gym.envs import GymConfigError, make_env
from tests.conftest import REPO
from tests.launch.conftest import Run

EXAMPLE = "examples/metaworld-reach-ppo.yaml"
MANISKILL_EXAMPLE = "examples/maniskill-pushcube-cpu.yaml"
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


@functools.cache
def _vulkan_missing() -> str | None:
    """Why SAPIEN cannot render here (it must, even for state observations), or None."""
    probe = "import sapien; sapien.render.RenderSystem(sapien.Device('cpu'))"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300, check=False)
    if done.returncode == 0:
        return None
    last = (done.stderr.strip().splitlines() or ["no output"])[-1]
    return f"SAPIEN finds no Vulkan device it accepts ({last}): `make vulkan-tools` installs one (root, Debian 12)"


@pytest.fixture(scope="module")
def pushcube_run(tmp_path_factory):
    reason = _vulkan_missing()
    if reason is not None:
        pytest.skip(reason)
    run = Run(
        REPO / MANISKILL_EXAMPLE,
        tmp_path_factory.mktemp("maniskill") / "run",
        "--quiet",
        f"--set=spec.trainer.steps={STEPS}",
        "--set=spec.task.gym.numEnvs=2",
        "--set=spec.trainer.batchSize=104",  # 2 envs x 52 steps: at least one episode of each ends per update
        "--set=spec.task.gym.vectorization=sync",  # no subprocess per env: each imports ManiSkill for seconds
        split_streams=True,
    )
    output = run.finish()
    return run, output


@pytest.mark.slow
def test_maniskill_env_replicas_serve_a_job_to_its_end_with_success_rates(pushcube_run):
    run, output = pushcube_run
    assert run.process.returncode == 0, output + run.errors
    assert output.startswith(f"done: reached trainer.steps ({STEPS})"), output
    rates = [r["success_rate"] for r in run.metrics()]
    assert len(rates) == STEPS and all(rate is not None and 0.0 <= rate <= 1.0 for rate in rates), rates
    assert not run.roles()
