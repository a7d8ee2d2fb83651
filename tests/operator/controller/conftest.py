"""Fixtures for the controller tests: the API emulator on a local port, the real operator running
against it, and the parts of a cluster the emulator lacks (kubelet, scheduler, garbage collector),
played explicitly by `Cluster`.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import kmock
import kopf
import pytest
import yaml
from kubernetes_asyncio.client import Configuration

from rljob.api.crd import build_crd
from rljob.operator import handlers
from rljob.operator.app import OperatorOptions, run_operator
from rljob.operator.controller import ControllerConfig
from rljob.operator.metrics import OperatorMetrics
from rljob.operator.progress import ProgressReader, ProgressUrl
from tests.operator.controller.emulator import KubernetesApiEmulator

RLJOBS = kmock.resource("rljob.io", "v1alpha1", "rljobs")
PODS = kmock.resource("", "v1", "pods")
CONFIGMAPS = kmock.resource("", "v1", "configmaps")
SECRETS = kmock.resource("", "v1", "secrets")
SERVICES = kmock.resource("", "v1", "services")
EVENTS = kmock.resource("", "v1", "events")
NETWORK_POLICIES = kmock.resource("networking.k8s.io", "v1", "networkpolicies")
CLAIMS = kmock.resource("", "v1", "persistentvolumeclaims")
STORAGE_CLASSES = kmock.resource("storage.k8s.io", "v1", "storageclasses")
SCALE_PATH = ("spec", "roles", "rollout", "replicas")

RESOURCES: dict[str, dict[str, Any]] = {
    "rljob.io/v1alpha1/rljobs": {"kind": "RLJob", "namespaced": True, "subresources": {"status", "scale"}},
    "v1/pods": {"kind": "Pod", "namespaced": True, "subresources": {"status"}},
    "v1/services": {"kind": "Service", "namespaced": True},
    "v1/configmaps": {"kind": "ConfigMap", "namespaced": True},
    "v1/secrets": {"kind": "Secret", "namespaced": True},
    "v1/events": {"kind": "Event", "namespaced": True},
    "v1/resourcequotas": {"kind": "ResourceQuota", "namespaced": True},
    "v1/limitranges": {"kind": "LimitRange", "namespaced": True},
    "v1/persistentvolumeclaims": {"kind": "PersistentVolumeClaim", "namespaced": True},
    "storage.k8s.io/v1/storageclasses": {"kind": "StorageClass", "namespaced": False},
    "v1/namespaces": {"kind": "Namespace", "namespaced": False},
    "kopf.dev/v1/kopfpeerings": {"kind": "KopfPeering", "namespaced": True},
    "kopf.dev/v1/clusterkopfpeerings": {"kind": "ClusterKopfPeering", "namespaced": False},
    "scheduling.volcano.sh/v1beta1/podgroups": {"kind": "PodGroup", "namespaced": True},
    "scheduling.x-k8s.io/v1alpha1/podgroups": {"kind": "PodGroup", "namespaced": True},
    "networking.k8s.io/v1/networkpolicies": {"kind": "NetworkPolicy", "namespaced": True},
}


def rljob_schema() -> dict[str, Any]:
    """The openAPIV3Schema of the RLJob CRD, as the chart installs it."""
    return build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


KUBELET_SECONDS = 0.05
"""The kubelet stand-in stops a deleted pod's containers this long after the delete (unless a test holds it)."""
GC_SECONDS = 0.05
"""The garbage collector deletes an object's dependents this long after the object went."""


def new_emulator(**kwargs: Any) -> KubernetesApiEmulator:
    """The realistic emulator; by default a kubelet finishes terminating pods and a garbage collector runs, each
    a moment after the delete (pass `kubelet_seconds=None` / `gc_seconds=None` to play them by hand)."""
    kwargs.setdefault("kubelet_seconds", KUBELET_SECONDS)
    kwargs.setdefault("gc_seconds", GC_SECONDS)
    emulator = KubernetesApiEmulator(
        status_subresources={RLJOBS, PODS},
        scale_subresources={RLJOBS: SCALE_PATH},
        schemas={RLJOBS: ("RLJob", "rljob.io", rljob_schema())},
        **kwargs,
    )
    for key, info in RESOURCES.items():
        emulator.resources[key] = kmock.ResourceInfo(
            verbs={"list", "watch", "get", "create", "patch", "delete"}, **info
        )
    return emulator


@pytest.fixture()
async def kube() -> AsyncIterator[KubernetesApiEmulator]:
    """A realistic API server stand-in on 127.0.0.1 (its URL is `kube.url`)."""
    emulator = new_emulator()
    async with emulator, kmock.Server(emulator):
        yield emulator
    emulator.stop_timers()


NS = "ns"
EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
FAST = ControllerConfig(
    resync_seconds=2.0,
    live_read_seconds=2.0,
    progress_seconds=0.2,
    expectation_seconds=3.0,
    error_backoff_seconds=0.2,
    watch_retry_seconds=0.1,
    peering_poll_seconds=0.2,
)


