"""An RLJob from creation to success, driven through the real operator against the API emulator."""

from __future__ import annotations

import aiohttp
import kmock
import yaml
import yarl

from rljob.runtime.llm.replicas.membership import parse_members
from tests.operator.controller.conftest import (
    CARTPOLE_PODS,
    CONFIGMAPS,
    FAST,
    NETWORK_POLICIES,
    NS,
    RESOURCES,
    SERVICES,
    Cluster,
    arithmetic_job,
    cartpole_job,
    code_job,
    eventually,
    new_emulator,
    operator_running,
    progress_server,
    start_cartpole,
)
from tests.operator.controller.emulator import KubernetesApiEmulator

MERGE = {"Content-Type": "application/merge-patch+json"}


async def test_create_makes_every_child_at_once_then_succeeds_and_cleans_up(
    kube: KubernetesApiEmulator, cluster: Cluster
) -> None:
    async with operator_running(kube):
        job = cluster.create_job(cartpole_job())
        pods = await eventually(lambda: set(cluster.pods("cp")) == CARTPOLE_PODS and cluster.pods("cp"))
        for pod in pods.values():
            owner = pod["metadata"]["ownerReferences"][0]
            assert owner["uid"] == job["metadata"]["uid"] and owner["controller"] is True
        assert kube.read_object(CONFIGMAPS, NS, "cp-config") and kube.read_object(SERVICES, NS, "cp")
        await eventually(lambda: cluster.phase("cp") == "Pending", what="Pending")

        cluster.run_all("cp")
        await eventually(lambda: cluster.phase("cp") == "Running", what="Running")
        status = cluster.status("cp")
        assert status["roles"]["env"] == {"desired": 2, "ready": 2, "failed": 0}
        assert status["startTime"]

        cluster.exit("cp-actor-0", 0)
        await eventually(lambda: cluster.phase("cp") == "Succeeded", what="Succeeded")
        await eventually(lambda: set(cluster.pods("cp")) == {"cp-actor-0"}, what="cleanup")
        status = cluster.status("cp")
        assert status["completionTime"] and status["progress"]["step"] == 150
        await eventually(lambda: {"Running", "TrainingCompleted"} <= set(cluster.reasons("cp")), what="events")


async def test_suspend_deletes_pods_keeps_status_and_resume_recreates_them(
    kube: KubernetesApiEmulator, cluster: Cluster
) -> None:
    async with operator_running(kube):
        await start_cartpole(cluster)
        cluster.patch_job("cp", {"spec": {"suspend": True}})
        await eventually(lambda: cluster.phase("cp") == "Suspended", what="Suspended")
        await eventually(lambda: cluster.pods("cp") == {}, what="pods deleted")
        assert cluster.status("cp")["progress"]["totalSteps"] == 150
        cluster.patch_job("cp", {"spec": {"suspend": False}})
        await eventually(lambda: set(cluster.pods("cp")) == CARTPOLE_PODS, what="pods recreated")
        cluster.run_all("cp")
        await eventually(lambda: cluster.phase("cp") == "Running", what="Running after resume")
        assert cluster.status("cp")["restarts"] == 0
        await eventually(lambda: {"Suspended", "Resumed"} <= set(cluster.reasons("cp")), what="events")


async def _scale_rollouts(kube: KubernetesApiEmulator, job: str, replicas: int) -> None:
    """`kubectl scale rljob/JOB --replicas=N`: a merge patch on the scale subresource."""
    scale = f"/apis/rljob.io/v1alpha1/namespaces/{NS}/rljobs/{job}/scale"
    # A one-off connection: a kept-alive one would outlive the operator and delay kopf's exit.
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as session:
        response = await session.patch(
            kube.url.join(yarl.URL(scale)), json={"spec": {"replicas": replicas}}, headers=MERGE
        )
        assert response.status == 200


def _rollout_members(kube: KubernetesApiEmulator, job: str) -> dict[int, str] | None:
    """The rollout membership the operator publishes to the job's actor pods, if written."""
    members = kube.read_object(CONFIGMAPS, NS, f"{job}-rollouts")
    return parse_members(members["data"]["rollouts.json"]) if members else None


