"""The GRPO-family update every actor rank runs on one batch of scored samples.

Each rank receives the whole batch (from rank 0), shuffles it with the shared seed, cuts it into
`algorithm.minibatches` minibatches and takes its equal shard of each, in micro-batches of
`trainer.microBatchSize`. Losses are normalised by the GLOBAL token or sequence count of the minibatch
(all-reduced over micro-batches and ranks), and gradients are summed over ranks, so the update is the same
for 1 or 4 micro-batches and 1 or 2 ranks, up to float summation order. With `trainer.parallelism: fsdp2`
the policy is sharded (see `sharding`) and FSDP sums the gradients itself.

Per-token tensors live on the [sequences, positions - 1] grid of next-token predictions; a mask marks the
response positions. Log-probabilities are those of softmax(logits / temperature): what the rollout engine
reports for the tokens it sampled.
"""

from __future__ import annotations

import contextlib
import gc
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from rljob.algorithms.losses import (
    entropy_bonus,
    kl_estimate,
    loss_normalizer,
    off_policy_weights,
    policy_loss_for,
)
from rljob.api.presets import resolve_algorithm
from rljob.api.spec import OFFLINE_STAGES, AlgorithmSpec, TrainerSpec
from rljob.runtime.llm.models.lora import adapter_state_dict, adapters_off, has_lora, load_adapter_state
from rljob.runtime.llm.models.policy import resolve_precision
from rljob.runtime.llm.training.batch import MicroBatch, Sample, by_prompt, collate, collate_shared
from rljob.runtime.llm.training.grad_sync import sum_gradients
from rljob.runtime.llm.training.logprobs import chunked_logprobs, full_logprobs, shares_prompts
from rljob.runtime.llm.training.packing import pack_by_tokens, split_to_count
from rljob.runtime.llm.training.sharding import gradient_norm, shard_policy, shards_model
from rljob.runtime.optim.divergence import check_update
from rljob.runtime.optim.optimizer import build_optimizer, learning_rate_at, set_learning_rate
from rljob.runtime.records.checkpoint import CheckpointError

FSDP_MIN_SAVING = 0.25
"""The share of a pass's token positions a shared prompt prefix must save under fsdp2. The prefix is one more
forward of the sharded policy: its layers' shards are gathered once more in forward and in backward, and its
gradients reduce-scattered once more. Where compute hides that traffic any saving pays, where it does not a small
one costs time; where the line lies has not been measured on GPUs, so this is a guess that keeps sharing for long
prompts (8 responses as long as their prompt save 44%) and skips it for short ones."""


class BatchShapeError(ValueError):
    """The batch cannot be split as configured; the message names the settings."""


def token_logprobs(
    model: nn.Module,
    batch: MicroBatch,
    temperature: float,
    with_entropy: bool,
    entropy_grad: bool = True,
    chunk_tokens: int | None = None,
) -> tuple[Tensor, Tensor | None]:
    """log p(target) per position under softmax(logits / T), and the entropy of that distribution.

    With `entropy_grad=False` the entropy is computed outside autograd (a statistic, not a loss term). With
    `chunk_tokens` only the response positions get values (0 elsewhere), at most that many rows of logits alive
    at once (see `logprobs`); without it, every position from the full logits.
    """
    if chunk_tokens is None:
        return full_logprobs(model, batch, temperature, with_entropy, entropy_grad)
    return chunked_logprobs(model, batch, temperature, with_entropy, entropy_grad, chunk_tokens)


def has_dropout(model: nn.Module) -> bool:
    """Whether a training-mode forward is random (dropout layers, or attention dropout in the HF config)."""
    config = getattr(model, "config", None)
    if any(float(getattr(config, key, 0.0) or 0.0) > 0 for key in ("attention_dropout", "dropout", "hidden_dropout")):
        return True
    return any(isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0 for m in model.modules())


def _add_policy_stats(sums: Tensor, mb: MicroBatch, logprobs: Tensor, entropy: Tensor) -> None:
    """Tokens, engine mismatch (k3 sum, max gap) and entropy of the data's own policy, into `sums[0:4]`."""
    mask = mb.response_mask
    gap = (logprobs - mb.rollout_logprobs) * mask
    sums[0] += float(mask.sum())
    sums[1] += float(((gap.exp() - 1.0 - gap) * mask).sum())
    sums[2] = max(float(sums[2]), float(gap.abs().max()) if mask.any() else 0.0)
    sums[3] += float((entropy * mask).sum())


