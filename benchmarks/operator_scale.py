"""The operator at fleet scale: RLJobs of 8 pods posted back to back against the API emulator, the operator run
as `rljob operator --all-namespaces` in its own process.

The emulator (tests/operator/controller/emulator.py) serves on localhost in this process and plays kubelet:
once a job's pods exist, they get a node, then Running and Ready. Its latency model: every read (GET, LIST)
waits `READ_SECONDS`, every write (POST, PATCH, DELETE) `WRITE_SECONDS` before it is served, without holding
its event loop (requests overlap, as on a real server); watches are not delayed. The operator runs exactly as
in a cluster (a kubeconfig pointing at the emulator), so its memory is its own and every API request it makes
is an HTTP request the emulator counts.

Scenarios, each with a fresh emulator and operator:
- `100` and `1000`: that many jobs in one namespace, POSTed over HTTP one after another (each answered before the
  next: a script of `kubectl create` calls, a CI system submitting jobs), so every POST pays the write latency;
- `100-burst`, `1000-burst`: the same jobs stored in-process all at once, without HTTP or latency: a flood no
  client can make, which shows how long the operator takes to work off a backlog;
- `fairness`: 500 jobs stored at once in namespace `busy`, then one in namespace `quiet`: how long the quiet
  namespace's first job waits for its pods, next to the busy namespace's jobs;
- `failover`: two operators with peering (15 s record lifetime, as the chart sets it); the active one is killed
  and a job posted at once: seconds until the standby is active and has created that job's pods.

Figures per scenario (benchmarks/results/operator_scale.json):
- create -> all pods created (the job's creation to its last pod's creation), p50/p99/max;
- create -> Running (the kubelet here marks pods ready as soon as it sees them), p50/p99;
- API requests per job, by verb and kind, until every job is Running;
- operator peak RSS (VmHWM) and CPU seconds;
- the operator's own trace (`rljob_operator_job_pass_seconds{stage}` scraped from its /metrics): seconds
  from the watch event to each stage of a pass, mean and p99 (bucket bound).

Run: `make bench-operator` (or `.venv/bin/python benchmarks/operator_scale.py --scenarios 100,1000,fairness`).
`RLJOB_BENCH_PROFILE=file.prof` runs the operator under cProfile (one scenario at a time: the file is rewritten).
`--operator-args='--concurrent-reconciles=8'` passes flags to every scenario's operator (recorded in the results).
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import os
import platform
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

CRDS = kmock.resource("apiextensions.k8s.io", "v1", "customresourcedefinitions")
NAMESPACES = kmock.resource("", "v1", "namespaces")
PODS_PER_JOB = 8
READ_SECONDS = 0.002
WRITE_SECONDS = 0.010
"""The latency model. A real API server answers a GET of one object in about 1-5 ms and a pod create in about
5-20 ms (etcd's write and fsync, admission), in a healthy, unloaded control plane."""
TRACE_STAGES = ("slot", "planned", "status_written", "pods_created", "done")
POSTER = "rljob-bench-poster"
"""The User-Agent of the job POSTs: not counted among the operator's requests."""
OPERATOR_ARGS: list[str] = []
"""Extra `rljob operator` flags for every scenario (`--operator-args`)."""


class TimedEmulator(KubernetesApiEmulator):
    """Records when each object was created (by the operator or by this script)."""

    created_at: dict[tuple[str, str, str], float]
    new_pods: list[tuple[str, str]]
    """Pods created since the kubelet stand-in last looked."""

    def _create(self, res: Any, namespace: str | None, body: Any) -> dict[str, Any]:
        raw = super()._create(res, namespace, body)
        self.created_at[(res.plural, namespace or "", raw["metadata"]["name"])] = time.monotonic()
        if res == PODS:
            self.new_pods.append((namespace or "", raw["metadata"]["name"]))
        return raw

    def phase_of(self, namespace: str, job: str) -> str | None:
        """The job's phase, read without copying the object."""
        obj = self.objects[RLJOBS, namespace, job]
        return None if obj.deleted else (obj.raw.get("status") or {}).get("phase")


TEMPLATE = yaml.safe_load((ROOT / "examples" / "cartpole-ppo.yaml").read_text())
TEMPLATE["spec"]["roles"] = {"actor": {"replicas": 2}, "rollout": {"replicas": 2}, "env": {"replicas": 4}}


def job_manifest(namespace: str, name: str) -> dict[str, Any]:
    job = copy.deepcopy(TEMPLATE)
    job["metadata"] = {"name": name, "namespace": namespace}
    return job


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def summary(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p99": None, "max": None}
    return {
        "p50": round(statistics.median(values), 3),
        "p99": round(percentile(values, 99), 3),
        "max": round(max(values), 3),
    }


def play_kubelet(kube: TimedEmulator) -> None:
    """Every pod created since the last call gets a node, then Running and Ready."""
    new, kube.new_pods = kube.new_pods, []
    for namespace, name in new:
        kube.patch_object(PODS, namespace, name, {"spec": {"nodeName": "node-1"}})
        kube.patch_status(
            PODS,
            namespace,
            name,
            {
                "phase": "Running",
                "conditions": [{"type": "PodScheduled", "status": "True"}, {"type": "Ready", "status": "True"}],
            },
        )


async def keep_kubelet(
    kube: TimedEmulator, posts: list[tuple[str, str]], running_at: dict[tuple[str, str], float], deadline: float
) -> None:
    """Play kubelet every 50 ms and note when each job is Running, until all are (or `deadline`)."""
    waiting = list(posts)
    while waiting and time.monotonic() < deadline:
        play_kubelet(kube)
        still = []
        for key in waiting:
            if ("rljobs", *key) in kube.created_at and kube.phase_of(*key) == "Running":
                running_at[key] = time.monotonic()
            else:
                still.append(key)
        waiting = still
        await asyncio.sleep(0.05)


async def post_one_after_another(server_url: str, posts: list[tuple[str, str]]) -> None:
    """POST each job over HTTP and wait for the answer before the next, as a script of `kubectl create` calls or
    a CI system submitting jobs does: every POST pays the write latency, like any client's."""
    group, version = RLJOBS.group, RLJOBS.version
    async with aiohttp.ClientSession(headers={"User-Agent": POSTER}) as session:
        for namespace, name in posts:
            url = f"{server_url.rstrip('/')}/apis/{group}/{version}/namespaces/{namespace}/{RLJOBS.plural}"
            async with session.post(url, json=job_manifest(namespace, name)) as response:
                if response.status != 201:
                    raise RuntimeError(f"POST {namespace}/{name}: {response.status} {await response.text()}")


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


async def scrape(url: str) -> str:
    async with aiohttp.ClientSession() as session, session.get(url) as response:
        return await response.text()


def trace_figures(metrics_text: str) -> dict[str, dict[str, float | None]]:
    """Mean and p99 (the upper bound of the bucket holding it) of each traced stage, from /metrics text."""
    buckets: dict[str, list[tuple[float, float]]] = {}
    sums: dict[str, float] = {}
    counts: dict[str, float] = {}
    for line in metrics_text.splitlines():
        if not line.startswith("rljob_operator_job_pass_seconds"):
            continue
        name_labels, value = line.rsplit(" ", 1)
        labels = dict(part.split("=", 1) for part in name_labels[name_labels.index("{") + 1 : -1].split(","))
        stage = labels["stage"].strip('"')
        if name_labels.startswith("rljob_operator_job_pass_seconds_bucket"):
            bound = labels["le"].strip('"')
            buckets.setdefault(stage, []).append((float("inf") if bound == "+Inf" else float(bound), float(value)))
        elif name_labels.startswith("rljob_operator_job_pass_seconds_sum"):
            sums[stage] = float(value)
        elif name_labels.startswith("rljob_operator_job_pass_seconds_count"):
            counts[stage] = float(value)
    out: dict[str, dict[str, float | None]] = {}
    for stage in TRACE_STAGES:
        count = counts.get(stage, 0.0)
        if not count:
            continue
        p99 = next((bound for bound, cumulative in sorted(buckets[stage]) if cumulative >= 0.99 * count), None)
        out[stage] = {"passes": count, "mean": round(sums[stage] / count, 4), "p99_at_most": p99}
    return out


def process_figures(pid: int) -> tuple[float, float]:
    """(peak RSS in MiB, CPU seconds) of a running process, from /proc."""
    status = Path(f"/proc/{pid}/status").read_text()
    hwm_kib = next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmHWM:"))
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    cpu = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return hwm_kib / 1024, cpu


def new_emulator() -> TimedEmulator:
    kube = TimedEmulator(
        status_subresources={RLJOBS, PODS},
        scale_subresources={RLJOBS: SCALE_PATH},
        keep_history=False,
        latency={"read": READ_SECONDS, "write": WRITE_SECONDS},
    )
    kube.created_at = {}
    kube.new_pods = []
    for key, info in RESOURCES.items():
        kube.resources[key] = kmock.ResourceInfo(verbs={"list", "watch", "get", "create", "patch", "delete"}, **info)
    kube.resources["apiextensions.k8s.io/v1/customresourcedefinitions"] = kmock.ResourceInfo(
        kind="CustomResourceDefinition", namespaced=False, verbs={"list", "watch", "get"}
    )
    return kube


def write_kubeconfig(path: Path, server_url: str) -> None:
    path.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "emulator", "cluster": {"server": server_url.rstrip("/")}}],
                "users": [{"name": "bench", "user": {"token": "bench"}}],
                "contexts": [{"name": "bench", "context": {"cluster": "emulator", "user": "bench"}}],
                "current-context": "bench",
            }
        )
    )


