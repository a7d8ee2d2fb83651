"""Versioned weight sync actor -> rollout: torch.distributed broadcast groups, or safetensors files.

`weightSync.method: broadcast`: actor rank 0 hosts a TCPStore on RLJOB_SYNC_PORT. Each rollout replica
forms a two-member group with it (actor rank 0 = broadcast root), keyed by both processes' incarnation
tags: a restarted rollout or actor simply forms a new group under a new key, and nobody else has to
re-join. Parameters travel flattened into buckets of at most `weightSync.bucketSizeMb`. Always gloo over
CPU tensors: an actor that trains on CUDA sends CPU copies, and the rollouts (gym policies) run on CPU.

`weightSync.method: filesystem`: actor rank 0 writes each version once as a safetensors file in a directory
every rollout can read (atomic rename, version and actor incarnation in the name) and sends its path.

A sharded actor (FSDP2) publishes a `GatheredWeights` instead of a module: each full tensor is assembled
as its bucket is built (a collective every actor rank joins), so no rank ever holds the whole model.
"""

from __future__ import annotations

import copy
import datetime
import gc
import os
import threading
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Protocol

import torch
from torch import nn
from torch.distributed import PrefixStore, ProcessGroupGloo, TCPStore

GROUP_TIMEOUT = datetime.timedelta(seconds=30)
ACCEPT_TIMEOUT = datetime.timedelta(seconds=5)


class SyncRefused(RuntimeError):
    """The rollout did not accept a weight sync in time (gone, restarted, or busy)."""


def accepted_key(key: str, version: int) -> str:
    """Store key the rollout sets to say "I am the incarnation `key` names and I am joining for `version`"."""
    return f"weights/{key}/accepted/{version}"


def make_pair_group(store: TCPStore, key: str, rank: int) -> torch.distributed.ProcessGroup:
    """A two-member gloo group (0 = actor, 1 = rollout) on its own key of the shared store; blocks until both join."""
    return ProcessGroupGloo(PrefixStore(f"weights/{key}/", store), rank, 2, GROUP_TIMEOUT)


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
    """A model held in shards across the actor ranks (see `rljob.runtime.llm.sharding.ShardedWeights`)."""

    def placeholders(self) -> list[torch.Tensor]:
        """Meta tensors in state-dict order with the shapes and dtypes the rollout holds: they size the buckets."""
        ...

    def names(self) -> list[str]:
        """The state-dict names of `placeholders()`, in the same order."""
        ...

    def begin_gather(self) -> None:
        """Tell the other actor ranks to join the gathers of one pass over every tensor, in order."""
        ...

    def full(self, index: int) -> torch.Tensor:
        """The whole tensor `index` on the CPU (a collective: every actor rank calls it, in the same order)."""
        ...


def broadcast_state(
    group: torch.distributed.ProcessGroup,
    tensors: Iterable[torch.Tensor],
    bucket_bytes: int,
    materialize: Callable[[int], torch.Tensor] | None = None,
) -> None:
    """Root side (rank 0) and receiving side alike: after the call, rank 1's tensors equal rank 0's.

    With `materialize` (root side only) `tensors` only size the buckets and tensor i is `materialize(i)`,
    built when its bucket is: one bucket of full tensors exists at a time. Those calls are collectives of
    the actor group, so a failed send does not stop them: the pass is finished, then the error is raised.
    """
    tensors = list(tensors)
    failure: RuntimeError | None = None
    for bucket in buckets(tensors, bucket_bytes):
        parts = [tensors[i] if materialize is None else materialize(i) for i in bucket]
        if failure is not None:
            continue
        flat = torch.cat([p.reshape(-1) for p in parts]) if len(parts) > 1 else parts[0].reshape(-1).clone()
        try:
            group.broadcast(flat, 0).wait()
        except RuntimeError as exc:
            if materialize is None:
                raise
            failure = exc
            continue
        if materialize is not None:
            continue  # the root's own copies: nothing to write back
        offset = 0
        for p in parts:
            n = p.numel()
            p.copy_(flat[offset : offset + n].view_as(p))
            offset += n
    if failure is not None:
        raise failure


class WeightPublisher:
    """Actor rank 0 side: one store, one group per (actor incarnation, rollout incarnation)."""

    def __init__(self, host: str, port: int, actor_tag: str, bucket_mb: int) -> None:
        self.store = TCPStore(host, port, is_master=True, wait_for_workers=False, timeout=GROUP_TIMEOUT)
        self.actor_tag = actor_tag
        self.bucket_bytes = bucket_mb * 2**20
        self._groups: dict[int, tuple[str, torch.distributed.ProcessGroup]] = {}
        self._generation: dict[int, int] = {}

    def group_key(self, replica: int, rollout_tag: str) -> str:
        # The generation changes after a failed sync: a new group never reuses a broken group's store keys.
        return f"{self.actor_tag}/{replica}/{rollout_tag}/{self._generation.get(replica, 0)}"

    def sync_key(self, replica: int, rollout_tag: str, version: int, model: nn.Module | GatheredWeights) -> str:
        """What the rollout's `sync_weights` request carries as `key`: the pair group's name."""
        return self.group_key(replica, rollout_tag)

    def publish(self, replica: int, key: str, version: int, model: nn.Module | GatheredWeights) -> None:
        """Broadcast `model`'s state to rollout `replica` once it has accepted this sync (see `accepted_key`).

        A rollout that is gone, or is a newer incarnation than `key` names, never accepts: after
        ACCEPT_TIMEOUT this raises SyncRefused and nobody is left blocked in a group.
        """
        flag = accepted_key(key, version)
        try:
            self.store.wait([flag], ACCEPT_TIMEOUT)
        except RuntimeError as exc:  # torch raises a DistStoreError (a RuntimeError) on timeout
            raise SyncRefused(f"rollout {replica} did not accept weights version {version}") from exc
        self.store.delete_key(flag)
        cached = self._groups.get(replica)
        if cached is None or cached[0] != key:
            self._groups[replica] = (key, make_pair_group(self.store, key, 0))
        group = self._groups[replica][1]
        if not isinstance(model, nn.Module):  # a GatheredWeights
            model.begin_gather()  # only now: a refused or unjoined sync never starts gathers on the other ranks
            broadcast_state(group, model.placeholders(), self.bucket_bytes, materialize=model.full)
            return
        tensors = [t.cpu() for t in state_tensors(model)]  # a CUDA-trained actor still syncs over gloo
        broadcast_state(group, tensors, self.bucket_bytes)

    def forget(self, replica: int) -> None:
        """Drop the group of a rollout that went away or failed a sync; the next sync forms a new one."""
        self._groups.pop(replica, None)
        self._generation[replica] = self._generation.get(replica, 0) + 1

    def close(self) -> None:
        """Release every group now, not during interpreter teardown, where gloo's threads die in no set order."""
        self._groups.clear()
        gc.collect()


