"""An offline stage (sft, dpo, reward_model) is the actor alone: the operator builds no rollout, env or reward pod,
nor does Ray."""

from __future__ import annotations

import pytest

from rljob.launch.ray_placement import job_bundles
from rljob.operator.manifests import build_children

STAGES = ["sft-tiny", "dpo-tiny", "reward-model-tiny"]


@pytest.mark.parametrize("example", STAGES)
def test_a_stage_resolves_to_the_actor_role_only(example, example_documents, job_from):
    job = job_from(example_documents[example])
    roles = job.spec.roles
    assert (roles.actor.replicas, roles.rollout.replicas, roles.env.replicas, roles.reward.replicas) == (1, 0, 0, 0)


@pytest.mark.parametrize("example", STAGES)
def test_the_operator_builds_one_actor_pod_per_replica_and_no_other_role(
    example, example_documents, job_from, settings, validate_manifest
):
    job = job_from(example_documents[example], spec__roles__actor__replicas=2)
    children = build_children(job, settings)
    for manifest in children:
        validate_manifest(manifest)
    pods = [c for c in children if c["kind"] == "Pod"]
    assert [p["metadata"]["name"] for p in pods] == [f"{example}-actor-0", f"{example}-actor-1"]
    assert {p["metadata"]["labels"]["rljob.io/role"] for p in pods} == {"actor"}


@pytest.mark.parametrize("example", STAGES)
def test_the_ray_launcher_places_the_actor_replicas_only(example, example_documents, job_from):
    job = job_from(example_documents[example], spec__roles__actor__replicas=2)
    assert [(b.role, b.replica) for b in job_bundles(job)] == [("actor", 0), ("actor", 1)]
