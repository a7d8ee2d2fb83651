"""The local launcher: every role replica of a job as a process on this machine.

Each child runs `rljob role <role>` with the same environment contract the operator gives pods
(`local_identities`), in its own process group; it asks for PR_SET_PDEATHSIG itself as it starts
(`parent_death`), so that it dies with the launcher even when the launcher itself is SIGKILLed. The
supervisor loop applies `spec.failurePolicy` through `FailurePolicy` (rljob/launch/failure_policy.py), the
object the operator uses for pods: a dead env or rollout replica is started again in place (same ports; the
actor notices its new incarnation) after a back-off that doubles with each failure in a row (1 s, 2 s ... 60 s;
the loop keeps supervising the others meanwhile), and the job fails when a replica fails more than
`maxReplacements` times in a row (the count is forgotten once a replacement has run for 10 minutes, or exits
0); a dead actor takes the whole actor group down and up again from the latest checkpoint, at most
`maxRestarts` times. A role that exits with EXIT_FATAL_CONFIG (a configuration error no restart can fix) fails
the job at once with its message. A replica whose `/livez` says one of its loops is stuck (a hung process,
`spec.roles.<role>.probes.livenessTimeoutSeconds`) is killed and handled as a failure, as the kubelet's
liveness probe does in a pod. The job succeeds when actor replica 0 exits 0.

An actor replica with `gpusPerReplica: N` runs N ranks, one per GPU, exactly as in its pod: the launcher
starts one `rljob role actor` per replica, which starts its N ranks (`rljob.runtime.wire.ranks`). Before anything
starts, the GPUs the job asks for are checked against the GPUs torch sees (`assign_local_gpus`), and each
replica that asks for GPUs gets its own through CUDA_VISIBLE_DEVICES, as the device plugin gives a pod its own.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from rljob.api import ROLE_NAMES, RLJob
from rljob.launch.failure_policy import FailurePolicy, ReplicaRecord
from rljob.launch.local_scaling import MEMBERS_FILE, RolloutScaler
from rljob.launch.ports import pick_ports
from rljob.launch.supervisor import Child, LaunchError, LogSink, RunResult, Supervisor
from rljob.runtime.preflight import gpu_problems, gpus_asked, most_replicas, preflight, visible_gpus
from rljob.runtime.process.group_exit import GROUP_EXIT_WAIT_S, kill_group, still_running, wait_for_group_exit
from rljob.runtime.process.parent_death import LAUNCHER_PID_ENV
from rljob.runtime.records.trackers import RESTART_ENV
from rljob.runtime.wire.identity import (
    COLLOCATED_ROLLOUT_HEALTH_ENV,
    DATA_PORT,
    MASTER_PORT,
    SYNC_PORT,
    ReplicaAddress,
    RoleIdentity,
    actor_ranks_per_replica,
    local_identities,
    placed_identities,
    ports_needed,
)

__all__ = ["Child", "HostLayout", "LaunchError", "LocalChild", "LocalRun", "LogSink", "ReplicaHost", "RunResult"]

STOP_GRACE_S = 10.0
SCALE_LOOK_S = 1.0
"""How often the rollout autoscaler reads actor 0's progress and looks for rollouts that came up."""

TEST_RANKS_PER_REPLICA_ENV = "RLJOB_TEST_RANKS_PER_REPLICA"
"""Test hook, not a user setting: ranks per actor replica for a local run in place of `gpusPerReplica`, so
tests on a machine without GPUs run several CPU (gloo) ranks per replica through the path GPU ranks take."""


def check_local(
    job: RLJob,
    ranks_per_replica: int,
    *,
    local_gpus: bool = True,
    visible: Sequence[str] | None = None,
    cuda_visible_devices: str | None = None,
) -> None:
    """Refuse what cannot run, before any process starts: the one preflight (`rljob.runtime.preflight`) that
    `rljob validate` and the operator share, with what the job reads and loads, its engine and, for a run on this
    machine, its GPUs."""
    problems = preflight(
        job,
        load=True,
        engine=True,
        local_gpus=local_gpus,
        ranks_per_replica=ranks_per_replica,
        visible_gpus=visible,
        cuda_visible_devices=cuda_visible_devices,
    )
    if problems:
        raise LaunchError("\n".join(problem.render() for problem in problems))


def local_actor_ranks(job: RLJob, env: Mapping[str, str] | None = None) -> int:
    """Ranks per actor replica: one per GPU it asks for (or RLJOB_TEST_RANKS_PER_REPLICA in tests)."""
    raw = (os.environ if env is None else env).get(TEST_RANKS_PER_REPLICA_ENV, "")
    if not raw:
        return actor_ranks_per_replica(job)
    if not raw.isdigit() or int(raw) < 1:
        raise LaunchError(f"{TEST_RANKS_PER_REPLICA_ENV} must be a whole number >= 1 (got {raw!r}); unset it")
    return int(raw)


