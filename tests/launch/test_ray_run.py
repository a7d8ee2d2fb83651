"""`rljob run --ray` on a real multi-node Ray test cluster (ray.cluster_utils.Cluster) on this machine.

Nodes declare fake GPUs and accelerator types: they only steer placement; every role runs on the CPU.
One cluster for the module keeps the Ray start-up cost to one.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

ray = pytest.importorskip("ray")
from ray.cluster_utils import Cluster  # noqa: E402

from rljob.api import validate_job  # noqa: E402
from rljob.api.loading import read_yaml_value  # noqa: E402
from rljob.launch.ray_cluster import RayRun  # noqa: E402
from rljob.launch.supervisor import LaunchError  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
REPO_PATH = Path(REPO)
SMALL_STORE = 80 * 1024**2


@pytest.fixture(scope="module")
def cluster():
    """A head with 2 CPUs and two 1-CPU 'GPU' nodes, one H100 and one A100 (fake resources, labelled)."""
    previous = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (REPO, previous) if p)  # raylets' workers find rljob
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 2, "object_store_memory": SMALL_STORE, "include_dashboard": False},
    )
    nodes = {
        "H100": cluster.add_node(
            num_cpus=1,
            num_gpus=1,
            resources={"accelerator_type:H100": 1},
            labels={"pool": "h100"},
            object_store_memory=SMALL_STORE,
        ),
        "A100": cluster.add_node(
            num_cpus=1,
            num_gpus=1,
            resources={"accelerator_type:A100": 1},
            labels={"pool": "a100"},
            object_store_memory=SMALL_STORE,
        ),
    }
    cluster.wait_for_nodes()  # registered with the GCS before a job looks at the cluster
    ray.init(address=cluster.address, log_to_driver=False)
    yield cluster, {name: n.node_id for name, n in nodes.items()}
    ray.shutdown()
    cluster.shutdown()
    if previous is None:
        os.environ.pop("PYTHONPATH", None)
    else:
        os.environ["PYTHONPATH"] = previous


def job_leftovers() -> tuple[list, list]:
    """RoleProcess actors still alive and placement groups not removed, as the cluster's GCS reports them."""
    actors = [a for a in ray._private.state.actors().values() if a["State"] != "DEAD" and "RoleProcess" in str(a)]
    groups = [g for g in ray.util.placement_group_table().values() if g["state"] != "REMOVED"]
    return actors, groups


def wait_until_clean(timeout: float = 30) -> tuple[list, list]:
    deadline = time.monotonic() + timeout
    left = job_leftovers()
    while (left[0] or left[1]) and time.monotonic() < deadline:
        time.sleep(0.5)
        left = job_leftovers()
    return left


def load(manifest, *sets: str):
    from rljob.launch.overrides import apply_overrides

    return validate_job(apply_overrides(read_yaml_value(manifest.read_text()), list(sets)))


def test_a_job_that_cannot_fit_fails_fast_naming_the_missing_resource(cluster, cartpole_manifest, tmp_path):
    address = cluster[0].address
    job = load(cartpole_manifest(), "spec.roles.actor.gpusPerReplica=1", "spec.roles.actor.placement.gpuProduct=B200")
    with pytest.raises(LaunchError) as caught:
        RayRun(job, tmp_path / "a", lambda *_: None, address=address)
    assert "spec.roles.actor.placement.gpuProduct" in str(caught.value)
    assert "accelerator_type:B200" in str(caught.value) and "A100, H100" in str(caught.value)
    job = load(cartpole_manifest(), "spec.roles.actor.replicas=4", "spec.roles.actor.gpusPerReplica=1")
    with pytest.raises(LaunchError, match=r"spec.roles.actor.gpusPerReplica: the job needs GPU 4 in all .* has 2"):
        RayRun(job, tmp_path / "b", lambda *_: None, address=address)
    assert not (tmp_path / "a").exists()
    assert job_leftovers() == ([], [])


