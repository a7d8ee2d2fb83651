"""Versioned weight sync actor -> rollouts: one torch.distributed broadcast group, or safetensors files.

`weightSync.method: broadcast`: actor rank 0 hosts a TCPStore on RLJOB_SYNC_PORT and broadcasts each version
ONCE to one group holding every rollout replica it syncs (rank 0 = the actor; each replica takes
`ranks_per_replica` ranks: one per vLLM tensor-parallel worker, each of which receives the full tensors and
loads its own shard). The group is named by the actor's incarnation tag and an epoch that changes whenever the
members (replica index and incarnation tag) change or a sync fails: a joined, left or restarted rollout makes
the next sync form a new group, and nobody ever reuses a broken group's store keys. Parameters travel
flattened into buckets of at most `weightSync.bucketSizeMb`.

A round is two-phase, so no member is ever left blocked in a group that will not broadcast: each member
accepts (a store key per member), the actor waits for all of them, then writes `go` (everyone joins the
broadcast) or `abort` (a member never accepted: the others give up at once, the actor retries without it).
How long a member is waited for depends on what the actor knows of it (`AcceptDeadlines`): one that
accepted before on this store is connected and answers in milliseconds; one never seen may still be making
its first connection, which can take tens of seconds (below); each miss doubles its next wait, up to a cap.

What a first connection costs: torch's c10d formats the peer's address with `getnameinfo` when a TCPStore
starts and when a client connects, which asks DNS for the reverse name of the IPv4-mapped form of the
address (`::ffff:10.0.0.5`): no /etc/hosts names that, so a cluster whose DNS is slow or silent makes each
such lookup wait out the resolver (5 s x 2 tries by default; measured 10.0 s per store start and per first
client connection, tests/multihost). torch offers no switch for it; a connection once made is kept, so the
cost is paid once per store and process, never per round.

The group's backend and device follow the tensors, one decision per round, made by the actor: each member's
accept says where it receives (`device_report`: the GPUs it receives into, or the CPU), and the actor picks
NCCL when its own tensors and every member's are CUDA, each on a GPU of its own (NCCL refuses two ranks on
one GPU), and gloo otherwise (`choose_backend`); the go key carries the choice. Under NCCL the actor sends
its CUDA tensors as they are and every buffer is on the device (released when the round ends: memory the
update and the engine use in between); under gloo it sends CPU copies and a member receiving into CUDA
tensors lets gloo stage them through the host. A round that switches the backend forms a new group, named
(store prefix) by the epoch, the backend and the round it was formed in (`GoSignal`).

`weightSync.method: filesystem`: actor rank 0 writes each version once as a safetensors file in a directory
every rollout can read (atomic rename, version and actor incarnation in the name) and sends its path.

A sharded actor (FSDP2) publishes a `GatheredWeights` instead of a module: each full tensor is assembled
as its bucket is built (a collective every actor rank joins), so no rank ever holds the whole model.
"""

from __future__ import annotations

import contextlib
import copy
import datetime
import gc
import os
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol

import torch
from torch import nn
from torch.distributed import PrefixStore, ProcessGroupGloo, TCPStore

from rljob.runtime.weights.nccl_env import GROUP_TIMEOUT_S, align_nccl_environment

GROUP_TIMEOUT = datetime.timedelta(seconds=GROUP_TIMEOUT_S)
"""How long group formation and each broadcast may take; covers a member's first gloo connections."""
ACCEPT_KNOWN_S = 5.0
"""Wait for a member that accepted a round of this actor before: it holds a live store connection."""
ACCEPT_FIRST_S = 20.0
"""First wait for a member never seen: its first store connection may pay reverse-DNS lookups (above)."""
ACCEPT_MAX_S = 160.0
"""The cap on a member's wait; each round it misses doubles the next one until then."""


class SyncRefused(RuntimeError):
    """Rollouts did not accept a weight sync in time (gone, restarted, or busy); `replicas` names them."""

    def __init__(self, message: str, replicas: frozenset[int] = frozenset()) -> None:
        super().__init__(message)
        self.replicas = replicas


class SyncAborted(RuntimeError):
    """The actor called a round off because another member never accepted it; it retries without that one."""


@dataclass(frozen=True)
class SyncTicket:
    """What a rollout's `sync_weights` request carries as `key` with `broadcast`: its place in one round.

    `rank` is the member's first rank in the group (its tensor-parallel workers take `rank + tp_rank`);
    `round` numbers the actor's rounds, so the accept and go keys of two rounds never meet.
    """

    group: str
    rank: int
    world: int
    round: int

    def encode(self) -> str:
        return f"{self.group}|{self.rank}|{self.world}|{self.round}"

    @classmethod
    def decode(cls, key: str) -> SyncTicket:
        group, rank, world, round_ = key.rsplit("|", 3)
        return cls(group, int(rank), int(world), int(round_))

    @property
    def accepted_key(self) -> str:
        """Set by the member: "this incarnation joins this round"."""
        return f"weights/{self.group}/accepted/{self.round}/{self.rank}"

    @property
    def go_key(self) -> str:
        """Set by the actor once every member accepted (`GoSignal`: the round's backend and group) or when one
        never did (b"abort")."""
        return f"weights/{self.group}/go/{self.round}"


