"""`weightSync.method: ipc`: the actor hands each version to the collocated rollout as handles to its own memory.

A collocated rollout runs beside actor rank 0 (same pod, same GPUs: `roles.rollout.collocated`). For each
version the actor exports every state-dict tensor as a handle the rollout opens in place, chosen by where the
tensor lives:

- a CUDA tensor: a CUDA IPC handle to the actor's own device memory (`torch.multiprocessing.reductions.
  reduce_tensor`, as vLLM's RLHF colocate example, veRL and OpenRLHF do). Nothing is copied on the actor's side
  and nothing goes through the host: the rollout maps the memory and copies from it, GPU to GPU. The handle
  names the device by UUID, so the rollout finds it whatever CUDA_VISIBLE_DEVICES numbers it as there;
- a CPU tensor (an actor on the CPU): one copy into a shared-memory file per version (`/dev/shm`), which the
  rollout maps (`torch.from_file(shared=True)`). The whole tensors an fsdp2 actor gathers, or a mixed-precision
  ddp actor casts to bf16, are made on the actor's device: CUDA IPC on a GPU, shared memory on the CPU.

The handles themselves (a few hundred bytes per tensor) go into a manifest file beside the shared memory; a
member's key (its `sync_weights` request) is `<manifest path>|<replica>-<incarnation tag>`. The rollout opens
the handles, copies the tensors into its engine, drops them and marks the version loaded (an empty file next to
the manifest);
`publish` waits for every planned member's mark, so the actor, whose CUDA parameters are the exported memory
itself, never trains on them while a rollout still reads them. Once every member loaded it, the version's
export (its shared-memory file, the references to its CUDA tensors, a gathered or cast copy) is released, so
the update that follows has that memory; a rollout that restarts or joins later gets the version exported again.

The manifest is a pickle (a CUDA handle's rebuild arguments): it is only ever read from the directory of the
actor beside the rollout, which no one else writes.
"""

from __future__ import annotations

import os
import pickle
import shutil
import tempfile
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from rljob.runtime.weights.sync import GatheredWeights, SyncRefused, full_state

LOAD_TIMEOUT_S = 60.0
"""How long `publish` waits for a member to mark a version loaded (the rollout may be finishing a chunk)."""
ALIGN = 64
"""Byte alignment of each tensor in the shared-memory file: any dtype can view it in place."""
POLL_S = 0.005


def ipc_root() -> Path:
    """Where exports go: /dev/shm (memory, not disk) when this machine has it, else the temporary directory.

    In a pod, /dev/shm is 64 MiB unless a memory-backed emptyDir is mounted there: a CPU export larger than that
    fails to write (a CUDA export only writes its small manifest)."""
    shm = Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())


def _device_uuid(index: int) -> str:
    return str(torch.cuda.get_device_properties(index).uuid)


def _local_device(uuid: str) -> int:
    """This process's index of the GPU the actor's handle names."""
    for index in range(torch.cuda.device_count()):
        if _device_uuid(index) == uuid:
            return index
    raise RuntimeError(
        f"the actor's weights live on GPU {uuid}, which this process does not see: a collocated rollout must see "
        "the actor's GPUs (the same CUDA_VISIBLE_DEVICES)"
    )


@dataclass
class Export:
    """One exported version: its manifest, its shared-memory file (CPU tensors), what keeps its memory alive."""

    version: int
    manifest: Path
    files: list[Path]
    keep: list[torch.Tensor] = field(default_factory=list)
    """The exported CUDA tensors: held so their memory is not reused while a handle to it is out."""

    def release(self) -> None:
        had_cuda = bool(self.keep)
        self.keep.clear()
        for path in self.files:
            path.unlink(missing_ok=True)
        for mark in self.manifest.parent.glob(f"{self.manifest.name}.loaded-*"):
            mark.unlink(missing_ok=True)
        if had_cuda:  # never on a CPU actor: ipc_collect would create a CUDA context on a GPU machine
            torch.cuda.ipc_collect()  # memory whose handles every rollout has dropped goes back to the allocator


