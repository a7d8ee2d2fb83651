"""ddp's gradient sum over ranks (issue 33, item 7): in place, packed buckets bounded, every gradient summed. The
all-reduce is recorded (and doubles what it is given, as two ranks with equal gradients would); the 2-rank gloo
update against one rank is tests/runtime/llm/training/test_learner.py::test_two_ranks_update_like_one."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from rljob.runtime.llm.training import grad_sync
from rljob.runtime.llm.training.grad_sync import MAX_BUCKETS_IN_FLIGHT, sum_gradients


class Work:
    def __init__(self, log: list, call: int) -> None:
        self.log, self.call = log, call

    def wait(self) -> None:
        self.log.append(("wait", self.call))


@pytest.fixture
def reduced(monkeypatch):
    """("all_reduce", call number, bytes, the tensor's address) and ("wait", call number), in order. Calls are told
    apart by number: a freed bucket's memory can hold the next bucket at the same address."""
    log: list[tuple] = []

    def all_reduce(tensor: torch.Tensor, async_op: bool = False) -> Work:
        tensor.mul_(2)
        call = sum(entry[0] == "all_reduce" for entry in log)
        log.append(("all_reduce", call, tensor.numel() * tensor.element_size(), tensor.data_ptr()))
        return Work(log, call)

    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    return log


def params_with_gradients() -> list[nn.Parameter]:
    torch.manual_seed(0)
    shapes = [(1024, 1024), (1024, 1024)] + [(256, 64)] * 24 + [(64,)] * 8  # 2 big, 32 small
    params = [nn.Parameter(torch.zeros(shape)) for shape in shapes]
    for p in params[:-1]:
        p.grad = torch.randn_like(p)
    return params  # the last one has no gradient: it counts as zeros


def test_every_gradient_is_summed_where_it_is(reduced):
    params = params_with_gradients()
    before = [None if p.grad is None else p.grad.clone() for p in params]
    storage = [None if p.grad is None else p.grad.data_ptr() for p in params]
    sum_gradients(params, bucket_bytes=256 * 64 * 4 * 5)
    for p, old, ptr in zip(params, before, storage, strict=True):
        if old is None:
            assert torch.equal(p.grad, torch.zeros_like(p))
        else:
            assert torch.equal(p.grad, 2 * old)
            assert p.grad.data_ptr() == ptr  # no copy left in its place


def test_the_big_gradients_go_in_place_and_no_more_than_two_packed_buckets_exist_at_once(reduced):
    params = params_with_gradients()
    grad_ptrs = {p.grad.data_ptr() for p in params if p.grad is not None}
    bucket = 256 * 64 * 4 * 5
    sum_gradients(params, bucket_bytes=bucket)
    big = [entry for entry in reduced if entry[0] == "all_reduce" and entry[3] in grad_ptrs]
    assert len(big) == 2
    packed, waited, most = set(), set(), 0
    for entry in reduced:
        if entry[0] == "all_reduce" and entry[3] not in grad_ptrs:
            assert entry[2] <= bucket
            packed.add(entry[1])
        elif entry[0] == "wait":
            waited.add(entry[1])
        most = max(most, len(packed - waited))
    assert most <= MAX_BUCKETS_IN_FLIGHT and packed <= waited
    assert len(packed) >= 4  # the small gradients did need several buckets


def test_gradients_of_another_dtype_are_never_packed_together(reduced):
    params = [nn.Parameter(torch.zeros(8)), nn.Parameter(torch.zeros(8, dtype=torch.float64))]
    for p in params:
        p.grad = torch.ones_like(p)
    assert len(grad_sync._buckets([p.grad for p in params], 2**20)) == 2
    sum_gradients(params)
    assert all(torch.equal(p.grad, 2 * torch.ones_like(p)) for p in params)


def test_a_ddp_learner_sums_its_gradients_in_place(reduced):
    from rljob.api.spec import AlgorithmSpec
    from tests.runtime.llm.training.test_learner import make_learner

    learner = make_learner(AlgorithmSpec(name="grpo", kl_coef=0.0))
    for p in learner.params:
        p.grad = torch.ones_like(p)
    ptrs = [p.grad.data_ptr() for p in learner.params]
    learner.world_size = 2  # as a rank of two would, with the all-reduce recorded
    learner._sync_gradients()
    assert [p.grad.data_ptr() for p in learner.params] == ptrs
    assert all(torch.equal(p.grad, 2 * torch.ones_like(p)) for p in learner.params)
