"""A pipeline by name: the roles that load another RLJob's model mount that job's claim read-only, and the config
they read names the export on it (`source: job` resolved to `source: local`)."""

from __future__ import annotations

import yaml

from rljob.api import load_jobs
from rljob.operator.manifests import build_children
from rljob.operator.naming import CONFIG_KEY


def test_the_policy_and_a_reward_model_come_from_two_upstream_jobs_mounted_where_each_role_loads_them(
    example_documents, job_from, settings, validate_manifest
):
    job = job_from(
        example_documents["grpo-tiny-arithmetic"],
        spec__model={"source": "job", "job": "sft"},
        spec__reward__functions=[
            {"builtin": "exact_match"},
            {"model": {"job": "rm"}, "weight": 0.5},
            {"judge": {"job": "judge", "rubric": "{prompt}{response} Score:"}, "weight": 0.5},
        ],
    )
    children = build_children(job, settings)
    for manifest in children:
        validate_manifest(manifest)
    config = yaml.safe_load(next(c for c in children if c["kind"] == "ConfigMap")["data"][CONFIG_KEY])["spec"]
    assert config["model"]["source"] == "local" and config["model"]["path"] == "/rljob/jobs/sft/model"
    assert config["reward"]["functions"][1]["model"]["path"] == "/rljob/jobs/rm/model"
    assert config["reward"]["functions"][2]["judge"]["path"] == "/rljob/jobs/judge/model"
    pods = {c["metadata"]["labels"]["rljob.io/role"]: c["spec"] for c in children if c["kind"] == "Pod"}

    def upstream_claims(pod: dict) -> dict[str, str]:
        claims = {v["name"]: v["persistentVolumeClaim"]["claimName"] for v in pod["volumes"] if "upstream" in v["name"]}
        mounts = {m["name"]: m for m in pod["containers"][0]["volumeMounts"] if m["name"] in claims}
        assert all(m["readOnly"] for m in mounts.values())
        return {mounts[name]["mountPath"]: claim for name, claim in claims.items()}

    # The rollout loads the starting weights as the actor does; only the reward role scores with the model.
    assert upstream_claims(pods["actor"]) == {"/rljob/jobs/sft": "sft-checkpoints"}
    assert upstream_claims(pods["rollout"]) == {"/rljob/jobs/sft": "sft-checkpoints"}
    assert upstream_claims(pods["reward"]) == {
        "/rljob/jobs/rm": "rm-checkpoints",
        "/rljob/jobs/judge": "judge-checkpoints",
    }


def test_an_llm_job_always_gets_a_claim_for_its_exported_model(example_documents, job_from, settings):
    job = job_from(example_documents["sft-tiny"], spec__checkpoint={"interval": 0})
    claims = [c["metadata"]["name"] for c in build_children(job, settings) if c["kind"] == "PersistentVolumeClaim"]
    assert claims == ["sft-tiny-checkpoints"]


def test_the_7b_pipeline_recipe_builds_valid_pods_that_mount_each_stage_where_it_is_loaded(
    repo, settings, validate_manifest
):
    path = repo / "examples/pipelines/qwen2.5-7b.yaml"
    jobs = {job.name: job for job in load_jobs(path.read_text(), str(path))}
    assert list(jobs) == ["qwen7b-sft", "qwen7b-rm", "qwen7b-grpo"]
    children = {name: build_children(job, settings) for name, job in jobs.items()}
    for manifest in (m for built in children.values() for m in built):
        validate_manifest(manifest)
    sft_claim = next(c for c in children["qwen7b-sft"] if c["kind"] == "PersistentVolumeClaim")
    assert sft_claim["spec"]["accessModes"] == ["ReadWriteMany"]  # mounted by the GRPO actor and its 4 rollouts
    grpo_pods = [c for c in children["qwen7b-grpo"] if c["kind"] == "Pod"]
    by_role: dict[str, set[str]] = {}
    for pod in grpo_pods:
        claims = {v["persistentVolumeClaim"]["claimName"] for v in pod["spec"]["volumes"] if "upstream" in v["name"]}
        by_role.setdefault(pod["metadata"]["labels"]["rljob.io/role"], set()).update(claims)
    assert by_role == {
        "actor": {"qwen7b-sft-checkpoints"},
        "rollout": {"qwen7b-sft-checkpoints"},
        "reward": {"qwen7b-rm-checkpoints"},
    }
