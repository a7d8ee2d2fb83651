"""The Ray launcher: every role replica of a job as a Ray actor on a Ray cluster (`rljob run FILE --ray ADDRESS`).

Each replica gets a bundle of one placement group per job (rljob/launch/ray_placement.py), reserved before
anything starts. In its bundle a `RoleProcess` Ray actor picks the replica's ports on its node and runs the
role entrypoint (`rljob role <role>`) as a subprocess with the identity contract every launcher uses
(`placed_identities` -> RLJOB_* variables, peers addressed by their nodes' IPs): the role's own process
semantics, exit codes and output are those of a local run or a pod. An actor replica with `gpusPerReplica: N`
is one Ray actor with N GPUs that starts its N ranks, exactly as in its pod (Ray's CUDA_VISIBLE_DEVICES then
numbers them from 0).

Supervision is the local launcher's (`Supervisor`, the same `FailurePolicy`): a dead env/rollout/reward process
or its Ray actor (a killed worker process, a lost node) is replaced in its bundle after the policy's back-off,
a dead actor restarts the actor group from the newest checkpoint, exit 78 fails the job at once. A replacement
asks for the same ports on its node; when it comes up elsewhere (Ray moved the bundle after a node was lost)
every replica is restarted with the new addresses, without charging the failure policy (node loss is not the
job's fault, as for pods). Stopping (success, failure, Ctrl-C) kills every Ray actor of the job and removes
its placement group.

GPUs: Ray hands out `GPU` resources, and a role uses CUDA only when torch sees a device; on nodes whose GPUs
are declared but absent (test clusters) the roles run on the CPU. The local launcher's check that torch sees
every GPU asked for does not apply: the cluster's resources are what Ray reports.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from rljob.api import RLJob
from rljob.launch.failure_policy import FailurePolicy
from rljob.launch.local import check_local, local_actor_ranks, prepare_run_dir
from rljob.launch.ports import pick_ports
from rljob.launch.ray_placement import (
    Bundle,
    ClusterNode,
    check_fits,
    job_bundles,
    placement_strategy,
    ray_notes,
    ray_problems,
    waiting_for,
)
from rljob.launch.supervisor import Child, LaunchError, LogSink, RunResult, Supervisor
from rljob.runtime.process.parent_death import LAUNCHER_PID_ENV
from rljob.runtime.records.trackers import RESTART_ENV
from rljob.runtime.wire.identity import ReplicaAddress, placed_identities

STOP_GRACE_S = 10.0
PLACEMENT_TIMEOUT_S = 120.0
"""How long a job that fits the cluster waits for its resources to be free before it fails."""
POLL_TIMEOUT_S = 30.0
REPLACE_QUIET_S = 5.0
"""How long a replacement's Ray actor may take to come up before the launcher says what it waits for."""
ACTOR_DIED = -9
"""The exit status reported for a replica whose Ray actor died (worker process killed, node lost)."""
LOCAL_ADDRESS = "local"
SHARED_MARKER = ".rljob-shared-check"


class RayConnectError(LaunchError):
    """No Ray cluster at the given address."""


def resolve_address(address: str) -> str:
    """`auto` means RAY_ADDRESS when set, else the cluster started on this machine by `ray start`."""
    if address in ("", "auto"):
        return os.environ.get("RAY_ADDRESS") or "auto"
    return address


def connect(address: str, cpus_needed: float = 0.0) -> None:
    """Connect this process to an existing cluster; `local` starts a throwaway one on this machine."""
    if ray.is_initialized():
        return
    if address == LOCAL_ADDRESS:
        # As for `rljob run` without Ray, the machine's cores are shared, not reserved: every replica fits.
        cpus = max(float(os.cpu_count() or 1), cpus_needed)
        ray.init(address="local", num_cpus=int(cpus + 0.999), include_dashboard=False, log_to_driver=False)
        return
    target = resolve_address(address)
    try:
        ray.init(address=target, log_to_driver=False)
    except (ConnectionError, RuntimeError, ValueError) as exc:
        raise RayConnectError(
            f"--ray {address}: no Ray cluster to connect to at {target} ({str(exc).splitlines()[0]}); start one "
            "with `ray start --head` (or give its address: host:6379, ray://host:10001, RAY_ADDRESS), or pass "
            "`--ray local` for a throwaway cluster on this machine"
        ) from None