SyncBackend = Literal["gloo", "nccl"]


@dataclass(frozen=True)
class GoSignal:
    """The go key's value: the round's backend, and the round its group was formed in (the group is named by
    the epoch, the backend and that round, so a switch of backend, there and back, always meets in fresh
    store keys)."""

    backend: SyncBackend
    formed: int

    def encode(self) -> bytes:
        return f"go:{self.backend}:{self.formed}".encode()

    @classmethod
    def decode(cls, value: bytes) -> GoSignal:
        """A RuntimeError (a failed sync, as any other) for a value no rljob actor of this version writes."""
        match value.decode(errors="replace").split(":"):
            case ["go", "gloo" | "nccl" as backend, formed] if formed.isdigit():
                return cls(backend, int(formed))  # type: ignore[arg-type]
        raise RuntimeError(f"the actor's go key holds {value[:40]!r}: is the actor another rljob version?")

    def group(self, ticket: SyncTicket) -> str:
        """The name of the round's group (its store prefix is `weights/<name>/pg/`)."""
        return f"{ticket.group}/{self.backend}/{self.formed}"


def tensors_device(tensors: Iterable[torch.Tensor]) -> torch.device:
    """Where a member's tensors live: the first one's device (the CPU for none)."""
    return next((t.device for t in tensors), torch.device("cpu"))


def gpu_uuid(device: torch.device) -> str:
    """The physical GPU behind `device`, the same whatever CUDA_VISIBLE_DEVICES numbers it in this process."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    return str(torch.cuda.get_device_properties(index).uuid)


def device_report(devices: Iterable[torch.device]) -> bytes:
    """What a member (or the actor) says about where it sends or receives a round: b"cuda:<uuid>,..." naming
    every GPU its tensors are on when all of them are CUDA and this torch has NCCL, else b"cpu"."""
    devices = list(devices)
    if not devices or any(d.type != "cuda" for d in devices) or not torch.distributed.is_nccl_available():
        return b"cpu"
    return ("cuda:" + ",".join(gpu_uuid(d) for d in devices)).encode()


def tensors_report(tensors: Iterable[torch.Tensor]) -> bytes:
    """`device_report` of one rank's tensors: its GPU when all are on one, else b"cpu" (a model spread over
    several devices goes by gloo)."""
    devices = {t.device for t in tensors}
    return device_report(devices) if len(devices) == 1 else b"cpu"


def joint_report(reports: Iterable[bytes]) -> bytes:
    """One member's report for several ranks (a vLLM rollout's tensor-parallel workers): their GPUs when
    every one receives into CUDA tensors, else b"cpu"."""
    reports = list(reports)
    if not reports or not all(r.startswith(b"cuda:") for r in reports):
        return b"cpu"
    return b"cuda:" + b",".join(r.removeprefix(b"cuda:") for r in reports)


def choose_backend(reports: Iterable[bytes]) -> SyncBackend:
    """The round's backend from the actor's `device_report` and every member's: NCCL when all hold CUDA
    tensors, each rank on a GPU no other rank uses (NCCL refuses two ranks on one GPU); gloo otherwise,
    including for a member that reports nothing of its device (b"1", an older rljob)."""
    gpus: list[str] = []
    for report in reports:
        if not report.startswith(b"cuda:"):
            return "gloo"
        gpus.extend(report.removeprefix(b"cuda:").decode().split(","))
    return "nccl" if len(set(gpus)) == len(gpus) else "gloo"


GLOO_THREADS = 8
"""Worker threads of a sync group. Each tensor of 1 MiB or more is its own asynchronous broadcast; gloo runs
them on this many threads. Measured on a 128 MiB policy (58 such tensors), 2 processes on this repository's
2-core machine: 1.8x one flat broadcast of the same bytes with gloo's default 2 threads, 1.45x with 8."""