async def test_scaling_rollout_adds_and_removes_rollout_pods_without_touching_actors(
    kube: KubernetesApiEmulator, cluster: Cluster
) -> None:
    """Rollouts of an llm job are interchangeable servers, so their count changes in place, and the actor
    learns the Ready ones from the membership ConfigMap mounted into its pod."""
    llm_pods = {"ar-actor-0", "ar-rollout-0", "ar-reward-0"}
    async with operator_running(kube, config=FAST):
        cluster.create_job(arithmetic_job())
        await eventually(lambda: set(cluster.pods("ar")) == llm_pods)
        actor_pod = cluster.pods("ar")["ar-actor-0"]["spec"]
        env = {e["name"]: e.get("value") for e in actor_pod["containers"][0]["env"]}
        assert env["RLJOB_ROLLOUT_MEMBERS_FILE"] == "/etc/rljob-rollouts/rollouts.json"
        assert {"name": "rljob-rollouts", "configMap": {"name": "ar-rollouts", "optional": True}} in actor_pod[
            "volumes"
        ]
        await eventually(lambda: _rollout_members(kube, "ar") == {}, what="nothing ready yet")
        cluster.run_all("ar")
        await eventually(lambda: cluster.phase("ar") == "Running")
        await eventually(lambda: _rollout_members(kube, "ar") == {0: "ar-rollout-0.ar:29600"}, what="rollout 0 in")
        actor = cluster.uid("ar-actor-0")
        await _scale_rollouts(kube, "ar", 3)
        await eventually(lambda: {"ar-rollout-1", "ar-rollout-2"} <= set(cluster.pods("ar")), what="scaled up")
        assert _rollout_members(kube, "ar") == {0: "ar-rollout-0.ar:29600"}  # not Ready yet: not fed yet
        cluster.run("ar-rollout-1")
        cluster.run("ar-rollout-2")
        await eventually(lambda: cluster.status("ar")["roles"]["rollout"] == {"desired": 3, "ready": 3, "failed": 0})
        await eventually(lambda: sorted(_rollout_members(kube, "ar") or {}) == [0, 1, 2], what="rollouts 1, 2 in")
        assert _rollout_members(kube, "ar")[2] == "ar-rollout-2.ar:29600"
        config = kube.read_object(CONFIGMAPS, NS, "ar-config")["data"]["job.yaml"]
        assert yaml.safe_load(config)["spec"]["roles"]["rollout"]["replicas"] == 3
        cluster.patch_job("ar", {"spec": {"roles": {"rollout": {"replicas": 1}}}})
        await eventually(lambda: set(cluster.pods("ar")) == llm_pods, what="scaled down")
        assert _rollout_members(kube, "ar") == {0: "ar-rollout-0.ar:29600"}
        assert cluster.uid("ar-actor-0") == actor and cluster.phase("ar") == "Running"
        assert cluster.status("ar")["restarts"] == 0
        assert "SpecChanged" not in cluster.reasons("ar")


async def test_scaling_rollout_of_a_gym_job_is_a_controlled_restart(
    kube: KubernetesApiEmulator, cluster: Cluster
) -> None:
    """Gym rollouts each step a fixed share of the envs, so the whole job restarts on the new count."""
    async with operator_running(kube):
        await start_cartpole(cluster)
        uids = {pod: cluster.uid(pod) for pod in CARTPOLE_PODS}
        await _scale_rollouts(kube, "cp", 2)
        scaled = CARTPOLE_PODS | {"cp-rollout-1"}
        await eventually(
            lambda: set(cluster.pods("cp")) == scaled and all(cluster.uid(p) != uids[p] for p in CARTPOLE_PODS),
            what="every pod recreated with two rollouts",
        )
        await eventually(lambda: "SpecChanged" in cluster.reasons("cp"), what="events")
        assert cluster.status("cp")["restarts"] == 0


