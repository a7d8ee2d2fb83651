"""A real env role serving MiniGrid's RGB views and the rollout's collector: pixels stay uint8 from the env to the
batch the actor receives, and the cnn acts on them through the torch policy."""

from __future__ import annotations

import logging
import threading

import numpy as np
import pytest

from rljob.api import load_job_file
from rljob.launch.local import free_ports
from rljob.runtime.gym.collector import TrajectoryCollector
from rljob.runtime.gym.env import run_env
from rljob.runtime.gym.envs import space_from_wire
from rljob.runtime.gym.models import build_actor_critic
from rljob.runtime.gym.torch_policy import TorchPolicy, rollout_policy
from rljob.runtime.wire.context import RoleContext
from rljob.runtime.wire.identity import local_identities, ports_needed

pytest.importorskip("minigrid", reason="the pixels extra is not installed: pip install 'rljob[pixels]'")

JOB = """\
apiVersion: rljob.io/v1alpha1
kind: RLJob
metadata:
  name: pixels-test
spec:
  task:
    type: gym
    gym:
      envId: minigrid:MiniGrid-Empty-5x5-v0
      numEnvs: 3
      wrappers: [{builtin: minigrid-rgb, args: {tile_size: 4}}]
  model: {builtin: {architecture: cnn, channels: [8, 8], kernelSizes: [4, 3], strides: [2, 2], hiddenSizes: [16]}}
  algorithm: {name: ppo, minibatches: 1}
  trainer: {steps: 1, batchSize: 12}
  roles:
    actor: {replicas: 1}
    rollout: {replicas: 1}
    env: {replicas: 1}
"""


def test_pixels_stay_bytes_from_the_env_role_to_the_batch(tmp_path):
    config = tmp_path / "job.yaml"
    config.write_text(JOB)
    job = load_job_file(config)
    replicas = {"actor": 1, "rollout": 1, "env": 1, "reward": 0}
    identities = {
        i.role: i for i in local_identities("pixels-test", replicas, str(config), free_ports(ports_needed(replicas)))
    }
    context = RoleContext(identity=identities["env"], job=job, log=logging.getLogger("rljob.env"))
    env_role = threading.Thread(target=run_env, args=(context,), daemon=True)
    env_role.start()
    collector = None
    try:
        collector = TrajectoryCollector([(0, identities["env"].endpoints["env"][0])], seed=0)
        observation_space = space_from_wire(collector.spaces["observation_space"])
        action_space = space_from_wire(collector.spaces["action_space"])
        assert observation_space.shape == (28, 28, 3) and observation_space.dtype == np.uint8
        model = build_actor_critic(job.spec.model.builtin, observation_space, action_space)
        policy = rollout_policy(model, seed=0)
        assert isinstance(policy, TorchPolicy)
        batch = collector.collect(4, policy, version=0)
        assert batch["obs"].shape == (4, 3, 28, 28, 3) and batch["obs"].dtype == np.uint8
        assert batch["actions"].shape == (4, 3) and batch["next_values"].shape == (4, 3)
        assert np.isfinite(batch["values"]).all() and np.isfinite(batch["next_values"]).all()
    finally:
        if collector is not None:
            collector.close()
        context.stop.set()
        env_role.join(timeout=30)