def cluster_nodes() -> list[ClusterNode]:
    """The alive nodes as Ray reports them, with what is free on each right now."""
    available: dict[str, dict[str, float]] = {}
    with contextlib.suppress(Exception):
        available = ray._private.state.state.available_resources_per_node()  # type: ignore[attr-defined]
    nodes = []
    for node in ray.nodes():
        if not node.get("Alive"):
            continue
        total = {k: float(v) for k, v in node.get("Resources", {}).items()}
        nodes.append(
            ClusterNode(
                node_id=node["NodeID"],
                ip=node["NodeManagerAddress"],
                total=total,
                available=available.get(node["NodeID"], total),
                labels=dict(node.get("Labels") or {}),
            )
        )
    return nodes


@ray.remote(max_restarts=0, max_concurrency=4)
class RoleProcess:
    """Runs one replica's role entrypoint as a subprocess on the node of its bundle, and reports on it."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.workdir = tempfile.mkdtemp(prefix=f"rljob-{name}-")
        self.process: subprocess.Popen[bytes] | None = None
        self.reader: threading.Thread | None = None
        self.lines: deque[str] = deque()
        self.lock = threading.Lock()

    def address(self, wanted: list[int]) -> tuple[str, list[int]]:
        return ray.util.get_node_ip_address(), pick_ports(len(wanted), wanted=wanted)

    def sees(self, paths: list[str]) -> list[bool]:
        return [Path(p).exists() for p in paths]

    def start(self, env: dict[str, str], config_text: str, cwd: str) -> int:
        config = Path(self.workdir) / "job.yaml"
        config.write_text(config_text, encoding="utf-8")
        import rljob

        # The node's copy of rljob (the one this actor runs) serves the role too.
        source = str(Path(rljob.__file__).resolve().parents[1])
        path = os.pathsep.join(p for p in (source, os.environ.get("PYTHONPATH", "")) if p)
        full_env = {
            **os.environ,
            **env,
            "RLJOB_CONFIG": str(config),
            "PYTHONPATH": path,
            "PYTHONUNBUFFERED": "1",
            LAUNCHER_PID_ENV: str(os.getpid()),  # the role dies with this Ray actor's worker process
        }
        self.process = subprocess.Popen(
            [sys.executable, "-m", "rljob.cli.main", "role", env["RLJOB_ROLE"]],
            env=full_env,
            cwd=cwd if Path(cwd).is_dir() else self.workdir,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        self.reader = threading.Thread(target=self._pump, args=(self.process,), daemon=True)
        self.reader.start()
        return self.process.pid

    def _pump(self, process: subprocess.Popen[bytes]) -> None:
        assert process.stdout is not None
        for raw in process.stdout:
            with self.lock:
                self.lines.append(raw.decode("utf-8", "replace").rstrip())

    def _take(self) -> list[str]:
        with self.lock:
            lines = list(self.lines)
            self.lines.clear()
        return lines

    def poll(self) -> tuple[int | None, list[str]]:
        """(exit status or None while it runs, the lines printed since the last poll)."""
        if self.process is None:
            return None, self._take()
        code = self.process.poll()
        if code is not None and self.reader is not None:
            self.reader.join(timeout=5)  # every line it printed comes with its exit status
        return code, self._take()

    def stop(self, grace_s: float) -> list[str]:
        process = self.process
        if process is not None and process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=grace_s)
        if process is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            if self.reader is not None:
                self.reader.join(timeout=2)
        return self._take()

    def kill(self) -> None:
        """SIGKILL the role's process group (a hung role): `poll` then reports its exit."""
        process = self.process
        if process is not None and process.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(process.pid, signal.SIGKILL)

    def pid(self) -> int | None:
        return None if self.process is None else self.process.pid

    def worker_pid(self) -> int:
        return os.getpid()

    def cleanup(self) -> None:
        shutil.rmtree(self.workdir, ignore_errors=True)


@dataclass
class RayChild(Child):
    bundle: Bundle | None = None
    bundle_index: int = 0
    handle: Any = None
    """The RoleProcess Ray actor; None once it died."""
    ports: tuple[int, ...] = ()
    """(data, metrics) and, on actor replica 0, (master, sync): asked for again by a replacement."""
    host: str = ""
    pid: int | None = None
    incarnation: int = 0
    code: int | None = None


class AddressChanged(Exception):
    """A replacement came up at another address: every replica must learn the new endpoints."""


