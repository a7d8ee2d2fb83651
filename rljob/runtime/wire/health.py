"""Every role's HTTP endpoint (R1's `RoleHTTPServer`) plus a few role-specific Prometheus gauges."""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Gauge

from rljob.runtime.records.metrics import RoleMetrics
from rljob.runtime.wire.context import RoleContext
from rljob.runtime.wire.identity import COLLOCATED_ROLLOUT_HEALTH_ENV
from rljob.runtime.wire.role_http import RoleHTTPServer, answers_ready


class RoleHealth:
    """`/healthz` (after `ready()`), `/livez` (the context's heartbeat against the role's
    `probes.livenessTimeoutSeconds`), `/metrics`; `counters` are read at scrape time, e.g. env steps served.

    In a collocated actor pod (COLLOCATED_ROLLOUT_HEALTH_ENV set) `/healthz` also needs the rollout beside the
    actor to answer its own: the pod is not Ready while that rollout loads, restarts or crash-loops."""

    def __init__(self, context: RoleContext, counters: dict[str, Callable[[], float]]) -> None:
        identity = context.identity
        self.registry = CollectorRegistry()
        self.metrics = RoleMetrics(identity.job, identity.role, identity.replica, registry=self.registry)
        self.counters = counters
        self._live: dict[str, Gauge] = {}
        self.heartbeat = context.heartbeat
        self.server = RoleHTTPServer(identity.metrics_port, self.registry)
        self.server.watch_liveness(self.heartbeat, context.job.spec.roles.liveness_timeout(identity.role))
        self.server.start()
        rollout = os.environ.get(COLLOCATED_ROLLOUT_HEALTH_ENV)
        if rollout:
            self.server.also_ready_when(functools.partial(answers_ready, rollout), f"the rollout beside it ({rollout})")
        self._register()

    def _register(self) -> None:
        for name, read in self.counters.items():
            if name not in self._live:
                gauge = Gauge(f"rljob_{name}", f"{name.replace('_', ' ')} (this process)", registry=self.registry)
                gauge.set_function(lambda read=read: float(read()))
                self._live[name] = gauge

    def ready(self) -> None:
        """Serving: `/healthz` answers ready, and the main loop's heartbeat starts (the startup probe passes)."""
        self._register()
        self.heartbeat.beat()
        self.server.mark_ready()

    def close(self) -> None:
        self.server.stop()


def wait_for_collocated_rollout(context: RoleContext, poll_s: float = 1.0, say_every_s: float = 60.0) -> None:
    """Before a collocated actor puts its model on the GPU: wait until the rollout beside it answers ready, which it
    does once its engine holds its memory (COLLOCATED_ROLLOUT_HEALTH_ENV names it; nothing to wait for without).

    vLLM takes `rollout.vllm.gpuMemoryUtilization` of the GPU's memory when it starts, refuses to start when less
    than that is free, and profiles its own use assuming no other process changes its use meanwhile: an actor
    loading at the same time makes which of the two fails a matter of timing. Started one after the other, the
    engine takes its share and the actor what is left.
    InterruptedError when the role is told to stop meanwhile (the rollout may never start)."""
    url = os.environ.get(COLLOCATED_ROLLOUT_HEALTH_ENV)
    if not url:
        return
    started = said = time.monotonic()
    while not answers_ready(url):
        if said == started or time.monotonic() - said >= say_every_s:
            waited = time.monotonic() - started
            context.log.info(
                "collocated: waiting for the rollout beside this actor to start its engine before taking GPU memory "
                "(%s, %.0fs so far)",
                url,
                waited,
            )
            said = time.monotonic()
        if context.stop.wait(poll_s):
            raise InterruptedError("stopped while waiting for the collocated rollout to start")
