"""The part of the vllm engine that runs inside vLLM's worker processes (`worker_extension_cls`).

vLLM mixes `WeightReceiver` into its worker class; the rollout calls its methods with `LLM.collective_rpc`.
The worker receives the actor's full state dict (Hugging Face names, tied weights included) into a staging
copy, then `rljob_swap_in` loads the staged tensors into the running model in place. Staging keeps the swap
between two chunks: a version that arrives while a chunk is generated never mixes into it. Where it stages:

- `broadcast` (`WeightSubscriber`: the actor's TCPStore, the round and group its ticket names, the same buckets;
  every tensor-parallel worker is a member of the group): on its GPU when the copy fits beside the engine (then a
  round can go by NCCL), on the host otherwise (gloo); allocated once, kept from version to version;
- `filesystem` (the version's safetensors file): on the host, kept;
- `ipc` (the collocated actor's memory handles, `rljob.runtime.weights.ipc`): on its GPU when the copy fits in the
  GPU's free memory at that moment, so the weights go GPU to GPU and never through the host, and released once
  swapped in, so the actor trains in that memory again (vLLM's sleep frees only vLLM's own pool, not this copy);
  on the host when it does not fit.

This module is imported in vLLM's worker processes: it imports nothing of vLLM at module level, and only
the weight-sync parts of rljob.
"""

from __future__ import annotations

import logging
import math

import torch

from rljob.runtime.weights.ipc import open_weights
from rljob.runtime.weights.sync import WeightSubscriber, device_report, read_weights_file

TensorLayout = list[tuple[str, list[int], str]]
"""(name, shape, dtype name) of every state-dict entry, in the actor's `state_dict()` order."""
CPU = torch.device("cpu")


def gpu_room(device: torch.device | None, nbytes: int) -> bool:
    """Whether `device` is a GPU whose free memory holds `nbytes` now."""
    if device is None or device.type != "cuda":
        return False
    free, _ = torch.cuda.mem_get_info(device)
    return free >= nbytes


def staging_device(worker_device: torch.device | None, staging_bytes: int, bucket_mb: int) -> torch.device:
    """Where a worker stages broadcast rounds: its GPU when NCCL is there and the GPU's free memory holds the
    staging copy and one bucket's pack buffer besides (vLLM took its `gpuMemoryUtilization` share before), else
    the CPU."""
    if torch.distributed.is_nccl_available() and gpu_room(worker_device, staging_bytes + bucket_mb * 2**20):
        assert worker_device is not None
        return worker_device
    return torch.device("cpu")


RELOAD_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"


class ComputedBuffersNotice(logging.Filter):
    """Drops vLLM's "RotaryEmbedding: Failed to load weights", logged on every reload although nothing is lost.

    A rotary embedding holds only its cos/sin cache, computed from the config and in no state dict (Hugging Face's
    or ours); the layer-wise reload finds no weight for it and puts the cache back as it was. Any other layer that
    loads nothing is still reported."""

    def filter(self, record: logging.LogRecord) -> bool:
        failed = record.msg == "%s: Failed to load weights"
        return not (failed and isinstance(record.args, tuple) and record.args[:1] == ("RotaryEmbedding",))


def quiet_computed_buffers() -> None:
    """Install `ComputedBuffersNotice` on vLLM's reload logger in this process, once."""
    logger = logging.getLogger(RELOAD_LOGGER)
    if not any(isinstance(f, ComputedBuffersNotice) for f in logger.filters):
        logger.addFilter(ComputedBuffersNotice())