def make_group(
    store: TCPStore,
    group: str,
    rank: int,
    world: int,
    backend: SyncBackend = "gloo",
    device: torch.device | None = None,
) -> torch.distributed.ProcessGroup:
    """The group `group` (`GoSignal.group`: epoch, backend, round formed) on its own prefix of the shared store;
    blocks until all `world` members join. An NCCL group needs `device`, the CUDA device of this member's
    tensors."""
    prefix = PrefixStore(f"weights/{group}/pg/", store)
    if backend == "nccl":
        if device is None or device.type != "cuda":
            raise ValueError(f"an NCCL weight sync group needs a CUDA device, got {device}")
        return _nccl_group(prefix, rank, world, device)
    options = ProcessGroupGloo._Options()
    options._timeout = GROUP_TIMEOUT
    # As torch's own constructor: the interfaces GLOO_SOCKET_IFNAME names (a multi-NIC node), else the default.
    interfaces = [i for i in os.environ.get("GLOO_SOCKET_IFNAME", "").split(",") if i]
    options._devices = [ProcessGroupGloo.create_device(interface=i) for i in interfaces] or [
        ProcessGroupGloo.create_default_device()
    ]
    options._threads = GLOO_THREADS
    return ProcessGroupGloo(prefix, rank, world, options)


_NCCL_ENV_LOCK = threading.Lock()
"""Held while the environment is changed for one group's constructor (threads of one process may make groups)."""


def rendezvous(
    store: torch.distributed.Store, rank: int, world: int, timeout: datetime.timedelta = GROUP_TIMEOUT
) -> None:
    """Say this rank is here and wait until all `world` ranks are; a RuntimeError (torch's DistStoreError) after
    `timeout` when one never comes."""
    store.set(f"joined/{rank}", b"1")
    store.wait([f"joined/{r}" for r in range(world)], timeout)


def _nccl_group(prefix: PrefixStore, rank: int, world: int, device: torch.device) -> torch.distributed.ProcessGroup:
    """ProcessGroupNCCL as torch's own stateless factory builds it (torch.distributed._dist2), with its
    communicator formed now on `device`.

    Blocking wait: a member that dies mid-round makes the broadcast raise after GROUP_TIMEOUT (the round
    fails, the next forms a new group), where NCCL's default error handling would tear this process down.
    ProcessGroupNCCL reads the variable when it is constructed, so it is set for this group alone.

    Non-blocking communicator creation (`config.blocking = 0`): a member that dies between the rendezvous and the
    init would otherwise leave the others in `ncclCommInitRank` for good; torch polls a non-blocking init for
    `TORCH_NCCL_NONBLOCKING_TIMEOUT` seconds (`align_nccl_environment`: GROUP_TIMEOUT) and raises."""
    from torch.distributed import ProcessGroupNCCL  # only in CUDA builds of torch

    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    # Forming the communicator has no timeout: a member that accepted the round and died before joining would
    # leave everyone in it for good. So every rank first says it is here and waits for all.
    rendezvous(prefix, rank, world)
    options = ProcessGroupNCCL.Options()
    options._timeout = GROUP_TIMEOUT
    options.is_high_priority_stream = False
    options.config.blocking = 0
    align_nccl_environment()  # a process that skipped the role entry (a test, a script) still gets a bounded init
    with _NCCL_ENV_LOCK:
        saved = os.environ.get("TORCH_NCCL_BLOCKING_WAIT")
        os.environ["TORCH_NCCL_BLOCKING_WAIT"] = "1"
        try:
            pg = ProcessGroupNCCL(prefix, rank, world, options)
        finally:
            if saved is None:
                del os.environ["TORCH_NCCL_BLOCKING_WAIT"]
            else:
                os.environ["TORCH_NCCL_BLOCKING_WAIT"] = saved
    pg._set_sequence_number_for_group()
    with torch.cuda.device(device):
        pg.eager_connect_single_device(device)
    return pg


def discard_group(group: torch.distributed.ProcessGroup | None) -> None:
    """Let a group go that no round will use again. An NCCL group is aborted now: its communicator, buffers and
    watchdog thread would otherwise stay until the process ends (one per failed round or new epoch)."""
    if group is None or not hasattr(group, "abort") or "nccl" not in group.name().lower():
        return
    with contextlib.suppress(RuntimeError):
        group.abort()


def buckets(tensors: list[torch.Tensor], bucket_bytes: int) -> list[list[int]]:
    """Indices of `tensors` grouped so each bucket holds at most `bucket_bytes` (a big tensor gets its own)."""
    groups: list[list[int]] = [[]]
    size = 0
    for i, t in enumerate(tensors):
        nbytes = t.numel() * t.element_size()
        if groups[-1] and size + nbytes > bucket_bytes:
            groups.append([])
            size = 0
        groups[-1].append(i)
        size += nbytes
    return groups


def state_tensors(model: nn.Module) -> list[torch.Tensor]:
    """Every tensor of the state dict (buffers and tied weights included), in a fixed order."""
    return [t.detach() for t in model.state_dict().values()]


