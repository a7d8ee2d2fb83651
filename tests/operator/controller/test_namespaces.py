"""Which namespaces the operator serves: `--namespace` (repeatable) or `--all-namespaces`."""

from __future__ import annotations

import asyncio

from tests.operator.controller.conftest import (
    CARTPOLE_PODS,
    Cluster,
    cartpole_job,
    eventually,
    operator_running,
)
from tests.operator.controller.emulator import KubernetesApiEmulator


async def test_jobs_in_the_served_namespaces_get_pods_and_others_are_left_alone(kube: KubernetesApiEmulator) -> None:
    teams = {ns: Cluster(kube, namespace=ns) for ns in ("team-a", "team-b", "elsewhere")}
    async with operator_running(kube, namespaces=("team-a", "team-b")):
        for ns, cluster in teams.items():
            cluster.create_job(cartpole_job(namespace=ns))
        for ns in ("team-a", "team-b"):
            await eventually(lambda ns=ns: set(teams[ns].pods("cp")) == CARTPOLE_PODS, what=f"pods in {ns}")
            teams[ns].run_all("cp")
            await eventually(lambda ns=ns: teams[ns].phase("cp") == "Running", what=f"Running in {ns}")
        # The same job name in two namespaces: two independent jobs, each with its own pods.
        assert teams["team-a"].uid("cp-actor-0") != teams["team-b"].uid("cp-actor-0")
        await asyncio.sleep(1.0)  # several reconcile rounds: still nothing outside the served namespaces
        assert teams["elsewhere"].pods("cp") == {} and teams["elsewhere"].status("cp") == {}


async def test_all_namespaces_serves_a_namespace_created_after_start(kube: KubernetesApiEmulator) -> None:
    async with operator_running(kube, all_namespaces=True):
        for ns in ("ns-1", "ns-2"):
            cluster = Cluster(kube, namespace=ns)
            cluster.create_job(cartpole_job(namespace=ns))
            await eventually(lambda cluster=cluster: set(cluster.pods("cp")) == CARTPOLE_PODS, what=f"pods in {ns}")
            cluster.run_all("cp")
            await eventually(lambda cluster=cluster: cluster.phase("cp") == "Running", what=f"Running in {ns}")