async def test_other_spec_edits_restart_every_pod_with_the_new_spec(
    kube: KubernetesApiEmulator, cluster: Cluster
) -> None:
    async with operator_running(kube):
        cluster.create_job(cartpole_job())
        await eventually(lambda: set(cluster.pods("cp")) == CARTPOLE_PODS)
        uids = {pod: cluster.uid(pod) for pod in CARTPOLE_PODS}
        cluster.patch_job("cp", {"spec": {"trainer": {"learningRate": 0.0005}}})
        await eventually(
            lambda: set(cluster.pods("cp")) == CARTPOLE_PODS and all(cluster.uid(p) != uids[p] for p in CARTPOLE_PODS),
            what="every pod recreated",
        )
        config = kube.read_object(CONFIGMAPS, NS, "cp-config")["data"]["job.yaml"]
        assert yaml.safe_load(config)["spec"]["trainer"]["learningRate"] == 0.0005
        await eventually(lambda: "SpecChanged" in cluster.reasons("cp"), what="events")
        assert cluster.status("cp")["restarts"] == 0


async def test_active_deadline_fails_the_job(kube: KubernetesApiEmulator, cluster: Cluster) -> None:
    async with operator_running(kube):
        cluster.create_job(cartpole_job(activeDeadlineSeconds=1))
        await eventually(lambda: set(cluster.pods("cp")) == CARTPOLE_PODS)
        cluster.run_all("cp")
        await eventually(lambda: cluster.phase("cp") == "Failed", timeout=5, what="DeadlineExceeded")
        failed = next(c for c in cluster.status("cp")["conditions"] if c["type"] == "Failed")
        assert failed["reason"] == "DeadlineExceeded"
        await eventually(lambda: cluster.pods("cp") == {}, what="pods deleted")


async def test_finished_job_is_deleted_after_its_ttl(kube: KubernetesApiEmulator, cluster: Cluster) -> None:
    async with operator_running(kube):
        cluster.create_job(cartpole_job(ttlSecondsAfterFinished=1))
        await eventually(lambda: set(cluster.pods("cp")) == CARTPOLE_PODS)
        cluster.run_all("cp")
        cluster.exit("cp-actor-0", 0)
        await eventually(lambda: cluster.phase("cp") == "Succeeded")
        assert cluster.job("cp") is not None
        await eventually(lambda: cluster.job("cp") is None, timeout=5, what="deleted by TTL")
        kube.collect_garbage()
        assert cluster.pods("cp") == {} and kube.read_object(CONFIGMAPS, NS, "cp-config") is None


async def test_conditions_say_why_a_job_waits(kube: KubernetesApiEmulator, cluster: Cluster) -> None:
    async with operator_running(kube):
        cluster.create_job(cartpole_job())
        await eventually(lambda: set(cluster.pods("cp")) == CARTPOLE_PODS)
        message = "0/3 nodes are available: 3 Insufficient nvidia.com/gpu."
        cluster.unschedulable("cp-actor-0", message)
        cluster.image_pull_failure("cp-env-0")

        def condition(kind: str) -> dict:
            return next((c for c in cluster.status("cp").get("conditions", []) if c["type"] == kind), {})

        await eventually(lambda: condition("Scheduled").get("reason") == "Unschedulable", what="Unschedulable")
        assert condition("Scheduled")["message"] == f"cp-actor-0: {message}"
        await eventually(lambda: condition("Ready").get("reason") == "ImagePullBackOff", what="image pull")
        assert "ghcr.io/rljob/nope:1" in condition("Ready")["message"]
        assert cluster.phase("cp") == "Pending"
        await eventually(lambda: {"Unschedulable", "ImagePullBackOff"} <= set(cluster.reasons("cp")), what="events")
        cluster.run_all("cp")
        await eventually(lambda: condition("Scheduled")["status"] == "True" and cluster.phase("cp") == "Running")


async def test_progress_is_pulled_from_actor_zero(kube: KubernetesApiEmulator, cluster: Cluster) -> None:
    progress = {"step": 42, "totalSteps": 150, "rewardMean": 187.5, "updatedAt": "2026-01-01T00:00:00Z", "epoch": 3}
    server = await progress_server(progress)
    try:
        async with operator_running(kube, progress_url=lambda pod, port: str(server.make_url("/progress"))):
            cluster.create_job(cartpole_job())
            await eventually(lambda: set(cluster.pods("cp")) == CARTPOLE_PODS)
            cluster.run_all("cp")
            await eventually(lambda: cluster.status("cp")["progress"]["step"] == 42, what="progress")
            assert cluster.status("cp")["progress"]["rewardMean"] == 187.5
            progress["step"] = 43
            await eventually(lambda: cluster.status("cp")["progress"]["step"] == 43, what="progress updated")
    finally:
        await server.close()