@pytest.mark.slow
def test_cartpole_learns_through_ray_and_survives_a_killed_env_worker_and_a_killed_actor(
    cluster, cartpole_manifest, start_run, monkeypatch
):
    monkeypatch.setenv("COLUMNS", "400")
    run = start_run(cartpole_manifest(steps=40, interval=5), "--ray", cluster[0].address, "--quiet")
    run.wait_for_step(5, timeout=180)
    env_role = run.role("env", 1)
    os.kill(env_role.ppid(), signal.SIGKILL)  # the env replica's Ray worker process (its role dies with it)
    run.wait_for_step(12)
    run.kill("actor", 0)
    output = run.finish()
    assert run.process.returncode == 0, output
    assert "env-1: its Ray actor died" in output
    assert "env-1 exited with code -9: replacing it" in output
    assert "restarting the actor group from the latest checkpoint (1/3)" in output
    log = (run.out / "logs" / "actor-0.log").read_text()
    # When the env's replacement cannot get its old port back, every replica restarts with the new
    # addresses (a resume from step 5, not charged); the actor kill after step 12 resumes from step >= 10.
    # A kill during a save resumes from its unrenamed directory (.tmp-step-N-<pid>), which it then completes.
    resumes = re.findall(r"resumed from .*step-(\d+)(?:-\d+)? \(step (\d+)", log)
    assert resumes and int(resumes[-1][1]) % 5 == 0 and 10 <= int(resumes[-1][1]) < 40, log
    records = run.metrics()
    assert [r["step"] for r in records] == list(range(1, 41))
    episodes = [ret for r in records for ret in r["episode_returns"]]
    first, last = sum(episodes[:10]) / 10, sum(episodes[-10:]) / 10
    assert last >= 3 * first, (first, last)
    assert (run.out / "curve.png").stat().st_size > 0 and list((run.out / "tb").iterdir())
    assert (run.out / "job.yaml").exists() and (run.out / "checkpoints").is_dir()
    assert not run.roles()
    assert wait_until_clean() == ([], [])


@pytest.mark.slow
def test_gpu_product_places_each_role_on_its_node_and_ctrl_c_leaves_no_actor_or_placement_group(
    cluster, cartpole_manifest, start_run
):
    address, node_of = cluster[0].address, cluster[1]
    run = start_run(
        cartpole_manifest(steps=500),
        "--ray",
        address,
        "--quiet",
        *("--set", "spec.roles.actor.gpusPerReplica=1", "--set", "spec.roles.actor.placement.gpuProduct=H100"),
        *("--set", "spec.roles.rollout.gpusPerReplica=1", "--set", "spec.roles.rollout.placement.gpuProduct=A100"),
    )
    # Given a fake GPU by Ray, the actor trains on the CPU: it reaches its first step.
    run.wait_for_step(1, timeout=180)
    actors, groups = job_leftovers()
    assert len(actors) == 4 and len(groups) == 1  # actor, rollout, 2 envs in one placement group
    placed = groups[0]["bundles_to_node_id"]  # bundles in role order: actor-0, rollout-0, env-0, env-1
    assert placed[0] == node_of["H100"] and placed[1] == node_of["A100"]
    assert {placed[2], placed[3]}.isdisjoint(node_of.values())
    workers = [psutil.Process(p.ppid()) for p in run.roles()]
    run.process.send_signal(signal.SIGINT)
    output = run.finish(timeout=90)
    assert run.process.returncode == 130, output
    assert "interrupted" in output
    assert wait_until_clean() == ([], [])
    time.sleep(0.5)
    assert not run.roles()
    assert not [w for w in workers if w.is_running() and w.status() != psutil.STATUS_ZOMBIE]


def add_pool_node(test_cluster: Any, pool: str) -> Any:
    """A one-CPU node labelled `pool`, registered before the launcher looks at the cluster."""
    node = test_cluster.add_node(num_cpus=1, labels={"pool": pool}, object_store_memory=SMALL_STORE)
    test_cluster.wait_for_nodes()
    return node


