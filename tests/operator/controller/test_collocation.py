"""The operator does not build collocated pods yet: a collocated RLJob fails with InvalidSpec naming the field,
the operator keeps running, and the job starts once edited into a non-collocated one."""

from __future__ import annotations

from tests.operator.controller.conftest import Cluster, arithmetic_job, eventually, operator_running
from tests.operator.controller.emulator import KubernetesApiEmulator


async def test_a_collocated_job_fails_with_invalid_spec_and_starts_once_collocation_is_turned_off(
    kube: KubernetesApiEmulator, cluster: Cluster
) -> None:
    async with operator_running(kube) as op:
        manifest = arithmetic_job("co")
        manifest["spec"]["roles"]["rollout"]["collocated"] = True
        manifest["spec"]["rollout"]["weightSync"] = {"method": "ipc"}
        cluster.create_job(manifest)
        await eventually(lambda: cluster.phase("co") == "Failed", what="Failed")
        failed = next(c for c in cluster.status("co")["conditions"] if c["type"] == "Failed")
        assert failed["reason"] == "InvalidSpec" and "spec.roles.rollout.collocated" in failed["message"]
        assert cluster.pods("co") == {}
        cluster.patch_job(
            "co",
            {"spec": {"roles": {"rollout": {"collocated": False}}, "rollout": {"weightSync": {"method": "broadcast"}}}},
        )
        await eventually(lambda: len(cluster.pods("co")) == 3, what="pods after the edit")
        assert not op.task.done()