class GatheredWeights(Protocol):
    """A model held in shards across the actor ranks (see `rljob.runtime.llm.training.sharding.ShardedWeights`)."""

    def placeholders(self) -> list[torch.Tensor]:
        """Meta tensors in state-dict order with the shapes and dtypes the rollout holds: they size the buckets."""
        ...

    def names(self) -> list[str]:
        """The state-dict names of `placeholders()`, in the same order."""
        ...

    def device(self) -> torch.device:
        """The device this rank's shards are on."""
        ...

    def begin_gather(self, bucket_bytes: int) -> None:
        """Tell the other actor ranks to join the gathers of one pass over every tensor, in order, waiting for their
        gathers after every `bucket_bytes` of them (the round's bucket: rank 0 builds one at a time)."""
        ...

    def full(self, index: int, device: torch.device | None = None) -> torch.Tensor:
        """The whole tensor `index` on `device` (the CPU by default); a collective: every actor rank calls
        it, in the same order."""
        ...


IN_PLACE_MIN_BYTES = 2**20
"""Tensors this big travel in place; smaller ones are packed together into one broadcast."""


class PackBuffer:
    """The flat tensors small tensors are packed into, one per dtype and device, kept from bucket to bucket;
    the host ones also from round to round: fresh memory pays a page fault per page on first touch (packing
    128 MiB took 47 ms into new memory, 13 ms into this buffer, on this repository's 2-core machine). The
    device ones go at the end of each round (`release_device`): up to a bucket per dtype of GPU memory that the
    actor's training, or the rollout's engine, uses until the next round."""

    def __init__(self) -> None:
        self._flat: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}

    def take(self, numel: int, dtype: torch.dtype, device: torch.device | None = None) -> torch.Tensor:
        key = (dtype, device or torch.device("cpu"))
        flat = self._flat.get(key)
        if flat is None or flat.numel() < numel:
            self._flat.pop(key, None)  # the old one goes first: on a GPU both may not fit
            flat = self._flat[key] = torch.empty(numel, dtype=dtype, device=key[1])
        return flat[:numel]

    def clear(self) -> None:
        """Free the buffers (a round on another device or backend will not use them)."""
        self._flat.clear()

    def release_device(self) -> None:
        """Free the buffers that are not in host memory (the end of a round); the host ones stay."""
        for key in [key for key in self._flat if key[1].type != "cpu"]:
            del self._flat[key]

    def held(self) -> dict[str, int]:
        """Bytes held per device (`cpu`, `cuda:0`, ...)."""
        held: dict[str, int] = {}
        for (_, device), flat in self._flat.items():
            held[str(device)] = held.get(str(device), 0) + flat.numel() * flat.element_size()
        return held


def round_stream(device: torch.device | None) -> torch.cuda.Stream | None:
    """A stream of the round's own on a CUDA `device` (None elsewhere), after the work this thread queued so far.

    The round's copies and waits go on it, and the host waits for it alone (`Stream.synchronize`), never for the
    whole device: on a rollout the round runs on the weight-receiving thread while the generating thread may be
    capturing a CUDA graph, which a device-wide `torch.cuda.synchronize` would break."""
    if device is None or device.type != "cuda":
        return None
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))  # the tensors' last writes (an optimizer step) come first
    return stream


def broadcast_state(
    group: torch.distributed.ProcessGroup,
    tensors: Iterable[torch.Tensor],
    bucket_bytes: int,
    materialize: Callable[[int], torch.Tensor] | None = None,
    pack: PackBuffer | None = None,
    device: torch.device | None = None,
) -> None:
    """Root side (rank 0) and receiving side alike: after the call, every member's tensors equal rank 0's.

    In each bucket, tensors of IN_PLACE_MIN_BYTES or more travel in place (one asynchronous broadcast each,
    no copy on either side) and the small ones are packed into `pack`, one broadcast per dtype: measured on
    a 128 MiB policy, about 1.5x a single broadcast of the same bytes, against 2.2x with every tensor on its
    own and 2x with everything packed. With `materialize` (root side only) `tensors` only size the buckets
    and tensor i is `materialize(i)`, built on `device` when its bucket is: one bucket of full tensors exists at
    a time. Those calls are collectives of the actor group, so a failed send does not stop them: the pass is
    finished, then the error is raised. The small tensors are packed on their own device. On CUDA the round runs
    on a stream of its own (`round_stream`) and the host waits for it after every bucket: a bucket's memory is
    given back before the next one is built (asynchronous collectives would otherwise queue every bucket at once),
    and the call returns once the round is done (a receiver's tensors are complete, a sender's may change).
    """
    tensors = list(tensors)
    if device is None and materialize is None and tensors:
        device = tensors_device(tensors)
    stream = round_stream(device)
    with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
        _broadcast_buckets(group, tensors, bucket_bytes, materialize, pack or PackBuffer(), stream)


