"""Which namespaces the operator serves: `--namespace` (repeatable) or `--all-namespaces`."""

from __future__ import annotations

from dataclasses import replace

from tests.operator.controller.conftest import (
    CARTPOLE_PODS,
    FAST,
    Cluster,
    RunningOperator,
    cartpole_job,
    eventually,
    operator_running,
)
from tests.operator.controller.emulator import KubernetesApiEmulator


async def test_jobs_in_the_served_namespaces_get_pods_and_others_are_left_alone(kube: KubernetesApiEmulator) -> None:
    teams = {ns: Cluster(kube, namespace=ns) for ns in ("team-a", "team-b", "elsewhere")}
    async with operator_running(kube, namespaces=("team-a", "team-b")) as op:
        for ns, cluster in teams.items():
            cluster.create_job(cartpole_job(namespace=ns))
        for ns in ("team-a", "team-b"):
            await eventually(lambda ns=ns: set(teams[ns].pods("cp")) == CARTPOLE_PODS, what=f"pods in {ns}")
            teams[ns].run_all("cp")
            await eventually(lambda ns=ns: teams[ns].phase("cp") == "Running", what=f"Running in {ns}")
        # The same job name in two namespaces: two independent jobs, each with its own pods.
        assert teams["team-a"].uid("cp-actor-0") != teams["team-b"].uid("cp-actor-0")
        # Evidence before the negative assertion: more reconcile passes ran after both jobs were Running
        # (every pass walks the jobs in view), and still no request of the operator went to "elsewhere".
        done = reconciles(op)
        await eventually(lambda: reconciles(op) >= done + 2, what="more reconcile passes")
        assert teams["elsewhere"].pods("cp") == {} and teams["elsewhere"].status("cp") == {}
        assert not [r for r in list(kube) if "/namespaces/elsewhere/" in str(r.url)]


def reconciles(op: RunningOperator) -> float:
    return sum(
        s.value
        for f in op.metrics.registry.collect()
        for s in f.samples
        if s.name == "rljob_operator_reconcile_duration_seconds_count"
    )


async def test_all_namespaces_serves_a_namespace_created_after_start(kube: KubernetesApiEmulator) -> None:
    async with operator_running(kube, all_namespaces=True):
        for ns in ("ns-1", "ns-2"):
            cluster = Cluster(kube, namespace=ns)
            cluster.create_job(cartpole_job(namespace=ns))
            await eventually(lambda cluster=cluster: set(cluster.pods("cp")) == CARTPOLE_PODS, what=f"pods in {ns}")
            cluster.run_all("cp")
            await eventually(lambda cluster=cluster: cluster.phase("cp") == "Running", what=f"Running in {ns}")


async def test_a_namespace_posting_many_jobs_does_not_queue_another_namespaces_first_job(
    kube: KubernetesApiEmulator,
) -> None:
    busy, quiet = Cluster(kube, namespace="busy"), Cluster(kube, namespace="quiet")
    # One reconcile slot: the busy namespace's jobs take turns, and the quiet one's job queues behind them.
    async with operator_running(kube, all_namespaces=True, config=replace(FAST, max_concurrent_reconciles=1)):
        for i in range(12):
            busy.create_job(cartpole_job(name=f"b{i}", namespace="busy"))
        quiet.create_job(cartpole_job(name="q", namespace="quiet"))
        await eventually(lambda: len(quiet.pods("q")) == len(CARTPOLE_PODS), what="the quiet job's pods", timeout=30)
        waiting = [i for i in range(12) if not busy.pods(f"b{i}")]
        # Slots go round robin by namespace: the quiet job waited for a few busy passes, not for all twelve.
        assert len(waiting) >= 6, f"only {waiting} of the busy jobs were still without pods"
        await eventually(lambda: all(busy.pods(f"b{i}") for i in range(12)), what="every busy job's pods", timeout=30)
