"""The checkpoint PersistentVolumeClaim the operator makes when a job names none: checkpoints outlive the actor pod."""

from __future__ import annotations

import pytest

from rljob.operator.manifests import build_children, build_pod
from rljob.operator.settings import OperatorSettings, SettingsError


def claims(children):
    return [c for c in children if c["kind"] == "PersistentVolumeClaim"]


def test_a_job_without_a_claim_gets_one_owned_by_it_in_the_default_class(
    example_documents, job_from, settings, validate_manifest
):
    job = job_from(example_documents["grpo-tiny-arithmetic"], metadata={"name": "ar", "namespace": "ns", "uid": "u"})
    (claim,) = claims(build_children(job, settings))
    validate_manifest(claim)
    assert claim["metadata"]["name"] == "ar-checkpoints"
    assert claim["metadata"]["ownerReferences"][0]["uid"] == "u"  # deleted with the job
    assert claim["spec"] == {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "50Gi"}}}


def test_size_and_class_come_from_the_spec_else_the_operator_settings(example_documents, job_from, validate_manifest):
    chart = OperatorSettings(checkpoint_volume_size="200Gi", checkpoint_storage_class="fast-rwo")
    job = job_from(example_documents["cartpole-ppo"])
    (claim,) = claims(build_children(job, chart))
    assert claim["spec"]["resources"]["requests"]["storage"] == "200Gi"
    assert claim["spec"]["storageClassName"] == "fast-rwo"
    job = job_from(
        example_documents["cartpole-ppo"], spec__checkpoint__storage={"size": "1Ti", "storageClassName": "nfs"}
    )
    (claim,) = claims(build_children(job, chart))
    validate_manifest(claim)
    assert claim["spec"]["resources"]["requests"]["storage"] == "1Ti"
    assert claim["spec"]["storageClassName"] == "nfs"


def test_several_pods_mounting_the_claim_make_it_read_write_many(example_documents, job_from, settings):
    job = job_from(example_documents["cartpole-ppo"], spec__roles__actor__replicas=2)
    assert claims(build_children(job, settings))[0]["spec"]["accessModes"] == ["ReadWriteMany"]
    job = job_from(example_documents["grpo-tiny-arithmetic"], spec__rollout__weightSync__method="filesystem")
    (claim,) = claims(build_children(job, settings))
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]
    rollout = build_pod(job, settings, "rollout", 0)
    volume = {
        "name": "rljob-checkpoints",
        "persistentVolumeClaim": {"claimName": claim["metadata"]["name"], "readOnly": True},
    }
    assert volume in rollout["spec"]["volumes"]


def test_a_retained_claim_has_no_owner_and_outlives_the_job(example_documents, job_from, settings):
    job = job_from(
        example_documents["cartpole-ppo"],
        metadata={"name": "cp", "namespace": "ns", "uid": "u"},
        spec__checkpoint__storage={"retain": True},
    )
    (claim,) = claims(build_children(job, settings))
    assert "ownerReferences" not in claim["metadata"]
    assert claim["metadata"]["labels"]["rljob.io/job"] == "cp"


@pytest.mark.parametrize(
    "changes",
    [
        {"spec__checkpoint__volumeClaim": "mine"},
        {"spec__checkpoint__storage": {"persistent": False}},
        {"spec__checkpoint__interval": 0},
        {
            "spec__checkpoint__dir": "/shared/ckpt",
            "spec__roles__actor__volumes": [{"name": "shared", "nfs": {"server": "nfs.local", "path": "/export"}}],
            "spec__roles__actor__volumeMounts": [{"name": "shared", "mountPath": "/shared"}],
        },
    ],
    ids=["own-claim", "not-persistent", "no-checkpoints", "own-volume"],
)
def test_no_claim_is_made_where_the_job_brings_its_own_storage_or_writes_no_checkpoints(
    example_documents, job_from, settings, changes
):
    assert claims(build_children(job_from(example_documents["cartpole-ppo"], **changes), settings)) == []


def test_a_default_size_that_is_no_quantity_names_the_variable():
    with pytest.raises(SettingsError, match="RLJOB_OPERATOR_CHECKPOINT_VOLUME_SIZE"):
        OperatorSettings.from_env({"RLJOB_OPERATOR_CHECKPOINT_VOLUME_SIZE": "lots"})
