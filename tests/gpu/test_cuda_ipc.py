"""`weightSync.method: ipc` on a GPU: CUDA IPC handles to the actor's own parameters, opened by another process.

Marked `cuda`: skipped without a CUDA device; `make gpu-check` runs it (the CPU shared-memory path of the same code
is tests/runtime/weights/test_ipc.py).
"""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
import torch

from rljob.runtime.weights.ipc import IpcWeightPublisher, manifest_of
from tests.runtime.weights.test_ipc import assert_received, model, sync_to_a_process

pytestmark = pytest.mark.cuda


def test_a_cuda_actor_hands_its_parameters_to_a_rollout_process_by_cuda_ipc_handles(tmp_path):
    actor = model(seed=1).cuda()
    publisher = IpcWeightPublisher("actor-a", root=tmp_path)
    try:
        assert_received(sync_to_a_process(publisher, actor, version=1), actor)
        key = publisher.plan([(0, "r0")], 1, actor)[0]
        manifest = pickle.loads(Path(manifest_of(key)).read_bytes())
        assert {kind for _, (kind, *_) in manifest["handles"]} == {"cuda"}
        assert not (publisher.directory / "v00000001.shm").exists()  # nothing went through the host
        # The handles point at the parameters themselves: no copy on the actor's side.
        assert publisher._export is not None
        pointers = {t.data_ptr() for t in publisher._export.keep}
        assert actor.hidden.weight.data_ptr() in pointers
        with torch.no_grad():
            actor.hidden.weight.add_(1.0)
        assert_received(sync_to_a_process(publisher, actor, version=2), actor)
    finally:
        publisher.close()


def test_the_parameters_are_shared_once_and_every_version_reaches_the_rollout_through_the_same_handles(tmp_path):
    """Issue 33, item 10: an export per version re-shared every live parameter (one more wrapper and ref-counter
    slot each time); now the first export's handles serve every version, each read with the new values."""
    actor = model(seed=1).cuda()
    publisher = IpcWeightPublisher("actor-a", root=tmp_path)
    try:
        handles = []
        for version in (1, 2, 3):
            with torch.no_grad():
                actor.hidden.weight.add_(1.0)
            assert_received(sync_to_a_process(publisher, actor, version=version), actor)
            handles.append(dict(publisher._shared))
        assert handles[0] and handles[0] == handles[1] == handles[2]
        allocated = torch.cuda.memory_allocated()
        assert_received(sync_to_a_process(publisher, actor, version=4), actor)
        assert torch.cuda.memory_allocated() == allocated  # nothing new held for a version
    finally:
        publisher.close()
