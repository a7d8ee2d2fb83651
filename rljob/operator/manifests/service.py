"""The headless Service that gives every pod of a job a stable DNS name (`<pod>.<job>`)."""

from __future__ import annotations

from typing import Any

from rljob.api import RLJob
from rljob.operator.manifests.pods import COLLOCATED_PORT_NAMES
from rljob.operator.naming import child_metadata, job_selector, service_name
from rljob.operator.settings import OperatorSettings
from rljob.runtime.wire.identity import DATA_PORT, MASTER_PORT, SYNC_PORT


def service_ports(job: RLJob) -> list[dict[str, Any]]:
    """Named ports of the job's pods: data plane, actor rendezvous and weight sync, HTTP metrics, and in a
    collocated job the ports of the rollout in the actor pod."""
    ports = [
        {"name": "data", "port": DATA_PORT, "targetPort": DATA_PORT, "protocol": "TCP"},
        {"name": "dist", "port": MASTER_PORT, "targetPort": MASTER_PORT, "protocol": "TCP"},
        {"name": "sync", "port": SYNC_PORT, "targetPort": SYNC_PORT, "protocol": "TCP"},
    ]
    metrics = job.spec.logging.prometheus_port
    if metrics not in (DATA_PORT, MASTER_PORT, SYNC_PORT):
        ports.append({"name": "metrics", "port": metrics, "targetPort": metrics, "protocol": "TCP"})
    if job.spec.roles.rollout.collocated:
        for name, port in COLLOCATED_PORT_NAMES.items():
            ports.append({"name": name, "port": port, "targetPort": port, "protocol": "TCP"})
    return ports


def build_service(job: RLJob, settings: OperatorSettings) -> dict[str, Any]:
    """Headless (no cluster IP) and publishing not-ready addresses: peers must resolve each other while
    they start, before any of them reports ready (the actor group rendezvous needs every rank's name)."""
    del settings
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": child_metadata(job, service_name(job), "service"),
        "spec": {
            "clusterIP": "None",
            "selector": job_selector(job),
            "publishNotReadyAddresses": True,
            "ports": service_ports(job),
        },
    }
