"""A collocated job's pods: the rollout runs in the actor pod, as a second process of its container."""

from __future__ import annotations

import pytest

from rljob.api import InvalidRLJob
from rljob.operator.manifests import build_children, build_pod_group, build_service, gang_size, role_image
from rljob.operator.settings import OperatorSettings
from rljob.runtime.wire.identity import COLLOCATED_DATA_PORT, COLLOCATED_METRICS_PORT, CONFIG_PATH_IN_POD, RoleIdentity

COLLOCATED = {"spec__roles__rollout__collocated": True, "spec__rollout__weightSync__method": "ipc"}


@pytest.fixture
def collocated(example_documents, job_from):
    def make(**changes):
        job = job_from(example_documents["grpo-tiny-arithmetic"], **COLLOCATED, **changes)
        job.metadata.uid, job.metadata.namespace = "uid-1", "research"
        return job

    return make


def pods_of(children):
    return {c["metadata"]["name"]: c for c in children if c["kind"] == "Pod"}


def env_of(pod):
    (main,) = pod["spec"]["containers"]
    return {e["name"]: e.get("value") for e in main["env"]}


def test_the_actor_pod_runs_the_rollout_too_and_no_rollout_pod_exists(collocated, settings, validate_manifest):
    job = collocated()
    children = build_children(job, settings)
    for child in children:
        validate_manifest(child)
    pods = pods_of(children)
    assert sorted(pods) == ["grpo-tiny-arithmetic-actor-0", "grpo-tiny-arithmetic-reward-0"]
    actor = pods["grpo-tiny-arithmetic-actor-0"]
    (main,) = actor["spec"]["containers"]
    assert main["args"] == ["role", "actor"]
    ports = {p["name"]: p["containerPort"] for p in main["ports"]}
    assert ports == {
        "data": 29600,
        "dist": 29500,
        "sync": 29501,
        "metrics": job.spec.logging.prometheus_port,
        "rollout-data": COLLOCATED_DATA_PORT,
        "rollout-metrics": COLLOCATED_METRICS_PORT,
    }
    assert all(len(name) <= 15 for name in ports)
    # Weights pass by ipc through /dev/shm: a memory-backed one, even on the CPU.
    shm = next(v for v in actor["spec"]["volumes"] if v.get("emptyDir", {}).get("medium") == "Memory")
    assert {"name": shm["name"], "mountPath": "/dev/shm"} in main["volumeMounts"]
    # No membership ConfigMap to follow: the rollout is where the actor starts it.
    assert "RLJOB_ROLLOUT_MEMBERS_FILE" not in env_of(actor)
    assert not any("configMap" in v and v["name"] == "rljob-rollouts" for v in actor["spec"]["volumes"])


def test_every_pod_reaches_the_rollout_in_the_actor_pod_and_the_actor_derives_its_identity(collocated, settings):
    pods = pods_of(build_children(collocated(), settings))
    endpoint = f"grpo-tiny-arithmetic-actor-0.grpo-tiny-arithmetic:{COLLOCATED_DATA_PORT}"
    for pod in pods.values():
        assert env_of(pod)["RLJOB_ROLLOUT_ENDPOINTS"] == endpoint
    actor_env = env_of(pods["grpo-tiny-arithmetic-actor-0"])
    assert actor_env["RLJOB_COLLOCATED_ROLLOUT_METRICS_PORT"] == str(COLLOCATED_METRICS_PORT)
    assert "RLJOB_COLLOCATED_ROLLOUT_METRICS_PORT" not in env_of(pods["grpo-tiny-arithmetic-reward-0"])
    rollout = RoleIdentity.from_env(actor_env).collocated_rollout()
    assert (rollout.role, rollout.replica, rollout.metrics_port) == ("rollout", 0, COLLOCATED_METRICS_PORT)
    assert (rollout.job, rollout.namespace, rollout.config_path) == (
        "grpo-tiny-arithmetic",
        "research",
        CONFIG_PATH_IN_POD,
    )


def test_the_service_names_the_rollouts_ports_and_the_gang_counts_only_real_pods(collocated, settings):
    job = collocated(spec__scheduling={"gang": "volcano"})
    ports = {p["name"]: p["port"] for p in build_service(job, settings)["spec"]["ports"]}
    assert (ports["rollout-data"], ports["rollout-metrics"]) == (COLLOCATED_DATA_PORT, COLLOCATED_METRICS_PORT)
    assert gang_size(job) == 2  # actor (with the rollout) and reward
    assert build_pod_group(job, settings)["spec"]["minMember"] == 2


