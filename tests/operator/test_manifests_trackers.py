"""The actor pods of a job with experiment trackers: each credential by Secret reference (never its value), the
restart count that names the run; no other pod gets either."""

from __future__ import annotations

from rljob.api import RLJobStatus
from rljob.operator.manifests import build_children, build_problems
from rljob.operator.manifests.pods import ANNOTATION_CONFIG_HASH

TRACKERS = [
    {"name": "wandb", "project": "math", "apiKeySecret": {"name": "tracker-keys", "key": "wandb"}},
    {"name": "mlflow", "uri": "http://mlflow.tracking:5000", "apiKeySecret": {"name": "tracker-keys", "key": "mlflow"}},
    {"name": "swanlab", "offline": True, "dir": "/checkpoints/swanlab"},
    {"name": "tensorboard", "dir": "/checkpoints/tb"},
]


def pods(job, settings):
    return {c["metadata"]["name"]: c for c in build_children(job, settings) if c["kind"] == "Pod"}


def env_entries(pod):
    (main,) = pod["spec"]["containers"]
    return {e["name"]: e for e in main["env"]}


def test_actor_pods_take_each_key_from_its_secret_and_the_restart_count(
    example_documents, job_from, settings, validate_manifest
):
    job = job_from(example_documents["grpo-qwen-math-h100"], spec__logging={"trackers": TRACKERS})
    job.metadata.namespace = "team-a"
    children = build_children(job, settings)
    for manifest in children:
        validate_manifest(manifest)
    by_name = pods(job, settings)
    for name in ("grpo-qwen-math-actor-0", "grpo-qwen-math-actor-1"):
        env = env_entries(by_name[name])
        assert env["WANDB_API_KEY"] == {
            "name": "WANDB_API_KEY",
            "valueFrom": {"secretKeyRef": {"name": "tracker-keys", "key": "wandb"}},
        }
        assert env["MLFLOW_TRACKING_TOKEN"]["valueFrom"] == {"secretKeyRef": {"name": "tracker-keys", "key": "mlflow"}}
        assert "SWANLAB_API_KEY" not in env  # offline: no key listed
        assert env["RLJOB_RESTART"]["value"] == "0"
    for name, pod in by_name.items():
        if "-actor-" not in name:
            assert not {"WANDB_API_KEY", "MLFLOW_TRACKING_TOKEN", "RLJOB_RESTART"} & set(env_entries(pod)), name


def test_a_restarted_actor_group_is_told_its_restart_and_its_pods_are_not_stale(example_documents, job_from, settings):
    job = job_from(example_documents["cartpole-ppo"], spec__logging={"trackers": TRACKERS[:1]})
    before = pods(job, settings)["cartpole-ppo-actor-0"]
    job.status = RLJobStatus(restarts=2)
    after = pods(job, settings)["cartpole-ppo-actor-0"]
    assert env_entries(after)["RLJOB_RESTART"]["value"] == "2"
    assert (
        after["metadata"]["annotations"][ANNOTATION_CONFIG_HASH]
        == before["metadata"]["annotations"][ANNOTATION_CONFIG_HASH]
    )


def test_a_job_without_trackers_gets_no_tracker_variables(example_documents, job_from, settings):
    job = job_from(example_documents["cartpole-ppo"])
    for pod in pods(job, settings).values():
        assert "RLJOB_RESTART" not in env_entries(pod)


def test_an_actor_variable_the_tracker_secret_sets_is_refused_with_both_fields(example_documents, job_from):
    document = example_documents["cartpole-ppo"]
    actor = {**document["spec"]["roles"]["actor"], "env": [{"name": "WANDB_API_KEY", "value": "plain"}]}
    job = job_from(document, spec__logging={"trackers": TRACKERS[:1]}, spec__roles__actor=actor)
    (problem,) = build_problems(job)
    assert problem.path == "spec.roles.actor.env[0].name"
    assert "spec.logging.trackers[0].apiKeySecret" in problem.message
    restart = {**document["spec"]["roles"]["actor"], "env": [{"name": "RLJOB_RESTART", "value": "7"}]}
    (problem,) = build_problems(job_from(document, spec__roles__actor=restart))
    assert problem.path == "spec.roles.actor.env[0].name" and "set by the operator" in problem.message
