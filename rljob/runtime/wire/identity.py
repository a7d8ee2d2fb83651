"""The contract between a launcher (local processes or the operator's pods) and every role process.

A role process learns who it is and where its peers are from environment variables only. The local
launcher and the operator both build those variables with the functions below, so one code path
serves both. This module imports nothing heavy: the operator image uses it too.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from rljob.api.spec import ROLE_NAMES, RoleName

if TYPE_CHECKING:
    from rljob.api.job import RLJob

# Fixed ports inside pods (each pod has its own IP); locally every process gets its own ports.
DATA_PORT = 29600
"""Data plane (transport) endpoint of every role replica."""
MASTER_PORT = 29500
"""torch.distributed rendezvous of the actor group (on actor replica 0)."""
SYNC_PORT = 29501
"""Weight-sync group actor -> rollout (on actor replica 0)."""
COLLOCATED_DATA_PORT = 29602
"""Data plane of a collocated rollout, the second process of its actor replica's pod (the actor has DATA_PORT)."""
COLLOCATED_METRICS_PORT = 29603
"""Health and metrics of a collocated rollout (the actor serves `spec.logging.prometheusPort`)."""
CONFIG_PATH_IN_POD = "/etc/rljob/job.yaml"
"""Where the operator mounts the ConfigMap holding the resolved job."""

ENV_PREFIX = "RLJOB_"
TRANSPORT_KEY_FILE_ENV = "RLJOB_TRANSPORT_KEY_FILE"
"""The file holding this job's transport key (the operator's per-job Secret, mounted in every pod).
Here, not in transport.py, so the operator image (no msgspec, numpy, zmq) can name it."""
COLLOCATED_ROLLOUT_METRICS_PORT_ENV = "RLJOB_COLLOCATED_ROLLOUT_METRICS_PORT"
"""Set on an actor replica whose process starts the rollout replica beside it (a collocated job in a pod)."""
COLLOCATED_ROLLOUT_HEALTH_ENV = "RLJOB_COLLOCATED_ROLLOUT_HEALTH"
"""Set by that process, once it started the rollout, for its own role program and its ranks: the URL of the
rollout's `/healthz`. The actor's `/healthz` (the pod's readiness probe) is ready only while that one is, so the
pod, and with it the job's status, is Ready only once both processes serve."""

EXIT_FATAL_CONFIG = 78
"""Exit status of a role stopped by its configuration (sysexits EX_CONFIG): an unknown envId, envKwargs the
env does not take, spaces the builtin model cannot handle, a checkpoint written for another model. A restart
would fail the same way, so the local launcher and the operator fail the job at once instead of retrying."""
EXIT_ROLLOUT_GAVE_UP = 79
"""Exit status of a collocated actor replica's process (`rljob role actor` in an actor pod) whose rollout could
not be kept running: it failed under `failurePolicy.rollout: FailJob`, or more than `maxReplacements` times in a
row (`rljob.runtime.roles.collocated`). The operator fails the job on it, as it would for a rollout pod of its own,
instead of restarting the actor group (whose new pod would count the rollout's failures from zero again)."""
EXIT_DIVERGED = 65
"""Exit status of an actor stopped by a non-finite loss or gradient norm (sysexits EX_DATAERR): it applied
no update and wrote no checkpoint from the bad weights. A restart from the last good checkpoint would
diverge the same way, so the local launcher and the operator fail the job (reason Diverged) instead."""
EXIT_PREEMPTED = 75
"""Exit status of an actor asked to stop (SIGTERM: a preemption, a drain, a suspend; SIGINT) that stopped at a step
boundary every rank agreed on and wrote the checkpoint of its last finished step (sysexits EX_TEMPFAIL). Not a
failure: the local launcher, the Ray launcher and the operator start the actor group again from that checkpoint
without charging `failurePolicy.maxRestarts`, and the resumed group goes on at the next step."""


