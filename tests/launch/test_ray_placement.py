"""Ray placement from the RLJob's fields: bundles, what Ray cannot express, and jobs that can never fit."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from rljob.api import validate_job
from rljob.launch.ray_placement import (
    ClusterNode,
    check_fits,
    job_bundles,
    placement_strategy,
    ray_notes,
    ray_problems,
    waiting_for,
)
from rljob.launch.supervisor import LaunchError

EXAMPLE = Path(__file__).parents[2] / "examples" / "cartpole-ppo.yaml"


def cartpole(**roles):
    data = yaml.safe_load(EXAMPLE.read_text())
    for role, fields in roles.items():
        data["spec"]["roles"].setdefault(role, {}).update(fields)
    return validate_job(data)


def node(name: str, cpus: float, gpus: float = 0, accelerator: str | None = None, free=None, **labels) -> ClusterNode:
    total = {"CPU": cpus, "memory": 8 * 2**30}
    if gpus:
        total["GPU"] = gpus
    if accelerator:
        total[f"accelerator_type:{accelerator}"] = 1.0
    return ClusterNode(name, "10.0.0.1", total, free if free is not None else total, labels)


def test_each_replica_is_a_bundle_from_gpus_product_requests_and_node_selector():
    job = cartpole(
        actor={"replicas": 2, "gpusPerReplica": 4, "placement": {"gpuProduct": "H100"}},
        env={"replicas": 1, "resources": {"requests": {"cpu": "500m", "memory": "2Gi"}}},
        rollout={"placement": {"nodeSelector": {"pool": "rollout"}}},
    )
    bundles = {b.name: b for b in job_bundles(job)}
    assert bundles["actor-0"].resources == {"CPU": 1.0, "GPU": 4.0, "accelerator_type:H100": 0.001}
    assert bundles["actor-1"].resources == bundles["actor-0"].resources
    assert bundles["env-0"].resources == {"CPU": 0.5, "memory": 2 * 2**30}
    assert bundles["rollout-0"].labels == {"pool": "rollout"}
    assert list(bundles) == ["actor-0", "actor-1", "rollout-0", "env-0"]


def test_what_ray_cannot_express_is_refused_naming_the_field():
    job = cartpole(
        actor={"placement": {"affinity": {"nodeAffinity": {}}}},
        env={"resources": {"requests": {"ephemeral-storage": "1Gi"}}},
    )
    problems = ray_problems(job)
    assert any(p.startswith("spec.roles.actor.placement.affinity: Ray has no node affinity") for p in problems)
    assert any(p.startswith("spec.roles.env.resources.requests.ephemeral-storage:") for p in problems)


def test_a_collocated_job_is_refused_on_ray_naming_the_field():
    data = yaml.safe_load((Path(__file__).parents[2] / "examples" / "grpo-tiny-arithmetic.yaml").read_text())
    data["spec"]["roles"]["rollout"]["collocated"] = True
    data["spec"]["rollout"]["weightSync"] = {"method": "ipc"}
    (problem,) = ray_problems(validate_job(data))
    assert problem.startswith("spec.roles.rollout.collocated: Ray places the rollout as a replica of its own")


def test_kubernetes_only_settings_are_said_not_to_apply():
    job = cartpole(actor={"image": "example/trainer:1", "placement": {"priorityClassName": "high"}})
    notes = ray_notes(job)
    assert "spec.roles.actor.image does not apply on Ray: roles run in the Python of the cluster's nodes" in notes
    assert "spec.roles.actor.placement.priorityClassName does not apply on Ray" in notes


def test_a_gpu_product_no_node_has_is_named_with_the_types_the_cluster_has():
    job = cartpole(actor={"gpusPerReplica": 1, "placement": {"gpuProduct": "B200"}})
    nodes = [node("a", 4, 1, "H100"), node("b", 4, 1, "A100")]
    with pytest.raises(LaunchError) as caught:
        check_fits(job_bundles(job), nodes, "PACK")
    message = str(caught.value)
    assert message.startswith("spec.roles.actor.placement.gpuProduct: no node of the Ray cluster has the resource")
    assert "accelerator_type:B200" in message and "it has A100, H100" in message


def test_more_gpus_per_replica_than_any_node_has_names_gpus_per_replica():
    job = cartpole(actor={"gpusPerReplica": 8})
    with pytest.raises(LaunchError, match=r"spec.roles.actor.gpusPerReplica: each actor replica needs GPU 8 on one"):
        check_fits(job_bundles(job), [node("a", 4, 4)], "PACK")


def test_a_job_larger_than_the_whole_cluster_names_the_resource_and_the_fields():
    job = cartpole(env={"replicas": 3, "resources": {"requests": {"cpu": "2"}}})
    with pytest.raises(LaunchError) as caught:
        check_fits(job_bundles(job), [node("a", 4), node("b", 2)], "PACK")
    assert "the job needs CPU 8 in all" in str(caught.value) and "whole Ray cluster has 6" in str(caught.value)


def test_a_node_selector_no_node_matches_is_named():
    job = cartpole(env={"placement": {"nodeSelector": {"pool": "cpu"}}})
    with pytest.raises(LaunchError, match=r"spec.roles.env.placement.nodeSelector: no node .* labels pool=cpu"):
        check_fits(job_bundles(job), [node("a", 8, pool="gpu")], "PACK")


def test_a_replica_pinned_by_node_selector_keeps_its_only_node_whatever_order_ray_lists_the_nodes_in():
    job = cartpole(env={"replicas": 1, "placement": {"nodeSelector": {"pool": "spare"}}})
    bundles = job_bundles(job)  # actor, rollout and env: one CPU each; only "spare" takes the env
    for nodes in ([node("spare", 1, pool="spare"), node("head", 2)], [node("head", 2), node("spare", 1, pool="spare")]):
        check_fits(bundles, nodes, "PACK")
        assert waiting_for(bundles, nodes, "PACK") is None


def test_whole_node_actor_replicas_land_on_distinct_nodes_and_a_busy_cluster_says_what_it_waits_for():
    job = cartpole(actor={"replicas": 2, "gpusPerReplica": 8})
    nodes = [node("a", 16, 8), node("b", 16, 8)]
    strategy = placement_strategy(job_bundles(job), nodes)
    check_fits(job_bundles(job), nodes, strategy)
    with pytest.raises(LaunchError, match=r"do not fit the Ray cluster's nodes together"):
        check_fits(job_bundles(job), [node("a", 16, 8), node("b", 16, 4), node("c", 16, 4)], strategy)
    busy = [node("a", 16, 8), node("b", 16, 8, free={"CPU": 16, "GPU": 2})]
    assert "actor-" in (waiting_for(job_bundles(job), busy, strategy) or "")
    assert waiting_for(job_bundles(job), nodes, strategy) is None


def test_the_runtime_never_imports_ray():
    import subprocess
    import sys

    code = (
        "import sys, pkgutil, importlib, rljob.runtime\n"
        "for m in pkgutil.walk_packages(rljob.runtime.__path__, 'rljob.runtime.'):\n"
        "    importlib.import_module(m.name)\n"
        "import rljob.cli.main, rljob.launch.local\n"
        "print('ray' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "False", done.stderr