def assign_local_gpus(
    job: RLJob, visible: Sequence[str], cuda_visible_devices: str | None = None
) -> dict[tuple[str, int], str]:
    """CUDA_VISIBLE_DEVICES for each replica that asks for GPUs: disjoint slices of `visible`, actors first.

    A replica then sees only its own GPUs, numbered from 0, like a pod: its rank i trains on `cuda:i`. A
    collocated rollout (`roles.rollout.collocated`) sees the GPUs of the actor replica it runs beside, as the two
    processes of one pod do.
    """
    problems = gpu_problems(job, visible, cuda_visible_devices)
    if problems:
        raise LaunchError("\n".join(problem.render() for problem in problems))
    free = iter(visible)
    assigned = {
        (role, replica): ",".join(next(free) for _ in range(gpus))
        for role, gpus, replicas in gpus_asked(job)
        for replica in range(replicas)
    }
    if job.spec.roles.rollout.collocated:
        for (role, replica), devices in list(assigned.items()):
            if role == "actor" and replica < (job.spec.roles.rollout.replicas or 0):
                assigned[("rollout", replica)] = devices
    return assigned


def prepare_run_dir(run_dir: Path) -> None:
    """Create the run directory (and logs/) and make sure this process can write there."""
    try:
        (run_dir / "logs").mkdir(parents=True, exist_ok=True)
        probe = run_dir / ".rljob-write-check"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        reason = exc.strerror or str(exc)
        blocker = next((p for p in (run_dir, *run_dir.parents) if p.exists() and not p.is_dir()), None)
        if blocker is not None:
            reason = f"{blocker} is a file, not a directory"
        raise LaunchError(
            f"--out {run_dir}: cannot use it as the run directory ({reason}); pass a new or writable directory"
        ) from None