class IdentityError(RuntimeError):
    """The environment does not describe a role process; says which variable is missing or wrong."""


@dataclass(frozen=True)
class RoleIdentity:
    """Who this process is and how to reach every peer."""

    job: str
    namespace: str
    role: RoleName
    replica: int
    config_path: str
    endpoints: dict[RoleName, list[str]]
    """`host:port` of the data-plane endpoint of each replica, per role (empty for absent roles)."""
    master_addr: str
    master_port: int
    sync_port: int
    metrics_port: int
    run_dir: str = ""
    """Local runs: the run's output directory; empty in pods (metrics go to stdout and /metrics)."""
    rollout_members_file: str = ""
    """Actor of an llm job in a pod: the file listing the current rollout replicas, kept by the operator
    (rljob/runtime/llm/replicas/membership.py). Empty: the rollouts are `endpoints["rollout"]`, fixed."""
    extra: dict[str, str] = field(default_factory=dict)
    ranks_per_replica: int = 1
    """Actor: torch.distributed ranks in each replica, one per GPU (`actor_ranks_per_replica`); 1 otherwise."""
    local_rank: int | None = 0
    """This process's rank inside its replica. None for the process a replica with several ranks starts
    as (`rljob role actor` in the pod): it trains in none of them, it starts one process per rank
    (`rljob.runtime.wire.ranks.run_rank_group`), each with its own `local_rank`."""
    collocated_rollout_metrics_port: int = 0
    """Actor replica in a pod of a collocated job: the metrics port of the rollout replica its process starts
    beside it (`rljob.runtime.roles.collocated`); 0 where the rollouts are processes or pods of their own."""

    @property
    def replicas(self) -> int:
        return len(self.endpoints[self.role])

    @property
    def starts_ranks(self) -> bool:
        """True for a replica's process that starts its ranks rather than being one."""
        return self.local_rank is None

    @property
    def rank(self) -> int:
        """Global rank in the actor group: replica-major, so global rank 0 is replica 0's local rank 0."""
        if self.local_rank is None:
            raise IdentityError(
                f"{self.role} replica {self.replica} starts {self.ranks_per_replica} ranks; it has none"
            )
        return self.replica * self.ranks_per_replica + self.local_rank

    @property
    def world_size(self) -> int:
        return self.replicas * self.ranks_per_replica

    def for_rank(self, local_rank: int) -> RoleIdentity:
        """The identity of one rank of this replica."""
        if not 0 <= local_rank < self.ranks_per_replica:
            raise IdentityError(f"local rank {local_rank} is outside 0..{self.ranks_per_replica - 1}")
        # The replica's own process starts the collocated rollout, once: its ranks start none.
        return replace(self, local_rank=local_rank, collocated_rollout_metrics_port=0)

    def collocated_rollout(self) -> RoleIdentity:
        """The identity of the rollout replica this actor replica's process starts beside it: same job, config and
        endpoints; role rollout, the same replica index, one rank, and its own metrics port."""
        if self.role != "actor" or not self.collocated_rollout_metrics_port:
            raise IdentityError(
                f"{self.role} replica {self.replica} starts no collocated rollout "
                "(RLJOB_COLLOCATED_ROLLOUT_METRICS_PORT is not set)"
            )
        if not 0 <= self.replica < len(self.endpoints["rollout"]):
            raise IdentityError(
                f"actor replica {self.replica} has no rollout replica beside it in RLJOB_ROLLOUT_ENDPOINTS "
                f"({len(self.endpoints['rollout'])} endpoints)"
            )
        return replace(
            self,
            role="rollout",
            metrics_port=self.collocated_rollout_metrics_port,
            rollout_members_file="",
            ranks_per_replica=1,
            local_rank=0,
            collocated_rollout_metrics_port=0,
        )

    def to_env(self) -> dict[str, str]:
        env = {
            "RLJOB_JOB_NAME": self.job,
            "RLJOB_NAMESPACE": self.namespace,
            "RLJOB_ROLE": self.role,
            "RLJOB_REPLICA": str(self.replica),
            "RLJOB_REPLICAS": str(self.replicas),
            "RLJOB_CONFIG": self.config_path,
            "RLJOB_METRICS_PORT": str(self.metrics_port),
            "RLJOB_SYNC_PORT": str(self.sync_port),
            "MASTER_ADDR": self.master_addr,
            "MASTER_PORT": str(self.master_port),
        }
        for role in ROLE_NAMES:
            env[f"RLJOB_{role.upper()}_ENDPOINTS"] = ",".join(self.endpoints[role])
        if self.role == "actor":
            env["WORLD_SIZE"] = str(self.world_size)
            env["LOCAL_WORLD_SIZE"] = str(self.ranks_per_replica)
            if self.local_rank is not None:
                env["RANK"] = str(self.rank)
                env["LOCAL_RANK"] = str(self.local_rank)
        if self.run_dir:
            env["RLJOB_RUN_DIR"] = self.run_dir
        if self.rollout_members_file:
            env["RLJOB_ROLLOUT_MEMBERS_FILE"] = self.rollout_members_file
        if self.collocated_rollout_metrics_port:
            env[COLLOCATED_ROLLOUT_METRICS_PORT_ENV] = str(self.collocated_rollout_metrics_port)
        env.update(self.extra)
        return env

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> RoleIdentity:
        env = os.environ if env is None else env

        def need(name: str) -> str:
            value = env.get(name)
            if value is None or value == "":
                raise IdentityError(
                    f"{name} is not set: role processes are started by `rljob run` or by the operator, "
                    "which set RLJOB_* variables (see rljob/runtime/wire/identity.py)"
                )
            return value

        def need_int(name: str) -> int:
            raw = need(name)
            try:
                return int(raw)
            except ValueError:
                raise IdentityError(f"{name} must be an integer (got {raw!r})") from None

        role = need("RLJOB_ROLE")
        if role not in ROLE_NAMES:
            raise IdentityError(f"RLJOB_ROLE must be one of {', '.join(ROLE_NAMES)} (got {role!r})")
        endpoints: dict[RoleName, list[str]] = {
            r: [e for e in env.get(f"RLJOB_{r.upper()}_ENDPOINTS", "").split(",") if e] for r in ROLE_NAMES
        }
        replica = need_int("RLJOB_REPLICA")
        if not 0 <= replica < len(endpoints[role]):  # type: ignore[index]
            raise IdentityError(
                f"RLJOB_REPLICA {replica} is outside RLJOB_{role.upper()}_ENDPOINTS ({len(endpoints[role])} endpoints)"  # type: ignore[index]
            )
        ranks_per_replica, local_rank = 1, 0
        collocated_metrics_port = 0
        if role == "actor":
            ranks_per_replica, local_rank = _ranks_from_env(env, replica, len(endpoints["actor"]))
            if env.get(COLLOCATED_ROLLOUT_METRICS_PORT_ENV):
                collocated_metrics_port = need_int(COLLOCATED_ROLLOUT_METRICS_PORT_ENV)
        return cls(
            job=need("RLJOB_JOB_NAME"),
            namespace=env.get("RLJOB_NAMESPACE", "default"),
            role=role,  # type: ignore[arg-type]
            replica=replica,
            config_path=need("RLJOB_CONFIG"),
            endpoints=endpoints,
            master_addr=need("MASTER_ADDR"),
            master_port=need_int("MASTER_PORT"),
            sync_port=need_int("RLJOB_SYNC_PORT"),
            metrics_port=need_int("RLJOB_METRICS_PORT"),
            run_dir=env.get("RLJOB_RUN_DIR", ""),
            rollout_members_file=env.get("RLJOB_ROLLOUT_MEMBERS_FILE", ""),
            ranks_per_replica=ranks_per_replica,
            local_rank=local_rank,
            collocated_rollout_metrics_port=collocated_metrics_port,
        )


