"""The PPO update the actor group runs on each batch of gym trajectories (CleanRL's `ppo.py`, distributed).

Every actor rank receives the whole batch and computes GAE and the minibatch permutation identically;
each minibatch's advantages are normalised over the WHOLE minibatch, then every rank takes its equal
shard, and DDP averages the gradients. The update is therefore the same whatever the number of ranks,
up to float summation order: `roles.actor.replicas` changes who computes, not what is learned.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass

import torch
import torch.distributed
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from rljob.algorithms.advantages import gae_advantages, normalize
from rljob.algorithms.losses import (
    entropy_bonus,
    explained_variance,
    off_policy_weights,
    ppo_policy_loss,
    value_loss,
)
from rljob.api.presets import resolve_algorithm
from rljob.api.spec import AlgorithmSpec, TrainerSpec
from rljob.runtime.gym.models import ActorCritic
from rljob.runtime.optim.divergence import check_update
from rljob.runtime.optim.optimizer import build_optimizer, learning_rate_at, set_learning_rate

BATCH_FIELDS = ("obs", "actions", "logprobs", "values", "next_values", "rewards", "terminated", "truncated")


@dataclass
class GymBatch:
    """[T, N, ...] tensors of one batch (T steps of N environments), as the rollout recorded them."""

    obs: Tensor
    actions: Tensor
    logprobs: Tensor
    values: Tensor
    next_values: Tensor
    rewards: Tensor
    terminated: Tensor
    truncated: Tensor


class BatchShapeError(ValueError):
    """The batch cannot be split as configured; the message names the settings to change."""


class _Evaluate(nn.Module):
    """DDP synchronises gradients of what runs through `forward`: route `evaluate` through it.

    For discrete actions it computes what `ActorCritic.evaluate` computes (log-probabilities,
    entropies, values) straight from log-softmax: a `Categorical` object costs more than the small
    network itself, 20 times per PPO update.
    """

    def __init__(self, model: ActorCritic, entropy_grad: bool) -> None:
        super().__init__()
        self.model = model
        self.entropy_grad = entropy_grad

    def forward(self, obs: Tensor, actions: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        if not self.model.discrete:
            return self.model.evaluate(obs, actions)
        logits, values = self.model.policy_and_value(obs)
        log_probs = torch.log_softmax(logits, dim=-1)
        logprobs = log_probs.gather(-1, actions.long().unsqueeze(-1)).squeeze(-1)
        # Without an entropy bonus the entropy is a statistic only: keep it out of the backward pass.
        source = log_probs if self.entropy_grad else log_probs.detach()
        entropy = -(source.exp() * source).sum(-1)
        return logprobs, entropy, values


class PPOLearner:
    """Owns the model's training state: optimizer, update counter and the minibatch RNG."""

    def __init__(
        self,
        model: ActorCritic,
        algorithm: AlgorithmSpec,
        trainer: TrainerSpec,
        rank: int = 0,
        world_size: int = 1,
        stale_data: bool = False,
    ) -> None:
        self.model = model
        self.stale_data = stale_data
        self.algorithm = algorithm = resolve_algorithm(algorithm)  # the preset when built in code, not from a job
        self.trainer = trainer
        self.rank, self.world_size = rank, world_size
        evaluator = _Evaluate(model, entropy_grad=algorithm.entropy_coef > 0)
        self.device = next(model.parameters()).device
        # One rank: DDP's hooks would only add per-step overhead.
        if world_size > 1:
            device_ids = [self.device] if self.device.type == "cuda" else None
            self.evaluator: nn.Module = DistributedDataParallel(evaluator, device_ids=device_ids)
        else:
            self.evaluator = evaluator
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = build_optimizer(self.params, trainer)
        self.step = 0
        self.generator = torch.Generator().manual_seed(trainer.seed)

    def check_batch(self, transitions: int) -> int:
        """Minibatch size for `transitions` per batch, or a BatchShapeError naming the settings."""
        minibatches = self.algorithm.minibatches
        if transitions % minibatches:
            raise BatchShapeError(
                f"trainer.batchSize ({transitions}) must be a multiple of algorithm.minibatches ({minibatches})"
            )
        size = transitions // minibatches
        if size % self.world_size:
            raise BatchShapeError(
                f"each minibatch ({size} transitions) must split evenly over the {self.world_size} actor ranks "
                "(roles.actor.replicas x gpusPerReplica)"
            )
        return size

    def update(self, batch: GymBatch) -> dict[str, float]:
        """One PPO update (epochs x minibatches optimizer steps); returns mean statistics."""
        algo = self.algorithm
        if batch.obs.device != self.device:
            batch = GymBatch(*(getattr(batch, f).to(self.device) for f in BATCH_FIELDS))
        lr = learning_rate_at(self.step, self.trainer)
        set_learning_rate(self.optimizer, lr)
        with torch.no_grad():
            ended = batch.terminated | batch.truncated
            advantages, returns = gae_advantages(
                batch.rewards, batch.values, batch.next_values, batch.terminated, ended, algo.gamma, algo.gae_lambda
            )
        n = batch.rewards.numel()
        obs = batch.obs.reshape(n, *self.model.input_shape)  # images stay uint8: the cnn scales them
        actions = batch.actions.reshape(n, *batch.actions.shape[2:])
        old_logprobs, old_values = batch.logprobs.reshape(n), batch.values.reshape(n)
        advantages, returns = advantages.reshape(n), returns.reshape(n)
        if self.stale_data:
            # Data from an older policy (async rollout): anchor the clipped ratio at the policy as it is now,
            # and weight by pi_now / pi_rollout as `algorithm.offPolicy` says (decoupled PPO, Hilton et al.
            # 2021). Clipping around the rollout policy instead would clip samples before any update.
            with torch.no_grad():
                anchor, _, _ = self.model.evaluate(obs, actions)
            weights, _ = off_policy_weights(
                anchor, old_logprobs, algo.off_policy.type, algo.off_policy.low, algo.off_policy.high
            )
            old_logprobs = anchor
        else:
            weights = None
        size = self.check_batch(n)
        shard = size // self.world_size
        mine = slice(self.rank * shard, (self.rank + 1) * shard)
        collected: list[Tensor] = []
        for _ in range(algo.epochs):
            order = torch.randperm(n, generator=self.generator).to(self.device)
            for start in range(0, n, size):
                index = order[start : start + size]
                adv = advantages[index]
                if algo.normalize_advantages and size > 1:
                    adv = normalize(adv)
                index, adv = index[mine], adv[mine]
                logprobs, entropy, values = self.evaluator(obs[index], actions[index])
                policy_loss, stats = ppo_policy_loss(
                    logprobs,
                    old_logprobs[index],
                    adv,
                    algo.clip_ratio_low,
                    algo.clip_ratio_high,
                    dual_clip=algo.dual_clip,
                    correction_weights=None if weights is None else weights[index],
                )
                v_loss = value_loss(values, old_values[index], returns[index], clip=algo.value_clip)
                entropy_mean = entropy_bonus(entropy)
                loss = policy_loss + algo.value_coef * v_loss
                if algo.entropy_coef:
                    loss = loss - algo.entropy_coef * entropy_mean
                self.optimizer.zero_grad(set_to_none=True)
                loss.backward()
                if self.trainer.grad_clip is not None:
                    grad_norm = nn.utils.clip_grad_norm_(self.params, self.trainer.grad_clip, foreach=True)
                else:  # measured anyway: a non-finite gradient must stop the update even with a finite loss
                    grads = [p.grad for p in self.params if p.grad is not None]
                    grad_norm = nn.utils.get_total_norm(grads, foreach=True)
                checked = {"loss": float(loss.detach()), "grad_norm": float(grad_norm)}
                check_update(self.step + 1, checked, self.world_size, self.device)
                self.optimizer.step()
                collected.append(
                    torch.stack(
                        [
                            loss.detach(),
                            policy_loss.detach(),
                            v_loss.detach(),
                            entropy_mean.detach(),
                            stats["approx_kl"],
                            stats["clip_fraction"],
                            grad_norm.detach(),
                        ]
                    )
                )
        self.step += 1
        summary = torch.cat([torch.stack(collected).mean(0), collected[0][:1]])
        if self.world_size > 1:
            # Each rank saw its shard of every minibatch: report the whole minibatch, like one rank would.
            torch.distributed.all_reduce(summary)
            summary /= self.world_size
        *means, first_loss = summary.tolist()
        keys = ("loss", "policy_loss", "value_loss", "entropy", "approx_kl", "clip_fraction", "grad_norm")
        out = dict(zip(keys, means, strict=True))
        out["first_loss"] = first_loss
        out["learning_rate"] = lr
        out["explained_variance"] = explained_variance(old_values, returns)
        return out

    def leave_group(self) -> None:
        """End this rank's part in the actor group after its last update; every rank calls it.

        The barrier keeps a rank from tearing down while a peer is still inside a collective. DDP holds the
        gloo/NCCL backend alive after `destroy_process_group` (which only drops the registry's references),
        so the wrapper goes first: otherwise the backend's threads die during interpreter teardown, in no
        defined order, and a rank can abort on exit ("terminate called without an active exception").
        """
        if self.world_size > 1 and torch.distributed.is_initialized():
            torch.distributed.barrier()
            if isinstance(self.evaluator, DistributedDataParallel):
                self.evaluator = self.evaluator.module
            gc.collect()
            torch.distributed.destroy_process_group()

    def state_dict(self) -> dict[str, object]:
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "step": self.step,
            "generator": self.generator.get_state(),
        }

    def load_state_dict(self, state: dict[str, object]) -> None:
        self.model.load_state_dict(state["model"])  # type: ignore[arg-type]
        self.optimizer.load_state_dict(state["optimizer"])  # type: ignore[arg-type]
        self.step = int(state["step"])  # type: ignore[call-overload]
        self.generator.set_state(state["generator"])  # type: ignore[arg-type]
