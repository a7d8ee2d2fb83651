"""The pure builders: RLJob -> ConfigMap, headless Service, PodGroup and pods."""

from __future__ import annotations

import posixpath
from pathlib import Path

import pytest
import yaml

from rljob.api import InvalidRLJob, load_job_file, validate_job
from rljob.operator.manifests import (
    build_children,
    build_config_map,
    build_pod,
    build_pod_group,
    build_service,
    config_hash,
    role_image,
)
from rljob.operator.manifests.members import build_rollout_members
from rljob.operator.settings import OperatorSettings
from rljob.runtime.llm.replicas.membership import parse_members
from rljob.runtime.wire.identity import CONFIG_PATH_IN_POD, RoleIdentity, pod_dns_name, pod_identity

EXAMPLES = sorted((Path(__file__).parents[2] / "examples").glob("*.yaml"))

H100 = "NVIDIA-H100-80GB-HBM3"
L40S = "NVIDIA-L40S"
GPU_TOLERATION = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}


def pods_by_name(children):
    return {c["metadata"]["name"]: c for c in children if c["kind"] == "Pod"}


def container(pod):
    (main,) = pod["spec"]["containers"]
    return main


def env_of(pod):
    return {e["name"]: e.get("value") for e in container(pod)["env"]}


def required_product(pod):
    terms = pod["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    return [
        [e["values"] for e in t["matchExpressions"] if e["key"] == "nvidia.com/gpu.product"]
        for t in terms["nodeSelectorTerms"]
    ]


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_every_child_of_every_example_validates_against_kubernetes(path, settings, validate_manifest):
    job = load_job_file(path)
    job.metadata.uid = "5f0c3b2e-1d7a-4a52-9d43-2f8a3c1b9e70"
    job.metadata.namespace = job.metadata.namespace or "default"
    children = build_children(job, settings)
    assert children
    for manifest in children:
        validate_manifest(manifest)


def test_children_come_in_creation_order_config_service_group_then_every_pod(example_documents, job_from, settings):
    job = job_from(example_documents["grpo-qwen-math-h100"])
    kinds = [c["kind"] for c in build_children(job, settings)]
    assert kinds == ["ConfigMap", "Service", "PodGroup", "NetworkPolicy"] + ["Pod"] * 8
    names = [c["metadata"]["name"] for c in build_children(job, settings) if c["kind"] == "Pod"]
    assert names == [
        "grpo-qwen-math-actor-0",
        "grpo-qwen-math-actor-1",
        *(f"grpo-qwen-math-rollout-{i}" for i in range(4)),
        "grpo-qwen-math-reward-0",
        "grpo-qwen-math-reward-1",
    ]


def test_builders_are_deterministic_and_leave_the_job_untouched(example_documents, job_from, settings):
    job = job_from(example_documents["grpo-qwen-math-h100"])
    before = job.model_dump()
    assert build_children(job, settings) == build_children(job, settings)
    assert job.model_dump() == before


def test_pods_resolve_each_other_through_the_headless_service(example_documents, job_from, settings):
    job = job_from(example_documents["cartpole-ppo"])
    service = build_service(job, settings)
    assert service["metadata"]["name"] == job.name
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["publishNotReadyAddresses"] is True
    assert service["spec"]["selector"] == {"rljob.io/job": job.name}
    for pod in pods_by_name(build_children(job, settings)).values():
        hostname, subdomain = pod["spec"]["hostname"], pod["spec"]["subdomain"]
        assert hostname == pod["metadata"]["name"] and subdomain == service["metadata"]["name"]
        labels = pod["metadata"]["labels"]
        assert f"{hostname}.{subdomain}" == pod_dns_name(
            job.name, labels["rljob.io/role"], int(labels["rljob.io/replica"])
        )
        assert all(labels[k] == v for k, v in service["spec"]["selector"].items())


def test_children_are_owned_by_the_job_once_it_has_a_uid(example_documents, job_from, settings):
    job = job_from(example_documents["grpo-qwen-math-h100"])
    assert all("ownerReferences" not in c["metadata"] for c in build_children(job, settings))
    job.metadata.uid = "uid-1"
    for child in build_children(job, settings):
        (owner,) = child["metadata"]["ownerReferences"]
        assert owner == {
            "apiVersion": "rljob.io/v1alpha1",
            "kind": "RLJob",
            "name": "grpo-qwen-math",
            "uid": "uid-1",
            "controller": True,
            "blockOwnerDeletion": True,
        }
        assert child["metadata"]["namespace"] == "research"
        assert child["metadata"]["labels"]["rljob.io/job"] == "grpo-qwen-math"