def _ranks_from_env(env: Mapping[str, str], replica: int, replicas: int) -> tuple[int, int | None]:
    """(ranks per replica, local rank or None) of an actor process; RANK and WORLD_SIZE must agree."""

    def optional_int(name: str) -> int | None:
        raw = env.get(name, "")
        if raw == "":
            return None
        try:
            return int(raw)
        except ValueError:
            raise IdentityError(f"{name} must be an integer (got {raw!r})") from None

    given = optional_int("LOCAL_WORLD_SIZE")
    ranks = 1 if given is None else given
    if ranks < 1:
        raise IdentityError(f"LOCAL_WORLD_SIZE must be >= 1 (got {ranks})")
    local_rank = optional_int("LOCAL_RANK")
    if local_rank is None and ranks == 1:
        local_rank = 0
    if local_rank is not None and not 0 <= local_rank < ranks:
        raise IdentityError(f"LOCAL_RANK {local_rank} is outside LOCAL_WORLD_SIZE ({ranks} ranks per replica)")
    world = optional_int("WORLD_SIZE")
    if world is not None and world != replicas * ranks:
        raise IdentityError(
            f"WORLD_SIZE {world} is not RLJOB_ACTOR_ENDPOINTS ({replicas} replicas) x LOCAL_WORLD_SIZE ({ranks})"
        )
    rank = optional_int("RANK")
    if rank is not None and local_rank is not None and rank != replica * ranks + local_rank:
        raise IdentityError(
            f"RANK {rank} is not RLJOB_REPLICA ({replica}) x LOCAL_WORLD_SIZE ({ranks}) + LOCAL_RANK ({local_rank})"
        )
    return ranks, local_rank