def _broadcast_buckets(
    group: torch.distributed.ProcessGroup,
    tensors: list[torch.Tensor],
    bucket_bytes: int,
    materialize: Callable[[int], torch.Tensor] | None,
    pack: PackBuffer,
    stream: torch.cuda.Stream | None,
) -> None:
    root = group.rank() == 0
    failure: RuntimeError | None = None
    for bucket in buckets(tensors, bucket_bytes):
        parts = [tensors[i] if materialize is None else materialize(i) for i in bucket]
        if failure is not None:
            continue
        try:
            _broadcast_bucket(group, parts, pack, root)
        except RuntimeError as exc:
            if materialize is None:
                raise
            failure = exc
        finally:
            del parts  # a materialized bucket's full tensors go as soon as the device is done with them
            if stream is not None:
                stream.synchronize()  # this bucket is done: its memory goes back before the next is built
    if failure is not None:
        raise failure


def _broadcast_bucket(
    group: torch.distributed.ProcessGroup, parts: list[torch.Tensor], pack: PackBuffer, root: bool
) -> None:
    big = [p for p in parts if p.is_contiguous() and p.numel() * p.element_size() >= IN_PLACE_MIN_BYTES]
    small: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for p in parts:
        if not any(p is b for b in big):
            small.setdefault((p.dtype, p.device), []).append(p)
    works = [group.broadcast(p, 0) for p in big]
    for (dtype, device), members in small.items():
        flat = pack.take(sum(p.numel() for p in members), dtype, device)
        if root:
            torch.cat([p.reshape(-1) for p in members], out=flat)
        group.broadcast(flat, 0).wait()
        if not root:
            offset = 0
            for p in members:
                p.copy_(flat[offset : offset + p.numel()].view_as(p))
                offset += p.numel()
    for work in works:
        work.wait()


class AcceptDeadlines:
    """How long a round waits for each member to accept: bounded, growing with every round it misses.

    Members are (replica index, incarnation tag): a restarted replica is a new member that has to connect
    again. A member that accepts is known from then on (ACCEPT_KNOWN_S); one that never accepted starts at
    ACCEPT_FIRST_S; each miss doubles the member's wait, up to ACCEPT_MAX_S.
    """

    def __init__(self) -> None:
        self._known: set[tuple[int, str]] = set()
        self._misses: dict[tuple[int, str], int] = {}

    def seconds(self, member: tuple[int, str]) -> float:
        base = ACCEPT_KNOWN_S if member in self._known else ACCEPT_FIRST_S
        return min(ACCEPT_MAX_S, base * 2 ** self._misses.get(member, 0))

    def accepted(self, member: tuple[int, str]) -> None:
        self._known.add(member)
        self._misses.pop(member, None)

    def missed(self, member: tuple[int, str]) -> None:
        self._misses[member] = self._misses.get(member, 0) + 1


