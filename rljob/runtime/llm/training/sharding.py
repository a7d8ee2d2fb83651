"""`trainer.parallelism: fsdp2` for the llm actor group: the policy sharded with FSDP2 (`fully_shard`).

With fsdp2 and more than one actor rank, every decoder layer and then the root module are sharded: each
rank holds 1/N of the parameters, gradients and optimizer state. FSDP reduce-scatters the gradients itself,
as a plain sum (no division by the rank count): each rank's loss is already divided by the global token or
sequence count, so the update equals ddp's (gradients summed over ranks) and a single rank's. On CUDA with
`trainer.precision` bf16 (or auto) the sharded parameters are fp32 and FSDP computes in bf16, reducing in fp32
(`MixedPrecisionPolicy`); on CPU there is no mixed precision.

Rank 0 drives the loop; every collective it starts, the other ranks must join in the same order. It says
which through a `CommandChannel` (`follow` is the other ranks' side): an update on a batch, a gather pass
for a weight sync (`ShardedWeights`: one full tensor at a time, bucket by bucket, only rank 0 sends), a
sharded checkpoint, a full-state export, the end. For a weight sync by NCCL the gathered tensors stay on the
actor's GPU (each bucket is built on the device); for one by gloo they are moved to the host as gathered.

Checkpoints of an fsdp2 job (whatever its world size, 1 included) hold the model and optimizer as
torch.distributed.checkpoint (DCP) shards in `sharded/` beside the usual `state.pt` (step, sampling RNG,
prompt stream, RNG states): every rank writes its shards into rank 0's temporary directory, and rank 0
commits it after a barrier. DCP reshards on load, so a checkpoint saved by 2 ranks resumes on 1 or 3.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from rljob.runtime.llm.models.lora import (
    ADAPTER,
    adapter_file_name,
    adapter_file_state,
    as_base_model,
    has_lora,
    lora_scalings,
    merge_state,
    merged_state_dict,
)
from rljob.runtime.llm.models.policy import resolve_precision
from rljob.runtime.records.checkpoint import STATE_FILE, CheckpointError, CheckpointManager
from rljob.runtime.wire.ranks import agree_to_stop

SHARDED_DIR = "sharded"
"""Subdirectory of a checkpoint with the DCP shards of the model and optimizer."""


def shards_model(parallelism: str, world_size: int) -> bool:
    """Whether the policy is sharded across the actor ranks (fsdp2 with more than one rank)."""
    return parallelism == "fsdp2" and world_size > 1


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The blocks sharded one by one: the classes a Hugging Face model names in `_no_split_modules`."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:  # not a transformers model that says: the members of its module lists
        layers = [child for m in model.modules() if isinstance(m, nn.ModuleList) for child in m]
    return layers


def shard_policy(model: nn.Module, device: torch.device, precision: str) -> torch.dtype:
    """Shard `model` in place across the default process group; returns the dtype the rollouts hold.

    Every rank must hold the same weights before (they are cut into shards, not exchanged).
    """
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    wire_dtype = next(model.parameters()).dtype
    policy = MixedPrecisionPolicy()
    if device.type == "cuda" and resolve_precision(precision, device) == "bf16":
        # fp32 master weights (sharded, so 1/N each), bf16 compute, fp32 gradient reduction.
        model.float()
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in decoder_layers(model):
        fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            # Sum, not FSDP's default mean over ranks: the losses are divided by global counts already.
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
    return wire_dtype


def is_sharded(model: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def full_tensor(tensor: Tensor) -> Tensor:
    """The whole of a (possibly sharded) tensor: a collective for a DTensor, itself otherwise."""
    from torch.distributed.tensor import DTensor

    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def gradient_norm(params: list[nn.Parameter], max_norm: float | None) -> float:
    """The global gradient norm over every rank's shards; gradients clipped to `max_norm` when set."""
    if max_norm is not None:
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    else:
        norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
    return float(full_tensor(norm))


# --- what rank 0 tells the other ranks ----------------------------------------------------------


class CommandChannel:
    """Rank 0 names the next collective; the other ranks receive it (no-ops with one rank)."""

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank, self.world_size = rank, world_size

    def send(self, command: str, *args: Any) -> None:
        if self.world_size > 1:
            dist.broadcast_object_list([(command, *args)], src=0)

    def receive(self) -> tuple[Any, ...]:
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def vote_to_stop(self, asked: bool, device: Any) -> bool:
        """Rank 0, at a step boundary: whether any rank was asked to stop (each answers in `follow`)."""
        self.send("vote")
        return bool(agree_to_stop(int(asked), device, self.world_size))


