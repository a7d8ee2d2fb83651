"""A job with experiment trackers: the new actor group after a restart is told its restart (its runs' names)."""

from __future__ import annotations

from tests.operator.controller.conftest import Cluster, cartpole_job, eventually, operator_running
from tests.operator.controller.emulator import KubernetesApiEmulator
from tests.operator.controller.test_failure_policy import start_running


def restart_env(cluster: Cluster, pod: str) -> str | None:
    (main,) = cluster.pods("cp")[pod]["spec"]["containers"]
    return next((e.get("value") for e in main["env"] if e["name"] == "RLJOB_RESTART"), None)


async def test_the_restarted_actor_group_runs_as_the_next_restart(
    kube: KubernetesApiEmulator, cluster: Cluster
) -> None:
    trackers = [{"name": "wandb", "apiKeySecret": {"name": "tracker-keys", "key": "wandb"}}]
    async with operator_running(kube):
        uids = await start_running(cluster, cartpole_job(logging={"trackers": trackers}))
        assert restart_env(cluster, "cp-actor-0") == "0"
        assert restart_env(cluster, "cp-rollout-0") is None
        cluster.exit("cp-actor-0", 1)
        await eventually(
            lambda: "cp-actor-0" in cluster.pods("cp") and cluster.uid("cp-actor-0") != uids["cp-actor-0"],
            what="new actor group",
        )
        assert restart_env(cluster, "cp-actor-0") == "1"
        assert cluster.status("cp")["restarts"] == 1
        assert cluster.uid("cp-rollout-0") == uids["cp-rollout-0"]  # the rest of the job is not recreated