class WeightPublisher:
    """Actor rank 0 side: one store, one group per epoch of members, one broadcast per round.

    `plan` names the round's members and returns each one's ticket (sent in its `sync_weights` request);
    `publish` waits until all accepted, then broadcasts once to all of them.
    """

    def __init__(self, host: str, port: int, actor_tag: str, bucket_mb: int, ranks_per_replica: int = 1) -> None:
        self.store = TCPStore(host, port, is_master=True, wait_for_workers=False, timeout=GROUP_TIMEOUT)
        self.actor_tag = actor_tag
        self.bucket_bytes = bucket_mb * 2**20
        self.ranks_per_replica = ranks_per_replica
        self._epoch = 0
        self._members: list[tuple[int, str]] | None = None
        self._group: torch.distributed.ProcessGroup | None = None
        self._go: GoSignal | None = None
        """The current group's backend and the round it was formed in."""
        self.backend: SyncBackend | None = None
        """The backend of the last round that started."""
        self._round = 0
        self._planned_tags: dict[int, str] = {}
        self._tickets: dict[int, SyncTicket] = {}
        self._pack = PackBuffer()
        self.deadlines = AcceptDeadlines()

    def plan(
        self, members: Iterable[tuple[int, str]], version: int, model: nn.Module | GatheredWeights
    ) -> dict[int, str]:
        """Tickets (the `key` of each member's `sync_weights` request) for one broadcast of `version` to
        `members` (replica index, incarnation tag). Another set of members than the last round's forms a new group."""
        chosen = sorted(members)
        if chosen != self._members:
            self._epoch += 1
            self._members = chosen
            discard_group(self._group)
            self._group = None
        self._round += 1
        world = 1 + len(chosen) * self.ranks_per_replica
        group = f"{self.actor_tag}/{self._epoch}"
        self._tickets = {
            replica: SyncTicket(group, 1 + i * self.ranks_per_replica, world, self._round)
            for i, (replica, _) in enumerate(chosen)
        }
        self._planned_tags = dict(chosen)
        return {replica: ticket.encode() for replica, ticket in self._tickets.items()}

    def _await_accepts(self, flags: dict[int, str]) -> dict[int, float]:
        """Wait until every member accepted or one's own deadline (`deadlines`) passed; {missing replica: the
        seconds it was given}."""
        started = time.monotonic()
        waits = {replica: self.deadlines.seconds((replica, self._planned_tags[replica])) for replica in flags}
        pending = dict(flags)
        while pending:
            pending = {r: flag for r, flag in pending.items() if not self.store.check([flag])}
            overdue = [r for r in pending if time.monotonic() - started >= waits[r]]
            if overdue or not pending:
                break
            # Wake as soon as all accept, or at the first pending member's deadline.
            left = min(waits[r] for r in pending) - (time.monotonic() - started)
            with contextlib.suppress(RuntimeError):  # torch raises a DistStoreError (a RuntimeError) on timeout
                self.store.wait(list(pending.values()), datetime.timedelta(seconds=max(0.01, left)))
        for replica in flags:
            member = (replica, self._planned_tags[replica])
            if replica in pending:
                self.deadlines.missed(member)
            else:
                self.deadlines.accepted(member)
        return {replica: waits[replica] for replica in pending}

    def _choose(self, flags: dict[int, str], report: bytes) -> SyncBackend:
        """The round's backend, from where the actor's tensors are and what each member said when it accepted."""
        return choose_backend([report, *self.store.multi_get(list(flags.values()))])

    def publish(self, version: int, model: nn.Module | GatheredWeights) -> None:
        """Broadcast `model`'s state to the planned members once every one has accepted this round.

        A member that is gone, or is another incarnation than its ticket names, never accepts: once its
        deadline (`AcceptDeadlines`) passes the round is aborted (the members that accepted stop waiting at
        once) and this raises SyncRefused naming the replicas that did not accept; the next `plan` forms a new
        group, and the caller syncs the others at once without waiting for them again.
        """
        tickets = self._tickets
        if not tickets:
            return
        ticket = next(iter(tickets.values()))
        flags = {replica: t.accepted_key for replica, t in tickets.items()}
        missing = self._await_accepts(flags)
        if missing:
            self.store.set(ticket.go_key, b"abort")
            self._members = None
            raise SyncRefused(
                f"rollout(s) {sorted(missing)} did not accept weights version {version} "
                f"(waited {max(missing.values()):.0f}s)",
                frozenset(missing),
            )
        if isinstance(model, nn.Module):
            tensors = state_tensors(model)
            device, report = tensors_device(tensors), tensors_report(tensors)
        else:
            tensors, device = [], model.device()
            report = device_report([device])
        backend = self._choose(flags, report)
        if self._group is None or self._go is None or self._go.backend != backend:
            if self._go is not None and self._go.backend != backend:
                self._pack.clear()  # its buffers are on the old backend's device
            discard_group(self._group)
            self._group, self._go = None, GoSignal(backend, ticket.round)
        go = self._go
        self.store.set(ticket.go_key, go.encode())
        for flag in flags.values():
            self.store.delete_key(flag)
        self.backend = backend
        # Under gloo the actor sends from host memory (gloo would stage CUDA tensors through it anyway).
        send_device = device if backend == "nccl" else torch.device("cpu")
        try:
            if self._group is None:
                self._group = make_group(self.store, go.group(ticket), 0, ticket.world, backend, send_device)
            if not isinstance(model, nn.Module):  # a GatheredWeights
                # Only now: a refused round never starts gathers on the other ranks.
                model.begin_gather(self.bucket_bytes)
                broadcast_state(
                    self._group,
                    model.placeholders(),
                    self.bucket_bytes,
                    lambda i: model.full(i, send_device),
                    self._pack,
                    device=send_device,
                )
                return
            broadcast_state(self._group, [t.to(send_device) for t in tensors], self.bucket_bytes, pack=self._pack)
        except RuntimeError:
            discard_group(self._group)
            self._group, self._members = None, None  # a member died mid-round: the next round forms a new group
            raise
        finally:
            self._pack.release_device()  # GPU memory the update is about to need

    def forget(self, replica: int) -> None:
        """A rollout went away or restarted: the next round forms a new group."""
        if self._members is not None and any(r == replica for r, _ in self._members):
            discard_group(self._group)
            self._group, self._members = None, None

    def close(self) -> None:
        """Release the group now, not during interpreter teardown, where gloo's threads die in no set order."""
        discard_group(self._group)
        self._group = None
        gc.collect()


