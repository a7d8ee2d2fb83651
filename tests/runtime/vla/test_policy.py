"""The VLA actor-critic: what it samples is what the PPO update scores, its value head trains, and the rollout's
copy acts the same once it has the actor's weights (the state dict weight sync moves)."""

from __future__ import annotations

from pathlib import Path

import gymnasium
import numpy as np
import pytest
import torch
import yaml

from rljob.api import RLJob
from rljob.api.rules import resolve_defaults
from rljob.runtime.gym.ppo import GymBatch, PPOLearner
from rljob.runtime.gym.torch_policy import TorchPolicy
from rljob.runtime.roles.gym_policy import build_gym_policy
from rljob.runtime.vla.policy import VLAActorCritic

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "vla-tiny.yaml"
ENV_ID = "rljob.runtime.vla.pick_color:PickColor-v0"


def tiny_job(**gym_kwargs: object) -> RLJob:
    raw = yaml.safe_load(EXAMPLE.read_text())
    raw["spec"]["task"]["gym"]["envKwargs"] = {"target": "red", **gym_kwargs}
    raw["spec"]["model"]["vla"]["actionBins"] = 8
    raw["spec"]["algorithm"].update(epochs=1, minibatches=1)  # one optimizer step is enough to see what trains
    return resolve_defaults(RLJob.model_validate(raw))


def frames(env: gymnasium.Env, count: int) -> torch.Tensor:
    return torch.from_numpy(np.stack([env.reset(seed=i)[0] for i in range(count)])).float()


@pytest.fixture(scope="module", params=[False, True], ids=["discrete", "box"])
def setup(request):
    continuous = request.param
    env = gymnasium.make(ENV_ID, continuous=continuous)
    job = tiny_job(continuous=continuous)
    torch.manual_seed(0)
    policy = build_gym_policy(job.spec, env.observation_space, env.action_space)
    return job, env, policy


def test_the_job_builds_a_vla_on_tiny_qwen2_vl(setup):
    job, _, policy = setup
    assert job.spec.model.builtin.architecture == "tiny-qwen2-vl"
    assert isinstance(policy, VLAActorCritic)
    assert policy.backbone.config.vision_config.patch_size == 4


def test_what_act_samples_is_what_evaluate_scores(setup):
    _, env, policy = setup
    obs = frames(env, 8)
    actions, logprobs, values = policy.act(obs)
    assert actions.shape == (8, *policy.action_shape)
    assert all(env.action_space.contains(a) for a in actions.numpy().astype(env.action_space.dtype))
    scored, entropy, scored_values = policy.evaluate(obs.reshape(8, -1), actions)  # flat, as the learner has them
    assert torch.allclose(scored, logprobs, atol=1e-5) and torch.allclose(scored_values, values, atol=1e-5)
    bins = policy.actions.bins
    assert (entropy > 0).all() and (entropy <= policy.actions.dims * np.log(bins) + 1e-5).all()
    assert torch.allclose(policy.value(obs), values, atol=1e-5)


def test_box_actions_are_bin_centers(setup):
    _, env, policy = setup
    if policy.discrete:
        pytest.skip("Discrete actions have no bins")
    actions, _, _ = policy.act(frames(env, 16))
    centers = policy.actions.centers()[0]
    assert all(torch.isclose(centers, a).any() for a in actions.flatten())


def test_a_ppo_update_trains_the_backbone_and_the_value_head(setup):
    job, env, built = setup
    torch.manual_seed(1)
    policy = build_gym_policy(job.spec, env.observation_space, env.action_space)
    policy.load_state_dict(built.state_dict())
    before = {name: p.detach().clone() for name, p in policy.named_parameters()}
    obs = frames(env, 16)
    actions, logprobs, values = policy.act(obs)
    rewards = torch.arange(16, dtype=torch.float32) % 2

    def row(x: torch.Tensor) -> torch.Tensor:
        return x.reshape(1, 16, *x.shape[1:])

    batch = GymBatch(
        obs=row(obs),
        actions=row(actions),
        logprobs=row(logprobs),
        values=row(values),
        next_values=torch.zeros(1, 16),
        rewards=row(rewards),
        terminated=torch.ones(1, 16, dtype=torch.bool),
        truncated=torch.zeros(1, 16, dtype=torch.bool),
    )
    stats = PPOLearner(policy, job.spec.algorithm, job.spec.trainer).update(batch)
    assert np.isfinite(stats["loss"]) and stats["grad_norm"] > 0
    moved = {name for name, p in policy.named_parameters() if not torch.equal(p, before[name])}
    assert "value_head.weight" in moved
    assert any(name.startswith("backbone.model.visual.") for name in moved)
    assert any(name.startswith("backbone.model.language_model.") for name in moved)


def test_the_rollout_copy_acts_like_the_trainer_after_a_weight_sync(setup):
    job, env, policy = setup
    torch.manual_seed(5)
    rollout = build_gym_policy(job.spec, env.observation_space, env.action_space)
    rollout.load_state_dict(policy.state_dict())  # what the bucketed broadcast delivers
    obs = frames(env, 4)
    fast = TorchPolicy(rollout, seed=0)
    torch.manual_seed(3)
    actions, logprobs, values = fast.act(obs.numpy())
    torch.manual_seed(3)
    expected = policy.act(obs)
    assert np.array_equal(actions, expected[0].numpy())
    assert np.allclose(logprobs, expected[1].numpy(), atol=1e-5) and np.allclose(values, expected[2].numpy(), atol=1e-5)
    assert np.allclose(fast.value(obs.reshape(4, -1).numpy()), values, atol=1e-5)


def test_a_saved_vision_language_checkpoint_loads_as_a_vla_over_the_last_tokens_of_its_vocabulary(setup, tmp_path):
    """`model.source: local` (or hub): the path a real Qwen2-VL style checkpoint takes, here the tiny one saved."""
    from rljob.runtime.llm.models.policy import export_hf
    from rljob.runtime.vla.policy import _builtin

    job, env, _ = setup
    backbone, tokenizer, _ = _builtin(job.spec.model, "pick up the red square", 2, 1, seed=0)
    export_hf(backbone, tokenizer, tmp_path / "vlm")
    raw = job.model_dump(by_alias=True, exclude_none=True)
    raw["spec"]["model"] = {"source": "local", "path": str(tmp_path / "vlm"), "vla": raw["spec"]["model"]["vla"]}
    local = resolve_defaults(RLJob.model_validate(raw))
    policy = build_gym_policy(local.spec, env.observation_space, env.action_space)
    assert isinstance(policy, VLAActorCritic)
    bins = policy.actions.bins
    assert policy.action_ids.tolist() == list(range(tokenizer.vocab_size - bins, tokenizer.vocab_size))
    obs = frames(env, 4)
    actions, logprobs, _ = policy.act(obs)
    assert torch.allclose(policy.evaluate(obs, actions)[0], logprobs, atol=1e-5)
