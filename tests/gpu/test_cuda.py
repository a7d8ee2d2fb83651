"""What only an NVIDIA GPU can check: the actor's update and its weight broadcast from CUDA tensors.

Every test here is marked `cuda` and skips without a CUDA device (tests/conftest.py); `make gpu-check` runs them on a
GPU machine (benchmarks/gpu/check.py). They import only what a role pod imports (no operator, no test emulator),
so the check runs with the few wheels `make gpu-wheels` brings along.
"""

from __future__ import annotations

import gymnasium
import pytest
import torch

from rljob.api.spec import AlgorithmSpec, TrainerSpec
from rljob.runtime.gym.models import MLPActorCritic
from rljob.runtime.llm.models.policy import policy_dtype
from rljob.runtime.llm.training.learner import LLMLearner
from rljob.runtime.weights.sync import WeightPublisher, WeightSubscriber
from tests.runtime.llm.training.test_learner import MAX_RESPONSE, TINY, TOKENIZER, make_model, make_samples
from tests.runtime.weights.test_sync import free_port, perturb, sync_round

pytestmark = pytest.mark.cuda

ALGORITHM = AlgorithmSpec(name="grpo", kl_coef=0.0, loss_aggregation="token-mean", minibatches=2, clip_ratio_high=0.28)


@pytest.fixture(autouse=True)
def _exact_fp32_matmuls():
    """TF32 would round fp32 matmuls to 10 mantissa bits: compare CUDA with the CPU in true fp32."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def learner_on(device: str, precision: str = "fp32", learning_rate: float = 0.05) -> LLMLearner:
    trainer = TrainerSpec(
        steps=10, optimizer="sgd", learning_rate=learning_rate, seed=3, grad_clip=None, precision=precision
    )
    # As the actor loads it: with ddp the policy itself is in the precision's dtype.
    dtype = policy_dtype(TINY, precision, torch.device(device))
    return LLMLearner(
        make_model().to(device=device, dtype=dtype),
        ALGORITHM,
        trainer,
        pad_id=TOKENIZER.pad_token_id,
        temperature=0.9,
        max_response_tokens=MAX_RESPONSE,
    )


def params(learner: LLMLearner) -> torch.Tensor:
    return torch.cat([p.detach().float().reshape(-1).cpu() for p in learner.model.parameters()])


def test_an_update_on_cuda_equals_the_cpu_update():
    cpu, gpu = learner_on("cpu"), learner_on("cuda")
    for seed in (0, 1):
        on_cpu, on_gpu = cpu.update(make_samples(seed)), gpu.update(make_samples(seed))
        for key in ("policy_loss", "entropy", "clip_fraction", "grad_norm"):
            assert on_gpu[key] == pytest.approx(on_cpu[key], rel=1e-4, abs=1e-5), key
    assert torch.allclose(params(gpu), params(cpu), atol=1e-5)


def test_a_bf16_update_on_cuda_stays_finite_and_close_to_fp32():
    fp32, bf16 = learner_on("cuda"), learner_on("cuda", precision="bf16")
    # ddp under bf16: fp32 master weights, bf16 compute (autocast), bf16 on the wire to rollouts and exports.
    assert next(bf16.model.parameters()).dtype == torch.float32
    assert (bf16.autocast_dtype, bf16.wire_dtype) == (torch.bfloat16, torch.bfloat16)
    stats32, stats16 = fp32.update(make_samples(0)), bf16.update(make_samples(0))
    for key in ("policy_loss", "entropy", "grad_norm"):
        assert torch.isfinite(torch.tensor(stats16[key])), key
    # bf16 keeps 8 mantissa bits: the statistics agree to a couple of percent, not to fp32's 1e-6.
    assert stats16["entropy"] == pytest.approx(stats32["entropy"], rel=0.05)
    assert stats16["policy_loss"] == pytest.approx(stats32["policy_loss"], rel=0.1, abs=0.02)


def test_a_bf16_update_far_below_bf16_resolution_still_moves_the_fp32_master_weights():
    learner = learner_on("cuda", precision="bf16", learning_rate=1e-7)
    before = params(learner).clone()
    learner.update(make_samples(0))
    after = params(learner)
    # Steps of about 1e-8 against weights of about 1e-2 (bf16 resolves 1e-4 there). Measured on the CPU in fp32:
    # 17% of the weights move, and rounding the result to bf16 keeps 0.7% of those moves. Stepped in bf16 the
    # update would all but vanish; the fp32 master weights take it.
    moved = (after != before).float().mean()
    moved_in_bf16 = (after.bfloat16() != before.bfloat16()).float().mean()
    assert moved > 0.1 and moved_in_bf16 < moved / 5
    assert (after - before).abs().max() < 1e-5


def test_weights_trained_on_cuda_reach_a_cpu_rollout_exactly():
    space = gymnasium.make("CartPole-v1").action_space
    actor, rollout, port = MLPActorCritic(4, space).cuda(), MLPActorCritic(4, space), free_port()
    perturb(actor)
    publisher = WeightPublisher("127.0.0.1", port, "actor-a", bucket_mb=1)
    subscriber = WeightSubscriber("127.0.0.1", port, 1)
    assert sync_round(publisher, actor, 1, {0: ("rollout-0", subscriber, rollout)}) == {0: None}
    for sent, received in zip(actor.state_dict().values(), rollout.state_dict().values(), strict=True):
        assert torch.equal(sent.cpu(), received)


def test_a_bf16_policy_on_cuda_reaches_a_cpu_hf_rollout_holding_the_sent_dtype():
    """The rollout holds the dtype the actor sends (runtime/llm/setup.py sent_dtype), not its own device's fp32."""
    actor = make_model().to(device="cuda", dtype=torch.bfloat16)
    rollout, port = make_model().to(dtype=torch.bfloat16), free_port()
    perturb(actor)
    publisher = WeightPublisher("127.0.0.1", port, "actor-a", bucket_mb=1)
    subscriber = WeightSubscriber("127.0.0.1", port, 1)
    assert sync_round(publisher, actor, 1, {0: ("rollout-0", subscriber, rollout)}) == {0: None}
    for sent, received in zip(actor.state_dict().values(), rollout.state_dict().values(), strict=True):
        assert received.dtype == torch.bfloat16 and torch.equal(sent.cpu(), received)