def start_env_pinned_run(start_run: Any, manifest: Any, test_cluster: Any, pool: str, *options: str) -> Any:
    """`rljob run --ray` on the test cluster with the env replica pinned to the nodes labelled `pool`."""
    pin = f"spec.roles.env.placement.nodeSelector={{pool: {pool}}}"
    return start_run(manifest, "--ray", test_cluster.address, "--quiet", *options, "--set", pin)


@pytest.mark.slow
def test_a_removed_node_is_survived_its_replica_placed_again_on_a_replacement_node_at_a_new_address(
    cluster, cartpole_manifest, start_run, monkeypatch
):
    """The env replica is pinned (nodeSelector -> Ray label) to a node of its own, which is removed mid-run.
    Its placement group bundle is re-placed on a replacement node with the same label. All nodes of a test
    cluster share this machine's IP, so the test holds the env's old data port: the replacement comes up at
    another address, as it would on another machine, and every replica restarts with the new addresses."""
    monkeypatch.setenv("COLUMNS", "400")
    test_cluster = cluster[0]

    def env_bundle_node() -> str | None:
        groups = [g for g in ray.util.placement_group_table().values() if g["state"] != "REMOVED"]
        return groups[0]["bundles_to_node_id"].get(2) if groups else None  # bundles: actor-0, rollout-0, env-0

    spare = add_pool_node(test_cluster, "spare")
    replacement = None
    held = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # the old port may linger in TIME_WAIT
    try:
        run = start_env_pinned_run(start_run, cartpole_manifest(steps=30, interval=5, envs=1), test_cluster, "spare")
        run.wait_for_step(6, timeout=180)
        assert env_bundle_node() == spare.node_id
        old_port = int(run.role("env", 0).environ()["RLJOB_ENV_ENDPOINTS"].rsplit(":", 1)[1])
        test_cluster.remove_node(spare)
        deadline = time.monotonic() + 60
        while True:  # the env process dies with its node's Ray worker; then its port is ours to hold
            try:
                held.bind(("", old_port))
                break
            except OSError:
                assert time.monotonic() < deadline, f"port {old_port} of the removed node's env never freed"
                time.sleep(0.2)
        held.listen()
        replacement = add_pool_node(test_cluster, "spare")
        deadline = time.monotonic() + 90
        while env_bundle_node() != replacement.node_id:  # Ray re-places the dead node's bundle
            assert time.monotonic() < deadline and run.process.poll() is None, run.finish()
            time.sleep(0.2)
        output = run.finish()
        assert run.process.returncode == 0, output
        assert "env-0: its Ray actor died (worker process killed or node lost)" in output
        moved = re.search(r"env-0 came back at \S+ ports \[(\d+), \d+\]: restarting every replica", output)
        assert moved and int(moved[1]) != old_port, output
        log = (run.out / "logs" / "actor-0.log").read_text()
        assert re.search(r"resumed from .*step-(\d+)", log), log
        assert [r["step"] for r in run.metrics()] == list(range(1, 31))
        assert not run.roles()
        assert wait_until_clean() == ([], [])
    finally:
        held.close()
        if replacement is not None:
            test_cluster.remove_node(replacement)
        if spare in test_cluster.worker_nodes:
            test_cluster.remove_node(spare)


@pytest.mark.slow
def test_a_removed_node_with_no_replacement_fails_the_job_after_the_placement_timeout_saying_what_it_needs(
    cluster, cartpole_manifest, start_run, monkeypatch
):
    monkeypatch.setenv("COLUMNS", "400")
    test_cluster = cluster[0]
    lonely = add_pool_node(test_cluster, "lonely")
    try:
        run = start_env_pinned_run(
            start_run,
            cartpole_manifest(steps=500, interval=5, envs=1),
            test_cluster,
            "lonely",
            "--placement-timeout",
            "3",
        )
        run.wait_for_step(2, timeout=180)
        test_cluster.remove_node(lonely)
        output = run.finish(timeout=120)
        assert run.process.returncode == 1, output
        assert "env-0: its Ray actor died (worker process killed or node lost)" in output
        assert (
            "waiting up to 3s for Ray to place env-0 again: it needs a node with CPU 1 free and the labels pool=lonely"
            in output
        )
        assert "env-0 was lost with its Ray actor (node lost?) and Ray did not place it again within 8s" in output
        assert not run.roles()
        assert wait_until_clean() == ([], [])
    finally:
        if lonely in test_cluster.worker_nodes:
            test_cluster.remove_node(lonely)