class WeightSubscriber:
    """Rollout side: joins the actor's store (again, when the actor restarted) and receives into tensors.

    `accept` and `receive_tensors` are the two halves of `receive`, for a receiver whose tensors live in
    other processes (vLLM workers, one per tensor-parallel rank): the rollout accepts at once for all of
    them, each worker joins the group at its rank and receives.
    """

    def __init__(self, host: str, port: int, bucket_mb: int) -> None:
        self.host, self.port = host, port
        self.bucket_bytes = bucket_mb * 2**20
        self._store: TCPStore | None = None
        self._store_actor = ""
        self._group_name = ""
        self._group: torch.distributed.ProcessGroup | None = None
        self._backend: SyncBackend | None = None
        self._pack = PackBuffer()

    def _connect(self, actor_tag: str) -> TCPStore:
        if self._store is None or self._store_actor != actor_tag:
            self._store = TCPStore(self.host, self.port, is_master=False, timeout=GROUP_TIMEOUT)
            self._store_actor = actor_tag
            discard_group(self._group)
            self._group = None
        return self._store

    def accept(self, key: str, version: int, actor_tag: str, report: bytes = b"cpu") -> None:
        """Tell the actor this incarnation joins the round its ticket `key` names, and where it receives
        (`device_report` of the devices its tensors are on: the actor picks the backend from it)."""
        self._connect(actor_tag).set(SyncTicket.decode(key).accepted_key, report)

    def wait_go(self, key: str, actor_tag: str) -> GoSignal:
        """Block until the actor starts the round (every member accepted) and return its backend and group;
        SyncAborted when it called the round off."""
        ticket = SyncTicket.decode(key)
        store = self._connect(actor_tag)
        store.wait([ticket.go_key], GROUP_TIMEOUT)
        go = store.get(ticket.go_key)
        if go == b"abort":
            raise SyncAborted(f"the actor called weight round {ticket.round} off: a member never accepted")
        return GoSignal.decode(go)

    def receive_tensors(self, key: str, actor_tag: str, tensors: list[torch.Tensor], rank_offset: int = 0) -> None:
        """Wait for the round's go, join the group (once per epoch) at rank `ticket.rank + rank_offset` and
        receive the actor's state into `tensors`, in order. SyncAborted when the actor called the round off."""
        ticket = SyncTicket.decode(key)
        store = self._connect(actor_tag)
        try:
            go = self.wait_go(key, actor_tag)
            if self._group is None or self._group_name != go.group(ticket):
                if go.backend != self._backend:
                    self._pack.clear()  # its buffers may be on another device than this backend's
                discard_group(self._group)
                self._group, self._backend = None, go.backend
                rank, device = ticket.rank + rank_offset, tensors_device(tensors)
                self._group = make_group(store, go.group(ticket), rank, ticket.world, go.backend, device)
                self._group_name = go.group(ticket)
            with torch.no_grad():
                broadcast_state(self._group, tensors, self.bucket_bytes, pack=self._pack)
        except SyncAborted:
            raise
        except RuntimeError:
            discard_group(self._group)
            self._group = None  # the actor forms a new group after a failure
            raise
        finally:
            self._pack.release_device()  # GPU memory the engine's cache can use until the next round

    def receive(self, key: str, version: int, actor_tag: str, model: nn.Module) -> None:
        """Accept the sync (saying where `model` is), then receive into `model`."""
        tensors = state_tensors(model)
        self.accept(key, version, actor_tag, tensors_report(tensors))
        self.receive_tensors(key, actor_tag, tensors)


class StagedWeights:
    """A rollout's incoming weights, received on a thread of their own into a staging copy of its model.

    The request thread hands each sync over (`submit`) and goes straight back to answering status and collect
    requests. The receiver thread accepts the sync and receives into `staging`; a sync whose actor paused,
    gave up or died ties up only this thread (for at most GROUP_TIMEOUT). The thread that acts copies the
    newest complete version into its own model between two batches (`copy_into`): acting weights are never
    half old, half new. `on_received(key, version, actor_tag, error)` is called after each sync, outside any
    lock of this class, with the error of a sync that failed (its partial tensors are never copied out). The
    report of a sync can come after a newer one was submitted (a slow first connection, say): `key` tells the
    receiver which sync it is about, so a stale failure never marks newer weights missing.
    """

    def __init__(
        self,
        subscriber: WeightSubscriber,
        model: nn.Module,
        on_received: Callable[[str, int, str, BaseException | None], None],
    ) -> None:
        self.subscriber = subscriber
        self.staging = copy.deepcopy(model)
        self._on_received = on_received
        self._staging_lock = threading.Lock()
        """Held while tensors are received into `staging` and while they are copied out of it."""
        self._version, self._actor_tag = -1, ""  # of the complete weights in `staging`
        self._wake = threading.Condition()
        self._pending: tuple[str, int, str] | None = None
        self._closed = False
        self._thread = threading.Thread(target=self._receive_loop, name="weight-receiver", daemon=True)
        self._thread.start()

    def submit(self, key: str, version: int, actor_tag: str) -> None:
        """Receive this sync next. A sync handed over earlier and not started yet was given up by its actor
        (an actor syncs a replica one version at a time): it is replaced."""
        with self._wake:
            self._pending = (key, version, actor_tag)
            self._wake.notify_all()

    def copy_into(self, model: nn.Module) -> tuple[int, str]:
        """Copy the staged weights into `model` (waiting for a sync in progress); their (version, actor tag).

        (-1, "") and `model` untouched when no complete weights are staged.
        """
        with self._staging_lock:
            if self._version >= 0:
                with torch.no_grad():
                    for dst, src in zip(model.state_dict().values(), self.staging.state_dict().values(), strict=True):
                        dst.copy_(src)
            return self._version, self._actor_tag

    def close(self) -> None:
        with self._wake:
            self._closed = True
            self._wake.notify_all()
        self._thread.join(timeout=1)  # a receive in progress ends with its group's timeout; the thread is a daemon

    def _receive_loop(self) -> None:
        while True:
            with self._wake:
                self._wake.wait_for(lambda: self._pending is not None or self._closed)
                if self._closed:
                    return
                assert self._pending is not None
                (key, version, actor_tag), self._pending = self._pending, None
            error: BaseException | None = None
            with self._staging_lock:
                try:
                    self.subscriber.receive(key, version, actor_tag, self.staging)
                    self._version, self._actor_tag = version, actor_tag
                except RuntimeError as exc:  # the actor died or gave up mid-sync: `staging` is partly overwritten
                    error = exc
                    self._version, self._actor_tag = -1, ""
            self._on_received(key, version, actor_tag, error)