class RayRun(Supervisor):
    """Starts, supervises and stops the replicas of one job on a Ray cluster."""

    def __init__(
        self,
        job: RLJob,
        run_dir: Path,
        log_sink: LogSink,
        address: str = "auto",
        extra_env: dict[str, str] | None = None,
        policy: FailurePolicy | None = None,
        placement_timeout_s: float = PLACEMENT_TIMEOUT_S,
    ) -> None:
        self.actor_ranks = local_actor_ranks(job)
        check_local(job, self.actor_ranks, local_gpus=False)  # the GPUs are the Ray cluster's (check_fits)
        problems = ray_problems(job)
        if problems:
            raise LaunchError("\n".join(problems))
        self.bundles = job_bundles(job)
        self.job = job
        self.policy = policy or FailurePolicy.from_spec(job.spec.failure_policy)
        self.run_dir = run_dir
        self.log_sink = log_sink
        self.extra_env = extra_env or {}
        self.config_path = run_dir / "job.yaml"
        self.placement_timeout_s = placement_timeout_s
        self.actor_restarts = 0
        self.pg: PlacementGroup | None = None
        self.address = address
        self.connected_here = not ray.is_initialized()
        connect(address, sum(b.resources.get("CPU", 0.0) for b in self.bundles))
        try:
            nodes = cluster_nodes()
            self.strategy = placement_strategy(self.bundles, nodes)
            check_fits(self.bundles, nodes, self.strategy)
            self.waiting = waiting_for(self.bundles, nodes, self.strategy)
            prepare_run_dir(run_dir)
        except BaseException:
            self.disconnect()
            raise
        self.children: list[RayChild] = [
            RayChild(
                identity=None,  # type: ignore[arg-type]  (known once every replica has its address)
                log_path=run_dir / "logs" / f"{b.name}.log",
                bundle=b,
                bundle_index=i,
            )
            for i, b in enumerate(self.bundles)
        ]
        for note in ray_notes(job):
            log_sink("launcher", f"note: {note}")

    # --- placement and addresses --------------------------------------------------------------------

    @property
    def progress_url(self) -> str:
        actor0 = self.child("actor", 0)
        return f"http://{actor0.identity.master_addr}:{actor0.identity.metrics_port}/progress"

    def child(self, role: str, replica: int) -> RayChild:  # type: ignore[override]
        return next(c for c in self.children if c.bundle and c.bundle.role == role and c.bundle.replica == replica)

    def _reserve(self) -> None:
        self.pg = placement_group(
            [b.resources for b in self.bundles],
            strategy=self.strategy,
            name=f"rljob-{self.job.name}-{uuid.uuid4().hex[:8]}",
            bundle_label_selector=[b.labels for b in self.bundles],
        )
        if self.waiting:
            self.log_sink(
                "launcher", f"waiting up to {self.placement_timeout_s:g}s for the placement group: {self.waiting}"
            )
        try:
            ray.get(self.pg.ready(), timeout=self.placement_timeout_s)
        except GetTimeoutError:
            why = waiting_for(self.bundles, cluster_nodes(), self.strategy) or "the cluster did not place it"
            raise LaunchError(
                f"the job's placement group ({len(self.bundles)} replicas, {self.strategy}) was not placed within "
                f"{self.placement_timeout_s:g}s: {why}"
            ) from None

    def _new_actor(self, child: RayChild) -> None:
        assert self.pg is not None and child.bundle is not None
        resources = dict(child.bundle.resources)
        options: dict[str, Any] = {
            "num_cpus": resources.pop("CPU", 0.0),
            "num_gpus": resources.pop("GPU", 0.0),
            "scheduling_strategy": PlacementGroupSchedulingStrategy(
                self.pg, placement_group_bundle_index=child.bundle_index
            ),
        }
        if "memory" in resources:
            options["memory"] = resources.pop("memory")
        if resources:
            options["resources"] = resources
        child.handle = RoleProcess.options(**options).remote(child.bundle.name)
        child.incarnation += 1

    def _wanted_ports(self, child: RayChild) -> list[int]:
        assert child.bundle is not None
        count = 4 if (child.bundle.role, child.bundle.replica) == ("actor", 0) else 2
        return list(child.ports) if child.ports else [0] * count

    def _identities(self) -> None:
        addresses = {
            (c.bundle.role, c.bundle.replica): ReplicaAddress(c.host, c.ports[0], c.ports[1])
            for c in self.children
            if c.bundle is not None
        }
        master = self.child("actor", 0)
        identities = placed_identities(
            self.job.name,
            "ray",
            addresses,
            str(self.config_path),
            master.ports[2],
            master.ports[3],
            str(self.run_dir),
            self.actor_ranks,
        )
        by_key = {(i.role, i.replica): i for i in identities}
        for child in self.children:
            assert child.bundle is not None
            child.identity = by_key[(child.bundle.role, child.bundle.replica)]

    def _check_shared(self) -> None:
        """The run directory and checkpoint.dir must be the same storage on every node hosting an actor replica:
        the actor writes metrics there and a restarted actor group (maybe elsewhere) resumes from there."""
        checkpoints = Path(self.job.spec.checkpoint.dir or self.run_dir / "checkpoints")
        token = uuid.uuid4().hex
        markers = []
        for directory in (self.run_dir, checkpoints):
            try:
                directory.mkdir(parents=True, exist_ok=True)
                marker = directory / f"{SHARED_MARKER}-{token}"
                marker.write_text(token)
            except OSError as exc:
                raise LaunchError(
                    f"spec.checkpoint.dir {directory}: cannot write there ({exc.strerror or exc})"
                ) from None
            markers.append(marker)
        try:
            actors = [c for c in self.children if c.identity.role == "actor"]
            seen = ray.get([c.handle.sees.remote([str(m) for m in markers]) for c in actors], timeout=POLL_TIMEOUT_S)
        finally:
            for marker in markers:
                marker.unlink(missing_ok=True)
        for child, (run_dir_seen, checkpoints_seen) in zip(actors, seen, strict=True):
            if not checkpoints_seen:
                raise LaunchError(
                    f"spec.checkpoint.dir {checkpoints}: not shared with the node of {child.name} ({child.host}), "
                    "which does not see a file the launcher wrote there; on a multi-node Ray cluster set "
                    "spec.checkpoint.dir to storage every node mounts at the same path (NFS, a mounted bucket)"
                )
            if not run_dir_seen:
                raise LaunchError(
                    f"--out {self.run_dir}: not shared with the node of {child.name} ({child.host}), where the actor "
                    "writes metrics.jsonl, TensorBoard and curve.png; pass an --out on storage every node mounts"
                )

    def start(self) -> None:
        self.write_config()
        self._reserve()
        for child in self.children:
            self._new_actor(child)
        self._locate(self.children)
        self._identities()
        self._check_shared()
        for role in ("env", "rollout", "reward", "actor"):
            for child in self.children:
                if child.identity.role == role:
                    self._launch(child)

    def _locate(self, children: Sequence[RayChild]) -> None:
        found = ray.get([c.handle.address.remote(self._wanted_ports(c)) for c in children], timeout=POLL_TIMEOUT_S)
        for child, (host, ports) in zip(children, found, strict=True):
            child.host, child.ports = host, tuple(ports)

    # --- the supervisor's hooks ---------------------------------------------------------------------

    def _start_child(self, child: RayChild) -> None:  # type: ignore[override]
        before = (child.host, child.ports)
        self._place(child)
        if (child.host, child.ports) != before:
            raise AddressChanged(child.name)
        self._run_role(child)

    def _place(self, child: RayChild) -> None:
        """A live Ray actor for the replica and its current address."""
        if child.handle is None:
            self._new_actor(child)
            self._locate_replacement(child)
        elif child.pid is not None:
            # A restart in the same Ray actor: its ports are asked for again, as one taken meanwhile by another
            # process would fail every restart.
            self._locate([child])

    def _run_role(self, child: RayChild) -> None:
        env = {**child.identity.to_env(), **self.extra_env, RESTART_ENV: str(child.restarts)}
        assert child.bundle is not None
        for var in self.job.spec.roles.get(child.bundle.role).env:
            if var.value is not None:
                env[var.name] = var.value
        child.code = None
        child.pid = ray.get(child.handle.start.remote(env, self.config_text(), os.getcwd()), timeout=POLL_TIMEOUT_S)

    def _locate_replacement(self, child: RayChild) -> None:
        """Wait for a fresh Ray actor in a dead one's bundle. After a node loss Ray first re-places the bundle on
        a node with room and matching labels, which can take long (an autoscaler adding a node): waited for up
        to the placement timeout, then the job fails saying what its bundle needs."""
        assert child.bundle is not None
        ref = child.handle.address.remote(self._wanted_ports(child))
        ready, _ = ray.wait([ref], timeout=REPLACE_QUIET_S)
        if not ready:
            self.log_sink(
                "launcher",
                f"waiting up to {self.placement_timeout_s:g}s for Ray to place {child.name} again: "
                f"{self._bundle_needs(child.bundle)}",
            )
            ready, _ = ray.wait([ref], timeout=self.placement_timeout_s)
        if not ready:
            raise LaunchError(
                f"{child.name} was lost with its Ray actor (node lost?) and Ray did not place it again within "
                f"{REPLACE_QUIET_S + self.placement_timeout_s:g}s: {self._bundle_needs(child.bundle)} "
                "(add such a node, or raise --placement-timeout)"
            )
        child.host, ports = ray.get(ref)
        child.ports = tuple(ports)

    @staticmethod
    def _bundle_needs(bundle: Bundle) -> str:
        resources = ", ".join(f"{name} {amount:g}" for name, amount in bundle.resources.items())
        labels = ", ".join(f"{k}={v}" for k, v in bundle.labels.items())
        return f"it needs a node with {resources} free" + (f" and the labels {labels}" if labels else "")

    def supervise(self, on_tick: Any = None, poll_s: float = 0.2) -> RunResult:
        """The supervisor's loop; a replacement that can never start (its bundle not placed) ends the run with
        the reason, after every replica is stopped."""
        try:
            return super().supervise(on_tick, poll_s)
        except LaunchError as exc:
            return self._result(1, str(exc))

    def _launch(self, child: Child) -> None:
        try:
            super()._launch(child)
        except AddressChanged:
            self._relocate(child)  # type: ignore[arg-type]

    def _relocate(self, moved: RayChild) -> None:
        """A replacement landed at another address (its node was lost): every replica learns the new endpoints.
        Not charged to the failure policy: losing a node is not the job's fault."""
        self.log_sink(
            "launcher",
            f"{moved.name} came back at {moved.host} ports {list(moved.ports)}: restarting every replica with the "
            "new addresses (the actor group resumes from the latest checkpoint)",
        )
        self._stop_children([c for c in self.children if c is not moved])
        for child in self.children:
            if child is not moved:
                self._place(child)
        self._identities()
        for child in self.children:
            child.replace_at = None
        for role in ("env", "rollout", "reward", "actor"):
            for child in self.children:
                if child.identity.role == role:
                    self._run_role(child)
                    child.started_at = time.monotonic()

    def _record(self, child: RayChild, lines: list[str]) -> None:
        if not lines:
            return
        with child.log_path.open("a", encoding="utf-8") as log:
            for line in lines:
                log.write(line + "\n")
        for line in lines:
            child.tail.append(line)
            self.log_sink(child.name, line)

    def _refresh(self) -> None:
        polled = [c for c in self.children if c.handle is not None and c.replace_at is None and c.code is None]
        refs = [c.handle.poll.remote() for c in polled]
        ray.wait(refs, num_returns=len(refs), timeout=POLL_TIMEOUT_S)
        for child, ref in zip(polled, refs, strict=True):
            try:
                code, lines = ray.get(ref, timeout=0.01)
            except RayActorError:
                child.handle = None
                child.code = ACTOR_DIED
                self.log_sink("launcher", f"{child.name}: its Ray actor died (worker process killed or node lost)")
                continue
            except GetTimeoutError:
                continue  # a busy or unreachable node: asked again next round
            self._record(child, lines)
            child.code = code

    def _exit_code(self, child: RayChild) -> int | None:  # type: ignore[override]
        return child.code

    def _live_url(self, child: RayChild) -> str | None:  # type: ignore[override]
        if child.handle is None or child.identity is None or not child.host or child.identity.local_rank != 0:
            return None
        return f"http://{child.host}:{child.identity.metrics_port}/livez"

    def _kill(self, child: RayChild) -> None:  # type: ignore[override]
        if child.handle is not None:
            child.handle.kill.remote()  # its exit comes with the next poll

    def _incarnation(self, child: RayChild) -> str:  # type: ignore[override]
        return f"{child.incarnation}/{child.pid}"

    def _stop_children(self, children: list[RayChild], grace_s: float | None = None) -> None:  # type: ignore[override]
        grace_s = STOP_GRACE_S if grace_s is None else grace_s
        live = [c for c in children if c.handle is not None]
        refs = [c.handle.stop.remote(grace_s) for c in live]
        ray.wait(refs, num_returns=len(refs), timeout=grace_s + 10)
        for child, ref in zip(live, refs, strict=True):
            try:
                self._record(child, ray.get(ref, timeout=0.01))
            except (RayActorError, GetTimeoutError):
                child.handle = None  # dead or stuck: a fresh Ray actor replaces it when it starts again
            child.code = None

    def stop(self) -> None:
        """Stop every role process, kill every Ray actor of the job and remove its placement group."""
        try:
            super().stop()
        finally:
            self.teardown()

    def teardown(self) -> None:
        for child in self.children:
            if child.handle is not None:
                with contextlib.suppress(Exception):
                    ray.get(child.handle.cleanup.remote(), timeout=5)
                with contextlib.suppress(Exception):
                    ray.kill(child.handle)
                child.handle = None
        if self.pg is not None:
            with contextlib.suppress(Exception):
                remove_placement_group(self.pg)
            self.pg = None

    def disconnect(self) -> None:
        """Leave the cluster if this run joined it (a throwaway `--ray local` cluster stops with it)."""
        if self.connected_here and ray.is_initialized():
            ray.shutdown()