class WeightSubscriber:
    """Rollout side: joins the actor's store (again, when the actor restarted) and receives into `model`.

    `accept` and `receive_tensors` are the two halves of `receive`, for a receiver whose tensors live in
    another process (a vLLM worker): the rollout accepts at once, the worker joins and receives.
    """

    def __init__(self, host: str, port: int, bucket_mb: int) -> None:
        self.host, self.port = host, port
        self.bucket_bytes = bucket_mb * 2**20
        self._store: TCPStore | None = None
        self._store_actor = ""
        self._key = ""
        self._group: torch.distributed.ProcessGroup | None = None

    def _connect(self, actor_tag: str) -> TCPStore:
        if self._store is None or self._store_actor != actor_tag:
            self._store = TCPStore(self.host, self.port, is_master=False, timeout=GROUP_TIMEOUT)
            self._store_actor = actor_tag
            self._group = None
        return self._store

    def accept(self, key: str, version: int, actor_tag: str) -> None:
        """Tell the actor this incarnation joins the sync `key` names (it waits for that before it joins)."""
        self._connect(actor_tag).set(accepted_key(key, version), b"1")

    def receive_tensors(self, key: str, actor_tag: str, tensors: list[torch.Tensor]) -> None:
        """Join the pair group of `key` (once per key) and receive the actor's state into `tensors`, in order."""
        store = self._connect(actor_tag)
        try:
            if self._group is None or self._key != key:
                self._group = make_pair_group(store, key, 1)
                self._key = key
            with torch.no_grad():
                broadcast_state(self._group, tensors, self.bucket_bytes)
        except RuntimeError:
            self._group = None  # the actor forms a new group under a new key after a failure
            raise

    def receive(self, key: str, version: int, actor_tag: str, model: nn.Module) -> None:
        """Accept the sync, then receive into `model`."""
        self.accept(key, version, actor_tag)
        self.receive_tensors(key, actor_tag, state_tensors(model))


class StagedWeights:
    """A rollout's incoming weights, received on a thread of their own into a staging copy of its model.

    The request thread hands each sync over (`submit`) and goes straight back to answering status and collect
    requests. The receiver thread accepts the sync and receives into `staging`; a sync whose actor paused,
    gave up or died ties up only this thread (for at most GROUP_TIMEOUT). The thread that acts copies the
    newest complete version into its own model between two batches (`copy_into`): acting weights are never
    half old, half new. `on_received(version, actor_tag, error)` is called after each sync, outside any lock
    of this class, with the error of a sync that failed (its partial tensors are never copied out).
    """

    def __init__(
        self,
        subscriber: WeightSubscriber,
        model: nn.Module,
        on_received: Callable[[int, str, BaseException | None], None],
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
            self._on_received(version, actor_tag, error)


# --- filesystem ---------------------------------------------------------------------------------

WEIGHTS_FILE_PREFIX = "weights-"


def weights_file_name(version: int, actor_tag: str) -> str:
    return f"{WEIGHTS_FILE_PREFIX}{version:08d}-{actor_tag}.safetensors"


def full_state(weights: nn.Module | GatheredWeights) -> dict[str, torch.Tensor]:
    """The whole state dict on this (root) rank's CPU; for a sharded model, one gather pass all ranks join."""
    if isinstance(weights, nn.Module):
        return {name: t.detach().cpu() for name, t in weights.state_dict().items()}
    weights.placeholders()
    weights.begin_gather()
    return {name: weights.full(i) for i, name in enumerate(weights.names())}


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

    The sync key a rollout gets is the path of the version's file, written once whatever the replica count.
    """

    def __init__(self, directory: str | Path, actor_tag: str) -> None:
        self.directory = Path(directory)
        self.actor_tag = actor_tag
        self._written: tuple[int, Path] | None = None

    def sync_key(self, replica: int, rollout_tag: str, version: int, model: nn.Module | GatheredWeights) -> str:
        if self._written is None or self._written[0] != version:
            self._written = (version, write_weights_file(self.directory, version, self.actor_tag, model))
        return str(self._written[1])

    def publish(self, replica: int, key: str, version: int, model: nn.Module | GatheredWeights) -> None:
        """Nothing to send: the rollout reads the file `key` names."""

    def forget(self, replica: int) -> None:
        pass

    def close(self) -> None:
        pass