def start_operator(
    kubeconfig: Path, log: Path, liveness_port: int, metrics_port: int, *extra: str, profile: str | None = None
) -> subprocess.Popen:
    """`rljob operator --all-namespaces` in a process of its own, as in a pod."""
    launcher = [sys.executable, "-m", "cProfile", "-o", profile] if profile else [sys.executable]
    return subprocess.Popen(
        [
            *launcher,
            "-m",
            "rljob.cli.main",
            "operator",
            "--all-namespaces",
            f"--liveness-port={liveness_port}",
            f"--metrics-port={metrics_port}",
            "--log-level=warning",
            *extra,
        ],
        env=dict(os.environ, KUBECONFIG=str(kubeconfig)),
        stdout=subprocess.DEVNULL,
        stderr=open(log, "w"),
    )


def stop_operator(operator: subprocess.Popen) -> None:
    operator.send_signal(signal.SIGTERM)
    try:
        operator.wait(timeout=60)
    except subprocess.TimeoutExpired:
        operator.kill()
        operator.wait()


async def scenario(posts: list[tuple[str, str]], timeout: float, posting: str = "http") -> dict[str, Any]:
    """Post the (namespace, name) jobs back to back; measure until every one is Running (or `timeout`).

    `posting`: "http", one POST after another, each answered before the next; "burst", stored in-process all at
    once, without HTTP or latency (a flood no client can make: the operator meets every job at once)."""
    kube = new_emulator()
    async with kube, kmock.Server(kube) as server:
        kube.create_object(CRDS, None, build_crd())
        for namespace in sorted({ns for ns, _ in posts}):
            kube.create_object(
                NAMESPACES, None, {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}}
            )
        with tempfile.TemporaryDirectory() as tmp:
            kubeconfig = Path(tmp) / "kubeconfig"
            write_kubeconfig(kubeconfig, str(server.url))
            liveness_port, metrics_port = 18080 + os.getpid() % 1000, 19090 + os.getpid() % 1000
            operator = start_operator(
                kubeconfig,
                Path(tmp) / "operator.log",
                liveness_port,
                metrics_port,
                *OPERATOR_ARGS,
                profile=os.environ.get("RLJOB_BENCH_PROFILE"),
            )
            try:
                await wait_http(f"http://127.0.0.1:{liveness_port}/healthz", 60)
                await asyncio.sleep(1.0)  # the watches are up and quiet
                requests_before = len(list(kube))
                _, cpu_before = process_figures(operator.pid)
                emulator_before = time.process_time()
                started = time.monotonic()
                running_at: dict[tuple[str, str], float] = {}
                kubelet = asyncio.create_task(keep_kubelet(kube, posts, running_at, started + timeout))
                if posting == "burst":
                    for namespace, name in posts:
                        kube.create_object(RLJOBS, namespace, job_manifest(namespace, name))
                        await asyncio.sleep(0)
                else:
                    await post_one_after_another(str(server.url), posts)
                posting_seconds = time.monotonic() - started
                await kubelet
                elapsed = time.monotonic() - started
                created = {(ns, name): kube.created_at[("rljobs", ns, name)] for ns, name in posts}
                operator_requests = [r for r in list(kube)[requests_before:] if r.headers.get("User-Agent") != POSTER]
                trace = trace_figures(await scrape(f"http://127.0.0.1:{metrics_port}/metrics"))
                peak_rss_mib, cpu_after = process_figures(operator.pid)
                emulator_cpu = time.process_time() - emulator_before
            finally:
                stop_operator(operator)
                log_tail = (Path(tmp) / "operator.log").read_text()[-2000:]
    pods_at: dict[tuple[str, str], list[float]] = {}
    for (plural, namespace, pod), at in kube.created_at.items():
        if plural == "pods":
            pods_at.setdefault((namespace, pod.rsplit("-", 2)[0]), []).append(at)
    children = {key: max(pods_at[key]) - t0 for key, t0 in created.items() if len(pods_at.get(key, ())) == PODS_PER_JOB}
    running = {key: running_at[key] - created[key] for key in running_at}
    jobs = len(posts)
    kinds = Counter(
        f"{r.method.value} {r.resource.plural}{'/status' if r.subresource == 'status' else ''}"
        for r in operator_requests
        if r.resource is not None
    )
    return {
        "jobs": jobs,
        "posting": posting,
        "posting_seconds": round(posting_seconds, 3),
        "jobs_with_all_pods": len(children),
        "jobs_running": len(running_at),
        "create_to_all_pods_seconds": summary(list(children.values())),
        "create_to_running_seconds": summary(list(running.values())),
        "all_running_after_seconds": round(elapsed, 2),
        "api_requests_per_job": round(len(operator_requests) / jobs, 2),
        "api_requests_per_job_by_kind": {k: round(v / jobs, 2) for k, v in sorted(kinds.items())},
        "operator_peak_rss_mib": round(peak_rss_mib, 1),
        "operator_cpu_seconds": round(cpu_after - cpu_before, 2),
        "emulator_and_kubelet_cpu_seconds": round(emulator_cpu, 2),
        "operator_trace_seconds_after_event": trace,
        "operator_exit_code": operator.returncode,
        "operator_log_tail": log_tail if len(running_at) < jobs else "",
        "_children": children,
    }