@pytest.mark.slow
def test_a_hung_replica_is_killed_through_its_ray_actor_and_replaced(cluster, start_run, tmp_path, monkeypatch):
    """As locally: the env's step never returns; the launcher asks its /livez on its node, kills it through its
    RoleProcess actor, replaces it, and the failure policy ends the job when the replacement hangs too."""
    from tests.runtime.wire.hanging_env import HUNG_ENV_JOB

    monkeypatch.setenv("COLUMNS", "400")
    manifest = tmp_path / "hung.yaml"
    manifest.write_text(HUNG_ENV_JOB)
    run = start_run(manifest, "--ray", cluster[0].address, "--quiet")
    output = run.finish(timeout=300)
    assert run.process.returncode == 1, output
    assert output.count("env-0 is hung (loop main has not beaten for ") == 2, output
    assert "env-0 exited with code -9: replacing it in 1s (failure 1 in a row" in output
    assert "it failed 2 times in a row: spec.failurePolicy.maxReplacements (1) exhausted" in output


def test_a_sigterm_to_the_actor_on_ray_checkpoints_and_resumes_at_the_next_step_uncharged(
    cluster, cartpole_manifest, start_run, monkeypatch
):
    """The Ray launcher applies the same supervisor: EXIT_PREEMPTED restarts the actor group, not charged."""
    monkeypatch.setenv("COLUMNS", "400")
    manifest = cartpole_manifest(steps=20, interval=1000, max_restarts=0, envs=1)
    run = start_run(manifest, "--ray", cluster[0].address, "--quiet")
    run.wait_for_step(4, timeout=180)
    os.kill(run.role("actor").pid, signal.SIGTERM)
    output = run.finish()
    assert run.process.returncode == 0, output  # maxRestarts 0: a charged restart would have failed the job
    assert "actor-0 exited with code 75 (preempted" in output, output
    log = (run.out / "logs" / "actor-0.log").read_text()
    stopped = re.findall(r"stopped at step (\d+) of 20 \(asked to stop\)", log)
    resumed = re.findall(r"resumed from \S*step-\d+ \(step (\d+)", log)
    assert len(stopped) == 1 and resumed == stopped, log
    assert [r["step"] for r in run.metrics()] == list(range(1, 21))
    assert not run.roles()
    assert wait_until_clean() == ([], [])


@pytest.mark.slow
def test_a_vision_language_job_runs_through_ray_with_its_images(cluster, start_run):
    """The tiny shapes example's images cross Ray workers (actor -> rollout) and the trainer reads what the engine
    generated from; whether it learns on Ray (it does: the same held-out 0.135 -> 0.719 as `rljob run`) is the
    600-step run in docs/guides/vision-language.md."""
    run = start_run(
        REPO_PATH / "examples" / "grpo-vlm-tiny-shapes.yaml",
        "--ray",
        cluster[0].address,
        "--set=spec.trainer.steps=4",
        "--set=spec.trainer.batchSize=8",
        "--set=spec.evaluation.interval=2",
        "--set=spec.evaluation.size=16",
        "--set=spec.logging.tensorboard=false",
        "--quiet",
    )
    output = run.finish(timeout=300)
    assert run.process.returncode == 0, output
    records = run.metrics()
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert all(r["mismatch_max_gap"] < 1e-4 and r["prompts_skipped_images"] == 0 for r in records)
    assert [r["eval_prompts"] for r in records if "eval_prompts" in r] == [16, 16]
    assert (run.out / "model" / "preprocessor_config.json").is_file()
    assert wait_until_clean() == ([], [])