def test_pods_are_labelled_with_job_role_and_replica(example_documents, job_from, settings):
    job = job_from(example_documents["cartpole-ppo"])
    pod = build_pod(job, settings, "env", 1)
    assert pod["metadata"]["name"] == "cartpole-ppo-env-1"
    labels = pod["metadata"]["labels"]
    assert (labels["rljob.io/job"], labels["rljob.io/role"], labels["rljob.io/replica"]) == ("cartpole-ppo", "env", "1")


def test_replica_outside_the_role_is_refused(example_documents, job_from, settings):
    job = job_from(example_documents["cartpole-ppo"])
    with pytest.raises(ValueError, match="env replica 2 is outside"):
        build_pod(job, settings, "env", 2)


def test_pod_environment_is_the_identity_contract_plus_the_role_env(example_documents, job_from, settings):
    job = job_from(
        example_documents["grpo-qwen-math-h100"],
        spec__roles__rollout__env=[{"name": "VLLM_LOGGING_LEVEL", "value": "DEBUG"}],
    )
    pod = build_pod(job, settings, "rollout", 2)
    env = env_of(pod)
    assert env.pop("VLLM_LOGGING_LEVEL") == "DEBUG"
    identity = RoleIdentity.from_env(env)
    assert identity == pod_identity(
        "grpo-qwen-math", "research", "rollout", 2, {"actor": 2, "rollout": 4, "env": 0, "reward": 2}, 9090
    )
    assert identity.config_path == CONFIG_PATH_IN_POD
    assert identity.master_addr == "grpo-qwen-math-actor-0.grpo-qwen-math"
    actor_env = env_of(build_pod(job, settings, "actor", 1))
    # 2 actor pods x 8 GPUs: 16 ranks; the pod's process starts its 8 and sets their RANK/LOCAL_RANK.
    assert (actor_env["WORLD_SIZE"], actor_env["LOCAL_WORLD_SIZE"]) == ("16", "8")
    assert "RANK" not in actor_env and "LOCAL_RANK" not in actor_env


def test_an_actor_pod_with_one_gpu_or_none_is_one_rank(example_documents, job_from, settings):
    for gpus in (0, 1):
        job = job_from(
            example_documents["cartpole-ppo"], spec__roles__actor__replicas=2, spec__roles__actor__gpusPerReplica=gpus
        )
        env = env_of(build_pod(job, settings, "actor", 1))
        assert {k: env[k] for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")} == {
            "RANK": "1",
            "LOCAL_RANK": "0",
            "WORLD_SIZE": "2",
            "LOCAL_WORLD_SIZE": "1",
        }


def test_an_actor_pod_with_n_gpus_runs_n_ranks_one_per_gpu(example_documents, job_from, settings, validate_manifest):
    job = job_from(
        example_documents["cartpole-ppo"],
        spec__roles__actor__replicas=2,
        spec__roles__actor__gpusPerReplica=2,
        spec__roles__rollout__replicas=1,
    )
    job.metadata.namespace = "default"
    pod = build_pod(job, settings, "actor", 1)
    validate_manifest(pod)
    main = container(pod)
    assert (main["command"], main["args"]) == (["rljob"], ["role", "actor"])
    assert main["resources"]["limits"]["nvidia.com/gpu"] == 2
    env = env_of(pod)
    assert (env["WORLD_SIZE"], env["LOCAL_WORLD_SIZE"]) == ("4", "2")
    identity = RoleIdentity.from_env(env)
    assert identity.starts_ranks and identity.world_size == 4
    ranks = [identity.for_rank(i) for i in range(2)]
    assert [(r.rank, r.local_rank) for r in ranks] == [(2, 0), (3, 1)]
    assert RoleIdentity.from_env({**env, **ranks[1].to_env()}) == ranks[1]
    # Rollout pods do not split into ranks whatever the actor does.
    rollout_env = env_of(build_pod(job, settings, "rollout", 0))
    assert "WORLD_SIZE" not in rollout_env and "LOCAL_RANK" not in rollout_env