def cartpole_job(name: str = "cp", namespace: str = NS, **spec: Any) -> dict[str, Any]:
    """The CartPole example (1 actor, 1 rollout, 2 env pods) with spec overrides merged in."""
    job = yaml.safe_load((EXAMPLES / "cartpole-ppo.yaml").read_text())
    job["metadata"] = {"name": name, "namespace": namespace}
    job["spec"]["roles"]["env"]["replicas"] = 2  # whatever the example is tuned to
    for key, value in spec.items():
        if isinstance(value, dict) and isinstance(job["spec"].get(key), dict):
            job["spec"][key] = {**job["spec"][key], **value}
        else:
            job["spec"][key] = value
    return job


CARTPOLE_PODS = {"cp-actor-0", "cp-rollout-0", "cp-env-0", "cp-env-1"}
"""The pods of `cartpole_job()` under its default name."""


async def start_cartpole(cluster: Cluster) -> None:
    """Create `cartpole_job()`, play the kubelet for its pods, and wait until the job is Running."""
    cluster.create_job(cartpole_job())
    await eventually(lambda: set(cluster.pods("cp")) == CARTPOLE_PODS, what="pods")
    cluster.run_all("cp")
    await eventually(lambda: cluster.phase("cp") == "Running", what="Running")


def arithmetic_job(name: str = "ar") -> dict[str, Any]:
    """The tiny GRPO arithmetic example (1 actor, 1 rollout, 1 reward pod): an llm task."""
    job = yaml.safe_load((EXAMPLES / "grpo-tiny-arithmetic.yaml").read_text())
    job["metadata"] = {"name": name, "namespace": NS}
    return job


def code_job(name: str = "gc") -> dict[str, Any]:
    """The tiny code example (1 actor, 1 rollout, 1 reward pod): code_exec rewards, sandbox network off."""
    job = yaml.safe_load((EXAMPLES / "grpo-tiny-code.yaml").read_text())
    job["metadata"] = {"name": name, "namespace": NS}
    return job


def kopf_test_settings() -> kopf.OperatorSettings:
    settings = kopf.OperatorSettings()
    settings.scanning.disabled = True
    settings.posting.enabled = False
    settings.watching.reconnect_backoff = 0.1
    settings.queueing.exit_timeout = 0.5
    settings.queueing.idle_timeout = 0.5
    settings.networking.request_timeout = 10
    settings.persistence.diffbase_storage = handlers.NoDiffBase()
    return settings


@dataclass
class RunningOperator:
    metrics: OperatorMetrics
    task: asyncio.Task[None]


@contextlib.asynccontextmanager
async def operator_running(
    kube: KubernetesApiEmulator,
    progress_url: ProgressUrl | None = None,
    config: ControllerConfig = FAST,
    metrics_port: int | None = None,
    liveness_port: int | None = None,
    namespaces: tuple[str, ...] = (NS,),
    all_namespaces: bool = False,
    peering: str | None = None,
    priority: int = 0,
) -> Any:
    """Run the real operator (kopf + controller) against the emulator for the body of a `with`.

    Enter it from the test body, not from an async fixture: kopf cancels tasks created after it started.
    """
    registry = kopf.OperatorRegistry()
    handlers.register(registry)
    url = str(kube.url).rstrip("/")

    @kopf.on.login(registry=registry)
    def login(**_: Any) -> kopf.ConnectionInfo:
        return kopf.ConnectionInfo(server=url, insecure=True)

    stop = asyncio.Event()
    metrics = OperatorMetrics()
    options = OperatorOptions(
        namespaces=() if all_namespaces else namespaces,
        all_namespaces=all_namespaces,
        metrics_port=metrics_port,
        liveness_port=liveness_port,
        peering=peering,
        priority=priority,
        controller=config,
    )
    progress = ProgressReader(url_for=progress_url) if progress_url else ProgressReader(url_for=lambda pod, port: None)
    task = asyncio.create_task(
        run_operator(
            options,
            Configuration(host=url),
            registry,
            progress=progress,
            settings=kopf_test_settings(),
            stop_flag=stop,
            metrics=metrics,
        )
    )
    try:
        yield RunningOperator(metrics, task)
    finally:
        stop.set()
        done, _ = await asyncio.wait([task], timeout=10)
        if not done:
            raise AssertionError(f"the operator did not stop in 10 s; still running:\n{_task_stacks()}")
        task.result()


def _task_stacks() -> str:
    """Where each pending task waits: what a shutdown that hangs is stuck on."""
    lines = []
    for pending in asyncio.all_tasks():
        frames = pending.get_stack(limit=3)
        where = " <- ".join(f"{f.f_code.co_name}:{f.f_lineno}" for f in frames) or "(not started)"
        lines.append(f"  {pending.get_name()}: {where}")
    return "\n".join(sorted(lines))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


