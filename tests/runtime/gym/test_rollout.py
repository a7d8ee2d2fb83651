"""The gym rollout role in this process, with a real env role and an actor side played over the real transport."""

from __future__ import annotations

import datetime
import logging
import threading
import time

import torch
from torch.distributed import TCPStore

from rljob.api import load_job_file
from rljob.launch.local import free_ports
from rljob.runtime.gym.env import run_env
from rljob.runtime.gym.envs import space_from_wire
from rljob.runtime.gym.models import build_mlp_actor_critic
from rljob.runtime.gym.rollout import run_rollout
from rljob.runtime.weights.sync import GoSignal, SyncTicket, broadcast_state, make_group, state_tensors
from rljob.runtime.wire.context import RoleContext
from rljob.runtime.wire.identity import local_identities, ports_needed
from rljob.runtime.wire.transport import RequestClient

JOB = """\
apiVersion: rljob.io/v1alpha1
kind: RLJob
metadata:
  name: rollout-test
spec:
  task:
    type: gym
    gym: {envId: CartPole-v1, numEnvs: 2}
  model: {builtin: {hiddenSizes: [8]}}
  algorithm: {name: ppo, minibatches: 1}
  trainer: {steps: 1, batchSize: 16}
  roles:
    actor: {replicas: 1}
    rollout: {replicas: 1}
    env: {replicas: 1}
"""


def test_the_rollout_answers_status_and_collect_while_weights_arrive(tmp_path):
    config = tmp_path / "job.yaml"
    config.write_text(JOB)
    job = load_job_file(config)
    replicas = {"actor": 1, "rollout": 1, "env": 1, "reward": 0}
    identities = {
        i.role: i for i in local_identities("rollout-test", replicas, str(config), free_ports(ports_needed(replicas)))
    }
    contexts = [
        RoleContext(identity=identities[r], job=job, log=logging.getLogger(f"rljob.{r}")) for r in ("env", "rollout")
    ]
    roles = [
        threading.Thread(target=run, args=(c,), daemon=True)
        for run, c in zip((run_env, run_rollout), contexts, strict=True)
    ]
    # The actor's side: the store every weight sync meets on, and two clients (one waits for the sync's reply).
    store = TCPStore("127.0.0.1", identities["actor"].sync_port, is_master=True, wait_for_workers=False)
    endpoint = identities["rollout"].endpoints["rollout"][0]
    syncing, asking = (RequestClient(endpoint, timeout=20.0, retries=0) for _ in range(2))
    group = None
    for role in roles:
        role.start()
    try:
        tag = asking.call("status", timeout=120.0)["tag"]
        spaces = RequestClient(identities["env"].endpoints["env"][0]).call("spaces")
        torch.manual_seed(3)
        actor_model = build_mlp_actor_critic(
            job.spec.model.builtin,
            space_from_wire(spaces["observation_space"]),
            space_from_wire(spaces["action_space"]),
        )
        ticket = SyncTicket("actor-a/1", rank=1, world=2, round=1)
        sync = syncing.send(
            "sync_weights", {"version": 0, "key": ticket.encode(), "actor_tag": "actor-a", "rollout_tag": tag}
        )
        store.wait([ticket.accepted_key], datetime.timedelta(seconds=60))
        go = GoSignal("gloo", ticket.round)
        store.set(ticket.go_key, go.encode())
        group = make_group(store, go.group(ticket), 0, 2)  # the rollout is in the transfer now, waiting for the tensors

        # The actor pauses mid-transfer; the rollout keeps answering.
        assert asking.call("status")["tag"] == tag
        collect = {"actor_version": 0, "max_staleness": 0, "actor_tag": "actor-a"}
        assert asking.call("collect", collect)["ready"] is False

        broadcast_state(group, state_tensors(actor_model), 2**20)
        group = None
        assert syncing.receive(sync)["version"] == 0
        deadline = time.monotonic() + 120
        reply = asking.call("collect", collect)
        while not reply["ready"] and time.monotonic() < deadline:
            reply = asking.call("collect", collect)
        assert reply["ready"] and reply["version"] == 0
        assert reply["obs"].shape == (8, 2, 4)
    finally:
        if group is not None:  # a rollout still in the transfer gets it, so that it can stop
            broadcast_state(group, state_tensors(actor_model), 2**20)
        for context in contexts:
            context.stop.set()
        for role in roles:
            role.join(timeout=30)
        syncing.close()
        asking.close()