async def test_a_non_finite_progress_value_is_left_out_and_progress_goes_on(
    kube: KubernetesApiEmulator, cluster: Cluster
) -> None:
    """JSON has no NaN: a real server refuses a status with one (400), which froze progress and lost the
    reconcile's actions. An actor reporting a NaN reward (an empty batch, say) or an infinite entropy keeps
    its step moving; the values that are not numbers are left out."""
    progress = {"step": 3, "totalSteps": 150, "rewardMean": float("nan"), "entropy": float("inf")}
    server = await progress_server(progress)
    try:
        async with operator_running(kube, progress_url=lambda pod, port: str(server.make_url("/progress"))):
            await start_cartpole(cluster)
            await eventually(lambda: cluster.status("cp")["progress"]["step"] == 3, what="progress")
            assert "rewardMean" not in cluster.status("cp")["progress"]
            assert "entropy" not in cluster.status("cp")["progress"]
            progress.update(step=4, rewardMean=12.5)
            await eventually(lambda: cluster.status("cp")["progress"].get("rewardMean") == 12.5, what="a number")
            assert cluster.status("cp")["progress"]["step"] == 4
    finally:
        await server.close()


async def test_volcano_pod_group_covers_every_pod_and_follows_scaling(
    kube: KubernetesApiEmulator, cluster: Cluster
) -> None:
    podgroups = kmock.resource("scheduling.volcano.sh", "v1beta1", "podgroups")
    async with operator_running(kube):
        cluster.create_job(cartpole_job(scheduling={"gang": "volcano", "queue": "research"}))
        await eventually(lambda: set(cluster.pods("cp")) == CARTPOLE_PODS)
        group = kube.read_object(podgroups, NS, "cp")
        assert group["spec"]["minMember"] == 4 and group["spec"]["queue"] == "research"
        assert all(p["spec"]["schedulerName"] == "volcano" for p in cluster.pods("cp").values())
        cluster.patch_job("cp", {"spec": {"roles": {"rollout": {"replicas": 2}}}})
        await eventually(lambda: kube.read_object(podgroups, NS, "cp")["spec"]["minMember"] == 5, what="minMember")
        await eventually(lambda: "cp-rollout-1" in cluster.pods("cp"), what="scaled up")


async def test_reward_pods_running_sandboxed_code_without_network_get_a_dns_only_egress_policy(
    kube: KubernetesApiEmulator, cluster: Cluster
) -> None:
    async with operator_running(kube):
        code = cluster.create_job(code_job())
        cluster.create_job(arithmetic_job())  # builtin rewards only: no policy
        policy = await eventually(lambda: kube.read_object(NETWORK_POLICIES, NS, "gc-reward-egress"), what="policy")
        assert policy["metadata"]["ownerReferences"][0]["uid"] == code["metadata"]["uid"]
        assert policy["spec"]["podSelector"]["matchLabels"] == {"rljob.io/job": "gc", "rljob.io/role": "reward"}
        await eventually(lambda: "gc-reward-0" in cluster.pods("gc") and "ar-reward-0" in cluster.pods("ar"))
        egress = [
            p["metadata"]["name"]
            for p in kube.list_objects(NETWORK_POLICIES, NS)
            if "Egress" in p["spec"]["policyTypes"]
        ]
        assert egress == ["gc-reward-egress"]

        # The sandbox gets network: the policy goes; taken away again: it comes back.
        cluster.patch_job("gc", {"spec": {"reward": {"sandbox": {"network": True}}}})
        await eventually(lambda: kube.read_object(NETWORK_POLICIES, NS, "gc-reward-egress") is None, what="deleted")
        cluster.patch_job("gc", {"spec": {"reward": {"sandbox": {"network": False}}}})
        await eventually(lambda: kube.read_object(NETWORK_POLICIES, NS, "gc-reward-egress"), what="recreated")