def test_pod_without_a_namespace_reads_it_from_the_downward_api(example_documents, job_from, settings):
    job = job_from(example_documents["cartpole-ppo"])
    (var,) = [e for e in container(build_pod(job, settings, "actor", 0))["env"] if e["name"] == "RLJOB_NAMESPACE"]
    assert var == {"name": "RLJOB_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}}


def test_config_map_holds_the_resolved_job_where_roles_read_it(example_documents, job_from, settings):
    job = job_from(example_documents["grpo-tiny-arithmetic"])
    config = build_config_map(job, settings)
    (key,) = config["data"]
    stored = validate_job(yaml.safe_load(config["data"][key]))
    assert stored.spec == job.spec and stored.spec.roles.reward.replicas == 1
    pod = build_pod(job, settings, "reward", 0)
    (volume,) = [v for v in pod["spec"]["volumes"] if v.get("configMap")]
    assert volume["configMap"]["name"] == config["metadata"]["name"]
    (mount,) = [m for m in container(pod)["volumeMounts"] if m["name"] == volume["name"]]
    assert posixpath.join(mount["mountPath"], key) == CONFIG_PATH_IN_POD and mount["readOnly"]


def test_llm_actor_pods_read_the_rollout_membership_the_operator_keeps(
    example_documents, job_from, settings, validate_manifest
):
    job = job_from(example_documents["grpo-tiny-arithmetic"], spec__roles__rollout__replicas=3)
    members = build_rollout_members(job, [0, 2])
    validate_manifest(members)
    (key,) = members["data"]
    assert parse_members(members["data"][key]) == {
        0: "grpo-tiny-arithmetic-rollout-0.grpo-tiny-arithmetic:29600",
        2: "grpo-tiny-arithmetic-rollout-2.grpo-tiny-arithmetic:29600",
    }
    actor = build_pod(job, settings, "actor", 0)
    (volume,) = [
        v for v in actor["spec"]["volumes"] if v.get("configMap", {}).get("name") == members["metadata"]["name"]
    ]
    assert volume["configMap"]["optional"] is True  # an actor pod never waits for it
    (mount,) = [m for m in container(actor)["volumeMounts"] if m["name"] == volume["name"]]
    env = {e["name"]: e.get("value") for e in container(actor)["env"]}
    assert env["RLJOB_ROLLOUT_MEMBERS_FILE"] == posixpath.join(mount["mountPath"], key)
    for role in ("rollout", "reward"):
        assert not any(v["name"] == volume["name"] for v in build_pod(job, settings, role, 0)["spec"]["volumes"])
    clash = job_from(
        example_documents["grpo-tiny-arithmetic"],
        spec__roles__actor__volumes=[{"name": "mine", "emptyDir": {}}],
        spec__roles__actor__volumeMounts=[{"name": "mine", "mountPath": mount["mountPath"]}],
    )
    with pytest.raises(InvalidRLJob) as caught:
        build_children(clash, settings)
    assert [p.path for p in caught.value.problems] == ["spec.roles.actor.volumeMounts[0].mountPath"]
    assert "holds the rollout membership" in caught.value.problems[0].message
    gym = job_from(example_documents["cartpole-ppo"])
    assert "RLJOB_ROLLOUT_MEMBERS_FILE" not in {
        e["name"] for e in container(build_pod(gym, settings, "actor", 0))["env"]
    }


def test_config_hash_ignores_server_metadata_and_follows_the_spec(example_documents, job_from):
    job = job_from(example_documents["cartpole-ppo"])
    stored = job.model_copy(deep=True)
    stored.metadata.uid, stored.metadata.resource_version = "u", "42"
    stored.metadata.annotations = {"kopf.zalando.org/last-handled-configuration": "{}"}
    assert config_hash(stored) == config_hash(job)
    edited = job_from(example_documents["cartpole-ppo"], spec__trainer__steps=151)
    assert config_hash(edited) != config_hash(job)
    assert build_pod(job, OperatorSettings(), "actor", 0)["metadata"]["annotations"]["rljob.io/config-hash"] == (
        config_hash(job)
    )


def test_h100_example_puts_actors_on_h100_nodes_and_rollouts_on_l40s(example_documents, job_from, settings):
    pods = pods_by_name(build_children(job_from(example_documents["grpo-qwen-math-h100"]), settings))
    for name in ("grpo-qwen-math-actor-0", "grpo-qwen-math-actor-1"):
        actor = pods[name]
        assert required_product(actor) == [[[H100]]]
        assert container(actor)["resources"]["limits"]["nvidia.com/gpu"] == 8
        assert GPU_TOLERATION in actor["spec"]["tolerations"]
        assert actor["spec"]["priorityClassName"] == "rl-training"
    for i in range(4):
        rollout = pods[f"grpo-qwen-math-rollout-{i}"]
        assert required_product(rollout) == [[[L40S]]]
        assert container(rollout)["resources"]["limits"] == {"nvidia.com/gpu": 1}
        assert GPU_TOLERATION in rollout["spec"]["tolerations"]
    reward = pods["grpo-qwen-math-reward-0"]
    assert reward["spec"]["nodeSelector"] == {"node-pool": "cpu"}
    assert "affinity" not in reward["spec"] and "tolerations" not in reward["spec"]
    assert "nvidia.com/gpu" not in container(reward)["resources"].get("limits", {})


def test_gpu_product_joins_every_node_selector_term_of_the_user(example_documents, job_from, settings):
    terms = [
        {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a"]}]},
        {"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["node-7"]}]},
    ]
    affinity = {
        "nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": terms}},
        "podAntiAffinity": {
            "preferredDuringSchedulingIgnoredDuringExecution": [
                {"weight": 10, "podAffinityTerm": {"topologyKey": "kubernetes.io/hostname"}}
            ]
        },
    }
    job = job_from(example_documents["grpo-qwen-math-h100"], spec__roles__actor__placement__affinity=affinity)
    pod = build_pod(job, settings, "actor", 0)
    built = pod["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert built["nodeSelectorTerms"][0]["matchExpressions"][0] == terms[0]["matchExpressions"][0]
    assert built["nodeSelectorTerms"][1]["matchFields"] == terms[1]["matchFields"]
    assert required_product(pod) == [[[H100]], [[H100]]]
    assert pod["spec"]["affinity"]["podAntiAffinity"] == affinity["podAntiAffinity"]
    assert job.spec.roles.actor.placement.affinity.node_affinity == affinity["nodeAffinity"]


def test_malformed_user_affinity_is_an_invalid_spec_naming_the_field(example_documents, job_from, settings):
    affinity = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": "zone-a"}}}
    job = job_from(example_documents["grpo-qwen-math-h100"], spec__roles__actor__placement__affinity=affinity)
    with pytest.raises(InvalidRLJob) as caught:
        build_pod(job, settings, "actor", 0)
    (problem,) = caught.value.problems
    assert problem.path == (
        "spec.roles.actor.placement.affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution.nodeSelectorTerms"
    )
    assert "must be a list" in problem.message


def test_a_user_toleration_covering_the_gpu_taint_is_not_duplicated(example_documents, job_from, settings):
    mine = {"key": "nvidia.com/gpu", "operator": "Exists"}
    job = job_from(example_documents["grpo-qwen-math-h100"], spec__roles__rollout__placement__tolerations=[mine])
    assert build_pod(job, settings, "rollout", 0)["spec"]["tolerations"] == [mine]
    other = {"key": "spot", "operator": "Equal", "value": "true", "effect": "NoSchedule"}
    job = job_from(example_documents["grpo-qwen-math-h100"], spec__roles__rollout__placement__tolerations=[other])
    assert build_pod(job, settings, "rollout", 0)["spec"]["tolerations"] == [other, GPU_TOLERATION]


def test_actor_mounts_the_checkpoint_claim_at_the_checkpoint_dir(example_documents, job_from, settings):
    job = job_from(example_documents["grpo-qwen-math-h100"])
    actor = build_pod(job, settings, "actor", 1)
    (volume,) = [v for v in actor["spec"]["volumes"] if v["name"] == "rljob-checkpoints"]
    assert volume["persistentVolumeClaim"] == {"claimName": "grpo-qwen-math-ckpt"}
    assert {"name": "rljob-checkpoints", "mountPath": "/checkpoints"} in container(actor)["volumeMounts"]
    rollout = build_pod(job, settings, "rollout", 0)
    assert all(v["name"] != "rljob-checkpoints" for v in rollout["spec"]["volumes"])


def test_without_a_claim_checkpoints_go_to_the_operators_claim_an_empty_dir_or_the_users_own_volume(
    example_documents, job_from, settings
):
    job = job_from(example_documents["cartpole-ppo"])
    actor = build_pod(job, settings, "actor", 0)
    claim = {"claimName": "cartpole-ppo-checkpoints"}
    assert {"name": "rljob-checkpoints", "persistentVolumeClaim": claim} in actor["spec"]["volumes"]
    assert {"name": "rljob-checkpoints", "mountPath": "/checkpoints"} in container(actor)["volumeMounts"]
    job = job_from(example_documents["cartpole-ppo"], spec__checkpoint__storage={"persistent": False})
    actor = build_pod(job, settings, "actor", 0)
    assert {"name": "rljob-checkpoints", "emptyDir": {}} in actor["spec"]["volumes"]
    job = job_from(
        example_documents["cartpole-ppo"],
        spec__checkpoint__dir="/shared/run-1/ckpt",
        spec__roles__actor__volumes=[{"name": "shared", "nfs": {"server": "nfs.local", "path": "/export"}}],
        spec__roles__actor__volumeMounts=[{"name": "shared", "mountPath": "/shared"}],
    )
    actor = build_pod(job, settings, "actor", 0)
    assert all(v["name"] != "rljob-checkpoints" for v in actor["spec"]["volumes"])


def test_pods_run_as_non_root_with_no_privilege_escalation(example_documents, job_from, settings):
    for pod in pods_by_name(build_children(job_from(example_documents["cartpole-ppo"]), settings)).values():
        security = pod["spec"]["securityContext"]
        assert security["runAsNonRoot"] is True and security["runAsUser"] >= 1
        assert security["seccompProfile"] == {"type": "RuntimeDefault"}
        assert container(pod)["securityContext"]["allowPrivilegeEscalation"] is False
        assert container(pod)["securityContext"]["capabilities"] == {"drop": ["ALL"]}
        assert pod["spec"]["automountServiceAccountToken"] is False


def test_reward_and_env_pods_have_a_read_only_root_and_a_writable_tmp(example_documents, job_from, settings):
    llm = job_from(example_documents["grpo-tiny-code"])
    gym = job_from(example_documents["cartpole-ppo"])
    for job, role in ((llm, "reward"), (gym, "env")):
        pod = build_pod(job, settings, role, 0)
        assert container(pod)["securityContext"]["readOnlyRootFilesystem"] is True
        assert {"name": "rljob-tmp", "mountPath": "/tmp"} in container(pod)["volumeMounts"]
        assert {"name": "rljob-tmp", "emptyDir": {}} in pod["spec"]["volumes"]
        assert {"name": "HOME", "value": "/tmp"} in container(pod)["env"]
    # The trainer keeps a writable root for its libraries' caches.
    assert "readOnlyRootFilesystem" not in container(build_pod(llm, settings, "actor", 0))["securityContext"]


def test_pods_run_the_role_entrypoint_never_restart_and_report_readiness(example_documents, job_from, settings):
    job = job_from(example_documents["cartpole-ppo"], spec__logging={"prometheusPort": 9400})
    for pod in pods_by_name(build_children(job, settings)).values():
        main = container(pod)
        assert main["command"] + main["args"] == ["rljob", "role", pod["metadata"]["labels"]["rljob.io/role"]]
        assert pod["spec"]["restartPolicy"] == "Never"
        assert main["readinessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}
        assert {"name": "metrics", "containerPort": 9400, "protocol": "TCP"} in main["ports"]


LIVEZ = {"path": "/livez", "port": "metrics"}


def test_every_role_gets_startup_and_liveness_probes_on_livez_with_its_default_budget(
    example_documents, job_from, settings, validate_manifest
):
    """Defaults per role: actor 1800 s to start, rollout 1800, env 300, reward 600; the liveness limit itself is
    counted by the process (its /livez), the kubelet acts after 3 failures 10 s apart."""
    jobs = [job_from(example_documents["cartpole-ppo"]), job_from(example_documents["grpo-tiny-arithmetic"])]
    startup_failures = {"actor": 360, "rollout": 360, "env": 60, "reward": 120}
    seen = set()
    for job in jobs:
        job.metadata.namespace = "default"
        for pod in pods_by_name(build_children(job, settings)).values():
            validate_manifest(pod)
            role = pod["metadata"]["labels"]["rljob.io/role"]
            main = container(pod)
            assert main["startupProbe"] == {
                "httpGet": LIVEZ,
                "timeoutSeconds": 5,
                "periodSeconds": 5,
                "failureThreshold": startup_failures[role],
            }
            assert main["livenessProbe"] == {
                "httpGet": LIVEZ,
                "timeoutSeconds": 5,
                "periodSeconds": 10,
                "failureThreshold": 3,
            }
            seen.add(role)
    assert seen == {"actor", "rollout", "env", "reward"}


def test_probe_budgets_come_from_the_role_spec_and_a_liveness_timeout_of_0_renders_no_probes(
    example_documents, job_from, settings, validate_manifest
):
    job = job_from(
        example_documents["cartpole-ppo"],
        spec__roles__rollout__probes={"startupTimeoutSeconds": 42, "livenessTimeoutSeconds": 120},
        spec__roles__env__probes={"livenessTimeoutSeconds": 0},
    )
    job.metadata.namespace = "default"
    assert job.spec.roles.liveness_timeout("rollout") == 120  # what the rollout's own /livez counts against
    rollout = build_pod(job, settings, "rollout", 0)
    validate_manifest(rollout)
    assert container(rollout)["startupProbe"]["failureThreshold"] == 9  # 42 s in 5 s periods, rounded up
    env = container(build_pod(job, settings, "env", 0))
    assert "livenessProbe" not in env and "startupProbe" not in env
    assert env["readinessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}
    assert container(build_pod(job, settings, "actor", 0))["startupProbe"]["failureThreshold"] == 360


def test_role_images_default_by_role_and_engine(example_documents, job_from):
    settings = OperatorSettings(trainer_image="t:1", rollout_image="r:1", env_image="e:1")
    llm = job_from(example_documents["grpo-qwen-math-h100"])
    assert [role_image(llm, r, settings) for r in ("actor", "rollout", "env", "reward")] == ["t:1", "r:1", "e:1", "e:1"]
    gym = job_from(example_documents["cartpole-ppo"])
    assert role_image(gym, "rollout", settings) == "t:1"
    own = job_from(example_documents["cartpole-ppo"], spec__roles__env__image="my/env:2")
    assert build_pod(own, settings, "env", 0)["spec"]["containers"][0]["image"] == "my/env:2"


def test_settings_reach_every_pod(example_documents, job_from):
    settings = OperatorSettings(
        image_pull_policy="Always",
        image_pull_secrets=("regcred",),
        pod_service_account="rl-runner",
        run_as_user=2000,
        extra_pod_labels={"cost-centre": "rl"},
    )
    pod = build_pod(job_from(example_documents["cartpole-ppo"]), settings, "actor", 0)
    assert container(pod)["imagePullPolicy"] == "Always"
    assert pod["spec"]["imagePullSecrets"] == [{"name": "regcred"}]
    assert pod["spec"]["serviceAccountName"] == "rl-runner" and "automountServiceAccountToken" not in pod["spec"]
    assert pod["spec"]["securityContext"]["runAsUser"] == 2000
    assert pod["metadata"]["labels"]["cost-centre"] == "rl"


def test_gpu_pods_get_shared_memory_unless_they_mount_their_own(example_documents, job_from, settings):
    job = job_from(example_documents["grpo-qwen-math-h100"])
    rollout = build_pod(job, settings, "rollout", 0)
    assert {"name": "rljob-dshm", "mountPath": "/dev/shm"} in container(rollout)["volumeMounts"]
    actor = build_pod(job, settings, "actor", 0)  # the example mounts its own dshm
    assert [m["name"] for m in container(actor)["volumeMounts"] if m["mountPath"] == "/dev/shm"] == ["dshm"]
    reward = build_pod(job, settings, "reward", 0)
    assert all(m["mountPath"] != "/dev/shm" for m in container(reward)["volumeMounts"])


# --- gang scheduling ----------------------------------------------------------------------------


def test_volcano_gang_groups_every_pod_in_the_queue(example_documents, job_from, settings):
    job = job_from(example_documents["grpo-qwen-math-h100"])
    group = build_pod_group(job, settings)
    assert group["apiVersion"] == "scheduling.volcano.sh/v1beta1"
    assert group["spec"] == {"minMember": 8, "queue": "research", "priorityClassName": "rl-training"}
    for pod in pods_by_name(build_children(job, settings)).values():
        assert pod["metadata"]["annotations"]["scheduling.k8s.io/group-name"] == group["metadata"]["name"]
        assert pod["spec"]["schedulerName"] == "volcano"


def test_scheduler_plugins_gang_labels_pods_for_the_coscheduling_plugin(example_documents, job_from, settings):
    job = job_from(example_documents["cartpole-ppo"], spec__scheduling={"gang": "scheduler-plugins"})
    group = build_pod_group(job, settings)
    assert group["apiVersion"] == "scheduling.x-k8s.io/v1alpha1" and group["kind"] == "PodGroup"
    assert group["spec"] == {"minMember": 4, "scheduleTimeoutSeconds": settings.gang_schedule_timeout_seconds}
    for pod in pods_by_name(build_children(job, settings)).values():
        assert pod["metadata"]["labels"]["scheduling.x-k8s.io/pod-group"] == "cartpole-ppo"
        assert pod["spec"]["schedulerName"] == "scheduler-plugins-scheduler"


def test_kueue_gang_marks_pods_as_one_plain_pod_group_without_a_podgroup(example_documents, job_from, settings):
    job = job_from(example_documents["cartpole-ppo"], spec__scheduling={"gang": "kueue", "queue": "team-a"})
    assert build_pod_group(job, settings) is None
    children = build_children(job, settings)
    assert [c["kind"] for c in children].count("PodGroup") == 0
    for pod in pods_by_name(children).values():
        assert pod["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "team-a"
        assert pod["metadata"]["labels"]["kueue.x-k8s.io/pod-group-name"] == "cartpole-ppo"
        assert pod["metadata"]["annotations"]["kueue.x-k8s.io/pod-group-total-count"] == "4"
        assert "schedulerName" not in pod["spec"]


def test_no_gang_means_no_group_and_the_chosen_scheduler(example_documents, job_from, settings):
    job = job_from(example_documents["cartpole-ppo"])
    assert build_pod_group(job, settings) is None
    assert "schedulerName" not in build_pod(job, settings, "actor", 0)["spec"]
    job = job_from(example_documents["cartpole-ppo"], spec__scheduling={"gang": "volcano", "schedulerName": "vc-2"})
    assert build_pod(job, settings, "actor", 0)["spec"]["schedulerName"] == "vc-2"
    assert "queue" not in build_pod_group(job, settings)["spec"]


# --- specs whose pods would clash with what rljob adds -----------------------------------------


@pytest.mark.parametrize(
    ("changes", "path", "hint"),
    [
        ({"spec__logging": {"prometheusPort": 29600}}, "spec.logging.prometheusPort", "choose another port"),
        ({"spec__checkpoint__dir": "ckpt"}, "spec.checkpoint.dir", "absolute path"),
        (
            {"spec__roles__env__env": [{"name": "RLJOB_ROLE", "value": "actor"}]},
            "spec.roles.env.env[0].name",
            "remove it from env",
        ),
        (
            {
                "spec__roles__actor__volumes": [{"name": "rljob-config", "emptyDir": {}}],
                "spec__roles__actor__volumeMounts": [{"name": "rljob-config", "mountPath": "/x"}],
            },
            "spec.roles.actor.volumes[0].name",
            "rename the volume",
        ),
        (
            {
                "spec__roles__env__volumes": [{"name": "etc", "emptyDir": {}}],
                "spec__roles__env__volumeMounts": [{"name": "etc", "mountPath": "/etc/rljob/"}],
            },
            "spec.roles.env.volumeMounts[0].mountPath",
            "mount the volume elsewhere",
        ),
        (
            {
                "spec__roles__actor__env": [{"name": "RLJOB_ROLLOUT_MEMBERS_FILE", "value": "/x"}],
            },
            "spec.roles.actor.env[0].name",
            "remove it from env",
        ),
        (
            {
                "spec__roles__actor__gpusPerReplica": 1,
                "spec__roles__actor__placement": {"gpuProduct": "NVIDIA H100 80GB"},
            },
            "spec.roles.actor.placement.gpuProduct",
            "node label value",
        ),
        (
            {"spec__scheduling": {"gang": "kueue", "queue": "team a"}},
            "spec.scheduling.queue",
            "queue-name label",
        ),
    ],
)
def test_a_clash_with_what_rljob_adds_is_an_invalid_spec_naming_the_field(
    example_documents, job_from, settings, changes, path, hint
):
    job = job_from(example_documents["cartpole-ppo"], **changes)
    with pytest.raises(InvalidRLJob) as caught:
        build_children(job, settings)
    assert [p.path for p in caught.value.problems] == [path]
    assert hint in caught.value.problems[0].message


def test_checkpoint_claim_and_a_user_mount_on_the_same_dir_clash(example_documents, job_from, settings):
    job = job_from(
        example_documents["grpo-qwen-math-h100"],
        spec__roles__actor__volumeMounts=[
            {"name": "dshm", "mountPath": "/dev/shm"},
            {"name": "data", "mountPath": "/checkpoints"},
        ],
    )
    with pytest.raises(InvalidRLJob) as caught:
        build_pod(job, settings, "actor", 0)
    assert [p.path for p in caught.value.problems] == ["spec.roles.actor.volumeMounts[1].mountPath"]


def test_filesystem_weight_sync_mounts_the_checkpoint_claim_read_only_in_rollout_pods(
    example_documents, job_from, settings, validate_manifest
):
    job = job_from(example_documents["grpo-qwen-math-h100"], spec__rollout__weightSync__method="filesystem")
    rollout = build_pod(job, settings, "rollout", 2)
    validate_manifest(rollout)
    (volume,) = [v for v in rollout["spec"]["volumes"] if v["name"] == "rljob-checkpoints"]
    assert volume["persistentVolumeClaim"] == {"claimName": "grpo-qwen-math-ckpt", "readOnly": True}
    assert {"name": "rljob-checkpoints", "mountPath": "/checkpoints", "readOnly": True} in container(rollout)[
        "volumeMounts"
    ]


def test_filesystem_weight_sync_without_a_shared_volume_is_an_invalid_spec(example_documents, job_from, settings):
    job = job_from(
        example_documents["grpo-tiny-arithmetic"],
        spec__rollout__weightSync__method="filesystem",
        spec__checkpoint__storage={"persistent": False},
    )
    with pytest.raises(InvalidRLJob) as caught:
        build_children(job, settings)
    assert [p.path for p in caught.value.problems] == ["spec.rollout.weightSync.method"]
    assert "set spec.checkpoint.volumeClaim" in caught.value.problems[0].message
    shared = [{"name": "shared", "nfs": {"server": "nfs.local", "path": "/export"}}]
    mounted = [{"name": "shared", "mountPath": "/shared"}]
    job = job_from(
        example_documents["grpo-tiny-arithmetic"],
        spec__rollout__weightSync__method="filesystem",
        spec__checkpoint__dir="/shared/ckpt",
        spec__roles__actor__volumes=shared,
        spec__roles__actor__volumeMounts=mounted,
        spec__roles__rollout__volumes=shared,
        spec__roles__rollout__volumeMounts=mounted,
    )
    assert build_children(job, settings)


# --- the reward pods' egress NetworkPolicy ------------------------------------------------------------


def egress_policies(children):
    return [c for c in children if c["kind"] == "NetworkPolicy" and "Egress" in c["spec"]["policyTypes"]]


def test_reward_pods_running_code_exec_without_network_may_send_dns_only(
    example_documents, job_from, settings, validate_manifest
):
    job = job_from(example_documents["grpo-tiny-code"])
    job.metadata.uid, job.metadata.namespace = "uid-1", "default"
    children = build_children(job, settings)
    (policy,) = egress_policies(children)
    validate_manifest(policy)
    assert policy["metadata"]["name"] == "grpo-tiny-code-reward-egress"
    assert policy["metadata"]["ownerReferences"][0]["uid"] == "uid-1"  # garbage-collected with the job
    spec = policy["spec"]
    assert spec["policyTypes"] == ["Egress"]  # ingress (the actor's requests, health probes) untouched
    assert spec["egress"] == [{"ports": [{"protocol": "UDP", "port": 53}, {"protocol": "TCP", "port": 53}]}]
    selected = [
        pod["metadata"]["name"]
        for pod in pods_by_name(children).values()
        if spec["podSelector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    ]
    assert selected == ["grpo-tiny-code-reward-0"]
    kinds = [c["kind"] for c in children]
    assert kinds.index("NetworkPolicy") < kinds.index("Pod")  # in force before a reward pod runs code


def test_user_reward_modules_count_as_sandboxed_code(example_documents, job_from, settings):
    job = job_from(
        example_documents["grpo-tiny-arithmetic"], spec__reward__functions=[{"module": "my_rewards.py:score"}]
    )
    assert len(egress_policies(build_children(job, settings))) == 1


def test_no_egress_policy_for_jobs_with_network_or_without_sandboxed_rewards(example_documents, job_from, settings):
    with_network = job_from(example_documents["grpo-tiny-code"], spec__reward__sandbox__network=True)
    builtins_only = job_from(example_documents["grpo-tiny-arithmetic"])
    gym = job_from(example_documents["cartpole-ppo"])
    for job in (with_network, builtins_only, gym):
        assert egress_policies(build_children(job, settings)) == [], job.name
    assert all(f.builtin != "code_exec" and f.module is None for f in builtins_only.spec.reward.functions)


def test_the_restart_relevant_spec_drops_what_applies_in_place_and_leaves_the_spec_as_it_is():
    import copy

    from rljob.operator.manifests.config import restart_relevant

    spec = {
        "task": {"type": "llm"},
        "roles": {"rollout": {"replicas": 2, "autoscale": {"max": 4}, "gpusPerReplica": 1}, "actor": {"replicas": 1}},
        "health": {"entropyFloor": 0.01},
        "suspend": False,
        "model": {"name": "m"},
    }
    before = copy.deepcopy(spec)
    assert restart_relevant(spec) == {
        "task": {"type": "llm"},
        "roles": {"rollout": {"gpusPerReplica": 1}, "actor": {"replicas": 1}},
        "model": {"name": "m"},
    }
    assert spec == before
    # A gym task's rollout count is fixed when the actor group starts: changing it restarts the pods.
    gym = {**before, "task": {"type": "gym"}}
    assert restart_relevant(gym)["roles"]["rollout"] == {"replicas": 2, "gpusPerReplica": 1}
    assert restart_relevant({"task": {"type": "gym"}, "roles": None}) == {"task": {"type": "gym"}, "roles": None}
