"""The supervised warm-up of llm jobs (`spec.sft`): demonstrations trained before RL step 0.

RL can only reinforce what the policy samples: a random tiny model never writes a well-formed tool call, so
GRPO has nothing to reward. The warm-up teaches the behaviour first. A row's demonstration is
`sft.responseTemplate` filled from the row's fields (`calc({expression})`) or its `sft.responseKey` column;
an example is the row's prompt, rendered and tokenized exactly as the RL loop does it, followed by the
demonstration's tokens and the end-of-sequence token (the rollout engine ends a model turn at it, so the
model learns to stop where the demonstration stops). The loss is the cross-entropy of the demonstration and
EOS tokens only (prompt tokens are masked), summed over them and divided by their GLOBAL count across micro-
batches and actor ranks; gradients are summed over ranks as in the RL update (`LLMLearner`), so every actor
rank takes part and the result does not depend on how the batch is split.

Rows come from the training split (never the held-out evaluation rows) in a seeded order of their own, so the
RL prompt stream starts where it would without a warm-up. The optimizer is the trainer's kind (eps, weight
decay, gradient clip) at `sft.learningRate`, made for the warm-up only: RL starts with a fresh optimizer state.
Rows whose prompt is over `maxPromptLength` or whose demonstration (with EOS) is over one turn's
`rollout.maxTokens` are skipped: a demonstration the engine would cut could never be written.
"""

from __future__ import annotations

import string
import time
from typing import Any

import torch

from rljob.api.spec import RLJobSpec, SFTSpec
from rljob.runtime.llm.data import PromptStream, Row, render_prompt
from rljob.runtime.llm.learner import LLMLearner, MicroBatch, collate, token_logprobs
from rljob.runtime.llm.sharding import gradient_norm
from rljob.runtime.optim import build_optimizer
from rljob.runtime.roles.common import FatalConfigError

PHASE = "sft"
"""The `phase` of the warm-up's metrics.jsonl records (RL records have none)."""


class _MissingField(KeyError):
    pass


class _RowFields(dict[str, Any]):
    def __missing__(self, key: str) -> Any:
        raise _MissingField(key)


def demonstration(sft: SFTSpec, row: Row) -> str:
    """The text the model is taught to write after the row's prompt."""
    if sft.response_key is not None:
        return str(row[sft.response_key])
    assert sft.response_template is not None
    return sft.response_template.format_map(_RowFields({k: v for k, v in row.items() if isinstance(k, str)}))


def template_fields(template: str) -> list[str]:
    """The field names a format string reads (`calc({expression})` -> ["expression"])."""
    names = []
    for _, name, _, _ in string.Formatter().parse(template):
        if name is not None:
            names.append(name.split(".", 1)[0].split("[", 1)[0])
    return names


def check_sft_rows(sft: SFTSpec, rows: list[Row]) -> list[tuple[str, str]]:
    """(field path, message) when some row cannot give a demonstration: a template field or a column it lacks."""
    if sft.steps == 0 or not rows:
        return []
    if sft.response_key is not None:
        for number, row in enumerate(rows):
            if sft.response_key not in row:
                return [
                    (
                        "spec.sft.responseKey",
                        f"row {number} of the dataset has no column {sft.response_key!r} (columns: "
                        f"{', '.join(sorted(map(str, row)))}); name the column that holds each row's demonstration",
                    )
                ]
        return []
    assert sft.response_template is not None
    for number, row in enumerate(rows):
        missing = [name for name in template_fields(sft.response_template) if name not in row]
        if missing:
            return [
                (
                    "spec.sft.responseTemplate",
                    f"reads {{{missing[0]}}}, but row {number} of the dataset has no column {missing[0]!r} "
                    f"(columns: {', '.join(sorted(map(str, row)))}); use one of them",
                )
            ]
        try:
            demonstration(sft, row)
        except (ValueError, IndexError, AttributeError, TypeError) as exc:
            return [("spec.sft.responseTemplate", f"cannot be filled from row {number} ({exc})")]
    return []


def demonstration_texts(spec: RLJobSpec, rows: list[Row]) -> list[str]:
    """Every demonstration of the job (the builtin tokenizer must be able to write them); none without SFT."""
    if spec.sft.steps == 0:
        return []
    return [demonstration(spec.sft, row) for row in rows]


def sft_loss(model: torch.nn.Module, batch: MicroBatch, normalizer: float) -> tuple[torch.Tensor, float]:
    """(summed cross-entropy of the demonstration tokens / normalizer, that sum): prompt and padding masked."""
    logprobs, _ = token_logprobs(model, batch, temperature=1.0, with_entropy=False)
    total = -(logprobs * batch.response_mask).sum()
    return total / normalizer, float(total.detach())


