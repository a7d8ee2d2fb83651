"""Training health as `kubectl` shows it: EntropyCollapsed and MismatchHigh from the actor's /progress, set and
cleared with Events and the HEALTH column, and Diverged when the actor stops on a non-finite update."""

from __future__ import annotations

from typing import Any

from rljob.api.crd import build_crd
from rljob.runtime.wire.identity import EXIT_DIVERGED
from tests.operator.controller.conftest import (
    CARTPOLE_PODS,
    NS,
    PODS,
    Cluster,
    cartpole_job,
    eventually,
    operator_running,
    progress_server,
    start_cartpole,
)
from tests.operator.controller.emulator import KubernetesApiEmulator

DIVERGED = (
    "diverged at step 12: non-finite loss and grad_norm (loss inf, grad_norm nan); the update was not applied; "
    "last good checkpoint: /checkpoints/step-00000010 (step 10)"
)


def health_column(job: dict[str, Any]) -> str:
    """What `kubectl get rljobs` prints in the HEALTH column: the CRD's own jsonPath read from the object."""
    [version] = build_crd()["spec"]["versions"]
    [column] = [c for c in version["additionalPrinterColumns"] if c["name"] == "Health"]
    value: Any = job
    for key in column["jsonPath"].strip(".").split("."):
        value = (value or {}).get(key)
    return value or ""


async def test_low_entropy_then_high_mismatch_set_and_clear_conditions_with_events_and_the_column(
    kube: KubernetesApiEmulator, cluster: Cluster
) -> None:
    progress: dict[str, Any] = {"step": 1, "totalSteps": 150, "entropy": 0.001, "mismatchKl": 0.0}
    server = await progress_server(progress)

    def condition(kind: str) -> dict:
        return next((c for c in cluster.status("cp").get("conditions", []) if c["type"] == kind), {})

    def streak(kind: str) -> dict:
        return cluster.status("cp").get("healthStreaks", {}).get(kind, {})

    def events(reason: str) -> list[dict]:
        return [e for e in cluster.events("cp") if e["reason"] == reason]

    try:
        async with operator_running(kube, progress_url=lambda pod, port: str(server.make_url("/progress"))):
            cluster.create_job(cartpole_job(health={"windowSteps": 2, "mismatchKlThreshold": 0.05}))
            await eventually(lambda: set(cluster.pods("cp")) == CARTPOLE_PODS)
            cluster.run_all("cp")
            await eventually(lambda: streak("EntropyCollapsed").get("since") == 1, what="step 1 looked at")
            assert condition("EntropyCollapsed") == {} and health_column(cluster.job("cp")) == ""

            progress.update(step=2, entropy=0.002)
            await eventually(lambda: condition("EntropyCollapsed").get("status") == "True", what="EntropyCollapsed")
            assert condition("EntropyCollapsed")["reason"] == "EntropyBelowFloor"
            assert condition("EntropyCollapsed")["message"] == (
                "policy entropy 0.002 at step 2, below spec.health.entropyFloor (0.01) for 2 steps (since step 1)"
            )
            assert cluster.status("cp")["progress"]["entropy"] == 0.002
            assert health_column(cluster.job("cp")) == "EntropyCollapsed"
            await eventually(lambda: events("EntropyBelowFloor"), what="Warning Event")
            assert events("EntropyBelowFloor")[0]["type"] == "Warning"
            assert cluster.phase("cp") == "Running"  # health conditions report; they never stop the job

            progress.update(step=3, entropy=0.4, mismatchKl=0.2)
            await eventually(lambda: condition("EntropyCollapsed").get("status") == "False", what="recovered")
            assert condition("EntropyCollapsed")["reason"] == "Recovered"
            assert (
                "policy entropy 0.4 is back above spec.health.entropyFloor (0.01) at step 3"
                in (condition("EntropyCollapsed")["message"])
            )
            progress.update(step=4, mismatchKl=0.3)
            await eventually(lambda: condition("MismatchHigh").get("status") == "True", what="MismatchHigh")
            assert condition("MismatchHigh")["message"] == (
                "rollout/trainer mismatch KL 0.3 at step 4, above spec.health.mismatchKlThreshold (0.05) "
                "for 2 steps (since step 3)"
            )
            assert health_column(cluster.job("cp")) == "MismatchHigh"
            await eventually(lambda: events("MismatchAboveThreshold"), what="mismatch Event")
            assert len(events("EntropyBelowFloor")) == 1  # one Event per transition, however often it is read
            assert [e["type"] for e in events("Recovered")] == ["Normal"]
    finally:
        await server.close()


async def test_an_actor_that_diverged_fails_the_job_with_its_message_and_is_not_restarted(
    kube: KubernetesApiEmulator, cluster: Cluster
) -> None:
    async with operator_running(kube):
        await start_cartpole(cluster)
        uid = cluster.uid("cp-actor-0")
        terminated = {"exitCode": EXIT_DIVERGED, "reason": "Error", "message": DIVERGED}
        kube.patch_status(
            PODS,
            NS,
            "cp-actor-0",
            {
                "phase": "Failed",
                "conditions": [{"type": "Ready", "status": "False"}],
                "containerStatuses": [{"name": "main", "ready": False, "state": {"terminated": terminated}}],
            },
        )
        await eventually(lambda: cluster.phase("cp") == "Failed", what="Failed")
        status = cluster.status("cp")
        failed = next(c for c in status["conditions"] if c["type"] == "Failed")
        assert failed["reason"] == "Diverged" and DIVERGED in failed["message"]
        diverged = next(c for c in status["conditions"] if c["type"] == "Diverged")
        assert diverged["status"] == "True" and diverged["reason"] == "NonFiniteUpdate"
        assert DIVERGED in diverged["message"]
        assert health_column(cluster.job("cp")) == "Diverged"
        assert status.get("restarts", 0) == 0
        await eventually(lambda: "Diverged" in cluster.reasons("cp"), what="Diverged Event")
        assert next(e for e in cluster.events("cp") if e["reason"] == "Diverged")["type"] == "Warning"
        assert "cp-actor-0" not in cluster.pods("cp") or cluster.uid("cp-actor-0") == uid  # never recreated