FAILOVER_LIFETIME_SECONDS = 15
FAILOVER_TRIALS = 3


async def failover_scenario(timeout: float) -> dict[str, Any]:
    """Two operators with peering (the chart's defaults: 15 s record lifetime); the active one is SIGKILLed (no
    clean exit, so its record stays until it runs out) and a job is posted at once: seconds until the standby
    has created all of that job's pods, and until its /metrics says it is active."""
    kube = new_emulator()
    async with kube, kmock.Server(kube) as server:
        kube.create_object(CRDS, None, build_crd())
        kube.create_object(NAMESPACES, None, {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "bench"}})
        peering = {"apiVersion": "kopf.dev/v1", "kind": "ClusterKopfPeering", "metadata": {"name": "rljob"}}
        kube.create_object(kmock.resource("kopf.dev", "v1", "clusterkopfpeerings"), None, peering)
        with tempfile.TemporaryDirectory() as tmp:
            kubeconfig = Path(tmp) / "kubeconfig"
            write_kubeconfig(kubeconfig, str(server.url))
            base = os.getpid() % 1000
            peering_args = ("--peering=rljob", f"--peering-lifetime={FAILOVER_LIFETIME_SECONDS}")
            active = start_operator(
                kubeconfig, Path(tmp) / "active.log", 18080 + base, 19090 + base, *peering_args, "--priority=20"
            )
            standby = start_operator(
                kubeconfig, Path(tmp) / "standby.log", 18180 + base, 19190 + base, *peering_args, "--priority=10"
            )
            standby_metrics = f"http://127.0.0.1:{19190 + base}/metrics"
            try:
                await wait_http(f"http://127.0.0.1:{18080 + base}/healthz", 60)
                await wait_http(f"http://127.0.0.1:{18180 + base}/healthz", 60)
                kube.create_object(RLJOBS, "bench", job_manifest("bench", "before"))
                deadline = time.monotonic() + timeout
                while kube.phase_of("bench", "before") != "Running" and time.monotonic() < deadline:
                    play_kubelet(kube)
                    await asyncio.sleep(0.05)
                standby_before = _gauge(await scrape(standby_metrics), "rljob_operator_standby")
                active.kill()  # no clean exit: kopf leaves its peering record behind
                killed = time.monotonic()
                kube.create_object(RLJOBS, "bench", job_manifest("bench", "after"))
                resumed_after = None
                while time.monotonic() < killed + timeout:
                    if resumed_after is None and _gauge(await scrape(standby_metrics), "rljob_operator_standby") == 0:
                        resumed_after = time.monotonic() - killed
                    pods = [
                        t
                        for (plural, _, name), t in kube.created_at.items()
                        if plural == "pods" and name.startswith("after-")
                    ]
                    if len(pods) == PODS_PER_JOB:
                        break
                    await asyncio.sleep(0.1)
                pods = [
                    t
                    for (plural, _, name), t in kube.created_at.items()
                    if plural == "pods" and name.startswith("after-")
                ]
            finally:
                for operator in (active, standby):
                    if operator.poll() is None:
                        stop_operator(operator)
    return {
        "peering_lifetime_seconds": FAILOVER_LIFETIME_SECONDS,
        "standby_gauge_before_kill": standby_before,
        "kill_to_standby_active_seconds": round(resumed_after, 2) if resumed_after is not None else None,
        "kill_to_all_pods_of_a_new_job_seconds": round(max(pods) - killed, 2) if len(pods) == PODS_PER_JOB else None,
    }


