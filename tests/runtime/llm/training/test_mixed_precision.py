"""ddp under bf16 on CUDA keeps fp32 master weights: what decides it, and how those weights reach rollouts and
exports in bf16 (the send side runs on the CPU here; the update itself is tests/gpu/test_cuda.py's)."""

from __future__ import annotations

import sys
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from rljob.runtime.llm.models.policy import build_char_tokenizer
from rljob.runtime.llm.training.learner import mixed_precision
from rljob.runtime.llm.training.sharding import CastWeights, export_policy, weight_source
from rljob.runtime.weights.ipc import export_weights, open_weights
from rljob.runtime.weights.sync import WeightPublisher, WeightSubscriber, state_tensors

sys.path.insert(0, str(Path(__file__).parent))
from test_learner import make_model

from tests.runtime.weights.test_sync import free_port

CUDA, CPU = torch.device("cuda"), torch.device("cpu")


@pytest.mark.parametrize(
    ("device", "precision", "loaded", "expected"),
    [
        (CUDA, "bf16", torch.bfloat16, True),
        (CUDA, "auto", torch.bfloat16, True),
        (CUDA, "fp32", torch.float32, False),
        (CUDA, "bf16", torch.float32, False),  # model.dtype float32 set explicitly: the user's choice stands
        (CUDA, "fp16", torch.float16, False),
        (CPU, "bf16", torch.float32, False),  # the CPU computes in fp32 whatever precision says
    ],
)
def test_fp32_master_weights_where_bf16_compute_runs_on_cuda(device, precision, loaded, expected):
    assert mixed_precision(device, precision, loaded) is expected


def master_and_rollout() -> tuple[torch.nn.Module, torch.nn.Module, CastWeights]:
    """An fp32 actor policy (master weights, moved off the starting point), its bf16 rollout, the send side."""
    master = make_model()
    with torch.no_grad():
        for p in master.parameters():
            p.add_(torch.randn_like(p) * 1e-3)  # below bf16's resolution of most weights: only fp32 holds it
    rollout = make_model().to(torch.bfloat16)
    return master, rollout, CastWeights(master, torch.bfloat16)


def expected_bf16(master: torch.nn.Module) -> list[torch.Tensor]:
    return [t.to(torch.bfloat16) if t.is_floating_point() else t for t in state_tensors(master)]


def test_the_broadcast_sends_fp32_master_weights_as_the_bf16_the_rollout_holds():
    master, rollout, weights = master_and_rollout()
    publisher = WeightPublisher("127.0.0.1", free_port(), "actor-a", bucket_mb=1)
    subscriber = WeightSubscriber("127.0.0.1", publisher.store.port, bucket_mb=1)
    try:
        keys = publisher.plan([(0, "rollout-0")], 1, weights)
        receiver = threading.Thread(target=subscriber.receive, args=(keys[0], 1, "actor-a", rollout))
        receiver.start()
        publisher.publish(1, weights)
        receiver.join(timeout=30)
    finally:
        publisher.close()
    for got, want in zip(state_tensors(rollout), expected_bf16(master), strict=True):
        assert torch.equal(got, want)
    assert next(master.parameters()).dtype == torch.float32  # the master weights themselves are untouched


def test_the_collocated_ipc_export_of_fp32_master_weights_is_bf16(tmp_path):
    master, _, weights = master_and_rollout()
    export = export_weights(tmp_path, 1, weights)
    try:
        opened = open_weights(str(export.manifest))
        for name, want in zip(master.state_dict(), expected_bf16(master), strict=True):
            assert torch.equal(opened[name], want)
    finally:
        export.release()


def test_a_mixed_precision_learner_sends_and_exports_bf16_and_a_plain_one_its_module(tmp_path):
    master, _, _ = master_and_rollout()
    mixed = SimpleNamespace(model=master, wire_dtype=torch.bfloat16)
    assert isinstance(weight_source(mixed, channel=None), CastWeights)
    assert weight_source(SimpleNamespace(model=master, wire_dtype=torch.float32), channel=None) is master

    from safetensors.torch import load_file

    tokenizer = build_char_tokenizer(["0123456789+="])
    export_policy(mixed, tokenizer, tmp_path / "model", channel=None)
    saved = {}
    for path in (tmp_path / "model").glob("*.safetensors"):
        saved.update(load_file(str(path)))
    assert saved and all(t.dtype == torch.bfloat16 for t in saved.values())
    name = "model.layers.0.mlp.up_proj.weight"
    assert torch.equal(saved[name], master.state_dict()[name].to(torch.bfloat16))
