"""The GPU-simulation recipe (examples/maniskill-pushcube-gpu.yaml): simulators and trainer on different node pools."""

from __future__ import annotations

from pathlib import Path

from rljob.api import load_job_file
from rljob.operator.manifests import build_children

EXAMPLE = Path(__file__).parents[2] / "examples" / "maniskill-pushcube-gpu.yaml"


def _pods(settings):
    job = load_job_file(EXAMPLE)
    job.metadata.uid = "5f0c3b2e-1d7a-4a52-9d43-2f8a3c1b9e70"
    job.metadata.namespace = "default"
    return {c["metadata"]["name"]: c for c in build_children(job, settings) if c["kind"] == "Pod"}


def _products(pod):
    terms = pod["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    return [e["values"] for t in terms["nodeSelectorTerms"] for e in t["matchExpressions"]]


def test_simulator_pods_take_gpus_on_the_sim_pool_and_the_trainer_its_own(settings, validate_manifest):
    pods = _pods(settings)
    for pod in pods.values():
        validate_manifest(pod)
    for name in ("maniskill-pushcube-gpu-env-0", "maniskill-pushcube-gpu-env-1"):
        env = pods[name]
        (main,) = env["spec"]["containers"]
        assert env["spec"]["nodeSelector"] == {"node-pool": "sim"}
        assert main["resources"]["limits"]["nvidia.com/gpu"] == 1
        assert _products(env) == [["NVIDIA-L40S"]]
        assert {"name": "NVIDIA_DRIVER_CAPABILITIES", "value": "compute,utility,graphics"} in main["env"]
        assert main["image"] == "registry.example.com/rljob/env-maniskill:0.1.0"
    actor = pods["maniskill-pushcube-gpu-actor-0"]
    assert actor["spec"]["nodeSelector"] == {"node-pool": "train"}
    assert _products(actor) == [["NVIDIA-H100-80GB-HBM3"]]
    rollout = pods["maniskill-pushcube-gpu-rollout-0"]
    assert rollout["spec"]["nodeSelector"] == {"node-pool": "sim"}
    (main,) = rollout["spec"]["containers"]
    assert "nvidia.com/gpu" not in main["resources"].get("limits", {})
