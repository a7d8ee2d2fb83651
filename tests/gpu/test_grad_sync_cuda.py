"""On a GPU: ddp's gradient sum over an NCCL group needs the gradients and at most two packed buckets, never a
copy of every gradient (issue 33, item 7). One rank (an NCCL group of one) sums as a group of N would allocate."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from rljob.runtime.llm.training.grad_sync import MAX_BUCKETS_IN_FLIGHT, sum_gradients
from tests.runtime.weights.test_sync import free_port

pytestmark = pytest.mark.cuda


def test_the_sum_of_64_mib_of_gradients_allocates_at_most_two_buckets_on_the_gpu():
    torch.cuda.set_device(0)
    dist.init_process_group(
        "nccl", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1, device_id=torch.device("cuda", 0)
    )
    try:
        params = [nn.Parameter(torch.zeros(256, 1024, device="cuda")) for _ in range(64)]  # 1 MiB each: all packed
        for p in params:
            p.grad = torch.ones_like(p)
        bucket = 8 * 2**20
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        sum_gradients(params, bucket_bytes=bucket)
        torch.cuda.synchronize()
        assert torch.cuda.max_memory_allocated() - base <= MAX_BUCKETS_IN_FLIGHT * bucket + 2**20
        assert all(torch.equal(p.grad, torch.ones_like(p)) for p in params)  # a sum over one rank
    finally:
        dist.destroy_process_group()