@pytest.mark.parametrize(
    ("engine", "actor_image", "rollout_image", "expected"),
    [
        ("hf", None, None, "t:1"),  # the trainer image holds the hf engine
        ("vllm", None, None, "r:1"),  # the rollout image holds vLLM and the trainer
        ("vllm", "mine:1", None, "mine:1"),
        ("hf", None, "mine:2", "mine:2"),
        ("vllm", "mine:3", "mine:3", "mine:3"),
    ],
)
def test_the_collocated_actor_pods_image(collocated, engine, actor_image, rollout_image, expected):
    settings = OperatorSettings(trainer_image="t:1", rollout_image="r:1", env_image="e:1")
    changes = {"spec__rollout__engine": engine}
    if actor_image:
        changes["spec__roles__actor__image"] = actor_image
    if rollout_image:
        changes["spec__roles__rollout__image"] = rollout_image
    job = collocated(**changes)
    assert role_image(job, "actor", settings) == expected
    (main,) = pods_of(build_children(job, settings))["grpo-tiny-arithmetic-actor-0"]["spec"]["containers"]
    assert main["image"] == expected


@pytest.mark.parametrize(
    ("changes", "path", "words"),
    [
        (
            {"spec__roles__actor__image": "a:1", "spec__roles__rollout__image": "b:1"},
            "spec.roles.rollout.image",
            "one image",
        ),
        ({"spec__roles__rollout__env": [{"name": "X", "value": "1"}]}, "spec.roles.rollout.env", "roles.actor.env"),
        (
            {"spec__roles__rollout__resources": {"limits": {"memory": "8Gi"}}},
            "spec.roles.rollout.resources",
            "roles.actor.resources",
        ),
        (
            {
                "spec__roles__rollout__volumes": [{"name": "v", "emptyDir": {}}],
                "spec__roles__rollout__volumeMounts": [{"name": "v", "mountPath": "/v"}],
            },
            "spec.roles.rollout.volumes spec.roles.rollout.volumeMounts",
            "roles.actor.volumeMounts",
        ),
        (
            {"spec__roles__rollout__placement": {"nodeSelector": {"pool": "a"}}},
            "spec.roles.rollout.placement",
            "roles.actor.placement",
        ),
        ({"spec__logging__prometheusPort": COLLOCATED_METRICS_PORT}, "spec.logging.prometheusPort", "9090"),
        ({"spec__logging__prometheusPort": COLLOCATED_DATA_PORT}, "spec.logging.prometheusPort", "9090"),
    ],
)
def test_what_cannot_work_in_one_container_is_refused_naming_the_field(collocated, settings, changes, path, words):
    with pytest.raises(InvalidRLJob) as caught:
        build_children(collocated(**changes), settings)
    assert [p.path for p in caught.value.problems] == path.split()
    assert words in caught.value.problems[-1].message


def test_the_rollouts_ports_are_free_for_a_job_that_is_not_collocated(example_documents, job_from, settings):
    job = job_from(example_documents["grpo-tiny-arithmetic"], spec__logging__prometheusPort=COLLOCATED_METRICS_PORT)
    assert build_children(job, settings)


def test_the_rollouts_own_variables_cannot_be_overridden_in_the_actors_env(collocated, settings):
    variable = {"name": "RLJOB_COLLOCATED_ROLLOUT_METRICS_PORT", "value": "1"}
    with pytest.raises(InvalidRLJob) as caught:
        build_children(collocated(spec__roles__actor__env=[variable]), settings)
    assert [p.path for p in caught.value.problems] == ["spec.roles.actor.env[0].name"]


def test_a_collocated_actor_pod_starts_within_the_larger_startup_budget_and_is_probed_for_liveness(
    collocated, settings, validate_manifest
):
    """The actor's first heartbeat comes after the rollout beside it has started its engine."""
    job = collocated(
        spec__roles__actor__probes={"startupTimeoutSeconds": 100, "livenessTimeoutSeconds": 900},
        spec__roles__rollout__probes={"startupTimeoutSeconds": 600},
    )
    pods = pods_of(build_children(job, settings))
    actor = pods["grpo-tiny-arithmetic-actor-0"]
    validate_manifest(actor)
    (main,) = actor["spec"]["containers"]
    assert main["startupProbe"]["httpGet"] == {"path": "/livez", "port": "metrics"}
    assert main["startupProbe"]["failureThreshold"] * main["startupProbe"]["periodSeconds"] == 600
    assert main["livenessProbe"]["httpGet"] == {"path": "/livez", "port": "metrics"}
    job = collocated(spec__roles__actor__probes={"startupTimeoutSeconds": 2000})
    (main,) = pods_of(build_children(job, settings))["grpo-tiny-arithmetic-actor-0"]["spec"]["containers"]
    assert main["startupProbe"]["failureThreshold"] * main["startupProbe"]["periodSeconds"] == 2000
