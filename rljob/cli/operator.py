"""`rljob operator`: run the RLJob operator (kopf) against the current cluster."""

from __future__ import annotations

import asyncio
import logging
import secrets
from typing import Annotated

import typer

from rljob.operator.settings import SettingsError

LOG_LEVELS = ("debug", "info", "warning", "error")


def operator(
    namespace: Annotated[
        list[str] | None,
        typer.Option("--namespace", "-n", help="Serve RLJobs in this namespace (repeatable; kopf glob patterns ok)."),
    ] = None,
    all_namespaces: Annotated[bool, typer.Option("--all-namespaces", "-A", help="Serve RLJobs cluster-wide.")] = False,
    peering: Annotated[
        str | None, typer.Option(help="kopf peering name: a hot standby waits while another operator runs.")
    ] = None,
    standalone: Annotated[bool, typer.Option(help="Run without peering (the default).")] = False,
    priority: Annotated[
        int | None,
        typer.Option(
            help="Peering priority (highest live one works). Default with --peering: random, so the replicas "
            "of one Deployment differ (kopf pauses all peers that share the highest priority)."
        ),
    ] = None,
    peering_lifetime: Annotated[
        int,
        typer.Option(
            help="Seconds a peering record lives without renewal: a standby takes over at most this long after the "
            "active operator dies."
        ),
    ] = 15,
    liveness_port: Annotated[int, typer.Option(help="Port of kopf's liveness probe `/healthz`.")] = 8080,
    metrics_port: Annotated[int, typer.Option(help="Port of the Prometheus `/metrics` endpoint.")] = 9090,
    resync_seconds: Annotated[float, typer.Option(help="Reconcile every job at least this often.")] = 30.0,
    progress_seconds: Annotated[float, typer.Option(help="Pull actor progress at most this often.")] = 10.0,
    concurrent_reconciles: Annotated[
        int | None,
        typer.Option(
            help="Reconcile passes at once (default 16), handed out round robin across namespaces. More overlaps "
            "more API latency; fewer finish each pass (and a quiet namespace's next job) sooner on a busy core."
        ),
    ] = None,
    log_level: Annotated[str, typer.Option(help=f"One of {', '.join(LOG_LEVELS)}.")] = "info",
) -> None:
    """Run the operator: RLJobs become pods; status follows the pods and the actor's progress.

    Reads the ServiceAccount in a pod, the kubeconfig elsewhere. Pod defaults (images, user ids, scheduler
    names) come from RLJOB_OPERATOR_* variables (see rljob/operator/settings.py).
    """
    from kubernetes_asyncio.config import ConfigException

    from rljob.operator.app import OperatorOptions, freeze_startup_heap, registry_with_login, run_operator
    from rljob.operator.client import load_configuration
    from rljob.operator.controller import ControllerConfig
    from rljob.operator.settings import OperatorSettings

    namespaces = tuple(namespace or ())
    if all_namespaces == bool(namespaces):
        typer.secho("give --namespace NS (repeatable) or --all-namespaces, not both", fg="red", err=True)
        raise typer.Exit(2)
    if peering and standalone:
        typer.secho("--peering and --standalone exclude each other", fg="red", err=True)
        raise typer.Exit(2)
    if log_level not in LOG_LEVELS:
        typer.secho(f"--log-level must be one of {', '.join(LOG_LEVELS)} (got {log_level!r})", fg="red", err=True)
        raise typer.Exit(2)
    if concurrent_reconciles is not None and concurrent_reconciles < 1:
        typer.secho(f"--concurrent-reconciles must be at least 1 (got {concurrent_reconciles})", fg="red", err=True)
        raise typer.Exit(2)
    if peering_lifetime < 12:
        # kopf renews 5-10 s before the record runs out: a shorter lifetime would let a healthy operator lapse.
        typer.secho(f"--peering-lifetime must be at least 12 seconds (got {peering_lifetime})", fg="red", err=True)
        raise typer.Exit(2)
    for name, value in (("--resync-seconds", resync_seconds), ("--progress-seconds", progress_seconds)):
        if value <= 0:
            typer.secho(f"{name} must be positive (got {value})", fg="red", err=True)
            raise typer.Exit(2)
    try:
        settings = OperatorSettings.from_env()
    except SettingsError as exc:
        typer.secho(str(exc), fg="red", err=True)
        raise typer.Exit(1) from None
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s", force=True)
    if log_level != "debug":
        # kopf logs every handler call at info ("Handler 'rljob-changed' succeeded."): one line per job event.
        logging.getLogger("kopf.objects").setLevel(logging.WARNING)
    options = OperatorOptions(
        namespaces=namespaces,
        all_namespaces=all_namespaces,
        metrics_port=metrics_port,
        liveness_port=liveness_port,
        peering=peering,
        priority=priority if priority is not None else secrets.randbelow(2**31 - 1) + 1,
        peering_lifetime=peering_lifetime,
        controller=ControllerConfig(
            resync_seconds=resync_seconds,
            progress_seconds=progress_seconds,
            **({"max_concurrent_reconciles": concurrent_reconciles} if concurrent_reconciles else {}),
        ),
        settings=settings,
    )

    async def serve() -> str | None:
        """Run until stopped; the reason when there are no credentials to run with."""
        try:
            configuration = await load_configuration()
        except ConfigException as exc:
            return str(exc)
        freeze_startup_heap()  # started: what exists now lives as long as the process
        await run_operator(options, configuration, registry_with_login())
        return None

    missing = asyncio.run(serve())
    if missing is not None:
        # Neither a ServiceAccount (in a pod) nor a usable kubeconfig: say what to provide, not a traceback.
        typer.secho(
            f"no Kubernetes credentials: run in a pod with a ServiceAccount or set KUBECONFIG ({missing})",
            fg="red",
            err=True,
        )
        raise typer.Exit(1)
