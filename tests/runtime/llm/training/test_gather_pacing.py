"""The actor ranks other than 0 join a sharded weight sync's gathers bucket by bucket (issue 33, item 3): they wait
for their gathers after every bucket of full tensors instead of queueing the whole model's at once. The gathers and
the waits are recorded here (on a GPU `full_tensor` never blocks the host; on a CPU it always does)."""

from __future__ import annotations

import torch

from rljob.runtime.llm.training import sharding
from rljob.runtime.llm.training.sharding import CommandChannel, ShardedWeights, follow, gather_pass
from tests.runtime.llm.training.test_learner import make_model


def record(monkeypatch) -> list[tuple[str, int]]:
    events: list[tuple[str, int]] = []

    def gathered(tensor: torch.Tensor) -> torch.Tensor:
        events.append(("gathered", tensor.numel() * tensor.element_size()))
        return tensor

    monkeypatch.setattr(sharding, "full_tensor", gathered)
    monkeypatch.setattr(sharding, "wait_for_gathers", lambda device: events.append(("wait", 0)))
    return events


def test_a_rank_never_holds_more_than_a_bucket_and_a_tensor_of_gathers_in_flight(monkeypatch):
    events = record(monkeypatch)
    model = make_model()
    sizes = [t.numel() * t.element_size() for t in model.state_dict().values()]
    bucket = sum(sizes) // 5
    gather_pass(model, bucket)
    in_flight, most = 0, 0
    for name, size in events:
        in_flight = 0 if name == "wait" else in_flight + size
        most = max(most, in_flight)
    assert most <= bucket + max(sizes)
    assert events.count(("wait", 0)) >= 5 and events[-1] == ("wait", 0)
    assert [size for name, size in events if name == "gathered"] == sizes  # every tensor, in state-dict order


def test_rank_0_tells_the_other_ranks_its_round_s_bucket_and_they_pace_by_it(monkeypatch):
    sent: list[tuple] = []
    channel = CommandChannel(0, 2)
    monkeypatch.setattr(channel, "send", lambda *command: sent.append(command))
    ShardedWeights(make_model(), torch.float32, channel).begin_gather(64 * 2**20)
    assert sent == [("gather", 64 * 2**20)]

    paced: list[int] = []
    commands = iter([("gather", 64 * 2**20), ("end",)])
    follower = CommandChannel(1, 2)
    monkeypatch.setattr(follower, "receive", lambda: next(commands))
    monkeypatch.setattr(sharding, "gather_pass", lambda model, bucket_bytes: paced.append(bucket_bytes))

    class Learner:
        model = make_model()

    follow(Learner(), follower)
    assert paced == [64 * 2**20]