async def test_a_child_the_cluster_cannot_create_is_reported_in_status_and_an_event() -> None:
    """`gang: volcano` on a cluster without Volcano: the PodGroup create is a 404. The job says so."""
    kube = new_emulator()
    del kube.resources["scheduling.volcano.sh/v1beta1/podgroups"]  # no Volcano here
    cluster = Cluster(kube)
    async with kube, kmock.Server(kube), operator_running(kube):
        cluster.create_job(cartpole_job(scheduling={"gang": "volcano"}))

        def condition() -> dict:
            return next((c for c in cluster.status("cp").get("conditions", []) if c["type"] == "ChildrenCreated"), {})

        await eventually(lambda: condition()["status"] == "False", what="the condition")
        assert condition()["reason"] == "FailedCreate" and "PodGroup/cp" in condition()["message"]
        assert cluster.phase("cp") == "Pending" and cluster.pods("cp") == {}  # no pod waits on a missing group
        await eventually(lambda: "FailedCreate" in cluster.reasons("cp"), what="the Event")
        # Volcano gets installed: the job goes on by itself.
        info = RESOURCES["scheduling.volcano.sh/v1beta1/podgroups"]
        kube.resources["scheduling.volcano.sh/v1beta1/podgroups"] = kmock.ResourceInfo(
            verbs={"list", "watch", "get", "create", "patch", "delete"}, **info
        )
        await eventually(lambda: condition()["status"] == "True", what="created")
        await eventually(lambda: set(cluster.pods("cp")) == CARTPOLE_PODS, what="pods")
    kube.stop_timers()


async def test_an_edit_that_deeper_validation_refuses_leaves_a_started_job_running_on_its_last_valid_spec(
    kube: KubernetesApiEmulator, cluster: Cluster
) -> None:
    """`kubectl scale --replicas=3` on a gym job with 2 env replicas passes the CRD but not rljob's validation
    (each rollout replica drives its own env replicas). The running job keeps its pods and says why."""

    def accepted() -> dict:
        return next((c for c in cluster.status("cp").get("conditions", []) if c["type"] == "SpecAccepted"), {})

    async with operator_running(kube):
        await start_cartpole(cluster)
        uids = {name: pod["metadata"]["uid"] for name, pod in cluster.pods("cp").items()}
        await _scale_rollouts(kube, "cp", 3)
        await eventually(lambda: accepted().get("status") == "False", what="the refused edit reported")
        assert accepted()["reason"] == "InvalidSpec" and "spec.roles.rollout.replicas" in accepted()["message"]
        await eventually(lambda: "InvalidSpec" in cluster.reasons("cp"), what="the Event")
        assert cluster.phase("cp") == "Running"
        assert {name: pod["metadata"]["uid"] for name, pod in cluster.pods("cp").items()} == uids
        # Back to a valid spec: accepted again, and nothing was restarted.
        await _scale_rollouts(kube, "cp", 1)
        await eventually(lambda: accepted().get("status") == "True", what="accepted")
        assert {name: pod["metadata"]["uid"] for name, pod in cluster.pods("cp").items()} == uids
        assert cluster.phase("cp") == "Running" and cluster.status("cp")["restarts"] == 0


async def test_an_operator_started_after_a_refused_edit_runs_the_job_on_the_spec_in_its_config(
    kube: KubernetesApiEmulator, cluster: Cluster
) -> None:
    async with operator_running(kube):
        await start_cartpole(cluster)
    uids = {name: pod["metadata"]["uid"] for name, pod in cluster.pods("cp").items()}
    cluster.patch_job("cp", {"spec": {"roles": {"rollout": {"replicas": 3}}}})  # while no operator runs
    async with operator_running(kube):
        await eventually(
            lambda: any(c["type"] == "SpecAccepted" for c in cluster.status("cp").get("conditions", [])),
            what="the refused edit reported",
        )
        assert cluster.phase("cp") == "Running"
        assert {name: pod["metadata"]["uid"] for name, pod in cluster.pods("cp").items()} == uids