# --- filesystem ---------------------------------------------------------------------------------

WEIGHTS_FILE_PREFIX = "weights-"
FILE_GATHER_BUCKET_BYTES = 256 * 2**20
"""The other actor ranks' pace when rank 0 gathers a whole state to its host (each tensor is moved there at once)."""


def weights_file_name(version: int, actor_tag: str) -> str:
    return f"{WEIGHTS_FILE_PREFIX}{version:08d}-{actor_tag}.safetensors"


def full_state(weights: nn.Module | GatheredWeights, device: torch.device | None = None) -> dict[str, torch.Tensor]:
    """The whole state dict on this (root) rank's `device` (the CPU by default); for a sharded model, one gather
    pass all ranks join."""
    device = device or torch.device("cpu")
    if isinstance(weights, nn.Module):
        return {name: t.detach().to(device) for name, t in weights.state_dict().items()}
    weights.placeholders()
    weights.begin_gather(FILE_GATHER_BUCKET_BYTES)
    return {name: weights.full(i, device) for i, name in enumerate(weights.names())}


def write_weights_file(
    directory: str | Path, version: int, actor_tag: str, model: nn.Module | GatheredWeights, keep: int = 2
) -> Path:
    """Write `model`'s full state dict (tied weights included) as one safetensors file, atomically.

    Readers only ever see complete files: the file is written under a temporary name and renamed. The
    newest `keep` files of this actor incarnation stay (a rollout may still be reading the previous one);
    older files, and those of earlier incarnations, go.
    """
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    target = directory / weights_file_name(version, actor_tag)
    tmp = directory / f".tmp-{target.name}"
    # safetensors refuses tensors sharing memory (tied embeddings): every entry gets its own copy.
    save_file({name: t.contiguous().clone() for name, t in full_state(model).items()}, str(tmp))
    os.replace(tmp, target)
    mine = sorted(directory.glob(f"{WEIGHTS_FILE_PREFIX}*-{actor_tag}.safetensors"))
    for old in directory.glob(f"{WEIGHTS_FILE_PREFIX}*.safetensors"):
        if old not in mine[-keep:]:
            old.unlink(missing_ok=True)
    return target


def read_weights_file(path: str | Path) -> dict[str, torch.Tensor]:
    """The state dict written by `write_weights_file` (CPU tensors, by name)."""
    from safetensors.torch import load_file

    return load_file(str(path))


class FileWeightPublisher:
    """Actor rank 0 side of `weightSync.method: filesystem`, with WeightPublisher's interface.

    Every member's key is the path of the version's file, written once whatever the replica count.
    """

    def __init__(self, directory: str | Path, actor_tag: str) -> None:
        self.directory = Path(directory)
        self.actor_tag = actor_tag
        self._written: tuple[int, Path] | None = None

    def plan(
        self, members: Iterable[tuple[int, str]], version: int, model: nn.Module | GatheredWeights
    ) -> dict[int, str]:
        if self._written is None or self._written[0] != version:
            self._written = (version, write_weights_file(self.directory, version, self.actor_tag, model))
        return {replica: str(self._written[1]) for replica, _ in members}

    def publish(self, version: int, model: nn.Module | GatheredWeights) -> None:
        """Nothing to send: the rollouts read the file their key names."""

    def forget(self, replica: int) -> None:
        pass

    def close(self) -> None:
        pass
