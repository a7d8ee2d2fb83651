"""On a GPU machine: each actor rank makes its own GPU current and its NCCL group is bound to it (issue 33, item 1).
With two GPUs, two real ranks each land on their own GPU (before, both landed on GPU 0: "Duplicate GPU detected")."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from rljob.runtime.wire.identity import local_identities, ports_needed
from rljob.runtime.wire.ranks import join_actor_group, rank_device
from tests.runtime.weights.test_sync import free_port

pytestmark = pytest.mark.cuda

REPLICAS = {"actor": 1, "rollout": 1, "env": 1, "reward": 0}


def _identity(ranks: int, local_rank: int, port: int):
    identity = local_identities(
        "job",
        REPLICAS,
        "/tmp/job.yaml",
        list(range(43000, 43000 + ports_needed(REPLICAS))),
        actor_ranks_per_replica=ranks,
    )[0].for_rank(local_rank)
    return dataclasses.replace(identity, master_addr="127.0.0.1", master_port=port)


def _rank(local_rank: int, ranks: int, port: int, seen: torch.multiprocessing.Queue) -> None:
    device = rank_device(ranks, local_rank)
    join_actor_group(_identity(ranks, local_rank, port), device, 2.0)
    box = [torch.cuda.current_device()] if local_rank == 0 else [None]
    dist.broadcast_object_list(box, src=0)  # uses the current device: each rank's own
    total = torch.ones(1, device=device)
    dist.all_reduce(total)
    seen.put((local_rank, torch.cuda.current_device(), float(total.item())))
    dist.destroy_process_group()


def test_one_rank_binds_its_group_to_its_current_gpu():
    device = rank_device(1, 0)
    assert torch.cuda.current_device() == device.index == 0
    join_actor_group(_identity(1, 0, free_port()), device, 2.0)
    try:
        box = [torch.cuda.current_device()]
        dist.broadcast_object_list(box, src=0)
        assert box == [0]
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs: one per rank")
def test_two_ranks_each_train_on_their_own_gpu():
    context = mp.get_context("spawn")
    seen = context.Queue()
    port = free_port()
    procs = [context.Process(target=_rank, args=(r, 2, port, seen)) for r in range(2)]
    for p in procs:
        p.start()
    results = sorted(seen.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    assert results == [(0, 0, 2.0), (1, 1, 2.0)]