def read_progress(url: str, timeout: float = 0.5) -> dict[str, object] | None:
    """Actor 0's `/progress`, or None while it does not answer (not started, busy, or gone mid-answer: an actor
    that exits while answering cuts the body short, an `http.client.IncompleteRead`)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            data = json.loads(response.read())
    except (OSError, ValueError, http.client.HTTPException):
        return None
    return data if isinstance(data, dict) else None


def free_ports(count: int) -> list[int]:
    """`count` distinct ports on this machine that were free a moment ago, outside the ephemeral range."""
    return pick_ports(count, host="127.0.0.1")


@dataclass(frozen=True)
class ReplicaHost:
    """A host of its own for one replica, as a pod is: its own network stack, name and address.

    Peers dial the replica by `name` (which every host resolves, as a pod's DNS name is resolved), on the fixed
    pod ports (rljob/runtime/wire/identity.py); this launcher reaches its health endpoint at `address`. The replica's
    process is started as `command_prefix + [python, -m, rljob.cli.main, role, ROLE]`: the prefix enters that
    host (a network namespace, say) and must exec the rest, so the process it starts is the replica itself.
    """

    name: str
    address: str
    command_prefix: tuple[str, ...] = ()


HostLayout = Callable[[str, int], ReplicaHost]
"""(role, replica) -> the host that replica runs on."""


def hosted_identities(
    job: RLJob, hosts: HostLayout, config_path: str, run_dir: str, actor_ranks: int
) -> list[RoleIdentity]:
    """Identities of a job whose replicas each run on a host of their own, reached by name on pod ports."""
    metrics_port = job.spec.logging.prometheus_port
    addresses = {
        (role, i): ReplicaAddress(hosts(role, i).name, DATA_PORT, metrics_port)
        for role in ROLE_NAMES
        for i in range(job.spec.roles.get(role).replicas or 0)
    }
    return placed_identities(
        job.name, "local", addresses, config_path, MASTER_PORT, SYNC_PORT, run_dir, actor_ranks_per_replica=actor_ranks
    )


@dataclass
class LocalChild(Child):
    process: subprocess.Popen[bytes] | None = None
    reader: threading.Thread | None = None


def beside_collocated_rollouts(identities: list[RoleIdentity], hosts: HostLayout | None) -> list[RoleIdentity]:
    """A collocated job's actor replicas, told where the rollout beside each answers `/healthz`, as the process of
    an actor pod tells its ranks (COLLOCATED_ROLLOUT_HEALTH_ENV): an actor on a GPU takes GPU memory only once its
    rollout's engine holds its own, and is ready only while that rollout is."""
    rollouts = {i.replica: i for i in identities if i.role == "rollout"}
    beside = []
    for identity in identities:
        rollout = rollouts.get(identity.replica) if identity.role == "actor" else None
        if rollout is not None:
            host = "127.0.0.1" if hosts is None else hosts("rollout", rollout.replica).address
            url = f"http://{host}:{rollout.metrics_port}/healthz"
            identity = replace(identity, extra={**identity.extra, COLLOCATED_ROLLOUT_HEALTH_ENV: url})
        beside.append(identity)
    return beside


class LocalRun(Supervisor):
    """Starts, supervises and stops the processes of one job on this machine."""

    def __init__(
        self,
        job: RLJob,
        run_dir: Path,
        log_sink: LogSink,
        extra_env: dict[str, str] | None = None,
        policy: FailurePolicy | None = None,
        hosts: HostLayout | None = None,
    ) -> None:
        """`hosts`: put each replica on a host of its own (a network namespace, as the multi-host tests do)
        instead of this machine's loopback, where every replica shares one network stack and hostname."""
        actor_ranks = local_actor_ranks(job)
        visible, cuda_visible_devices = visible_gpus() if gpus_asked(job) else ([], None)
        check_local(job, actor_ranks, visible=visible, cuda_visible_devices=cuda_visible_devices)
        devices = assign_local_gpus(job, visible, cuda_visible_devices) if gpus_asked(job) else {}
        self.job = job
        self.policy = policy or FailurePolicy.from_spec(job.spec.failure_policy)
        self.run_dir = run_dir
        self.log_sink = log_sink
        self.extra_env = extra_env or {}
        self.config_path = run_dir / "job.yaml"
        self.hosts = hosts
        autoscale = job.spec.roles.rollout.autoscale if job.spec.task.type == "llm" else None
        # Identities (ports, GPUs) for every replica the run can have; the scaler starts some of the rollouts.
        replicas = {r: most_replicas(job, r)[0] for r in ROLE_NAMES}
        if hosts is None:
            identities = local_identities(
                job.name,
                replicas,
                str(self.config_path),
                free_ports(ports_needed(replicas)),
                str(run_dir),
                actor_ranks_per_replica=actor_ranks,
            )
        else:
            identities = hosted_identities(job, hosts, str(self.config_path), str(run_dir), actor_ranks)
        identities = [
            replace(i, extra={**i.extra, "CUDA_VISIBLE_DEVICES": devices[(i.role, i.replica)]})
            if (i.role, i.replica) in devices
            else i
            for i in identities
        ]
        if job.spec.roles.rollout.collocated:
            identities = beside_collocated_rollouts(identities, hosts)
        self.scaler: RolloutScaler | None = None
        if autoscale is not None:
            members = str(run_dir / MEMBERS_FILE)
            identities = [replace(i, rollout_members_file=members) if i.role == "actor" else i for i in identities]
        prepare_run_dir(run_dir)
        self.children: list[LocalChild] = [
            LocalChild(i, run_dir / "logs" / f"{i.role}-{i.replica}.log") for i in identities
        ]
        self.actor_restarts = 0
        if autoscale is not None:
            self.scaler = RolloutScaler(
                autoscale,
                job.spec.roles.rollout.replicas,
                {c.identity.replica: c.identity.endpoints["rollout"][c.identity.replica] for c in self.rollouts()},
                run_dir / MEMBERS_FILE,
                start=self._start_rollout,
                stop=self._stop_rollout,
                ready=self._rollout_ready,
                say=lambda line: self.log_sink("launcher", line),
            )
            for child in self.rollouts():
                child.parked = child.identity.replica >= self.scaler.count
            self._next_scale_look = 0.0

    # --- rollout autoscaling (spec.roles.rollout.autoscale; rljob/launch/local_scaling.py) ---------------

    def rollouts(self) -> list[LocalChild]:
        return [c for c in self.children if c.identity.role == "rollout"]

    def start(self) -> None:
        if self.scaler is not None:
            self.scaler.write_members()  # before the actor starts: it reads the file, never the full list
        super().start()

    def _tick(self) -> None:
        if self.scaler is None or time.monotonic() < self._next_scale_look:
            return
        self._next_scale_look = time.monotonic() + SCALE_LOOK_S
        self.scaler.observe(read_progress(self.progress_url))

    # --- liveness (spec.roles.<role>.probes; the supervisor's `_kill_hung`) ------------------------------------

    def _live_url(self, child: LocalChild) -> str | None:  # type: ignore[override]
        if child.identity.local_rank != 0:
            return None  # its replica's local rank 0 serves the replica's endpoint
        host = "127.0.0.1" if self.hosts is None else self.hosts(child.identity.role, child.identity.replica).address
        return f"http://{host}:{child.identity.metrics_port}/livez"

    def _kill(self, child: LocalChild) -> None:  # type: ignore[override]
        self._signal(child, signal.SIGKILL)

    def _start_rollout(self, replica: int) -> None:
        child = self.child("rollout", replica)
        child.parked = False
        child.failures = ReplicaRecord()  # a fresh start, not a replacement in a row
        self._launch(child)

    def _stop_rollout(self, replica: int) -> None:
        child = self.child("rollout", replica)
        child.parked = True  # its exit is not a failure
        child.replace_at = None
        self._stop_children([child])

    def _rollout_ready(self, replica: int) -> bool:
        child = self.child("rollout", replica)
        if child.parked or child.process is None or child.process.poll() is not None:
            return False
        host = "127.0.0.1" if self.hosts is None else self.hosts("rollout", replica).address
        try:
            with urllib.request.urlopen(f"http://{host}:{child.identity.metrics_port}/healthz", timeout=0.5) as r:
                return bool(r.status == 200)
        except (OSError, ValueError, http.client.HTTPException):
            return False

    @property
    def progress_url(self) -> str:
        actor0 = next(c for c in self.children if c.identity.role == "actor" and c.identity.replica == 0)
        host = "127.0.0.1" if self.hosts is None else self.hosts("actor", 0).address
        return f"http://{host}:{actor0.identity.metrics_port}/progress"

    def _start_child(self, child: LocalChild) -> None:  # type: ignore[override]
        env = {
            **os.environ,
            **child.identity.to_env(),
            **self.extra_env,
            "PYTHONUNBUFFERED": "1",
            LAUNCHER_PID_ENV: str(os.getpid()),  # the child asks to die with us (see parent_death)
            RESTART_ENV: str(child.restarts),  # each actor-group start is a run of its own in the trackers
        }
        prefix = () if self.hosts is None else self.hosts(child.identity.role, child.identity.replica).command_prefix
        child.process = subprocess.Popen(
            [*prefix, sys.executable, "-m", "rljob.cli.main", "role", child.identity.role],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        child.reader = threading.Thread(target=self._pump, args=(child, child.process), daemon=True)
        child.reader.start()

    def _pump(self, child: LocalChild, process: subprocess.Popen[bytes]) -> None:
        assert process.stdout is not None
        with child.log_path.open("ab") as log:
            for raw in process.stdout:
                log.write(raw)
                log.flush()
                line = raw.decode("utf-8", "replace").rstrip()
                child.tail.append(line)
                self.log_sink(child.name, line)

    def _signal(self, child: LocalChild, sig: signal.Signals) -> None:
        if child.process is not None and child.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(child.process.pid, sig)

    def _stop_children(self, children: list[LocalChild], grace_s: float | None = None) -> None:  # type: ignore[override]
        for child in children:
            self._signal(child, signal.SIGTERM)
        deadline = time.monotonic() + (STOP_GRACE_S if grace_s is None else grace_s)
        for child in children:
            if child.process is None:
                continue
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.process.wait(timeout=max(0.1, deadline - time.monotonic()))
            # Whatever is left in the group (the child itself if it ignored SIGTERM, or its own children).
            killed = kill_group(child.process.pid)
            child.process.wait()  # before the group's wait, which would reap it unseen by Popen (status 0)
            if killed:
                self._wait_for_group_exit(child)
            if child.reader is not None:
                child.reader.join(timeout=2)

    def _exit_code(self, child: LocalChild) -> int | None:  # type: ignore[override]
        assert child.process is not None
        code = child.process.poll()
        if code is not None and kill_group(child.process.pid):
            # What the replica started (a vLLM engine's processes) would outlive it and hold the memory its
            # next start needs.
            self._wait_for_group_exit(child)
        return code

    def _wait_for_group_exit(self, child: LocalChild) -> None:
        """After the child's group was SIGKILLed and the child itself reaped."""
        assert child.process is not None
        living = wait_for_group_exit(child.process.pid)
        if living:
            self.log_sink("launcher", f"{child.name}: {still_running(living, GROUP_EXIT_WAIT_S)}")

    def _incarnation(self, child: LocalChild) -> str:  # type: ignore[override]
        assert child.process is not None
        return str(child.process.pid)

    def _drain(self, child: LocalChild) -> None:  # type: ignore[override]
        if child.reader is not None:
            child.reader.join(timeout=5)
