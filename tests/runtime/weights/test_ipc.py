"""`weightSync.method: ipc` on the CPU: versions reach a rollout process through real shared memory (/dev/shm).

The CUDA handles of the same path are checked in tests/gpu/test_cuda_ipc.py (a GPU machine: `make gpu-check`).
"""

from __future__ import annotations

import multiprocessing
import pickle
from pathlib import Path

import pytest
import torch
from torch import nn

from rljob.runtime.weights.ipc import IpcWeightPublisher, manifest_of, mark_loaded, open_weights
from rljob.runtime.weights.sync import SyncRefused


class Tied(nn.Module):
    """Tied embedding and head (two state-dict names, one tensor) and a bf16 buffer: what llm policies hold."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 16)
        self.hidden = nn.Linear(16, 16)
        self.head = nn.Linear(16, 50, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("scale", torch.arange(3, dtype=torch.bfloat16))


def model(seed: int) -> Tied:
    torch.manual_seed(seed)
    return Tied()


def load_in_another_process(key: str, queue: multiprocessing.Queue) -> None:
    """A rollout: open the version, copy it into its own policy, drop the handles, mark it loaded."""
    policy = model(seed=99)
    tensors = open_weights(manifest_of(key))
    policy.load_state_dict(tensors)
    del tensors
    mark_loaded(key)
    queue.put({name: t.float().tolist() for name, t in policy.state_dict().items()})


def sync_to_a_process(publisher: IpcWeightPublisher, actor: nn.Module, version: int, tag: str = "r0") -> dict:
    keys = publisher.plan([(0, tag)], version, actor)
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    child = context.Process(target=load_in_another_process, args=(keys[0], queue))
    child.start()
    publisher.publish(version, actor)  # returns once the rollout marked the version loaded
    received = queue.get(timeout=60)
    child.join(timeout=30)
    assert child.exitcode == 0
    return received


def assert_received(received: dict, actor: nn.Module) -> None:
    for name, tensor in actor.state_dict().items():
        assert torch.equal(torch.tensor(received[name]), tensor.float()), name


def test_each_version_reaches_a_rollout_process_through_shared_memory_and_is_released_once_loaded(tmp_path):
    actor = model(seed=1)
    publisher = IpcWeightPublisher("actor-a", root=tmp_path)
    try:
        assert_received(sync_to_a_process(publisher, actor, version=1), actor)
        # Loaded: its memory goes at once, not at the next version (the actor trains in that memory meanwhile).
        assert list(publisher.directory.iterdir()) == []
        with torch.no_grad():
            actor.hidden.weight.add_(1.0)
        assert_received(sync_to_a_process(publisher, actor, version=2), actor)
        assert list(publisher.directory.iterdir()) == []
        # A rollout that restarts after the version was loaded gets it exported again.
        assert_received(sync_to_a_process(publisher, actor, version=2), actor)
    finally:
        publisher.close()
    assert not publisher.directory.exists()


def test_the_manifest_carries_handles_and_the_tensors_are_views_of_the_shared_memory(tmp_path):
    actor = model(seed=1)
    publisher = IpcWeightPublisher("actor-a", root=tmp_path)
    try:
        key = publisher.plan([(0, "r0")], 3, actor)[0]
        manifest = pickle.loads(Path(manifest_of(key)).read_bytes())
        assert {kind for _, (kind, *_) in manifest["handles"]} == {"shm"}
        opened = open_weights(manifest_of(key))
        again = open_weights(manifest_of(key))
        opened["hidden.bias"].fill_(7.0)  # one mapping of the memory, not a copy: a second opening sees the write
        assert torch.equal(again["hidden.bias"], torch.full((16,), 7.0))
        assert again["scale"].dtype == torch.bfloat16 and torch.equal(again["scale"], actor.scale)
    finally:
        publisher.close()


def test_a_rollout_that_never_loads_the_version_is_refused_by_name(tmp_path):
    publisher = IpcWeightPublisher("actor-a", root=tmp_path, load_timeout_s=0.2)
    try:
        keys = publisher.plan([(0, "r0"), (1, "r1")], 1, model(seed=1))
        mark_loaded(keys[1])
        with pytest.raises(SyncRefused) as refused:
            publisher.publish(1, model(seed=1))
        assert refused.value.replicas == frozenset({0})
    finally:
        publisher.close()


def test_a_restarted_rollout_never_counts_as_loaded_by_its_predecessor_s_mark(tmp_path):
    actor = model(seed=1)
    publisher = IpcWeightPublisher("actor-a", root=tmp_path)
    try:
        sync_to_a_process(publisher, actor, version=1, tag="first")
        publisher.load_timeout_s = 0.2
        publisher.plan([(0, "second")], 1, actor)  # the same version, to the replica's new incarnation
        with pytest.raises(SyncRefused):
            publisher.publish(1, actor)
    finally:
        publisher.close()