class WeightReceiver:
    """Methods vLLM adds to its worker (`self` is the worker: `model_runner`, `vllm_config` are vLLM's)."""

    def rljob_prepare_weights(
        self, layout: TensorLayout, host: str, port: int, bucket_mb: int, method: str = "broadcast"
    ) -> str:
        """Remember the policy's layout and where the actor's store is, allocate the staging tensors of a
        `broadcast` (`staging_device`) or `filesystem` (the host: a file gains nothing from the GPU) job, and
        return where this worker receives (its `device_report`, which the rollout tells the actor when it
        accepts). An `ipc` job stages each version afresh (`rljob_read_ipc`)."""
        self.rljob_names = [name for name, _, _ in layout]
        self.rljob_shapes = [(shape, getattr(torch, dtype)) for _, shape, dtype in layout]
        sizes = [math.prod(shape) * dtype.itemsize for shape, dtype in self.rljob_shapes]
        self.rljob_bytes = sum(sizes)
        self.rljob_largest = max(sizes, default=0)
        self.rljob_bucket_bytes = bucket_mb * 2**20
        self.rljob_per_version = method == "ipc"
        self.rljob_staging: list[torch.Tensor] = []
        worker = getattr(self, "device", None)
        device = staging_device(worker, self.rljob_bytes, bucket_mb) if method == "broadcast" else CPU
        if not self.rljob_per_version:
            device = self._rljob_allocate(device)
        self.rljob_subscriber = WeightSubscriber(host, port, bucket_mb)
        return device_report([device]).decode()

    def _rljob_allocate(self, device: torch.device) -> torch.device:
        """Staging tensors on `device`, or on the host when the GPU ran out (the engine took memory since it was
        checked); where they are."""
        self.rljob_staging = []  # the old copy goes first: a move between devices never holds both
        try:
            self.rljob_staging = [torch.empty(shape, dtype=dtype, device=device) for shape, dtype in self.rljob_shapes]
        except torch.OutOfMemoryError:
            device = CPU
            self.rljob_staging = [torch.empty(shape, dtype=dtype, device=device) for shape, dtype in self.rljob_shapes]
        return device

    def rljob_receive(self, key: str, actor_tag: str) -> None:
        """Join the round `key` names (the rollout has accepted it for every worker) at this worker's rank in
        the replica's block and receive the full tensors into staging; `rljob_swap_in` loads this worker's
        shard of each (vLLM's weight loaders slice full tensors by tensor-parallel rank)."""
        self.rljob_subscriber.receive_tensors(key, actor_tag, self.rljob_staging, rank_offset=self.rank)

    def rljob_read_file(self, path: str) -> None:
        """Stage the version written by the actor as a safetensors file."""
        self._rljob_stage(read_weights_file(path), path)

    def rljob_read_ipc(self, manifest: str, on_gpu: bool = True) -> None:
        """Stage the version the collocated actor exported (`weightSync.method: ipc`): open its handles (CUDA IPC or
        shared memory), copy, and drop them, so the actor's memory is free again once every worker returned.

        The copy goes GPU to GPU when `on_gpu` (the engine is awake) and this worker's GPU has room now for it, for
        the largest tensor (vLLM's layer-wise reload makes each layer afresh on the GPU before it copies it in)
        and for one bucket besides; else to the host."""
        tensors = open_weights(manifest)
        self._rljob_check_names(tensors, manifest)  # before staging: a refused version leaves no half copy
        if not (self.rljob_staging and self.rljob_staging[0].is_cuda):  # else a version not swapped in keeps it
            worker = getattr(self, "device", None)
            headroom = self.rljob_bytes + self.rljob_largest + self.rljob_bucket_bytes
            fits = on_gpu and gpu_room(worker, headroom)
            if fits or not self.rljob_staging:
                self._rljob_allocate(worker if fits and worker is not None else CPU)
        self._rljob_stage(tensors, manifest)
        del tensors

    def _rljob_check_names(self, tensors: dict[str, torch.Tensor], source: str) -> None:
        """A ValueError naming `source` when it lacks a tensor of the policy."""
        missing = set(self.rljob_names) - set(tensors)
        if missing:
            raise ValueError(f"{source} lacks {len(missing)} tensor(s) of the policy, e.g. {sorted(missing)[0]}")

    def _rljob_stage(self, tensors: dict[str, torch.Tensor], source: str) -> None:
        """Copy the policy's tensors by name into staging."""
        self._rljob_check_names(tensors, source)
        with torch.no_grad():
            for name, staged in zip(self.rljob_names, self.rljob_staging, strict=True):
                staged.copy_(tensors[name])

    def rljob_swap_in(self) -> None:
        """Load the staged tensors into the running model in place; an `ipc` job's copy on the GPU is then
        given back (`rljob_release_staging`).

        `model.load_weights` fails on the CPU backend once the model has started (its linear weights are
        repacked); `reload_weights` goes through vLLM's layer-wise reload, which handles that (NOTES.md)."""
        from vllm.config import set_current_vllm_config

        if len(self.rljob_staging) != len(self.rljob_names):  # before vLLM takes the layers apart to reload them
            raise RuntimeError("no weights version is staged in this vLLM worker: nothing to swap in")
        quiet_computed_buffers()
        with set_current_vllm_config(self.vllm_config):
            weights = zip(self.rljob_names, self.rljob_staging, strict=True)
            self.model_runner.reload_weights(weights_iterator=iter(weights))
        self.rljob_release_staging()

    def rljob_write_adapter(self, directory: str) -> None:
        """`model.lora.sync: adapters`: write the staged adapter tensors (PEFT's names) into `directory` as its
        `adapter_model.safetensors`, for vLLM to load as a LoRA adapter; the first worker writes, the others
        (tensor-parallel ranks on the same machine) read the same file."""
        from safetensors.torch import save_file

        if len(self.rljob_staging) != len(self.rljob_names):
            raise RuntimeError("no adapter version is staged in this vLLM worker: nothing to write")
        if getattr(self, "rank", 0) == 0:
            staged = zip(self.rljob_names, self.rljob_staging, strict=True)
            tensors = {name: t.detach().cpu().contiguous() for name, t in staged}
            save_file(tensors, f"{directory}/adapter_model.safetensors")
        self.rljob_release_staging()

    def rljob_release_staging(self) -> None:
        """Give an `ipc` job's staging copy on the GPU back to the device once loaded: the actor trains in it."""
        if self.rljob_per_version and self.rljob_staging and self.rljob_staging[0].is_cuda:
            self.rljob_staging = []
            torch.cuda.empty_cache()  # the caching allocator would keep the blocks for this process

    def rljob_offload_staging(self) -> None:
        """Before the engine sleeps: move a version staged on the GPU and not swapped in yet to the host, so the
        sleeping rollout holds no GPU memory while the actor trains (it is swapped in from there)."""
        if self.rljob_per_version and self.rljob_staging and self.rljob_staging[0].is_cuda:
            self.rljob_staging = [t.cpu() for t in self.rljob_staging]
            torch.cuda.empty_cache()
