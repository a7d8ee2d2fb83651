"""Weight sync over a real torch.distributed (gloo) pair group: the rollout's copy equals the actor's."""

from __future__ import annotations

import socket
import threading

import gymnasium
import pytest
import torch

from rljob.runtime.gym.models import MLPActorCritic
from rljob.runtime.weight_sync import SyncRefused, WeightPublisher, WeightSubscriber


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_weights_reach_the_rollout_and_a_restarted_rollout_joins_a_new_group():
    space = gymnasium.make("CartPole-v1").action_space
    actor, port = MLPActorCritic(4, space), free_port()
    publisher = WeightPublisher("127.0.0.1", port, "actor-a", bucket_mb=1)
    version = 0
    for incarnation in ("rollout-1", "rollout-2"):  # the second one is a restarted rollout process
        rollout = MLPActorCritic(4, space)
        subscriber = WeightSubscriber("127.0.0.1", port, bucket_mb=1)
        if incarnation == "rollout-2":
            publisher.forget(0)
        for _ in range(2):  # the second sync reuses the group
            with torch.no_grad():
                for p in actor.parameters():
                    p.add_(torch.randn_like(p))
            key = publisher.group_key(0, incarnation)
            version += 1
            receiver = threading.Thread(target=subscriber.receive, args=(key, version, "actor-a", rollout))
            receiver.start()
            publisher.publish(0, key, version, actor)
            receiver.join(timeout=30)
            for mine, theirs in zip(actor.state_dict().values(), rollout.state_dict().values(), strict=True):
                assert torch.equal(mine, theirs)


def test_a_sync_nobody_accepts_is_refused_quickly():
    publisher = WeightPublisher("127.0.0.1", free_port(), "actor-a", bucket_mb=1)
    model = MLPActorCritic(4, gymnasium.make("CartPole-v1").action_space)
    with pytest.raises(SyncRefused, match="did not accept weights version 3"):
        publisher.publish(0, publisher.group_key(0, "gone"), 3, model)