SharedHandles = dict[tuple[Any, ...], tuple[Any, ...]]
"""CUDA IPC handles of the actor's live parameters, by the memory they name: made once, reused every version."""


def cuda_handle(tensor: torch.Tensor, shared: SharedHandles | None) -> tuple[Any, ...]:
    """(rebuild, args) of a CUDA IPC handle to `tensor`. Sharing a storage again wraps it in one more reference-
    counted block (and one more slot in the ref-counter files) each time, so a live parameter, updated in place from
    version to version, is shared once: its handle, kept in `shared`, names the same memory with the new values."""
    from torch.multiprocessing import reductions

    if shared is None:
        return reductions.reduce_tensor(tensor)
    key = (
        tensor.untyped_storage().data_ptr(),
        tensor.storage_offset(),
        tuple(tensor.shape),
        tuple(tensor.stride()),
        tensor.dtype,
    )
    if key not in shared:
        shared[key] = reductions.reduce_tensor(tensor)
    return shared[key]


def export_weights(
    directory: Path, version: int, weights: nn.Module | GatheredWeights, shared: SharedHandles | None = None
) -> Export:
    """Handles to every state-dict tensor (tied weights included) of `weights`, written as the version's manifest.

    A module's own CUDA tensors are shared once and their handles kept in `shared` (`cuda_handle`); gathered or cast
    copies are new memory each version, shared afresh and released with the export."""
    if isinstance(weights, nn.Module):
        state = {name: t.detach() for name, t in weights.state_dict().items()}
    else:
        shared = None  # copies made for this version only
        # One gather (fsdp2) or cast (ddp mixed precision) pass, onto the actor's device: a GPU's whole
        # tensors go by CUDA IPC like a module's own, a CPU actor's into the shared-memory file.
        state = full_state(weights, weights.device())
    directory.mkdir(parents=True, exist_ok=True)
    stem = directory / f"v{version:08d}"
    shm = stem.with_suffix(".shm")
    offsets: dict[str, int] = {}
    total = 0
    for name, tensor in state.items():
        if tensor.device.type != "cuda":
            offsets[name] = total
            total += -(-tensor.numel() * tensor.element_size() // ALIGN) * ALIGN
    export = Export(version, stem.with_suffix(".manifest"), [stem.with_suffix(".manifest")])
    buffer = None
    if offsets:
        buffer = torch.from_file(str(shm), shared=True, size=max(total, 1), dtype=torch.uint8)
        export.files.append(shm)
    handles: list[tuple[str, tuple[Any, ...]]] = []
    for name, tensor in state.items():
        if tensor.device.type == "cuda":
            rebuild, args = cuda_handle(tensor, shared)
            export.keep.append(tensor)
            handles.append((name, ("cuda", _device_uuid(tensor.device.index), rebuild, args)))
            continue
        assert buffer is not None
        start, nbytes = offsets[name], tensor.numel() * tensor.element_size()
        buffer[start : start + nbytes].view(tensor.dtype).view(tensor.shape).copy_(tensor)
        handles.append((name, ("shm", str(shm), start, tuple(tensor.shape), str(tensor.dtype).removeprefix("torch."))))
    tmp = stem.with_suffix(".tmp")
    tmp.write_bytes(pickle.dumps({"version": version, "size": total, "handles": handles}))
    os.replace(tmp, export.manifest)  # a rollout never reads half a manifest
    return export


def member_key(manifest: Path, replica: int, rollout_tag: str) -> str:
    """The member's incarnation is part of it: a restarted rollout never finds its predecessor's mark."""
    return f"{manifest}|{replica}-{rollout_tag}"


def manifest_of(key: str) -> str:
    return key.rpartition("|")[0]


def loaded_mark(key: str) -> Path:
    manifest, _, member = key.rpartition("|")
    return Path(f"{manifest}.loaded-{member}")


def open_weights(manifest: str) -> dict[str, torch.Tensor]:
    """The exported tensors by name, as views of the actor's memory (no copy): copy them, then drop them."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    data = pickle.loads(Path(manifest).read_bytes())
    mapped: dict[str, torch.Tensor] = {}
    tensors: dict[str, torch.Tensor] = {}
    for name, handle in data["handles"]:
        if handle[0] == "cuda":
            _, uuid, rebuild, args = handle
            if rebuild is not rebuild_cuda_tensor:
                raise RuntimeError(f"{manifest}: {name} is not a CUDA IPC handle")
            args = list(args)
            args[6] = _local_device(uuid)  # the storage's device index, as this process numbers the GPU
            tensors[name] = rebuild(*args)
            continue
        _, path, start, shape, dtype = handle
        if path not in mapped:
            mapped[path] = torch.from_file(path, shared=True, size=max(int(data["size"]), 1), dtype=torch.uint8)
        nbytes = int(torch.Size(shape).numel()) * torch.empty(0, dtype=getattr(torch, dtype)).element_size()
        tensors[name] = mapped[path][start : start + nbytes].view(getattr(torch, dtype)).view(shape)
    return tensors


def mark_loaded(key: str) -> None:
    """Tell the actor this member has copied the version its key names (and dropped the handles)."""
    loaded_mark(key).touch()


class IpcWeightPublisher:
    """Actor rank 0 side of `weightSync.method: ipc`, with WeightPublisher's interface.

    `plan` exports a version once (whatever the member count), `publish` waits until every planned member
    marked it loaded; members that did not within `load_timeout_s` are refused (SyncRefused names them).
    """

    def __init__(self, actor_tag: str, root: Path | None = None, load_timeout_s: float = LOAD_TIMEOUT_S) -> None:
        self.directory = (root or ipc_root()) / f"rljob-ipc-{actor_tag}"
        self.load_timeout_s = load_timeout_s
        self._export: Export | None = None
        self._keys: dict[int, str] = {}
        self._shared: SharedHandles = {}
        """The live parameters' CUDA IPC handles, made at the first export and reused."""

    def plan(
        self, members: Iterable[tuple[int, str]], version: int, model: nn.Module | GatheredWeights
    ) -> dict[int, str]:
        if self._export is None or self._export.version != version:
            if self._export is not None:
                self._export.release()
            self._export = None  # a failed export leaves none behind
            self._export = export_weights(self.directory, version, model, self._shared)
        self._keys = {replica: member_key(self._export.manifest, replica, tag) for replica, tag in members}
        return dict(self._keys)

    def publish(self, version: int, model: nn.Module | GatheredWeights) -> None:
        """Return once every planned member loaded the version; SyncRefused naming those that did not in time."""
        pending = dict(self._keys)
        deadline = time.monotonic() + self.load_timeout_s
        while pending:
            pending = {r: key for r, key in pending.items() if not loaded_mark(key).exists()}
            if not pending or time.monotonic() >= deadline:
                break
            time.sleep(POLL_S)
        if pending:
            raise SyncRefused(
                f"rollout(s) {sorted(pending)} did not load weights version {version} "
                f"(waited {self.load_timeout_s:.0f}s)",
                frozenset(pending),
            )
        # Loaded everywhere: free the export now, not at the next version. A gathered (fsdp2) or cast (ddp mixed
        # precision) copy would otherwise sit in the actor's GPU memory through the update it makes room for; a
        # rollout that restarts before then gets the version exported again by the next `plan`.
        if self._export is not None:
            self._export.release()
            self._export = None

    def forget(self, replica: int) -> None:
        """Nothing to undo: the next plan exports the current version again for the member."""

    def close(self) -> None:
        if self._export is not None:
            self._export.release()
            self._export = None
        shutil.rmtree(self.directory, ignore_errors=True)
