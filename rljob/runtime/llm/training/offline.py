"""The update and the held-out evaluation of the offline stages (sft, dpo, reward_model), on the learner's model
and rank group.

A step takes `trainer.batchSize` examples (sft: prompt + completion; dpo, reward_model: prompt + chosen + rejected),
every actor rank its share (`examples[rank::world]`), in passes of `trainer.microBatchSize` examples. The loss is
normalised by the GLOBAL count (sft: completion tokens; else pairs) all-reduced over ranks, and gradients are summed
over ranks as in the RL update (`LLMLearner`), so the step does not depend on how the batch is split. The optimizer,
its learning-rate schedule, gradient clip and divergence check are the trainer's.

sft: summed cross-entropy of the completion tokens (EOS included; the prompt masked) per completion token.
dpo: `rljob.algorithms.preference.dpo_loss` on summed sequence log-probs; the reference's come from a frozen copy of
the starting policy in the same micro-batches (no gradient). Log-probs are those of softmax(logits) (temperature 1).
reward_model: `bradley_terry_loss` on the scalar head's scores of the chosen and rejected sequences (prompt, response,
EOS), read at the EOS.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from rljob.algorithms.preference import PreferenceLoss, bradley_terry_loss, dpo_loss
from rljob.api.spec import AlgorithmSpec
from rljob.runtime.llm.data.offline_rows import Encoded
from rljob.runtime.llm.models.lora import adapters_off
from rljob.runtime.llm.training.batch import MicroBatch, collate
from rljob.runtime.llm.training.learner import LLMLearner, token_logprobs
from rljob.runtime.llm.training.sharding import gradient_norm
from rljob.runtime.optim.divergence import check_update
from rljob.runtime.optim.optimizer import learning_rate_at, set_learning_rate


def response_batch(prompts: list[list[int]], responses: list[list[int]], pad_id: int) -> MicroBatch:
    """Right-padded prompt + response rows; the response mask marks the positions that predict response tokens."""
    samples = [
        {"prompt_ids": p, "response_ids": r, "rollout_logprobs": [0.0] * len(r), "advantage": 0.0}
        for p, r in zip(prompts, responses, strict=True)
    ]
    return collate(samples, pad_id)  # type: ignore[arg-type]


@dataclass
class SequenceScores:
    """Per row: summed response log-prob, response tokens, and how many of them are the model's top choice."""

    logprob: Tensor
    tokens: Tensor
    top1: Tensor | None = None


def sequence_scores(
    model: nn.Module, batch: MicroBatch, chunk_tokens: int | None = None, with_top1: bool = False
) -> SequenceScores:
    """Each row's summed response log-prob (with grad when enabled) and response token count (and top-1 hits)."""
    logprobs, _ = token_logprobs(model, batch, temperature=1.0, with_entropy=False, chunk_tokens=chunk_tokens)
    mask = batch.response_mask
    top1 = None
    if with_top1:  # greedy decoding writes the response exactly iff every response token is the argmax
        with torch.no_grad():
            logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False).logits
            hits = (logits[:, :-1].argmax(-1) == batch.targets).float() * mask
            top1 = hits.sum(1)
    return SequenceScores((logprobs * mask).sum(1), mask.sum(1), top1)


