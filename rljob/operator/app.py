"""Assembles and runs the operator: kopf with rljob's handlers, the controller, liveness and metrics."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
from dataclasses import dataclass, field
from typing import Any

import kopf
from aiohttp import web
from kubernetes_asyncio.client import Configuration
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from rljob.operator import handlers
from rljob.operator.client import KubeClient
from rljob.operator.controller import Controller, ControllerConfig
from rljob.operator.metrics import OperatorMetrics
from rljob.operator.peering import PeeringGate, new_identity
from rljob.operator.progress import ProgressReader
from rljob.operator.settings import OperatorSettings

logger = logging.getLogger(__name__)


@dataclass
class OperatorOptions:
    namespaces: tuple[str, ...] = ()
    """Namespaces to serve (kopf patterns allowed); empty with `all_namespaces` for the whole cluster."""
    all_namespaces: bool = False
    metrics_port: int | None = 8081
    """Prometheus `/metrics`; None: no metrics server."""
    liveness_port: int | None = 8080
    """kopf's liveness probe `/healthz`; None: no probe."""
    peering: str | None = None
    """kopf peering name for a hot standby; None runs standalone."""
    priority: int = 0
    """Peering priority: the live operator with the highest one works, the others stand by. kopf pauses
    every operator when live peers share the highest priority, so replicas must differ."""
    peering_lifetime: int = 15
    """Seconds an operator's peering record stays live without a renewal: a standby takes over this long after
    the active operator died at the latest (kopf renews 5-10 s before it runs out). 15: controller-runtime's
    leader-election lease; kopf's own default is 60."""
    controller: ControllerConfig = field(default_factory=ControllerConfig)
    settings: OperatorSettings = field(default_factory=OperatorSettings)


def freeze_startup_heap() -> None:
    """Put what the operator's process holds once it has started (kopf's, kubernetes_asyncio's and pydantic's modules
    and classes: most of its objects) out of the cycle collector's way, and collect less often. A full collection
    walks every tracked object: with Python's default thresholds the collector took 15-20% of the operator's CPU
    time at 100 jobs, mostly in those walks; after this, under 10%. For the process entrypoint only: what is frozen is
    never collected as a cycle (it lives as long as the process anyway)."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(10_000, 10, 10)  # young collections every 10,000 allocations instead of 700


def registry_with_login() -> kopf.OperatorRegistry:
    """The handlers, plus a login from the same source as the controller's client (kubernetes_asyncio:
    the ServiceAccount in a pod, else the kubeconfig, exec credential plugins included)."""
    registry = kopf.OperatorRegistry()
    handlers.register(registry)

    @kopf.on.login(registry=registry)
    async def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
        return await kopf.login_via_async_client(**kwargs)

    return registry


def kopf_settings(options: OperatorOptions) -> kopf.OperatorSettings:
    settings = kopf.OperatorSettings()
    settings.posting.enabled = False  # the controller posts its own Events on transitions
    settings.watching.server_timeout = 300
    settings.watching.client_timeout = 330
    settings.persistence.diffbase_storage = handlers.NoDiffBase()
    settings.peering.standalone = options.peering is None
    if options.peering is not None:
        settings.peering.name = options.peering
        settings.peering.priority = options.priority
        settings.peering.lifetime = options.peering_lifetime
        settings.peering.clusterwide = options.all_namespaces
    return settings


async def serve_metrics(metrics: OperatorMetrics, port: int) -> web.AppRunner:
    async def scrape(_: web.Request) -> web.Response:
        return web.Response(body=generate_latest(metrics.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    app = web.Application()
    app.router.add_get("/metrics", scrape)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "0.0.0.0", port).start()
    return runner


async def run_operator(
    options: OperatorOptions,
    configuration: Configuration,
    registry: kopf.OperatorRegistry,
    progress: ProgressReader | None = None,
    settings: kopf.OperatorSettings | None = None,
    stop_flag: asyncio.Event | None = None,
    metrics: OperatorMetrics | None = None,
) -> None:
    """Run until `stop_flag` is set (or a signal stops kopf); cleans up the controller's workers."""
    metrics = metrics or OperatorMetrics()
    client = KubeClient(configuration, metrics.observe_call)
    controller = Controller(client, options.settings, metrics, progress, options.controller)
    identity = None
    peering_task = None
    if options.peering is not None:
        # kopf runs with this identity too, so the gate finds this operator's own record and skips it.
        identity = new_identity()
        controller.peering = PeeringGate(
            client,
            options.peering,
            identity,
            options.priority,
            clusterwide=options.all_namespaces,
            poll_seconds=options.controller.peering_poll_seconds,
        )
        metrics.standby.set(1)  # until the first read of the peering objects says otherwise
        peering_task = asyncio.create_task(controller.watch_peering(options.namespaces), name="rljob peering gate")
        controller.peering_task = peering_task
    controller.follow_pods(options.namespaces, options.all_namespaces)
    runner = await serve_metrics(metrics, options.metrics_port) if options.metrics_port is not None else None
    liveness = f"http://0.0.0.0:{options.liveness_port}/healthz" if options.liveness_port is not None else None
    try:
        await kopf.operator(
            registry=registry,
            settings=settings or kopf_settings(options),
            clusterwide=options.all_namespaces,
            namespaces=list(options.namespaces),
            liveness_endpoint=liveness,
            memo=kopf.Memo(controller=controller),
            stop_flag=stop_flag,
            standalone=options.peering is None,
            peering_name=options.peering,
            priority=options.priority if options.peering is not None else None,
            identity=identity,  # type: ignore[arg-type]
        )
    finally:
        if peering_task is not None:
            peering_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await peering_task
        await controller.stop()
        if runner is not None:
            await runner.cleanup()
