"""Operator at scale: 200 RLJobs x 8 pods against the API emulator, the operator run as `rljob operator`.

The emulator (tests/operator/controller/emulator.py) serves on localhost in this process and plays
kubelet: once a job's pods exist, they are marked scheduled, running and ready. The operator runs as a
subprocess exactly as in a cluster (`rljob operator -n bench`, kubeconfig pointing at the emulator),
so its memory is its own and every API request it makes is an HTTP request the emulator counts.

Figures (benchmarks/results/operator_scale.json):
- create -> all-children latency: from the RLJob's creation to its last pod's creation, p50/p99;
- create -> Running latency (the kubelet here marks pods ready as soon as they exist);
- API requests per job, by verb, until every job is Running;
- operator peak RSS (ru_maxrss of the exited operator process).

Run: `make bench-operator` (or `.venv/bin/python benchmarks/operator_scale.py --jobs 200`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp
import kmock
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rljob.api.crd import build_crd  # noqa: E402
from tests.operator.controller.conftest import PODS, RESOURCES, RLJOBS, SCALE_PATH  # noqa: E402
from tests.operator.controller.emulator import KubernetesApiEmulator  # noqa: E402

NS = "bench"
CRDS = kmock.resource("apiextensions.k8s.io", "v1", "customresourcedefinitions")
NAMESPACES = kmock.resource("", "v1", "namespaces")


class TimedEmulator(KubernetesApiEmulator):
    """Records when each object was created (by the operator or by this script)."""

    created_at: dict[tuple[str, str], float]

    def create_object(self, res: Any, namespace: str | None, body: Any) -> dict[str, Any]:
        raw = super().create_object(res, namespace, body)
        self.created_at[(res.plural, raw["metadata"]["name"])] = time.monotonic()
        return raw

    def phase_of(self, job: str) -> str | None:
        """The job's phase, read without copying the object."""
        obj = self.objects[RLJOBS, NS, job]
        return None if obj.deleted else (obj.raw.get("status") or {}).get("phase")


def job_manifest(name: str) -> dict[str, Any]:
    job = yaml.safe_load((ROOT / "examples" / "cartpole-ppo.yaml").read_text())
    job["metadata"] = {"name": name, "namespace": NS}
    job["spec"]["roles"] = {"actor": {"replicas": 2}, "rollout": {"replicas": 2}, "env": {"replicas": 4}}
    return job


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def play_kubelet(kube: TimedEmulator, seen_running: set[str]) -> None:
    """Every pod created since the last call gets a node, then Running and Ready."""
    new = [pod for (plural, pod) in list(kube.created_at) if plural == "pods" and pod not in seen_running]
    for name in new:
        seen_running.add(name)
        kube.patch_object(PODS, NS, name, {"spec": {"nodeName": "node-1"}})
        kube.patch_status(
            PODS,
            NS,
            name,
            {
                "phase": "Running",
                "conditions": [{"type": "PodScheduled", "status": "True"}, {"type": "Ready", "status": "True"}],
            },
        )


async def wait_http(url: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < deadline:
            try:
                async with session.get(url) as response:
                    if response.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.1)
    raise TimeoutError(f"{url} did not answer in {timeout}s")