def follow(
    learner: Any,
    channel: CommandChannel,
    stop: threading.Event | None = None,
    device: Any = None,
    beat: Callable[[], None] = lambda: None,
) -> bool:
    """A rank other than 0: join rank 0's collectives in the order it names them, until it says `end`; `beat()`
    before each command (the role's heartbeat).

    Returns whether rank 0 ended for a preemption (a checkpoint written, trainer.steps not reached). `stop` is this
    rank's own stop request, its vote at each step boundary (rank 0 decides for all, with every vote)."""
    while True:
        beat()
        command, *args = channel.receive()
        if command == "vote":
            agree_to_stop(int(stop is not None and stop.is_set()), device, channel.world_size)
        elif command == "update":
            learner.update(args[0])
        elif command == "gather":
            gather_pass(learner.model, *args)
        elif command == "checkpoint":
            save_shards(learner, Path(args[0]))
            dist.barrier()
        elif command == "export":
            full_state_dict(learner.model)
        elif command == "end":
            return bool(args and args[0])
        else:
            raise RuntimeError(f"actor rank {channel.rank} got an unknown command {command!r} from rank 0")


# --- weight sync --------------------------------------------------------------------------------


def wait_for_gathers(device: torch.device) -> None:
    """Block the host until the gathers this rank queued are done: on CUDA its current stream (the gathers' results
    wait there), never the whole device; on the CPU gloo's gathers are done when they return."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


def gather_order(keys: list[str], adapters_only: bool = False) -> tuple[list[str], list[str]]:
    """The state-dict entries a weight sync gathers, in the order every rank gathers them: a policy's LoRA adapters
    first (small; rank 0 merges each base weight with them as it is gathered), then the other entries unless the
    adapters alone are sent. Without adapters: every entry in state-dict order."""
    adapters = [k for k in keys if ".lora_" in k]
    rest = [] if adapters_only else [k for k in keys if ".lora_" not in k and ".original_module." not in k]
    return adapters, rest


def gather_pass(model: nn.Module, bucket_bytes: int, adapters_only: bool = False) -> None:
    """The other ranks' part of a weight sync: every gather `ShardedWeights.full` makes, in the same order, paced
    by bucket.

    `full_tensor` never blocks the host on a GPU: without a wait, this rank would queue every all-gather of the
    model at once and allocate every full tensor up front (the whole model, 4 bytes a parameter in fp32), while
    rank 0 goes bucket by bucket at the pace of its rollouts. Waiting after every `bucket_bytes` of gathered tensors
    keeps at most one bucket (and one tensor) here."""
    device = next(model.parameters()).device
    queued = 0
    state = model.state_dict()
    adapters, rest = gather_order(list(state), adapters_only)
    with torch.no_grad():
        for key in adapters + rest:
            whole = full_tensor(state[key])
            queued += whole.numel() * whole.element_size()
            del whole
            if queued >= bucket_bytes:
                wait_for_gathers(device)
                queued = 0
        wait_for_gathers(device)


class WireWeights:
    """The policy as a weight-sync source (`rljob.runtime.weights.sync.GatheredWeights`) whose whole tensors go out
    one at a time in the dtype the rollouts hold; `_whole` makes a tensor whole."""

    def __init__(self, model: nn.Module, wire_dtype: torch.dtype) -> None:
        self.model, self.wire_dtype = model, wire_dtype
        self._tensors: list[Tensor] = []

    def placeholders(self) -> list[Tensor]:
        self._tensors = [t.detach() for t in self.model.state_dict().values()]
        dtype = self.wire_dtype
        return [
            torch.empty(t.shape, dtype=dtype if t.is_floating_point() else t.dtype, device="meta")
            for t in self._tensors
        ]

    def names(self) -> list[str]:
        return list(self.model.state_dict())

    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def begin_gather(self, bucket_bytes: int) -> None:
        """Nothing to start: every tensor is this rank's own."""

    def _whole(self, tensor: Tensor) -> Tensor:
        return tensor

    def full(self, index: int, device: torch.device | None = None) -> Tensor:
        """The whole tensor in the wire dtype, made whole on the model's device and left there for an NCCL round
        (`device` the actor's GPU), moved to the CPU otherwise."""
        whole = self._whole(self._tensors[index])
        if whole.is_floating_point():
            whole = whole.to(self.wire_dtype)  # before the move: fp32 weights cross to the host in bf16
        return whole.to(device or torch.device("cpu"))


class ShardedWeights(WireWeights):
    """A sharded policy, on rank 0: each tensor gathered whole from the shards (a collective of every rank)."""

    def __init__(self, model: nn.Module, wire_dtype: torch.dtype, channel: CommandChannel) -> None:
        super().__init__(model, wire_dtype)
        self.channel = channel

    def begin_gather(self, bucket_bytes: int) -> None:
        self.channel.send("gather", bucket_bytes)

    def _whole(self, tensor: Tensor) -> Tensor:
        return full_tensor(tensor)