class Warmup:
    """Builds the demonstrations batch by batch and trains on them with the learner's model and rank group."""

    def __init__(self, spec: RLJobSpec, learner: LLMLearner, tokenizer: Any, rows: list[Row], log: Any) -> None:
        assert spec.task.llm is not None
        self.spec, self.sft, self.task = spec, spec.sft, spec.task.llm
        self.learner, self.tokenizer, self.rows, self.log = learner, tokenizer, rows, log
        self.turn_tokens = spec.rollout.max_tokens or self.task.max_response_length
        self.stream = PromptStream(len(rows), spec.trainer.seed)
        self.skipped = 0
        self._examples: dict[int, dict[str, Any] | None] = {}
        trainer = spec.trainer.model_copy(
            update={"learning_rate": self.sft.learning_rate, "lr_schedule": "constant", "warmup_steps": 0}
        )
        self.optimizer = build_optimizer(learner.params, trainer)

    def example(self, index: int) -> dict[str, Any] | None:
        """Prompt and demonstration token ids of a row (None when too long), as `collate` takes them."""
        if index not in self._examples:
            row = self.rows[index]
            prompt = self.tokenizer(render_prompt(self.task, row, self.tokenizer))["input_ids"]
            response = self.tokenizer(demonstration(self.sft, row), add_special_tokens=False)["input_ids"]
            if self.tokenizer.eos_token_id is not None:
                response = [*response, self.tokenizer.eos_token_id]
            fits = len(prompt) <= self.task.max_prompt_length and 0 < len(response) <= self.turn_tokens
            self._examples[index] = (
                {
                    "prompt_ids": prompt,
                    "response_ids": response,
                    "rollout_logprobs": [0.0] * len(response),
                    "advantage": 0.0,
                }
                if fits
                else None
            )
        return self._examples[index]

    def batch(self) -> list[dict[str, Any]]:
        chosen: list[dict[str, Any]] = []
        while len(chosen) < self.sft.batch_size:
            example = self.example(next(self.stream))
            if example is None:
                self.skipped += 1
                if self.skipped > 10 * len(self.rows):
                    field = "responseKey" if self.sft.response_key is not None else "responseTemplate"
                    raise FatalConfigError(
                        f"spec.sft.{field}: no row gives a usable example: every prompt is over "
                        f"task.llm.maxPromptLength ({self.task.max_prompt_length}) or every demonstration (with "
                        f"its end-of-sequence token) over one turn's rollout.maxTokens ({self.turn_tokens}); "
                        "shorten the demonstrations or raise those limits"
                    )
                continue
            chosen.append(example)
        return chosen

    def step(self) -> dict[str, float]:
        """One supervised step on every rank (each takes its share of the same batch); the mean token loss."""
        learner = self.learner
        examples = self.batch()
        mine = examples[learner.rank :: learner.world_size]
        size = self.spec.trainer.micro_batch_size or max(len(mine), 1)
        micro = [collate(mine[i : i + size], learner.pad_id).to(learner.device) for i in range(0, len(mine), size)]
        local = sum(float(mb.response_mask.sum()) for mb in micro)
        tokens = float(learner._all_reduce(torch.tensor([local], dtype=torch.float64))[0])
        learner.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        loss_sum = 0.0
        for mb in micro:
            loss, summed = sft_loss(learner.model, mb, tokens)
            loss.backward()
            loss_sum += summed
        learner._sync_gradients()
        grad_norm = gradient_norm(learner.params, self.spec.trainer.grad_clip)  # over the shards under fsdp2
        self.optimizer.step()
        total = float(learner._all_reduce(torch.tensor([loss_sum], dtype=torch.float64))[0])
        return {"sft_loss": total / max(tokens, 1.0), "sft_tokens": tokens, "sft_grad_norm": grad_norm}

    def run(self) -> list[dict[str, Any]]:
        """`sft.steps` steps; one metrics record per step (`phase: sft`, `sft_step`, `sft_loss`, ...)."""
        started = time.perf_counter()
        records = []
        total = self.sft.steps
        self.log.info(
            "supervised warm-up: %d steps of %d demonstrations (%s) before RL",
            total,
            self.sft.batch_size,
            f"responseKey {self.sft.response_key!r}"
            if self.sft.response_key is not None
            else f"responseTemplate {self.sft.response_template!r}",
        )
        for k in range(1, total + 1):
            stats = self.step()
            records.append(
                {
                    "phase": PHASE,
                    "sft_step": k,
                    **stats,
                    "learning_rate": self.sft.learning_rate,
                    "wall_time": round(time.perf_counter() - started, 4),
                }
            )
            if k == 1 or k % 10 == 0 or k == total:
                self.log.info("sft step %d/%d loss %.4f", k, total, stats["sft_loss"])
        if self.skipped:
            self.log.warning("supervised warm-up: %d row(s) skipped as too long", self.skipped)
        self.optimizer.zero_grad(set_to_none=True)
        return records