def actor_ranks_per_replica(job: RLJob) -> int:
    """Ranks each actor replica runs: one per GPU it asks for (`gpusPerReplica`), one on CPU."""
    return max(1, job.spec.roles.actor.gpus_per_replica)


def _replica_ranks(role: RoleName, actor_ranks_per_replica: int) -> tuple[int, int | None]:
    """(ranks_per_replica, local_rank) of a replica's own process: with several ranks it starts them."""
    if role != "actor" or actor_ranks_per_replica == 1:
        return 1, 0
    return actor_ranks_per_replica, None


def pod_hostname(job: str, role: RoleName, replica: int) -> str:
    """Pod name and hostname: `<job>-<role>-<i>`."""
    return f"{job}-{role}-{replica}"


def pod_dns_name(job: str, role: RoleName, replica: int) -> str:
    """Resolvable inside the namespace through the job's headless Service (named after the job)."""
    return f"{pod_hostname(job, role, replica)}.{job}"


def pod_identity(
    job: str,
    namespace: str,
    role: RoleName,
    replica: int,
    replicas: Mapping[str, int],
    metrics_port: int,
    actor_ranks_per_replica: int = 1,
    collocated_rollout: bool = False,
) -> RoleIdentity:
    """The identity of one pod of a job; `replicas` maps each role to its replica count.

    `collocated_rollout`: rollout replica i runs in actor pod i, as a second process of its container, so its
    endpoint (in every pod's identity) is that pod's name at COLLOCATED_DATA_PORT, and an actor's identity carries
    the rollout's metrics port (COLLOCATED_METRICS_PORT) for its process to start it
    (`RoleIdentity.collocated_rollout`)."""
    ranks, local_rank = _replica_ranks(role, actor_ranks_per_replica)
    endpoints: dict[RoleName, list[str]] = {
        r: [f"{pod_dns_name(job, r, i)}:{DATA_PORT}" for i in range(replicas.get(r, 0))] for r in ROLE_NAMES
    }
    if collocated_rollout:
        endpoints["rollout"] = [
            f"{pod_dns_name(job, 'actor', i)}:{COLLOCATED_DATA_PORT}" for i in range(replicas.get("rollout", 0))
        ]
    return RoleIdentity(
        job=job,
        namespace=namespace,
        role=role,
        replica=replica,
        config_path=CONFIG_PATH_IN_POD,
        endpoints=endpoints,
        master_addr=pod_dns_name(job, "actor", 0),
        master_port=MASTER_PORT,
        sync_port=SYNC_PORT,
        metrics_port=metrics_port,
        ranks_per_replica=ranks,
        local_rank=local_rank,
        collocated_rollout_metrics_port=COLLOCATED_METRICS_PORT if collocated_rollout and role == "actor" else 0,
    )


