"""The part of the vllm engine that runs inside vLLM's worker processes (`worker_extension_cls`).

vLLM mixes `WeightReceiver` into its worker class; the rollout calls its methods with `LLM.collective_rpc`.
The worker receives the actor's full state dict (Hugging Face names, tied weights included) into a staging
copy on its GPU when the copy fits beside the engine (then a round can go by NCCL), on the CPU otherwise
(gloo), by the same protocol as every other rollout (`WeightSubscriber`: the actor's TCPStore, the
round and group its ticket names, the same buckets; every tensor-parallel worker is a member of the group)
or from the version's safetensors file, or from the collocated actor's memory handles
(`rljob.runtime.weight_ipc`), and `rljob_swap_in` loads the staged tensors into the running model in place.
Staging keeps the swap between two chunks: a version that arrives while a chunk is generated never mixes into it.

This module is imported in vLLM's worker processes: it imports nothing of vLLM at module level, and only
the weight-sync parts of rljob.
"""

from __future__ import annotations

import math

import torch

from rljob.runtime.weight_ipc import open_weights
from rljob.runtime.weight_sync import WeightSubscriber, device_report, read_weights_file

TensorLayout = list[tuple[str, list[int], str]]
"""(name, shape, dtype name) of every state-dict entry, in the actor's `state_dict()` order."""


def staging_device(worker_device: torch.device | None, staging_bytes: int, bucket_mb: int) -> torch.device:
    """Where a worker stages: its GPU when the GPU's free memory holds the staging copy and one bucket's
    pack buffer besides (vLLM took its `gpuMemoryUtilization` share before), else the CPU."""
    if worker_device is None or worker_device.type != "cuda" or not torch.distributed.is_nccl_available():
        return torch.device("cpu")
    free, _ = torch.cuda.mem_get_info(worker_device)
    return worker_device if free >= staging_bytes + bucket_mb * 2**20 else torch.device("cpu")


class WeightReceiver:
    """Methods vLLM adds to its worker (`self` is the worker: `model_runner`, `vllm_config` are vLLM's)."""

    def rljob_prepare_weights(
        self, layout: TensorLayout, host: str, port: int, bucket_mb: int, broadcast: bool = True
    ) -> str:
        """Allocate the staging tensors (`staging_device`; on the host for weight files, which gain nothing
        from the GPU), remember where the actor's store is, and return where this worker receives (its
        `device_report`, which the rollout tells the actor when it accepts)."""
        self.rljob_names = [name for name, _, _ in layout]
        shapes = [(shape, getattr(torch, dtype)) for _, shape, dtype in layout]
        nbytes = sum(math.prod(shape) * dtype.itemsize for shape, dtype in shapes)
        device = staging_device(getattr(self, "device", None) if broadcast else None, nbytes, bucket_mb)
        try:
            self.rljob_staging = [torch.empty(shape, dtype=dtype, device=device) for shape, dtype in shapes]
        except torch.OutOfMemoryError:  # the engine took memory since the check: stage on the host
            device = torch.device("cpu")
            self.rljob_staging = [torch.empty(shape, dtype=dtype, device=device) for shape, dtype in shapes]
        self.rljob_subscriber = WeightSubscriber(host, port, bucket_mb)
        return device_report([device]).decode()

    def rljob_receive(self, key: str, actor_tag: str) -> None:
        """Join the round `key` names (the rollout has accepted it for every worker) at this worker's rank in
        the replica's block and receive the full tensors into staging; `rljob_swap_in` loads this worker's
        shard of each (vLLM's weight loaders slice full tensors by tensor-parallel rank)."""
        self.rljob_subscriber.receive_tensors(key, actor_tag, self.rljob_staging, rank_offset=self.rank)

    def rljob_read_file(self, path: str) -> None:
        """Stage the version written by the actor as a safetensors file."""
        self._rljob_stage(read_weights_file(path), path)

    def rljob_read_ipc(self, manifest: str) -> None:
        """Stage the version the collocated actor exported (`weightSync.method: ipc`): open its handles (CUDA IPC or
        shared memory), copy, and drop them, so the actor's memory is free again once every worker returned."""
        tensors = open_weights(manifest)
        self._rljob_stage(tensors, manifest)
        del tensors

    def _rljob_stage(self, tensors: dict[str, torch.Tensor], source: str) -> None:
        """Copy the policy's tensors by name into staging; a ValueError naming `source` when one is missing."""
        missing = set(self.rljob_names) - set(tensors)
        if missing:
            raise ValueError(f"{source} lacks {len(missing)} tensor(s) of the policy, e.g. {sorted(missing)[0]}")
        with torch.no_grad():
            for name, staged in zip(self.rljob_names, self.rljob_staging, strict=True):
                staged.copy_(tensors[name])

    def rljob_swap_in(self) -> None:
        """Load the staged tensors into the running model in place.

        `model.load_weights` fails on the CPU backend once the model has started (its linear weights are
        repacked); `reload_weights` goes through vLLM's layer-wise reload, which handles that (NOTES.md)."""
        from vllm.config import set_current_vllm_config

        with set_current_vllm_config(self.vllm_config):
            weights = zip(self.rljob_names, self.rljob_staging, strict=True)
            self.model_runner.reload_weights(weights_iterator=iter(weights))
