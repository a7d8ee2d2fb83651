"""The gym actor's controller against a rollout peer over the real transport."""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import gymnasium
import pytest

from rljob.api import load_job_file
from rljob.api.spec import AlgorithmSpec, BuiltinNetwork, TrainerSpec
from rljob.launch.local import free_ports
from rljob.runtime.gym.actor import Controller, StaleBatch
from rljob.runtime.gym.models import build_mlp_actor_critic
from rljob.runtime.gym.ppo import PPOLearner
from rljob.runtime.wire.context import RoleContext
from rljob.runtime.wire.identity import local_identities, ports_needed
from rljob.runtime.wire.transport import RequestServer

REPO = Path(__file__).resolve().parents[3]


def actor_context(tmp_path: Path) -> RoleContext:
    config = REPO / "examples" / "cartpole-ppo.yaml"  # maxStaleness 0
    replicas = {"actor": 1, "rollout": 1, "env": 1, "reward": 0}
    identities = local_identities("stale", replicas, str(config), free_ports(ports_needed(replicas)), str(tmp_path))
    identity = next(i for i in identities if i.role == "actor")
    return RoleContext(identity=identity, job=load_job_file(config), log=logging.getLogger("rljob.actor"))


def test_a_batch_older_than_max_staleness_is_refused_before_the_update(tmp_path):
    context = actor_context(tmp_path)
    env = gymnasium.make("CartPole-v1")
    model = build_mlp_actor_critic(BuiltinNetwork(hidden_sizes=[8]), env.observation_space, env.action_space)
    learner = PPOLearner(model, AlgorithmSpec(name="ppo", minibatches=1), TrainerSpec(steps=5, batch_size=64))
    # A rollout that breaks its side of the contract: it answers the actor at version 3 with version 1's batch.
    rollout = RequestServer(
        context.identity.endpoints["rollout"][0],
        {
            "status": lambda _: {"tag": "rollout-a", "version": 3, "actor_tag": ""},
            "collect": lambda _: {"ready": True, "tag": "rollout-a", "version": 1},
        },
    )
    done = threading.Event()
    serving = threading.Thread(target=rollout.serve, args=(done.is_set,), daemon=True)
    serving.start()
    controller = Controller(context, learner)
    try:
        link = controller.links[0]
        link.tag, link.version = "rollout-a", 3  # the weights of version 3 are there already
        with pytest.raises(StaleBatch, match=r"rollout 0 .* version 1 for step 3: 2 versions old.*maxStaleness \(0\)"):
            controller.fetch(3)
    finally:
        controller.close()
        done.set()
        serving.join(timeout=5)
        rollout.close()
