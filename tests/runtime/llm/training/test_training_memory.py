"""What the actor holds after an update (issue 33, item 2): no gradient outlives its step, and a collocated actor
hands the allocator's cached blocks back before its rollout wakes into them."""

from __future__ import annotations

import gc

import torch

from rljob.api.spec import AlgorithmSpec
from tests.runtime.llm.training.test_learner import make_learner, make_samples

ALGORITHM = AlgorithmSpec(name="grpo", kl_coef=0.0, loss_aggregation="token-mean", minibatches=2)


def gradient_bytes(learner) -> int:
    return sum(p.grad.numel() * p.grad.element_size() for p in learner.model.parameters() if p.grad is not None)


def test_no_gradient_is_held_between_steps():
    learner = make_learner(ALGORITHM)
    learner.update(make_samples(0))
    assert gradient_bytes(learner) == 0
    before = [p.detach().clone() for p in learner.model.parameters()]
    learner.update(make_samples(1))  # the next step still trains: its gradients were made afresh
    assert any(not torch.equal(a, p) for a, p in zip(before, learner.model.parameters(), strict=True))
    assert gradient_bytes(learner) == 0


def test_a_collocated_learner_frees_gradients_then_collects_then_empties_the_gpu_cache(monkeypatch):
    learner = make_learner(ALGORITHM)
    learner.returns_memory = True
    learner.update(make_samples(0))
    for p in learner.model.parameters():  # as a step leaves them, before the release
        p.grad = torch.ones_like(p)
    calls: list[tuple[str, int]] = []
    monkeypatch.setattr(gc, "collect", lambda *a: calls.append(("gc.collect", gradient_bytes(learner))) or 0)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append(("empty_cache", gradient_bytes(learner))))
    learner.device = torch.device("cuda", 0)  # only the release reads it here
    learner._free_training_memory()
    assert calls == [("gc.collect", 0), ("empty_cache", 0)]


def test_a_learner_beside_no_rollout_keeps_the_allocator_cache(monkeypatch):
    learner = make_learner(ALGORITHM)
    emptied: list[bool] = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append(True))
    learner.device = torch.device("cuda", 0)
    learner._free_training_memory()
    assert emptied == [] and gradient_bytes(learner) == 0