class OfflineUpdate:
    """One sft or dpo step on every rank, and the held-out evaluation (on the calling rank alone)."""

    def __init__(self, learner: LLMLearner, algorithm: AlgorithmSpec, reference: nn.Module | None = None) -> None:
        self.learner, self.algorithm, self.reference = learner, algorithm, reference
        self.stage = algorithm.name
        if self.stage == "dpo" and reference is None and not learner.reference_is_base:
            raise ValueError("the dpo stage measures log-ratios against a reference: pass the frozen starting policy")
        self.chunk = learner.trainer.logprob_chunk_tokens
        self.micro_size = learner.trainer.micro_batch_size

    def _parts(self, examples: list[Encoded]) -> list[list[Encoded]]:
        size = self.micro_size or max(len(examples), 1)
        return [examples[i : i + size] for i in range(0, len(examples), size)]

    def _batch(self, part: list[Encoded]) -> MicroBatch:
        """sft: one row per example; dpo: the chosen rows, then the rejected rows."""
        prompts = [e.prompt for e in part]
        if self.stage == "sft":
            rows = (prompts, [e.responses[0] for e in part])
        else:
            rows = (prompts + prompts, [e.responses[0] for e in part] + [e.responses[1] for e in part])
        return response_batch(*rows, self.learner.pad_id).to(self.learner.device)

    def _preference(self, batch: MicroBatch, pairs: int, scores: SequenceScores) -> Any:
        with torch.no_grad(), self.learner.compute():
            if self.reference is None:  # LoRA: the policy with its adapters off is the starting policy
                assert self.learner.reference_is_base
                with adapters_off(self.learner.model):
                    reference = sequence_scores(self.learner.model, batch, self.chunk).logprob
            else:
                reference = sequence_scores(self.reference, batch, self.chunk).logprob
        dpo = self.algorithm.dpo
        return dpo_loss(
            scores.logprob[:pairs],
            scores.logprob[pairs:],
            reference[:pairs],
            reference[pairs:],
            beta=dpo.beta,
            loss_type=dpo.loss_type,
            label_smoothing=dpo.label_smoothing,
            chosen_tokens=scores.tokens[:pairs],
            rejected_tokens=scores.tokens[pairs:],
        )

    def _rewards(self, batch: MicroBatch, pairs: int) -> PreferenceLoss:
        """reward_model: the head's scores of the chosen and rejected rows under the Bradley-Terry loss."""
        with self.learner.compute():
            scores = self.learner.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
        scores = scores[:, 0].float()
        return bradley_terry_loss(scores[:pairs], scores[pairs:])

    def pass_loss(self, part: list[Encoded], batch: MicroBatch | None = None) -> tuple[Tensor, Tensor]:
        """One forward pass over `part`: its summed loss (with grad; sft: completion-token NLL, dpo and reward_model:
        per-pair loss) and [loss, chosen rewards, rejected rewards, pairs ranked right, response tokens] summed."""
        batch = self._batch(part) if batch is None else batch
        sums = torch.zeros(5, dtype=torch.float64)
        sums[4] = float(batch.response_mask.sum())
        if self.stage == "reward_model":
            result = self._rewards(batch, len(part))
        else:
            with self.learner.compute():
                scores = sequence_scores(self.learner.model, batch, self.chunk)
            if self.stage == "sft":
                total = -scores.logprob.sum()
                sums[0] = float(total.detach())
                return total, sums
            result = self._preference(batch, len(part), scores)
        total = result.loss.sum()
        sums[1] = float(result.chosen_rewards.sum())
        sums[2] = float(result.rejected_rewards.sum())
        sums[3] = float(result.correct.sum())
        sums[0] = float(total.detach())
        return total, sums

    def step(self, examples: list[Encoded]) -> dict[str, float]:
        """One optimizer step on this rank's share of `examples` (the whole batch, the same on every rank)."""
        learner = self.learner
        mine = examples[learner.rank :: learner.world_size]
        parts = self._parts(mine)
        batches = [self._batch(part) for part in parts]
        # The global count the loss is divided by: completion tokens (sft) or pairs (dpo).
        local = sum(float(b.response_mask.sum()) for b in batches) if self.stage == "sft" else float(len(mine))
        normalizer = max(float(learner._all_reduce(torch.tensor([local], dtype=torch.float64))[0]), 1.0)
        lr = learning_rate_at(learner.step, learner.trainer)
        set_learning_rate(learner.optimizer, lr)
        learner.model.train()
        learner.optimizer.zero_grad(set_to_none=True)
        sums = torch.zeros(5, dtype=torch.float64)  # loss, chosen rewards, rejected rewards, correct, tokens
        for part, batch in zip(parts, batches, strict=True):
            total, part_sums = self.pass_loss(part, batch)
            (total / normalizer).backward()
            sums += part_sums
        learner._sync_gradients()
        grad_norm = gradient_norm(learner.params, learner.trainer.grad_clip)
        totals = learner._all_reduce(sums)
        check_update(
            learner.step + 1, {"loss": float(totals[0]), "grad_norm": grad_norm}, learner.world_size, learner.device
        )
        learner.optimizer.step()
        learner.step += 1
        learner.optimizer.zero_grad(set_to_none=True)
        return self._stats(totals, normalizer, "") | {"grad_norm": grad_norm, "learning_rate": lr}

    def _stats(self, totals: Tensor, normalizer: float, prefix: str) -> dict[str, float]:
        stats = {f"{prefix}loss": float(totals[0]) / normalizer, f"{prefix}tokens": float(totals[4])}
        if self.stage != "sft":
            pairs = normalizer
            stats |= {
                f"{prefix}rewards_chosen": float(totals[1]) / pairs,
                f"{prefix}rewards_rejected": float(totals[2]) / pairs,
                f"{prefix}reward_margin": float(totals[1] - totals[2]) / pairs,
                f"{prefix}preference_accuracy": float(totals[3]) / pairs,
            }
        return stats

    @torch.no_grad()
    def evaluate(self, examples: list[Encoded]) -> dict[str, float]:
        """Held-out `eval_*` metrics at the current weights. sft: mean token loss and exact match (the share of
        completions greedy decoding would write exactly, EOS included); dpo and reward_model: mean loss, preference
        accuracy and reward margin."""
        if not examples:
            return {}
        model = self.learner.model
        was_training = model.training
        model.eval()
        sums = torch.zeros(5, dtype=torch.float64)
        exact = 0.0
        try:
            for part in self._parts(examples):
                batch = self._batch(part)
                if self.stage == "sft":
                    with self.learner.compute():
                        scores = sequence_scores(model, batch, self.chunk, with_top1=True)
                    sums[4] += float(scores.tokens.sum())
                    sums[0] += float(-scores.logprob.sum())
                    assert scores.top1 is not None
                    exact += float((scores.top1 == scores.tokens).sum())
                else:
                    sums += self.pass_loss(part, batch)[1]
        finally:
            model.train(was_training)
        normalizer = float(sums[4]) if self.stage == "sft" else float(len(examples))
        stats = self._stats(sums, max(normalizer, 1.0), "eval_")
        stats["eval_examples"] = float(len(examples))
        if self.stage == "sft":
            stats["eval_exact_match"] = exact / len(examples)
        return stats
