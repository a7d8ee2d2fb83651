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


def test_weight_files_are_written_whole_versioned_and_pruned(tmp_path):
    from rljob.runtime.weight_sync import FileWeightPublisher, read_weights_file, write_weights_file

    model = MLPActorCritic(4, gymnasium.make("CartPole-v1").action_space)
    write_weights_file(tmp_path, 1, "old-actor", model)
    publisher = FileWeightPublisher(tmp_path, "actor-a")
    paths = []
    for version in (1, 2, 3):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
        path = publisher.sync_key(0, "rollout-1", version, model)
        assert publisher.sync_key(1, "rollout-2", version, model) == path  # one file per version, any replica
        paths.append(path)
        loaded = read_weights_file(path)
        assert sorted(loaded) == sorted(model.state_dict())  # by name: safetensors sorts them
        for name, tensor in model.state_dict().items():
            assert torch.equal(loaded[name], tensor)
    assert paths[-1].endswith("weights-00000003-actor-a.safetensors")
    # The newest two of this actor stay (a rollout may still read the previous one); no temporary file is left.
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "weights-00000002-actor-a.safetensors",
        "weights-00000003-actor-a.safetensors",
    ]


def test_an_hf_engine_takes_a_weight_file_in_and_swaps_it_in_between_chunks(tmp_path):
    from rljob.api.spec import BuiltinNetwork, DatasetSpec, LLMTask, ModelSpec
    from rljob.runtime.llm.data import arithmetic_rows
    from rljob.runtime.llm.engine import HFEngine, WeightSyncSettings, WeightUpdate
    from rljob.runtime.llm.policy import load_policy
    from rljob.runtime.weight_sync import write_weights_file

    task = LLMTask(dataset=DatasetSpec(builtin="arithmetic", size=8), max_prompt_length=8, max_response_length=2)
    spec = ModelSpec(source="builtin", builtin=BuiltinNetwork(hidden_size=16, num_layers=1, num_heads=2))
    model, tokenizer = load_policy(spec, task, arithmetic_rows(8, 0), 0, torch.device("cpu"))
    trainer, _ = load_policy(spec, task, arithmetic_rows(8, 0), 0, torch.device("cpu"))
    with torch.no_grad():
        trainer.model.embed_tokens.weight.mul_(2.0)  # the tied head moves with it
    engine = HFEngine(model, tokenizer, torch.device("cpu"), WeightSyncSettings("filesystem", "", 0, 1))
    assert engine.swap_in() is None
    engine.receive_weights(WeightUpdate(5, "actor-a", str(write_weights_file(tmp_path, 5, "actor-a", trainer))))
    assert not torch.equal(model.lm_head.weight, trainer.lm_head.weight)  # staged, not live yet
    assert engine.swap_in() == 5 and engine.swap_in() is None
    for mine, theirs in zip(model.state_dict().values(), trainer.state_dict().values(), strict=True):
        assert torch.equal(mine, theirs)