async def eventually(check: Callable[[], Any], timeout: float = 30.0, what: str = "") -> Any:
    """Poll `check` until it returns something truthy (its value is returned) or fail after `timeout` (generous: a
    loaded 2-core CI machine once took over 10 s for what takes 1 s alone; a passing check returns at once)."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = check()
        except (KeyError, TypeError, AssertionError) as exc:
            last = exc
        else:
            if last:
                return last
        await asyncio.sleep(0.05)
    raise AssertionError(f"not reached in {timeout}s: {what or check}; last: {last!r}")


# --- the tests play kubelet and scheduler -----------------------------------------------------------


class Cluster:
    """Kubelet, scheduler and garbage collector for the emulator, driven explicitly by the tests."""

    def __init__(self, kube: KubernetesApiEmulator, namespace: str = NS) -> None:
        self.kube = kube
        self.namespace = namespace

    def job(self, name: str) -> dict[str, Any] | None:
        return self.kube.read_object(RLJOBS, self.namespace, name)

    def status(self, name: str) -> dict[str, Any]:
        return (self.job(name) or {}).get("status") or {}

    def phase(self, name: str) -> str | None:
        return self.status(name).get("phase")

    def pods(self, job: str) -> dict[str, dict[str, Any]]:
        return {p["metadata"]["name"]: p for p in self.kube.list_objects(PODS, self.namespace, f"rljob.io/job={job}")}

    def uid(self, pod: str) -> str:
        return self.kube.read_object(PODS, self.namespace, pod)["metadata"]["uid"]

    def events(self, job: str) -> list[dict[str, Any]]:
        events = self.kube.list_objects(EVENTS, self.namespace)
        return [e for e in events if e["involvedObject"]["name"] == job]

    def reasons(self, job: str) -> list[str]:
        return [e["reason"] for e in self.events(job)]

    def create_job(self, manifest: dict[str, Any]) -> dict[str, Any]:
        return self.kube.create_object(RLJOBS, self.namespace, manifest)

    def patch_job(self, name: str, patch: dict[str, Any]) -> dict[str, Any]:
        return self.kube.patch_object(RLJOBS, self.namespace, name, patch)

    def run(self, pod: str, ready: bool = True, ip: str = "127.0.0.1", node: str = "node-1") -> None:
        self.kube.patch_object(PODS, self.namespace, pod, {"spec": {"nodeName": node}})
        self.kube.patch_status(
            PODS,
            self.namespace,
            pod,
            {
                "phase": "Running",
                "podIP": ip,
                "conditions": [
                    {"type": "PodScheduled", "status": "True"},
                    {"type": "Ready", "status": "True" if ready else "False"},
                ],
                "containerStatuses": [{"name": "main", "ready": ready, "state": {"running": {}}}],
            },
        )

    def run_all(self, job: str) -> None:
        for name in self.pods(job):
            self.run(name)

    def exit(self, pod: str, code: int, reason: str = "", message: str = "") -> None:
        """The pod's container ended with `code`; `message`: what it left in its termination-log."""
        terminated = {"exitCode": code, "reason": reason or ("Completed" if code == 0 else "Error")}
        if message:
            terminated["message"] = message
        self.kube.patch_status(
            PODS,
            self.namespace,
            pod,
            {
                "phase": "Succeeded" if code == 0 else "Failed",
                "conditions": [{"type": "Ready", "status": "False"}],
                "containerStatuses": [{"name": "main", "ready": False, "state": {"terminated": terminated}}],
            },
        )

    def evict(self, pod: str) -> None:
        self.kube.patch_status(
            PODS,
            self.namespace,
            pod,
            {
                "phase": "Failed",
                "reason": "Evicted",
                "message": "The node was low on resource: memory.",
                "conditions": [{"type": "DisruptionTarget", "status": "True", "reason": "TerminationByKubelet"}],
            },
        )

    def unschedulable(self, pod: str, message: str) -> None:
        self.kube.patch_status(
            PODS,
            self.namespace,
            pod,
            {
                "phase": "Pending",
                "conditions": [
                    {"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": message}
                ],
            },
        )

    def image_pull_failure(self, pod: str) -> None:
        self.kube.patch_object(PODS, self.namespace, pod, {"spec": {"nodeName": "node-1"}})
        waiting = {"reason": "ImagePullBackOff", "message": 'Back-off pulling image "ghcr.io/rljob/nope:1"'}
        self.kube.patch_status(
            PODS,
            self.namespace,
            pod,
            {
                "phase": "Pending",
                "conditions": [{"type": "PodScheduled", "status": "True"}],
                "containerStatuses": [{"name": "main", "image": "ghcr.io/rljob/nope:1", "state": {"waiting": waiting}}],
            },
        )

    def delete_job(self, name: str) -> None:
        """`kubectl delete rljob NAME` (background propagation): the garbage collector removes the children
        afterwards, on its own time."""
        self.kube.delete_object(RLJOBS, self.namespace, name)


@pytest.fixture()
def cluster(kube: KubernetesApiEmulator) -> Cluster:
    return Cluster(kube)


async def progress_server(progress: dict[str, Any]) -> Any:
    """A stand-in for actor replica 0's `GET /progress`, answering `progress` as it is at each request."""
    from aiohttp import web
    from aiohttp.test_utils import TestServer

    async def serve(request: web.Request) -> web.Response:
        return web.json_response(progress)

    app = web.Application()
    app.router.add_get("/progress", serve)
    server = TestServer(app)
    await server.start_server()
    return server
