"""The actor's CUDA IPC exports (issue 33, item 10): a live parameter is shared once and its handle reused from
version to version, and a CPU actor's export never touches CUDA. `reduce_tensor` and `torch.cuda` are recorded here;
tests/gpu/test_cuda_ipc.py checks the handles on a GPU."""

from __future__ import annotations

import torch
from torch.multiprocessing import reductions

from rljob.runtime.weights.ipc import cuda_handle, export_weights
from tests.runtime.llm.training.test_learner import make_model


def test_a_live_parameter_is_shared_once_and_a_new_tensor_is_shared_again(monkeypatch):
    shared_calls: list[int] = []
    monkeypatch.setattr(
        reductions, "reduce_tensor", lambda t: shared_calls.append(t.data_ptr()) or ("rebuild", (t.data_ptr(),))
    )
    handles: dict = {}
    weight = torch.zeros(4, 4)
    first = cuda_handle(weight, handles)
    weight.add_(1.0)  # the optimizer's in-place update: the same memory
    assert cuda_handle(weight, handles) == first
    assert shared_calls == [weight.data_ptr()]
    assert cuda_handle(weight[1], handles) != first  # a view of other bytes: its own handle
    copy = weight.clone()  # a gathered or cast copy: new memory
    cuda_handle(copy, handles)
    assert shared_calls == [weight.data_ptr(), weight[1].data_ptr(), copy.data_ptr()]
    assert cuda_handle(weight, None) and len(shared_calls) == 4  # without a cache, shared every time


def test_a_cpu_actor_s_export_is_released_without_touching_cuda(tmp_path, monkeypatch):
    touched: list[str] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a GPU machine, the actor on its CPU
    monkeypatch.setattr(torch.cuda, "ipc_collect", lambda: touched.append("ipc_collect"))
    export = export_weights(tmp_path, 1, make_model())
    export.release()
    assert touched == []