@dataclass(frozen=True)
class ReplicaAddress:
    """Where one replica process listens: its host and the ports picked for it there."""

    host: str
    data_port: int
    metrics_port: int


def placed_identities(
    job: str,
    namespace: str,
    addresses: Mapping[tuple[str, int], ReplicaAddress],
    config_path: str,
    master_port: int,
    sync_port: int,
    run_dir: str = "",
    actor_ranks_per_replica: int = 1,
) -> list[RoleIdentity]:
    """Identities of every replica process of a job whose replicas listen at `addresses` ((role, replica) ->
    host and ports; replicas of a role numbered from 0). Actor replica 0 also hosts the rendezvous
    (`master_port`) and the weight-sync group (`sync_port`). An actor replica with several ranks is one process,
    as in its pod; it starts its ranks itself."""
    replicas = {r: sum(1 for role, _ in addresses if role == r) for r in ROLE_NAMES}
    endpoints: dict[RoleName, list[str]] = {
        r: [f"{addresses[(r, i)].host}:{addresses[(r, i)].data_port}" for i in range(replicas[r])] for r in ROLE_NAMES
    }
    identities = []
    for role in ROLE_NAMES:
        ranks, local_rank = _replica_ranks(role, actor_ranks_per_replica)
        for i in range(replicas[role]):
            identities.append(
                RoleIdentity(
                    job=job,
                    namespace=namespace,
                    role=role,
                    replica=i,
                    config_path=config_path,
                    endpoints=endpoints,
                    master_addr=addresses[("actor", 0)].host,
                    master_port=master_port,
                    sync_port=sync_port,
                    metrics_port=addresses[(role, i)].metrics_port,
                    run_dir=run_dir,
                    ranks_per_replica=ranks,
                    local_rank=local_rank,
                )
            )
    return identities


def local_identities(
    job: str,
    replicas: Mapping[str, int],
    config_path: str,
    ports: list[int],
    run_dir: str = "",
    actor_ranks_per_replica: int = 1,
) -> list[RoleIdentity]:
    """Identities of every replica process of a local run, on 127.0.0.1.

    `ports` must hold free ports: one data port per replica, plus master, sync, and a metrics
    port per replica. Use `ports_needed(replicas)` to know how many. An actor replica with several
    ranks is one process here, as in its pod; it starts its ranks itself.
    """
    if len(ports) < ports_needed(replicas):
        raise ValueError(f"need {ports_needed(replicas)} free ports, got {len(ports)}")
    order = [(r, i) for r in ROLE_NAMES for i in range(replicas.get(r, 0))]
    data_ports = dict(zip(order, ports, strict=False))
    master_port, sync_port = ports[len(order)], ports[len(order) + 1]
    metrics_ports = dict(zip(order, ports[len(order) + 2 :], strict=False))
    addresses = {key: ReplicaAddress("127.0.0.1", data_ports[key], metrics_ports[key]) for key in order}
    return placed_identities(
        job, "local", addresses, config_path, master_port, sync_port, run_dir, actor_ranks_per_replica
    )


def ports_needed(replicas: Mapping[str, int]) -> int:
    total = sum(replicas.get(r, 0) for r in ROLE_NAMES)
    return 2 * total + 2