def mixed_precision(device: torch.device, precision: str, loaded: torch.dtype) -> bool:
    """Whether a replicated (ddp) policy trains with fp32 master weights and bf16 compute: `trainer.precision`
    bf16 (or auto) on CUDA, the policy loaded in bf16 for it (not an explicit `model.dtype` of another kind)."""
    return device.type == "cuda" and resolve_precision(precision, device) == "bf16" and loaded == torch.bfloat16


class LLMLearner:
    """Owns the policy's training state: optimizer, update counter, the minibatch RNG and the reference."""

    def __init__(
        self,
        model: nn.Module,
        algorithm: AlgorithmSpec,
        trainer: TrainerSpec,
        *,
        pad_id: int,
        temperature: float,
        max_response_tokens: int,
        reference: nn.Module | None = None,
        reference_is_base: bool = False,
        teacher: nn.Module | None = None,
        merge_on_export: bool = True,
        rank: int = 0,
        world_size: int = 1,
        returns_memory: bool = False,
    ) -> None:
        self.model = model
        self.returns_memory = returns_memory
        """Hand the allocator's cached blocks back to the GPU after each update: a collocated rollout wakes into
        that memory next (its pool and KV cache), and the training peak the allocator keeps would not leave it room."""
        # A resolved job's algorithm is already complete; one built in code gets its paper's preset here.
        self.algorithm, self.trainer = resolve_algorithm(algorithm, max_response_tokens), trainer
        algorithm = self.algorithm
        self.merge_on_export = merge_on_export
        """With LoRA: the export merges the adapters into the base (true) or writes the adapter directory alone."""
        self.reference_is_base = reference_is_base and has_lora(model)
        """The KL reference is the policy itself with its LoRA adapters switched off (`lora.adapters_off`)."""
        if algorithm.kl_coef and reference is None and not self.reference_is_base:
            raise ValueError(
                f"spec.algorithm.klCoef {algorithm.kl_coef} needs a reference model to measure the KL against: "
                "pass one, or set klCoef 0"
            )
        self.pad_id = pad_id
        self.temperature = temperature
        self.max_response_tokens = max_response_tokens
        self.reference = reference
        if (algorithm.name == "distill") != (teacher is not None):
            raise ValueError("algorithm.name distill trains against a teacher model, and only distill does")
        self.teacher = teacher
        """distill: the frozen teacher whose log-probs of the student's tokens give each token's advantage."""
        self.rank, self.world_size = rank, world_size
        self.device = next(model.parameters()).device
        # An offline stage (sft, dpo) brings its own loss (`rljob.runtime.llm.stage`) and never calls `update`.
        self.policy_loss = None if algorithm.name in OFFLINE_STAGES else policy_loss_for(algorithm.name)
        self.step = 0
        self.generator = torch.Generator().manual_seed(trainer.seed)
        if world_size > 1:  # every rank starts from rank 0's weights, whatever each one loaded
            for tensor in model.state_dict().values():
                dist.broadcast(tensor, 0)
        self.sharded = shards_model(trainer.parallelism, world_size)
        self.sharded_checkpoints = trainer.parallelism == "fsdp2"
        """Model and optimizer checkpointed as DCP shards (whatever the world size, so any size resumes them)."""
        self.wire_dtype = next(model.parameters()).dtype
        """The dtype of the policy as loaded: what rollouts hold and exports store."""
        self.autocast_dtype: torch.dtype | None = None
        """ddp with bf16 on CUDA: the dtype forward passes compute in, the weights and optimizer staying fp32."""
        if self.sharded:
            self.wire_dtype = shard_policy(model, self.device, trainer.precision)
            for frozen in (reference, teacher):  # sharded too: each is at least as large as the policy
                if frozen is not None:
                    shard_policy(frozen, self.device, trainer.precision)
        elif mixed_precision(self.device, trainer.precision, self.wire_dtype):
            # As fsdp2's MixedPrecisionPolicy: fp32 master weights, bf16 compute. Stepping bf16 weights would
            # round away every update below 1/256 of a weight (most updates at RL learning rates).
            model.float()
            self.autocast_dtype = torch.bfloat16
        self.params = [p for p in model.parameters() if p.requires_grad]  # DTensor shards once sharded
        # With dropout, the responses to a prompt would share one dropout mask over its positions: not the same.
        # The reference runs the same micro-batches: it must take a shared prefix too.
        self.share_prompts = (
            trainer.shared_prompts
            and shares_prompts(model)
            and not has_dropout(model)
            and all(frozen is None or shares_prompts(frozen) for frozen in (reference, teacher))
        )
        """Whether micro-batches run each distinct prompt's prefix once (`batch.collate_shared`)."""
        self.optimizer = build_optimizer(self.params, trainer)
        self.old_logprobs_pass = algorithm.epochs > 1 or algorithm.minibatches > 1 or has_dropout(model)
        """Whether each step starts with a no-grad forward for the old log-probs and the step's statistics.
        With one epoch of one minibatch the old log-probs ARE the training forward's (detached, ratio 1), and
        that forward gives the same statistics, so the pass is skipped (as TRL does). A model with dropout
        keeps it: skipping would change its random stream."""

    def compute(self) -> contextlib.AbstractContextManager[Any]:
        """The context every forward pass of the policy (and reference) runs in: bf16 autocast under mixed
        precision (`autocast_dtype`), nothing otherwise."""
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    def shard(self, samples: list[Sample]) -> list[list[Sample]]:
        """This rank's share of each minibatch (a seeded shuffle first, the same on every rank)."""
        minibatches = self.algorithm.minibatches
        if len(samples) % (minibatches * self.world_size):
            raise BatchShapeError(
                f"{len(samples)} samples per step (trainer.batchSize x algorithm.groupSize) must split into "
                f"algorithm.minibatches ({minibatches}) x actor ranks ({self.world_size}) equal parts"
            )
        order = torch.randperm(len(samples), generator=self.generator).tolist()
        size = len(samples) // minibatches
        per_rank = size // self.world_size
        return [
            [samples[i] for i in order[m * size + self.rank * per_rank : m * size + (self.rank + 1) * per_rank]]
            for m in range(minibatches)
        ]

    def _micro(self, samples: list[Sample]) -> list[MicroBatch]:
        if self.share_prompts:  # a prompt's responses in one micro-batch: its prefix runs once for all of them
            samples = by_prompt(samples)
        size = self.trainer.micro_batch_size or max(len(samples), 1)
        budget = self.trainer.micro_batch_tokens
        if budget is None:
            parts = [samples[i : i + size] for i in range(0, len(samples), size)]
        else:
            lengths = [len(s["prompt_ids"]) + len(s["response_ids"]) for s in samples]
            groups = pack_by_tokens(lengths, budget, self.trainer.micro_batch_size)
            if self.sharded:  # every rank runs as many passes as the one that needs most
                groups = split_to_count(groups, int(self._max_over_ranks(float(len(groups)))))
            parts = [[samples[i] for i in g] for g in groups]
        shared = [
            collate_shared(part, self.pad_id, FSDP_MIN_SAVING if self.sharded else 0.0) if self.share_prompts else None
            for part in parts
        ]
        if budget is not None:  # the rows attend over their prefix too: rows x (prefix + row) must fit the budget
            shared = [s if s is None or s.attention_mask.numel() <= budget else None for s in shared]
        if self.sharded and self.share_prompts:
            # A shared prefix is one more forward of the sharded policy, and every forward gathers its shards
            # with the other ranks: a pass shares only where every rank's does, or the collectives would not pair.
            agreed = self._all_reduce(torch.tensor([float(s is not None) for s in shared]), dist.ReduceOp.MIN)
            shared = [s if bool(ok) else None for s, ok in zip(shared, agreed.tolist(), strict=True)]
        return [(s or collate(part, self.pad_id)).to(self.device) for s, part in zip(shared, parts, strict=True)]

    def _all_reduce(self, values: Tensor, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> Tensor:
        if self.world_size > 1:
            values = values.to(self.device)
            dist.all_reduce(values, op=op)
        return values.cpu()

    def update(self, samples: list[Sample]) -> dict[str, float]:
        """One step: `algorithm.epochs` passes over the minibatches; returns token-weighted statistics."""
        algo = self.algorithm
        lr = learning_rate_at(self.step, self.trainer)
        set_learning_rate(self.optimizer, lr)
        shards = self.shard(samples)
        micro = [self._micro(shard) for shard in shards]
        old_pass = self.old_logprobs_pass
        old: list[list[Tensor | None]] = []
        sums = torch.zeros(9, dtype=torch.float64)
        # [tokens, mismatch k3 sum, mismatch max gap, entropy sum, kl sum, clip sum, loss sum, corrected sum,
        #  distill: student-teacher log-ratio sum]
        self.model.train()
        chunk = self.trainer.logprob_chunk_tokens
        if old_pass:
            with torch.no_grad(), self.compute():  # the data's own policy, once per step
                for batches in micro:
                    old.append([])
                    for mb in batches:
                        logprobs, entropy = token_logprobs(self.model, mb, self.temperature, True, chunk_tokens=chunk)
                        assert entropy is not None
                        old[-1].append(logprobs)
                        _add_policy_stats(sums, mb, logprobs, entropy)
        else:  # the training forward below is the data's own policy: it adds these statistics itself
            old = [[None] * len(batches) for batches in micro]
        refs = self._reference_logprobs(micro) if algo.kl_coef > 0 else None
        teachers = self._teacher_logprobs(micro) if self.teacher is not None else None
        for _ in range(algo.epochs):
            for m, batches in enumerate(micro):
                local = sum(loss_normalizer(mb.response_mask, algo.loss_aggregation) for mb in batches)
                normalizer = float(self._all_reduce(torch.tensor([local], dtype=torch.float64))[0])
                if normalizer <= 0:
                    continue
                self.optimizer.zero_grad(set_to_none=True)
                loss = 0.0
                for j, mb in enumerate(batches):
                    ref = None if refs is None else refs[m][j]
                    teacher = None if teachers is None else teachers[m][j]
                    stats = self._backward(mb, old[m][j], ref, teacher, normalizer, sums)
                    for k, v in stats.items():
                        sums[k] += v
                    loss += stats[6]
                self._sync_gradients()
                grad_norm = gradient_norm(self.params, self.trainer.grad_clip)
                check_update(self.step + 1, {"loss": loss, "grad_norm": grad_norm}, self.world_size, self.device)
                self.optimizer.step()
        self.step += 1
        self._free_training_memory()
        totals = self._all_reduce(sums.clone())
        totals[2] = self._max_over_ranks(float(sums[2]))
        tokens = max(float(totals[0]), 1.0)
        passes = algo.epochs
        return {
            "policy_loss": float(totals[6]) / (passes * algo.minibatches),
            "entropy": float(totals[3]) / tokens,
            "kl": float(totals[4]) / (tokens * passes) if algo.kl_coef > 0 else 0.0,
            "clip_fraction": float(totals[5]) / (tokens * passes),
            "mismatch_kl": float(totals[1]) / tokens,
            "mismatch_max_gap": float(totals[2]),
            "corrected_fraction": float(totals[7]) / (tokens * passes),
            # k1 estimate of KL(student || teacher) per token, on the student's own samples (distill).
            "distill_kl": float(totals[8]) / (tokens * passes) if self.teacher is not None else 0.0,
            "grad_norm": grad_norm,
            "learning_rate": lr,
            "response_tokens": tokens,
        }

    def _free_training_memory(self) -> None:
        """After the step: the gradients are spent (the next step zeroes them first anyway), so they are freed now
        rather than held through generation; with `returns_memory` the allocator's cache goes back to the GPU too."""
        self.optimizer.zero_grad(set_to_none=True)
        if self.returns_memory:
            gc.collect()  # activations a reference cycle still holds
            if self.device.type == "cuda":
                torch.cuda.empty_cache()

    def _backward(
        self,
        mb: MicroBatch,
        old: Tensor | None,
        ref: Tensor | None,
        teacher: Tensor | None,
        normalizer: float,
        sums: Tensor,
    ) -> dict[int, float]:
        algo = self.algorithm
        mask = mb.response_mask
        # Without an old-log-prob pass this forward also reports the entropy statistic, with or without a bonus.
        with_entropy = algo.entropy_coef > 0 or old is None
        with self.compute():
            logprobs, entropy = token_logprobs(
                self.model,
                mb,
                self.temperature,
                with_entropy=with_entropy,
                entropy_grad=algo.entropy_coef > 0,
                chunk_tokens=self.trainer.logprob_chunk_tokens,
            )
        old_logprobs = logprobs.detach() if old is None else old
        if old is None:
            assert entropy is not None
            _add_policy_stats(sums, mb, old_logprobs, entropy.detach())
        correction = algo.off_policy
        weights = None
        corrected = 0.0
        if correction.type != "none":
            weights, cstats = off_policy_weights(
                old_logprobs, mb.rollout_logprobs, correction.type, correction.low, correction.high, mask
            )
            corrected = float(cstats["corrected_fraction"]) * float(mask.sum())
        common = {"mask": mask, "aggregation": algo.loss_aggregation, "normalizer": normalizer}
        norm_length = self.max_response_tokens if algo.loss_aggregation == "seq-mean-token-sum-norm" else None
        assert self.policy_loss is not None, "an offline stage's learner runs no RL update"
        advantages = mb.advantages
        distill_sum = 0.0
        if teacher is not None:
            assert algo.distill is not None
            # Each sampled token's advantage: coef x (log teacher - log student), the negative per-token reverse KL.
            log_ratio = (old_logprobs - teacher).detach() * mask
            advantages = advantages - algo.distill.coef * log_ratio
            distill_sum = float(log_ratio.sum())
        loss, stats = self.policy_loss(
            logprobs,
            old_logprobs,
            advantages,
            algo.clip_ratio_low,
            algo.clip_ratio_high,
            dual_clip=algo.dual_clip,
            correction_weights=weights,
            norm_length=norm_length,
            **common,
        )
        kl_sum = 0.0
        if ref is not None:
            kl = kl_estimate(logprobs, ref, algo.kl_estimator)
            loss = loss + algo.kl_coef * entropy_bonus(kl, norm_length=norm_length, **common)
            kl_sum = float((kl.detach() * mask).sum())
        if entropy is not None and algo.entropy_coef > 0:
            loss = loss - algo.entropy_coef * entropy_bonus(entropy, norm_length=norm_length, **common)
        loss.backward()
        tokens = float(mask.sum())
        return {
            4: kl_sum,
            5: float(stats["clip_fraction"]) * tokens,
            6: float(loss.detach()),
            7: corrected,
            8: distill_sum,
        }

    @torch.no_grad()
    def _reference_logprobs(self, micro: list[list[MicroBatch]]) -> list[list[Tensor]]:
        if self.reference_is_base:
            with adapters_off(self.model):
                return self._logprobs_of(self.model, micro)
        assert self.reference is not None
        self.reference.eval()
        return self._logprobs_of(self.reference, micro)

    @torch.no_grad()
    def _teacher_logprobs(self, micro: list[list[MicroBatch]]) -> list[list[Tensor]]:
        assert self.teacher is not None
        self.teacher.eval()
        return self._logprobs_of(self.teacher, micro)

    def _logprobs_of(self, model: nn.Module, micro: list[list[MicroBatch]]) -> list[list[Tensor]]:
        chunk = self.trainer.logprob_chunk_tokens
        with self.compute():
            return [
                [token_logprobs(model, mb, self.temperature, False, chunk_tokens=chunk)[0] for mb in batches]
                for batches in micro
            ]

    def _sync_gradients(self) -> None:
        """Sum gradients over ranks: each rank's loss is already divided by the global count."""
        if self.world_size == 1 or self.sharded:  # FSDP reduce-scattered them in backward
            return
        sum_gradients(self.params)  # bucketed, in place (grad_sync)

    def _max_over_ranks(self, value: float) -> float:
        if self.world_size == 1:
            return value
        t = torch.tensor([value], device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t)

    def state_dict(self) -> dict[str, Any]:
        """What `state.pt` holds; with sharded checkpoints model and optimizer go to DCP shards instead."""
        if self.sharded_checkpoints:
            return {"sharded": True, "step": self.step, "generator": self.generator.get_state()}
        return {
            # With LoRA the base weights never change: the adapters are the model's whole trained state.
            "model": adapter_state_dict(self.model) if has_lora(self.model) else self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "step": self.step,
            "generator": self.generator.get_state(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The inverse of `state_dict` (`sharding.load_checkpoint` also reads the shards)."""
        if not state.get("sharded"):
            if has_lora(self.model):
                try:
                    load_adapter_state(self.model, state["model"])
                except KeyError as exc:
                    raise CheckpointError(f"spec.model.lora: {exc.args[0]}") from None
            elif any(".lora_" in key for key in state["model"]):
                raise CheckpointError(
                    "spec.model.lora: the checkpoint holds LoRA adapters and this job has none: set model.lora as "
                    "it was, or start afresh (checkpoint.resume: never)"
                )
            else:
                self.model.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
        self.step = int(state["step"])
        self.generator.set_state(state["generator"])

    def leave_group(self) -> None:
        """Final barrier, then drop the group now (not at interpreter exit, where gloo threads die in any order)."""
        if self.world_size > 1 and dist.is_initialized():
            dist.barrier()
            gc.collect()
            dist.destroy_process_group()
