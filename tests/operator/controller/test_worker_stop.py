"""Stopping a job's worker (a DELETED event, a recreated namesake, the operator shutting down) always ends it."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from rljob.operator.controller import ControllerConfig, JobWorker


async def test_a_worker_woken_in_the_same_turn_as_its_stop_still_stops() -> None:
    passes = 0

    async def one_pass() -> float:
        nonlocal passes
        passes += 1
        return 60.0

    controller = SimpleNamespace(config=ControllerConfig(coalesce_seconds=0.0))
    worker = JobWorker(controller, ("ns", "job"), {"metadata": {"name": "job", "namespace": "ns"}})  # type: ignore[arg-type]
    worker.reconcile_safely = one_pass  # type: ignore[method-assign]
    worker.start()
    for _ in range(3):
        await asyncio.sleep(0)  # the worker has passed once and waits for its next wake
    assert passes == 1
    worker.nudge()  # a pod event, and in the same breath the job's deletion stops the worker
    await asyncio.wait_for(worker.stop(), timeout=5)
    assert worker.task is not None and worker.task.done()
    assert passes == 1
