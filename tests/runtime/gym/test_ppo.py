"""The actor's PPO update: DDP over 2 ranks learns like 1 rank; a resumed learner repeats the next update."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import textwrap

import gymnasium
import pytest
import torch

from rljob.api.spec import AlgorithmSpec, BuiltinNetwork, TrainerSpec
from rljob.runtime.gym.models import build_mlp_actor_critic
from rljob.runtime.gym.ppo import BatchShapeError, GymBatch, PPOLearner
from rljob.runtime.optim.optimizer import learning_rate_at
from rljob.runtime.records.checkpoint import CheckpointManager, capture_rng_state, restore_rng_state

ALGORITHM = AlgorithmSpec(name="ppo", epochs=3, minibatches=2, gamma=0.98, gae_lambda=0.8, value_clip=0.5)
TRAINER = TrainerSpec(steps=10, batch_size=64, learning_rate=1e-3, lr_schedule="linear", grad_clip=0.5, seed=3)


def make_batch(seed: int, steps: int = 16, envs: int = 4) -> GymBatch:
    g = torch.Generator().manual_seed(seed)
    return GymBatch(
        obs=torch.randn(steps, envs, 4, generator=g),
        actions=torch.randint(0, 2, (steps, envs), generator=g),
        logprobs=torch.full((steps, envs), -0.69) + 0.05 * torch.randn(steps, envs, generator=g),
        values=torch.randn(steps, envs, generator=g),
        next_values=torch.randn(steps, envs, generator=g),
        rewards=torch.ones(steps, envs),
        terminated=torch.rand(steps, envs, generator=g) < 0.05,
        truncated=torch.rand(steps, envs, generator=g) < 0.05,
    )


def make_learner(rank: int = 0, world: int = 1) -> PPOLearner:
    torch.manual_seed(TRAINER.seed)
    env = gymnasium.make("CartPole-v1")
    model = build_mlp_actor_critic(BuiltinNetwork(), env.observation_space, env.action_space)
    return PPOLearner(model, ALGORITHM, TRAINER, rank=rank, world_size=world)


RANK_SCRIPT = textwrap.dedent(
    """
    import json, sys, torch, torch.distributed as dist
    sys.path.insert(0, sys.argv[4])
    from test_ppo import make_batch, make_learner
    rank, port, out = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    learner = make_learner(rank, 2)
    losses = [learner.update(make_batch(i))["loss"] for i in range(3)]
    if rank == 0:
        params = torch.cat([p.detach().reshape(-1) for p in learner.model.parameters()]).tolist()
        json.dump({"losses": losses, "params": params}, open(out, "w"))
    learner.leave_group()
    assert not dist.is_initialized()
    """
)


def test_two_actor_replicas_learn_like_one(tmp_path):
    single = make_learner()
    losses = [single.update(make_batch(i))["loss"] for i in range(3)]
    params = torch.cat([p.detach().reshape(-1) for p in single.model.parameters()])

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "rank0.json"
    here = str(__import__("pathlib").Path(__file__).parent)
    ranks = [subprocess.Popen([sys.executable, "-c", RANK_SCRIPT, str(r), str(port), str(out), here]) for r in range(2)]
    assert [p.wait(timeout=120) for p in ranks] == [0, 0]
    distributed = json.loads(out.read_text())
    # Each rank computes half of every minibatch; DDP averages: the same update up to float summation order.
    assert torch.allclose(torch.tensor(distributed["params"]), params, atol=1e-5)
    assert distributed["losses"] == pytest.approx(losses, rel=1e-4)


def test_resumed_learner_reproduces_the_next_update(tmp_path):
    learner = make_learner()
    for i in range(2):
        learner.update(make_batch(i))
    CheckpointManager(tmp_path, keep=1).save(
        learner.step, {"learner": learner.state_dict(), "rng": capture_rng_state()}
    )
    uninterrupted = learner.update(make_batch(2))

    torch.manual_seed(999)  # a restarted process starts from other weights and RNG states
    resumed = make_learner()
    resumed.update(make_batch(7))
    step, state, _ = CheckpointManager(tmp_path, keep=1).latest_valid()
    resumed.load_state_dict(state["learner"])
    restore_rng_state(state["rng"])
    again = resumed.update(make_batch(2))
    assert step == 2 and resumed.step == 3
    assert again["first_loss"] == uninterrupted["first_loss"]
    assert again["loss"] == uninterrupted["loss"]
    assert again["learning_rate"] == uninterrupted["learning_rate"] == learning_rate_at(2, TRAINER)


def test_a_batch_that_does_not_split_over_the_replicas_names_the_settings():
    learner = make_learner(rank=0, world=1)
    learner.world_size = 3
    with pytest.raises(BatchShapeError, match=r"roles\.actor\.replicas"):
        learner.check_batch(64)
    with pytest.raises(BatchShapeError, match=r"algorithm\.minibatches"):
        make_learner().check_batch(63)


def test_stale_data_is_clipped_around_the_current_policy():
    one_pass = AlgorithmSpec(name="ppo", epochs=1, minibatches=1)
    batch = make_batch(0)
    torch.manual_seed(TRAINER.seed)
    env = gymnasium.make("CartPole-v1")
    model = build_mlp_actor_critic(BuiltinNetwork(), env.observation_space, env.action_space)
    with torch.no_grad():
        current, _, _ = model.evaluate(batch.obs.reshape(-1, 4), batch.actions.reshape(-1))
    # The rollout's policy (one version older) gave these actions much lower probability than now.
    batch.logprobs = (current - 0.5).reshape(batch.logprobs.shape)
    learners = {}
    for stale in (False, True):
        copy = build_mlp_actor_critic(BuiltinNetwork(), env.observation_space, env.action_space)
        copy.load_state_dict(model.state_dict())
        learners[stale] = PPOLearner(copy, one_pass, TRAINER, stale_data=stale).update(batch)
    # Anchored at the rollout policy, every ratio starts at e^0.5 > 1.2: clipped before any update.
    assert learners[False]["clip_fraction"] == 1.0
    assert learners[True]["clip_fraction"] == 0.0


def test_the_discrete_fast_path_evaluates_like_the_model():
    from rljob.runtime.gym.ppo import _Evaluate

    env = gymnasium.make("CartPole-v1")
    model = build_mlp_actor_critic(BuiltinNetwork(), env.observation_space, env.action_space)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * torch.randn_like(p))
    obs, actions = torch.randn(50, 4), torch.randint(0, 2, (50,))
    for got, expected in zip(
        _Evaluate(model, entropy_grad=True)(obs, actions), model.evaluate(obs, actions), strict=True
    ):
        assert torch.allclose(got, expected, atol=1e-6)