class CastWeights(WireWeights):
    """A replicated policy's fp32 master weights (ddp under mixed precision: `LLMLearner.autocast_dtype`), sent in
    the dtype the rollouts hold; no other rank takes part."""


class MergedWeights(WireWeights):
    """A policy with LoRA adapters (ddp): the base model's tensors with the adapters merged in, under the base
    model's names, so the rollout loads them as it loads any policy (`lora.merged_state_dict`)."""

    def placeholders(self) -> list[Tensor]:
        merged = merged_state_dict(self.model)
        self._names, self._tensors = list(merged), list(merged.values())
        dtype = self.wire_dtype
        return [
            torch.empty(t.shape, dtype=dtype if t.is_floating_point() else t.dtype, device="meta")
            for t in self._tensors
        ]

    def names(self) -> list[str]:
        return list(merged_state_dict(self.model))


class AdapterWeights(WireWeights):
    """A policy with LoRA adapters whose rollouts serve the adapters on their base (`model.lora.sync: adapters`,
    vLLM): the adapters' A and B alone, under the names of PEFT's adapter file (`lora.adapter_file_state`)."""

    def placeholders(self) -> list[Tensor]:
        adapters = adapter_file_state(self.model)
        self._tensors = list(adapters.values())
        return [torch.empty(t.shape, dtype=self.wire_dtype, device="meta") for t in self._tensors]

    def names(self) -> list[str]:
        return list(adapter_file_state(self.model))


class ShardedLoraWeights(WireWeights):
    """A sharded policy with LoRA adapters (fsdp2), on rank 0: the adapters gathered whole first (every rank joins,
    `gather_pass`), then either sent alone (`adapters_only`, PEFT's file names) or each base tensor gathered and sent
    with its adapters merged in, under the base model's names and in its state-dict order (what the rollout holds).
    """

    def __init__(self, model: nn.Module, wire_dtype: torch.dtype, channel: CommandChannel, adapters_only: bool) -> None:
        super().__init__(model, wire_dtype)
        self.channel, self.adapters_only = channel, adapters_only
        self._adapters: dict[str, Tensor] = {}

    def _keys(self) -> tuple[dict[str, Tensor], list[str]]:
        state = self.model.state_dict()
        adapters, rest = gather_order(list(state), self.adapters_only)
        return state, adapters if self.adapters_only else rest

    def placeholders(self) -> list[Tensor]:
        state, keys = self._keys()
        self._state, self._sent = state, keys
        dtype = self.wire_dtype
        return [  # a DTensor's shape is the whole tensor's
            torch.empty(state[k].shape, dtype=dtype if state[k].is_floating_point() else state[k].dtype, device="meta")
            for k in keys
        ]

    def names(self) -> list[str]:
        _, keys = self._keys()
        if self.adapters_only:
            return [adapter_file_name(k) for k in keys]
        return list(merge_state({k: torch.empty(0) for k in keys}, {}))

    def begin_gather(self, bucket_bytes: int) -> None:
        self.channel.send("gather", bucket_bytes, self.adapters_only)
        self._state, self._sent = self._keys()
        adapters, _ = gather_order(list(self._state), self.adapters_only)
        with torch.no_grad():
            self._adapters = {k: full_tensor(self._state[k]) for k in adapters}
        self._scalings = lora_scalings(self.model)

    def full(self, index: int, device: torch.device | None = None) -> Tensor:
        key = self._sent[index]
        if self.adapters_only:
            whole = self._adapters[key]
        else:
            whole = full_tensor(self._state[key])
            layer = key.removesuffix(".base_layer.weight")
            if key.endswith(".base_layer.weight") and layer in self._scalings:
                b = self._adapters[f"{layer}.lora_B.{ADAPTER}.weight"]
                a = self._adapters[f"{layer}.lora_A.{ADAPTER}.weight"]
                whole = whole + (self._scalings[layer] * (b @ a)).to(whole.dtype)
        if whole.is_floating_point():
            whole = whole.to(self.wire_dtype)
        return whole.to(device or torch.device("cpu"))


def weight_source(learner: Any, channel: CommandChannel, adapters_only: bool = False) -> Any:
    """What the weight sync publishes: the module itself, its shards gathered one tensor at a time, its fp32
    master weights cast to the rollouts' dtype one tensor at a time, its adapters merged into the base, or with
    `adapters_only` its adapters alone."""
    if has_lora(learner.model) and is_sharded(learner.model):
        return ShardedLoraWeights(learner.model, learner.wire_dtype, channel, adapters_only)
    if has_lora(learner.model):
        if adapters_only:
            return AdapterWeights(learner.model, learner.wire_dtype)
        return MergedWeights(learner.model, learner.wire_dtype)
    if is_sharded(learner.model):
        return ShardedWeights(learner.model, learner.wire_dtype, channel)
    if next(learner.model.parameters()).dtype != learner.wire_dtype:
        return CastWeights(learner.model, learner.wire_dtype)
    return learner.model


