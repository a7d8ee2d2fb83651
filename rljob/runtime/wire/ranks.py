"""An actor replica with several ranks (one per GPU): its process starts one process per rank and answers for them.

The launcher (a local process, or the container of an actor pod) starts `rljob role actor` once per replica,
whatever its number of ranks, so a replica is one unit locally and in Kubernetes. When the replica has
several ranks (`LOCAL_WORLD_SIZE` > 1, no `LOCAL_RANK`), that process runs `run_rank_group`: it starts
`rljob role actor` again for each local rank with `RANK`/`LOCAL_RANK` set (the rank trains on
`cuda:LOCAL_RANK`), prefixes every line they print with `rank <RANK> |`, and ends like one process would:
when one rank fails the others are stopped and the replica exits with that rank's code (EXIT_FATAL_CONFIG
when any rank stopped on a configuration error, so the launcher never retries it).

Also here: `nccl_usage_problem`, which tells a configuration error in how ranks use GPUs (two ranks on one
GPU) from a failure a restart could get past.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any, BinaryIO

from rljob.runtime.process.early_stop import held_stop_request
from rljob.runtime.process.parent_death import LAUNCHER_PID_ENV
from rljob.runtime.process.prefixed_output import copy_prefixed
from rljob.runtime.wire.context import FatalConfigError
from rljob.runtime.wire.identity import (
    COLLOCATED_ROLLOUT_METRICS_PORT_ENV,
    EXIT_DIVERGED,
    EXIT_FATAL_CONFIG,
    EXIT_PREEMPTED,
    RoleIdentity,
)

RANK_STOP_GRACE_S = 10.0
"""How long the ranks left after a failure (or a stop request) get to exit before they are killed."""


def rank_command(role: str) -> list[str]:
    return [sys.executable, "-m", "rljob.cli.main", "role", role]


def _exit_status(code: int) -> int:
    """A shell-style status: a rank killed by signal N is reported as 128 + N."""
    return 128 - code if code < 0 else code


class RankGroup:
    """The rank processes of one replica, their output, and their end."""

    def __init__(
        self,
        identity: RoleIdentity,
        command: Sequence[str],
        base_env: Mapping[str, str],
        out: BinaryIO,
    ) -> None:
        self.identity = identity
        self.out = out
        self._lock = threading.Lock()
        self.processes: list[subprocess.Popen[bytes]] = []
        self.readers: list[threading.Thread] = []
        # The replica's process runs a collocated rollout (rljob/runtime/roles/collocated.py); its ranks run none.
        base_env = {k: v for k, v in base_env.items() if k != COLLOCATED_ROLLOUT_METRICS_PORT_ENV}
        for local_rank in range(identity.ranks_per_replica):
            rank = identity.for_rank(local_rank)
            process = subprocess.Popen(
                list(command),
                # Each rank asks to die with this process first thing (see parent_death): fork-safe.
                env={**base_env, **rank.to_env(), "PYTHONUNBUFFERED": "1", LAUNCHER_PID_ENV: str(os.getpid())},
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
            self.processes.append(process)
            reader = threading.Thread(target=self._pump, args=(rank.rank, process), daemon=True)
            reader.start()
            self.readers.append(reader)

    def _pump(self, rank: int, process: subprocess.Popen[bytes]) -> None:
        assert process.stdout is not None
        copy_prefixed(process.stdout, f"rank {rank} | ", self.out, self._lock)

    def say(self, message: str) -> None:
        with self._lock:
            self.out.write(f"{self.identity.role}[{self.identity.replica}] {message}\n".encode())
            self.out.flush()

    def signal(self, sig: int) -> None:
        for process in self.processes:
            if process.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    process.send_signal(sig)

    def stop(self) -> None:
        """SIGTERM every rank still running, SIGKILL what is left after the grace period, drain the output."""
        self.signal(signal.SIGTERM)
        deadline = time.monotonic() + RANK_STOP_GRACE_S
        for process in self.processes:
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=max(0.1, deadline - time.monotonic()))
            if process.poll() is None:
                process.kill()
                process.wait()
        for reader in self.readers:
            reader.join(timeout=5)

    def wait(self, poll_s: float = 0.1) -> int:
        """Until every rank exited 0 (-> 0) or stopped for a preemption (-> EXIT_PREEMPTED, when any did), or one
        failed (-> its status, EXIT_FATAL_CONFIG or EXIT_DIVERGED when a
        rank exited with it; the rest stopped)."""
        while True:
            codes = [p.poll() for p in self.processes]
            # A rank that stopped for a preemption agreed on it with every other: they end on their own (rank 0
            # may still be writing the checkpoint), so the others are left to finish, not stopped.
            failed = [(i, c) for i, c in enumerate(codes) if c not in (None, 0, EXIT_PREEMPTED)]
            if failed:
                local_rank, code = failed[0]
                self.say(
                    f"rank {self.identity.for_rank(local_rank).rank} exited with code {code}: "
                    "stopping the other ranks of this replica"
                )
                self.stop()
                codes = [p.returncode for p in self.processes]
                if EXIT_FATAL_CONFIG in codes:
                    return EXIT_FATAL_CONFIG
                if EXIT_DIVERGED in codes:  # every rank agreed; the first to exit need not be the one that saw it
                    return EXIT_DIVERGED
                return _exit_status(code)  # type: ignore[arg-type]
            if all(c is not None for c in codes):
                for reader in self.readers:
                    reader.join(timeout=5)
                return EXIT_PREEMPTED if EXIT_PREEMPTED in codes else 0
            time.sleep(poll_s)


def run_rank_group(
    identity: RoleIdentity,
    command: Sequence[str] | None = None,
    base_env: Mapping[str, str] | None = None,
    out: BinaryIO | None = None,
) -> int:
    """Start the replica's ranks, forward SIGTERM/SIGINT to them, and return the replica's exit status.

    `command` is what each rank runs (default: `rljob role <role>`); each gets `base_env` (default: this
    process's environment) plus its identity's variables.
    """
    if not identity.starts_ranks:
        raise ValueError(f"{identity.role} replica {identity.replica} is a rank (LOCAL_RANK is set); it starts none")
    command = command or rank_command(identity.role)
    base_env = os.environ if base_env is None else base_env
    out = out or sys.stdout.buffer
    first, last = identity.replica * identity.ranks_per_replica, (identity.replica + 1) * identity.ranks_per_replica
    group: RankGroup | None = None
    requested: list[int] = []

    def forward(signum: int, _frame: object) -> None:
        # The ranks finish their unit of work and exit; `wait` sees them go.
        requested.append(signum)
        if group is not None:
            group.signal(signum)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGINT)}
    if (held := held_stop_request()) is not None:  # asked before this handler was there (early_stop)
        requested.append(held)
    try:
        group = RankGroup(identity, command, base_env, out)
        if requested:  # a stop asked for while the ranks were being started
            group.signal(requested[0])
        group.say(
            f"started ranks {first}..{last - 1} of WORLD_SIZE {identity.world_size} "
            f"({identity.ranks_per_replica} per replica)"
        )
        return group.wait()
    except BaseException:
        if group is not None:
            group.stop()
        raise
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def nccl_usage_problem(exc: BaseException) -> str | None:
    """The NCCL complaint when `exc` says the ranks use GPUs wrongly (a configuration error); None otherwise.

    NCCL reports two ranks on one GPU as `ncclInvalidUsage` ("Duplicate GPU detected : rank 1 and rank 0
    both on CUDA device ..."). That fails the same way after every restart, unlike a peer that died or a
    timeout (`ncclRemoteError`, `ncclSystemError`), which a restart may get past.
    """
    if not isinstance(exc, RuntimeError):  # torch.distributed.DistBackendError is one
        return None
    text = str(exc)
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    duplicate = next((line for line in lines if "Duplicate GPU detected" in line), None)
    if duplicate is not None:
        return duplicate
    lowered = text.lower()
    if "nccl" in lowered and ("invalid usage" in lowered or "ncclinvalidusage" in lowered):
        return lines[0] if lines else "NCCL invalid usage"
    return None


def rank_device(gpus_per_replica: int, local_rank: int | None, field: str = "spec.roles.actor.gpusPerReplica") -> Any:
    """This rank's device, made the process's current CUDA device: `cuda:LOCAL_RANK` when the role was given GPUs
    and sees them (one GPU per rank), else the CPU.

    The current device is what NCCL puts a communicator on, and what FSDP2's `fully_shard` and
    `broadcast_object_list` allocate on: without `set_device` every rank of a replica works on GPU 0 (NCCL's
    "Duplicate GPU detected", a hang, or out of memory). A local rank without a GPU of its own is a configuration
    error naming `field`."""
    import torch

    if gpus_per_replica == 0 or not torch.cuda.is_available():
        return torch.device("cpu")
    local_rank = local_rank or 0
    visible = torch.cuda.device_count()
    if local_rank >= visible:
        raise FatalConfigError(
            f"{field} ({gpus_per_replica}) gives each replica {gpus_per_replica} ranks, one per GPU, but local "
            f"rank {local_rank} sees only {visible} GPU(s) (CUDA_VISIBLE_DEVICES="
            f"{os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}): lower it or give the replica its GPUs"
        )
    device = torch.device("cuda", local_rank)
    torch.cuda.set_device(device)
    return device


def join_actor_group(identity: RoleIdentity, device: Any, timeout_minutes: float) -> None:
    """Join the actor ranks' torch.distributed group (NCCL between GPUs, gloo on CPU); rank 0 hosts it.

    On a GPU the group is bound to this rank's device (`device_id`, after `set_device`): NCCL creates the
    communicator on it at once, never on whatever device happens to be current."""
    import datetime

    import torch
    import torch.distributed as dist

    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group(
        "nccl" if cuda else "gloo",
        init_method=f"tcp://{identity.master_addr}:{identity.master_port}",
        rank=identity.rank,
        world_size=identity.world_size,
        timeout=datetime.timedelta(minutes=timeout_minutes),
        **({"device_id": device} if cuda else {}),
    )


def nccl_config_error(replicas: int, gpus_per_replica: int, exc: BaseException) -> FatalConfigError | None:
    """NCCL refusing how the actor's ranks use GPUs is a configuration error (a FatalConfigError naming the fields):
    no restart would fix it. None for any other failure."""
    problem = nccl_usage_problem(exc)
    if problem is None:
        return None
    return FatalConfigError(
        f"NCCL refused the actor group's GPUs ({problem}): every rank needs a GPU of its own; "
        f"spec.roles.actor.replicas ({replicas}) x spec.roles.actor.gpusPerReplica ({gpus_per_replica}) "
        "must fit the GPUs given to the actor replicas"
    )


STOP_RUN = 1
"""`agree_to_stop`'s answer: finish the current step, write its checkpoint, exit EXIT_PREEMPTED."""
STOP_NOW = 2
"""`agree_to_stop`'s answer: abandon the current step (rank 0 has no batch for it), checkpoint the last one, exit."""


def agree_to_stop(vote: int, device: Any, world_size: int) -> int:
    """Every actor rank's answer to "stop?" at a step boundary, the same on all: the largest vote (0 go on,
    STOP_RUN, STOP_NOW). A rank votes STOP_RUN once asked to stop (SIGTERM/SIGINT); rank 0 votes STOP_NOW when
    it gave up waiting for the step's data. One all-reduce of one number (gloo on CPU, NCCL on GPU); with one rank
    its own vote."""
    if world_size <= 1:
        return vote
    import torch
    import torch.distributed as dist

    box = torch.tensor([vote], dtype=torch.int32, device=device)
    dist.all_reduce(box, op=dist.ReduceOp.MAX)
    return int(box.item())