async def run(jobs: int, pods_per_job: int, timeout: float) -> dict[str, Any]:
    load_at_start = round(os.getloadavg()[0], 2)
    kube = TimedEmulator(
        status_subresources={RLJOBS, PODS}, scale_subresources={RLJOBS: SCALE_PATH}, keep_history=False
    )
    kube.created_at = {}
    for key, info in RESOURCES.items():
        kube.resources[key] = kmock.ResourceInfo(verbs={"list", "watch", "get", "create", "patch", "delete"}, **info)
    kube.resources["apiextensions.k8s.io/v1/customresourcedefinitions"] = kmock.ResourceInfo(
        kind="CustomResourceDefinition", namespaced=False, verbs={"list", "watch", "get"}
    )
    async with kube, kmock.Server(kube) as server:
        kube.create_object(CRDS, None, build_crd())
        kube.create_object(NAMESPACES, None, {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NS}})
        with tempfile.TemporaryDirectory() as tmp:
            kubeconfig = Path(tmp) / "kubeconfig"
            kubeconfig.write_text(
                yaml.safe_dump(
                    {
                        "apiVersion": "v1",
                        "kind": "Config",
                        "clusters": [{"name": "emulator", "cluster": {"server": str(server.url).rstrip("/")}}],
                        "users": [{"name": "bench", "user": {"token": "bench"}}],
                        "contexts": [{"name": "bench", "context": {"cluster": "emulator", "user": "bench"}}],
                        "current-context": "bench",
                    }
                )
            )
            liveness_port, metrics_port = 18080 + os.getpid() % 1000, 19090 + os.getpid() % 1000
            env = dict(os.environ, KUBECONFIG=str(kubeconfig))
            # RLJOB_BENCH_PROFILE=file.prof runs the operator under cProfile (for finding hot spots).
            profile = os.environ.get("RLJOB_BENCH_PROFILE")
            launcher = [sys.executable, "-m", "cProfile", "-o", profile] if profile else [sys.executable]
            operator = subprocess.Popen(
                [
                    *launcher,
                    "-m",
                    "rljob.cli.main",
                    "operator",
                    f"--namespace={NS}",
                    f"--liveness-port={liveness_port}",
                    f"--metrics-port={metrics_port}",
                    "--log-level=warning",
                ],
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=open(Path(tmp) / "operator.log", "w"),  # noqa: SIM115
            )
            try:
                await wait_http(f"http://127.0.0.1:{liveness_port}/healthz", 60)
                requests_before = len(list(kube))
                created: dict[str, float] = {}
                started = time.monotonic()
                for i in range(jobs):
                    name = f"job-{i:03d}"
                    kube.create_object(RLJOBS, NS, job_manifest(name))
                    created[name] = time.monotonic()
                    await asyncio.sleep(0)
                seen_running: set[str] = set()
                running_at: dict[str, float] = {}
                deadline = started + timeout
                while len(running_at) < jobs and time.monotonic() < deadline:
                    play_kubelet(kube, seen_running)
                    for name in created:
                        if name not in running_at and kube.phase_of(name) == "Running":
                            running_at[name] = time.monotonic()
                    await asyncio.sleep(0.05)
                elapsed = time.monotonic() - started
                operator_requests = list(kube)[requests_before:]
            finally:
                operator.send_signal(signal.SIGTERM)
                try:
                    operator.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    operator.kill()
                    operator.wait()
                log_tail = (Path(tmp) / "operator.log").read_text()[-2000:]
    children_latency = []
    for name, t0 in created.items():
        pods = [t for (plural, pod), t in kube.created_at.items() if plural == "pods" and pod.startswith(name + "-")]
        if len(pods) == pods_per_job:
            children_latency.append(max(pods) - t0)
    running_latency = [running_at[n] - created[n] for n in running_at]
    verbs = Counter(
        f"{r.method.value} {'status' if r.subresource == 'status' else r.resource.plural}"
        for r in operator_requests
        if r.resource is not None
    )
    peak_rss_mib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    return {
        "benchmark": "operator_scale",
        "jobs": jobs,
        "pods_per_job": pods_per_job,
        "jobs_with_all_children": len(children_latency),
        "jobs_running": len(running_at),
        "create_to_all_children_seconds": {
            "p50": round(statistics.median(children_latency), 3) if children_latency else None,
            "p99": round(percentile(children_latency, 99), 3) if children_latency else None,
            "max": round(max(children_latency), 3) if children_latency else None,
        },
        "create_to_running_seconds": {
            "p50": round(statistics.median(running_latency), 3) if running_latency else None,
            "p99": round(percentile(running_latency, 99), 3) if running_latency else None,
        },
        "all_running_after_seconds": round(elapsed, 2),
        "api_requests_per_job": round(len(operator_requests) / jobs, 2),
        "api_requests_per_job_by_kind": {k: round(v / jobs, 2) for k, v in sorted(verbs.items())},
        "operator_peak_rss_mib": round(peak_rss_mib, 1),
        "operator_exit_code": operator.returncode,
        "operator_log_tail": log_tail if len(running_at) < jobs else "",
        "environment": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "platform": platform.platform(),
            "load_average_1m_at_start": load_at_start,
            "note": "emulator and kubelet stand-in share this machine with the operator process",
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=200)
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for every job to run")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "operator_scale.json")
    args = parser.parse_args()
    result = asyncio.run(run(args.jobs, 8, args.timeout))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "operator_log_tail"}, indent=2))
    if result["jobs_running"] < args.jobs:
        print(result["operator_log_tail"], file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