# --- export -------------------------------------------------------------------------------------


def full_state_dict(model: nn.Module) -> dict[str, Tensor]:
    """The whole state on rank 0's CPU (empty on the others), one tensor gathered at a time: all ranks call it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def export_policy(learner: Any, tokenizer: Any, directory: Path, channel: CommandChannel) -> Path:
    """Rank 0: the Hugging Face export of the policy, sharded or not (the other ranks join the gathers)."""
    from rljob.runtime.llm.models.policy import export_hf

    if has_lora(learner.model):
        return export_lora(learner, tokenizer, directory, channel)
    if not is_sharded(learner.model):
        if next(learner.model.parameters()).dtype == learner.wire_dtype:
            return export_hf(learner.model, tokenizer, directory)
        state = {  # fp32 master weights (ddp under mixed precision): exported in the dtype the policy came in
            k: v.to(learner.wire_dtype) if v.is_floating_point() else v for k, v in learner.model.state_dict().items()
        }
        return export_hf(learner.model, tokenizer, directory, state_dict=state)
    channel.send("export")
    state = {
        k: v.to(learner.wire_dtype) if v.is_floating_point() else v for k, v in full_state_dict(learner.model).items()
    }
    return export_hf(learner.model, tokenizer, directory, state_dict=state)


def export_lora(learner: Any, tokenizer: Any, directory: Path, channel: CommandChannel) -> Path:
    """A policy with adapters: the merged model (`model.lora.mergeOnExport`, the default) or the PEFT adapter
    directory, which transformers writes for a model with adapters. A sharded policy is gathered whole first (every
    rank joins)."""
    from rljob.runtime.llm.models.policy import export_hf

    model = learner.model
    sharded = is_sharded(model)
    if sharded:
        channel.send("export")
    state = full_state_dict(model) if sharded else model.state_dict()
    if not learner.merge_on_export:
        state = {k: v.to(learner.wire_dtype) if v.is_floating_point() else v for k, v in state.items()}
        return export_hf(model, tokenizer, directory, state_dict=state)
    merged = merge_state(state, lora_scalings(model)) if sharded else merged_state_dict(model)
    state = {k: v.to(learner.wire_dtype) if v.is_floating_point() else v for k, v in merged.items()}
    with as_base_model(model):
        return export_hf(model, tokenizer, directory, state_dict=state)


# --- checkpoints --------------------------------------------------------------------------------


def _dcp_state(learner: Any) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    return {
        "model": get_model_state_dict(learner.model),
        "optimizer": get_optimizer_state_dict(learner.model, learner.optimizer),
    }


def save_shards(learner: Any, directory: Path) -> None:
    """Every rank: write this rank's shards of the model and optimizer into `directory/sharded`."""
    import torch.distributed.checkpoint as dcp

    # One rank (an fsdp2 job resumed on one) has no process group: DCP then reads and writes alone.
    dcp.save(_dcp_state(learner), checkpoint_id=directory / SHARDED_DIR, no_dist=not dist.is_initialized())


def save_checkpoint(
    manager: CheckpointManager, learner: Any, step: int, state: dict[str, Any], channel: CommandChannel
) -> Path:
    """Rank 0: the checkpoint of `step` (`state` holds the learner's own and the loop's state), atomically."""
    if not learner.sharded_checkpoints:
        return manager.save(step, state)
    tmp = manager.begin(step)
    channel.send("checkpoint", str(tmp))
    save_shards(learner, tmp)
    if dist.is_initialized():
        dist.barrier()  # every rank's shards are on disk before the manifest hashes them
    return manager.commit(step, tmp, state)


def load_checkpoint(learner: Any, state: dict[str, Any], path: Path) -> None:
    """Every rank: restore the learner from a checkpoint `resolve_resume` found (its `state.pt` and shards)."""
    directory = path.parent if path.name == STATE_FILE else path
    sharded = bool(state.get("sharded"))
    if sharded != learner.sharded_checkpoints:
        saved, wanted = ("fsdp2", "ddp") if sharded else ("ddp", "fsdp2")
        raise CheckpointError(
            f"checkpoint {directory} was saved with spec.trainer.parallelism {saved} and this job uses {wanted}: "
            f"set trainer.parallelism back to {saved}, or start afresh (checkpoint.resume: never)"
        )
    learner.load_state_dict(state)
    if not sharded:
        return
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    target = _dcp_state(learner)
    # Reshards: any world size reads any other's.
    dcp.load(target, checkpoint_id=directory / SHARDED_DIR, no_dist=not dist.is_initialized())
    set_model_state_dict(learner.model, target["model"])
    set_optimizer_state_dict(learner.model, learner.optimizer, target["optimizer"])