def _gauge(metrics_text: str, name: str) -> float | None:
    for line in metrics_text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    return None


async def run(names: list[str], timeout: float) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for name in names:
        load = round(os.getloadavg()[0], 2)
        if name == "failover":
            # The kill lands anywhere in the active operator's renewal cycle: several trials show the spread.
            trials = [await failover_scenario(timeout) for _ in range(FAILOVER_TRIALS)]
            takeovers = [t["kill_to_all_pods_of_a_new_job_seconds"] for t in trials]
            result = {
                "trials": trials,
                "kill_to_all_pods_of_a_new_job_seconds_max": None if None in takeovers else max(takeovers),
                "note": "the operators start a moment before the kill, so it lands right after the active one renewed "
                "its record (kopf renews at start, then 5-10 s before the record runs out): the worst case, in which "
                "the takeover takes the whole lifetime; a kill later in the renewal cycle is taken over sooner",
                "load_average_1m_at_start": load,
            }
            results[name] = result
            print(name, json.dumps(result), flush=True)
            continue
        if name == "fairness":
            busy = [("busy", f"job-{i:04d}") for i in range(500)]
            # The busy namespace floods: its 500 jobs are stored at once, then the quiet one's first job.
            result = await scenario([*busy, ("quiet", "first")], timeout, posting="burst")
            children = result.pop("_children")
            busy_times = [t for (ns, _), t in children.items() if ns == "busy"]
            result["quiet_first_job_create_to_all_pods_seconds"] = (
                round(children["quiet", "first"], 3) if ("quiet", "first") in children else None
            )
            result["busy_create_to_all_pods_seconds"] = summary(busy_times)
        else:
            jobs = [("bench", f"job-{i:04d}") for i in range(int(name.removesuffix("-burst")))]
            result = await scenario(jobs, timeout, posting="burst" if name.endswith("-burst") else "http")
            result.pop("_children")
        result["load_average_1m_at_start"] = load
        result["operator_args"] = list(OPERATOR_ARGS)
        results[name] = result
        print(name, json.dumps({k: v for k, v in result.items() if k != "operator_log_tail"}), flush=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--scenarios",
        default="100,1000,100-burst,1000-burst,fairness,failover",
        help="comma-separated: a job count (N or N-burst), fairness or failover",
    )
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for every job of a scenario")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "operator_scale.json")
    parser.add_argument(
        "--operator-args", default="", help="extra `rljob operator` flags, e.g. '--concurrent-reconciles=8'"
    )
    args = parser.parse_args()
    OPERATOR_ARGS.extend(args.operator_args.split())
    names = [n.strip() for n in args.scenarios.split(",") if n.strip()]
    scenarios = asyncio.run(run(names, args.timeout))
    if args.out.exists():  # a run of some scenarios keeps the others' figures
        scenarios = {**json.loads(args.out.read_text()).get("scenarios", {}), **scenarios}
    result = {
        "benchmark": "operator_scale",
        "pods_per_job": PODS_PER_JOB,
        "latency_model_seconds": {"read": READ_SECONDS, "write": WRITE_SECONDS, "watch": 0.0},
        "scenarios": scenarios,
        "environment": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "platform": platform.platform(),
            "note": "the emulator and the kubelet stand-in share this machine (and its cores) with the operator",
        },
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    failed = [name for name in names if scenarios[name].get("jobs_running", 0) < scenarios[name].get("jobs", 0)]
    if "failover" in names and scenarios["failover"]["kill_to_all_pods_of_a_new_job_seconds_max"] is None:
        failed.append("failover")
    for name in failed:
        print(f"{name}: not every job ran\n{scenarios[name].get('operator_log_tail', '')}", file=sys.stderr)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
