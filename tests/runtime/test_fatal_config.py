"""Configuration errors no restart can fix: a role says what to change and exits EXIT_FATAL_CONFIG."""

from __future__ import annotations

import os
import subprocess
import sys

import gymnasium
import pytest
import torch

from rljob.api.spec import AlgorithmSpec, BuiltinNetwork, TrainerSpec
from rljob.launch.local import free_ports
from rljob.runtime.gym.actor import restore_learner
from rljob.runtime.gym.models import build_mlp_actor_critic
from rljob.runtime.gym.ppo import PPOLearner
from rljob.runtime.records.checkpoint import CheckpointManager
from rljob.runtime.wire.context import FatalConfigError
from rljob.runtime.wire.identity import EXIT_FATAL_CONFIG, local_identities, ports_needed

JOB = """\
apiVersion: rljob.io/v1alpha1
kind: RLJob
metadata:
  name: fatal
spec:
  task:
    type: gym
    gym: {{envId: {env_id}, numEnvs: 2, envKwargs: {env_kwargs}}}
  algorithm: {{name: ppo, minibatches: 1}}
  trainer: {{steps: 1, batchSize: 64}}
  roles:
    actor: {{replicas: 1}}
    rollout: {{replicas: 1}}
    env: {{replicas: 1}}
"""


@pytest.mark.parametrize(
    ("env_id", "env_kwargs", "named"),
    [
        ("CartPol-v9", "{}", "spec.task.gym.envId 'CartPol-v9'"),
        ("CartPole-v1", "{foo: 1}", "spec.task.gym.envKwargs {'foo': 1}"),
        ("Blackjack-v1", "{}", "spec.task.gym.envId 'Blackjack-v1' has observation space Tuple"),
    ],
)
def test_env_role_exits_with_the_fatal_config_code_and_names_the_field(tmp_path, env_id, env_kwargs, named):
    config = tmp_path / "job.yaml"
    config.write_text(JOB.format(env_id=env_id, env_kwargs=env_kwargs))
    replicas = {"actor": 1, "rollout": 1, "env": 1, "reward": 0}
    identity = next(
        i
        for i in local_identities("fatal", replicas, str(config), free_ports(ports_needed(replicas)), str(tmp_path))
        if i.role == "env"
    )
    result = subprocess.run(
        [sys.executable, "-m", "rljob.cli.main", "role", "env"],
        env={**os.environ, **identity.to_env()},
        capture_output=True,
        text=True,
        timeout=120,  # a safety net: the role exits as soon as it has tried to create the env
    )
    output = result.stdout + result.stderr
    assert result.returncode == EXIT_FATAL_CONFIG, output
    assert named in output
    assert "Traceback" not in output


def make_learner(hidden: list[int]) -> PPOLearner:
    env = gymnasium.make("CartPole-v1")
    model = build_mlp_actor_critic(BuiltinNetwork(hidden_sizes=hidden), env.observation_space, env.action_space)
    trainer = TrainerSpec(steps=5, batch_size=64)
    return PPOLearner(model, AlgorithmSpec(name="ppo", minibatches=1), trainer)


def test_a_checkpoint_of_another_model_is_a_fatal_config_error_naming_the_fix(tmp_path):
    manager = CheckpointManager(tmp_path / "checkpoints")
    written = make_learner([64, 64])
    written.step = 4
    path = manager.save(4, {"learner": written.state_dict()})
    _, state = manager.load(path)
    for hidden in ([32, 32], [64]):  # other widths (size mismatch), other depth (unexpected keys)
        with pytest.raises(FatalConfigError) as caught:
            restore_learner(make_learner(hidden), state, path)
        message = str(caught.value)
        assert message.startswith(f"checkpoint {path} was written for a different model (")
        assert message.endswith("use a new --out (or another spec.checkpoint.dir) or set spec.checkpoint.resume: never")
    same = make_learner([64, 64])
    restore_learner(same, state, path)
    assert same.step == 4
    for mine, saved in zip(same.model.state_dict().values(), state["learner"]["model"].values(), strict=True):
        assert torch.equal(mine, saved)
