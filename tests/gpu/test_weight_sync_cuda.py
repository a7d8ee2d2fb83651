"""The weight sync's backend and buffers following the tensors onto GPUs.

One GPU checks what it can: NCCL refuses two ranks on one GPU ("Duplicate GPU detected"), so an actor and a
rollout sharing it must sync by gloo, from CUDA tensors into CUDA tensors, and a sharded actor's gathered
tensors stay on the device when asked. The NCCL rounds themselves need two GPUs: those tests skip below that,
saying so. Every test here is marked `cuda` (tests/conftest.py skips them without CUDA; `make gpu-check` runs
this directory on a GPU machine).
"""

from __future__ import annotations

import gymnasium
import pytest
import torch

from rljob.runtime.gym.models import MLPActorCritic
from rljob.runtime.llm.training.sharding import CommandChannel, ShardedWeights
from rljob.runtime.weights.sync import WeightPublisher, WeightSubscriber, choose_backend, device_report, gpu_uuid
from tests.runtime.llm.training.test_learner import make_model
from tests.runtime.weights.test_sync import free_port, perturb, sync_round

pytestmark = pytest.mark.cuda

TWO_GPUS = pytest.mark.skipif(
    torch.cuda.device_count() < 2, reason="an NCCL round needs 2 GPUs: NCCL refuses two ranks on one GPU"
)


def assert_same_weights(sent: torch.nn.Module, received: torch.nn.Module, device: torch.device) -> None:
    for mine, theirs in zip(sent.state_dict().values(), received.state_dict().values(), strict=True):
        assert theirs.device == device and torch.equal(mine.cpu(), theirs.cpu())


def test_a_cuda_rank_reports_its_gpu_and_two_ranks_on_one_gpu_sync_by_gloo():
    gpu = torch.device("cuda", 0)
    report = device_report([gpu])
    assert report == f"cuda:{gpu_uuid(gpu)}".encode()
    assert choose_backend([report, device_report([torch.device("cuda")])]) == "gloo"  # the same GPU twice
    assert choose_backend([report, device_report([torch.device("cpu")])]) == "gloo"


def test_an_actor_and_a_rollout_on_one_gpu_sync_by_gloo_from_cuda_tensors_into_cuda_tensors():
    space = gymnasium.make("CartPole-v1").action_space
    gpu = torch.device("cuda", 0)
    actor, rollout, port = MLPActorCritic(4, space).to(gpu), MLPActorCritic(4, space).to(gpu), free_port()
    publisher = WeightPublisher("127.0.0.1", port, "actor-a", bucket_mb=1)
    subscriber = WeightSubscriber("127.0.0.1", port, 1)
    for version in (1, 2):
        perturb(actor)
        assert sync_round(publisher, actor, version, {0: ("rollout-0", subscriber, rollout)}) == {0: None}
        assert publisher.backend == "gloo"
        assert_same_weights(actor, rollout, gpu)  # received into the rollout's CUDA tensors, packed on the GPU
    publisher.close()


@pytest.mark.parametrize(
    ("actor_gpu", "rollout_gpu", "backend"),
    [(0, 0, "gloo"), pytest.param(0, 1, "nccl", marks=TWO_GPUS)],
)
def test_a_round_leaves_no_gpu_memory_allocated_behind(actor_gpu: int, rollout_gpu: int, backend: str):
    """The pack buffers on a GPU (the receiver's under gloo, both sides' under NCCL) go at the end of each round:
    what was allocated before a round is what is allocated after it, on every GPU, round after round."""
    space = gymnasium.make("CartPole-v1").action_space
    here, there = torch.device("cuda", actor_gpu), torch.device("cuda", rollout_gpu)
    actor, rollout, port = MLPActorCritic(4, space).to(here), MLPActorCritic(4, space).to(there), free_port()
    publisher = WeightPublisher("127.0.0.1", port, "actor-a", bucket_mb=1)
    subscriber = WeightSubscriber("127.0.0.1", port, 1)
    devices = sorted({here, there}, key=str)
    for version in (1, 2, 3):
        perturb(actor)
        before = {device: torch.cuda.memory_allocated(device) for device in devices}
        assert sync_round(publisher, actor, version, {0: ("rollout-0", subscriber, rollout)}) == {0: None}
        assert publisher.backend == backend
        assert_same_weights(actor, rollout, there)
        assert {device: torch.cuda.memory_allocated(device) for device in devices} == before, version
        assert "cuda" not in "".join(publisher._pack.held()) + "".join(subscriber._pack.held())
    publisher.close()


def test_a_sharded_source_gathers_onto_the_gpu_for_nccl_and_onto_the_host_for_gloo():
    """`ShardedWeights.full` on one rank (no shards to gather): the tensor in the wire dtype, on the device asked."""
    gpu = torch.device("cuda", 0)
    model = make_model().to(gpu)
    source = ShardedWeights(model, torch.bfloat16, CommandChannel(0, 1))
    placeholders = source.placeholders()
    assert source.device() == gpu
    on_gpu, on_host = source.full(0, gpu), source.full(0)
    assert on_gpu.device == gpu and on_host.device == torch.device("cpu")
    assert on_gpu.dtype == on_host.dtype == placeholders[0].dtype == torch.bfloat16
    assert torch.equal(on_gpu.cpu(), on_host)


@TWO_GPUS
def test_an_actor_and_a_rollout_on_two_gpus_sync_by_nccl_and_a_rollout_on_the_host_by_gloo():
    """One subscriber, the same members throughout: where the rollout's tensors are decides each round's
    backend, and each switch forms a new group (the backend is in its store prefix)."""
    space = gymnasium.make("CartPole-v1").action_space
    actor_gpu, rollout_gpu, cpu = torch.device("cuda", 0), torch.device("cuda", 1), torch.device("cpu")
    actor, port = MLPActorCritic(4, space).to(actor_gpu), free_port()
    publisher = WeightPublisher("127.0.0.1", port, "actor-a", bucket_mb=1)
    subscriber = WeightSubscriber("127.0.0.1", port, 1)
    for version, device, backend in ((1, rollout_gpu, "nccl"), (2, cpu, "gloo"), (3, rollout_gpu, "nccl")):
        perturb(actor)
        rollout = MLPActorCritic(4, space).to(device)
        assert sync_round(publisher, actor, version, {0: ("rollout-0", subscriber, rollout)}) == {0: None}
        assert publisher.backend == backend, version
        assert_same_weights(actor, rollout, device)
    publisher.close()


def test_a_round_from_cuda_tensors_waits_for_its_own_stream_never_the_whole_device(monkeypatch):
    """Issue 33, item 6: the weight-receiving thread of a rollout may run a round while its generating thread
    captures a CUDA graph; a device-wide synchronize there would break the capture. An actor and a rollout on one
    GPU (gloo) sync with `torch.cuda.synchronize` refused, and the rollout's tensors are complete on return."""

    def refused(*args: object) -> None:
        raise AssertionError("a weight round synchronized the whole device")

    monkeypatch.setattr(torch.cuda, "synchronize", refused)
    gpu = torch.device("cuda", 0)
    actor, rollout, port = make_model().to(gpu), make_model().to(gpu), free_port()
    publisher = WeightPublisher("127.0.0.1", port, "actor-a", bucket_mb=1)
    subscriber = WeightSubscriber("127.0.0.1", port, 1)
    perturb(actor)
    assert sync_round(publisher, actor, 1, {0: ("rollout-0", subscriber, rollout)}) == {0: None}
    assert_same_weights(actor, rollout, gpu)
    publisher.close()


def test_a_nonblocking_nccl_weight_sync_group_forms_and_broadcasts_on_one_gpu():
    """Issue 33, item 11: the weight-sync communicator is created non-blocking (`config.blocking = 0`) and still
    forms and carries a broadcast (a group of one: NCCL refuses two ranks on one GPU)."""
    from torch.distributed import TCPStore

    from rljob.runtime.weights.sync import discard_group, make_group

    store = TCPStore("127.0.0.1", free_port(), 1, is_master=True, wait_for_workers=False)
    gpu = torch.device("cuda", 0)
    group = make_group(store, "nonblocking", 0, 1, "nccl", gpu)
    try:
        tensor = torch.arange(16, device=gpu, dtype=torch.float32)
        group.broadcast(tensor, 0).wait()
        torch.cuda.current_stream(gpu).synchronize()
        assert torch.equal(tensor.cpu(), torch.arange(16, dtype=torch.float32))
    finally:
        discard_group(group)
