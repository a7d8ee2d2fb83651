"""The supervised warm-up of llm jobs (`spec.sft`): demonstrations trained before RL step 0.

RL can only reinforce what the policy samples: a random tiny model never writes a well-formed tool call, so
GRPO has nothing to reward. The warm-up teaches the behaviour first. A row's demonstration is one model turn,
`sft.responseTemplate` filled from the row's fields (`calc({expression})`) or its `sft.responseKey` column,
or a whole episode, `sft.turns` (`["calc({expression})", "{answer}"]`): a template per model turn.

An example is the row's prompt, rendered and tokenized exactly as the RL loop does it, followed by the
response a rollout would produce if the model wrote the demonstration: each turn's tokens and the
end-of-sequence token (the rollout engine ends a model turn at it, so the model learns to stop where the
turn stops). With a text environment (`task.llm.env`) the response is built by the rollout's own episode code
(`EpisodeRunner.demonstrate`) against the env role, never in the trainer: the environment's opening and its
replies between the turns (`= 7`) are its own, tokenized as in rollouts, and masked like them; only the model
turns are trained on. The loss is the cross-entropy of those turn and EOS tokens (prompt and environment tokens
masked), summed over them and divided by their GLOBAL count across micro-batches and actor ranks; gradients
are summed over ranks as in the RL update (`LLMLearner`), so every actor rank takes part and the result does not
depend on how the batch is split.

Rows come from the training split (never the held-out evaluation rows) in a seeded order of their own, so the
RL prompt stream starts where it would without a warm-up. The optimizer is the trainer's kind (eps, weight
decay, gradient clip) at `sft.learningRate`, made for the warm-up only: RL starts with a fresh optimizer state.
Rows whose prompt is over `maxPromptLength`, a turn of whose demonstration (with EOS) is over one turn's
`rollout.maxTokens`, whose episode is over `maxResponseLength`, or whose episode the environment ends before the
last turn are skipped: a rollout could never give that sample. When no row is left the job stops (exit 78),
saying why.
"""

from __future__ import annotations

import string
import time
from collections.abc import Callable
from typing import Any

import torch

from rljob.api.spec import RLJobSpec, SFTSpec
from rljob.runtime.llm.data.rows import PromptStream, Row, encode_prompt
from rljob.runtime.llm.episodes.multiturn import EpisodeRunner
from rljob.runtime.llm.training.learner import LLMLearner, MicroBatch, token_logprobs
from rljob.runtime.llm.training.sharding import gradient_norm
from rljob.runtime.optim.divergence import check_update
from rljob.runtime.optim.optimizer import build_optimizer
from rljob.runtime.wire.context import FatalConfigError

PHASE = "sft"
"""The `phase` of the warm-up's metrics.jsonl records (RL records have none)."""


class _MissingField(KeyError):
    pass


class _RowFields(dict[str, Any]):
    def __missing__(self, key: str) -> Any:
        raise _MissingField(key)


def _fill(template: str, row: Row) -> str:
    return template.format_map(_RowFields({k: v for k, v in row.items() if isinstance(k, str)}))


def demonstration_turns(sft: SFTSpec, row: Row) -> list[str]:
    """The model turns the row demonstrates: one, or one per `sft.turns` template."""
    if sft.turns is not None:
        return [_fill(turn, row) for turn in sft.turns]
    if sft.response_key is not None:
        return [str(row[sft.response_key])]
    assert sft.response_template is not None
    return [_fill(sft.response_template, row)]


def demonstration_field(sft: SFTSpec) -> str:
    """The spec field the demonstrations come from, for messages."""
    if sft.turns is not None:
        return "spec.sft.turns"
    return "spec.sft.responseKey" if sft.response_key is not None else "spec.sft.responseTemplate"


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
    if sft.turns is not None:
        templates = [(f"spec.sft.turns[{i}]", turn) for i, turn in enumerate(sft.turns)]
    else:
        assert sft.response_template is not None
        templates = [("spec.sft.responseTemplate", sft.response_template)]
    for number, row in enumerate(rows):
        for field, template in templates:
            missing = [name for name in template_fields(template) if name not in row]
            if missing:
                return [
                    (
                        field,
                        f"reads {{{missing[0]}}}, but row {number} of the dataset has no column {missing[0]!r} "
                        f"(columns: {', '.join(sorted(map(str, row)))}); use one of them",
                    )
                ]
            try:
                _fill(template, row)
            except (ValueError, IndexError, AttributeError, TypeError) as exc:
                return [(field, f"cannot be filled from row {number} ({exc})")]
    return []


def demonstration_texts(spec: RLJobSpec, rows: list[Row]) -> list[str]:
    """Every demonstrated turn of the job (the builtin tokenizer must be able to write them); none without SFT."""
    if spec.sft.steps == 0:
        return []
    return [turn for row in rows for turn in demonstration_turns(spec.sft, row)]


def sft_loss(
    model: torch.nn.Module, batch: MicroBatch, normalizer: float, chunk_tokens: int | None = None
) -> tuple[torch.Tensor, float]:
    """(summed cross-entropy of the demonstration tokens / normalizer, that sum): prompt and padding masked;
    `chunk_tokens` as in `token_logprobs`."""
    logprobs, _ = token_logprobs(model, batch, temperature=1.0, with_entropy=False, chunk_tokens=chunk_tokens)
    total = -(logprobs * batch.response_mask).sum()
    return total / normalizer, float(total.detach())


class Warmup:
    """Builds the demonstrations batch by batch and trains on them with the learner's model and rank group.

    `episodes` (the job has a text environment) builds each example as a rollout episode against the env role;
    without it an example is the prompt and the single turn."""

    def __init__(
        self,
        spec: RLJobSpec,
        learner: LLMLearner,
        tokenizer: Any,
        rows: list[Row],
        log: Any,
        episodes: EpisodeRunner | None = None,
    ) -> None:
        assert spec.task.llm is not None
        self.spec, self.sft, self.task = spec, spec.sft, spec.task.llm
        self.learner, self.tokenizer, self.rows, self.log = learner, tokenizer, rows, log
        self.episodes = episodes
        if len(self.sft.turns or ()) > 1 and episodes is None:
            raise FatalConfigError("spec.sft.turns: several turns need a text environment (task.llm.env)")
        if learner.sharded and self.sft.batch_size % learner.world_size:
            # Equal shares: sharded (fsdp2) ranks pair up their gathers pass by pass, so every rank must run as
            # many forward/backward passes as the others (a rank one example short would leave its peers waiting).
            # ddp ranks meet once per step whatever their shares (gradients summed, a missing one as zeros).
            raise FatalConfigError(
                f"spec.sft.batchSize ({self.sft.batch_size}) must split into the {learner.world_size} fsdp2 actor "
                f"ranks in equal parts: make it a multiple of {learner.world_size}"
            )
        self.turn_tokens = spec.rollout.max_tokens or self.task.max_response_length
        self.stream = PromptStream(len(rows), spec.trainer.seed)
        self.skipped: dict[str, int] = {}
        """Rows skipped, by why."""
        self._examples: dict[int, dict[str, Any] | None] = {}
        trainer = spec.trainer.model_copy(
            update={"learning_rate": self.sft.learning_rate, "lr_schedule": "constant", "warmup_steps": 0}
        )
        self.optimizer = build_optimizer(learner.params, trainer)

    def _skip(self, index: int, why: str) -> None:
        self._examples[index] = None
        self.skipped[why] = self.skipped.get(why, 0) + 1

    def build(self, indices: list[int]) -> None:
        """The examples of the rows `indices` not built yet (one environment round trip per turn for all)."""
        todo = [i for i in dict.fromkeys(indices) if i not in self._examples]
        eos = [self.tokenizer.eos_token_id] if self.tokenizer.eos_token_id is not None else []
        ready: list[tuple[int, list[int], list[list[int]]]] = []
        for index in todo:
            row = self.rows[index]
            prompt = encode_prompt(self.task, row, self.tokenizer)
            turns = [
                [*self.tokenizer(text, add_special_tokens=False)["input_ids"], *eos]
                for text in demonstration_turns(self.sft, row)
            ]
            if len(prompt) > self.task.max_prompt_length:
                self._skip(index, f"the prompt is over task.llm.maxPromptLength ({self.task.max_prompt_length})")
            elif not all(0 < len(turn) <= self.turn_tokens for turn in turns):
                self._skip(
                    index, f"a turn (with its end-of-sequence token) is over rollout.maxTokens ({self.turn_tokens})"
                )
            else:
                ready.append((index, prompt, turns))
        if self.episodes is None:
            for index, prompt, (turn,) in ready:
                if len(turn) > self.task.max_response_length:
                    self._skip(index, f"it is over task.llm.maxResponseLength ({self.task.max_response_length})")
                    continue
                self._examples[index] = self._example(prompt, turn, [1] * len(turn))
            return
        if not ready:
            return
        built = self.episodes.demonstrate(
            [prompt for _, prompt, _ in ready], [self.rows[i] for i, _, _ in ready], [t for _, _, t in ready]
        )
        for (index, prompt, _), (completion, why) in zip(ready, built, strict=True):
            if completion is None:
                self._skip(index, why)
            else:
                self._examples[index] = self._example(prompt, completion["token_ids"], completion["loss_mask"])

    @staticmethod
    def _example(prompt: list[int], response: list[int], mask: list[int]) -> dict[str, Any]:
        return {
            "prompt_ids": prompt,
            "response_ids": response,
            "rollout_logprobs": [0.0] * len(response),
            "loss_mask": mask,
            "advantage": 0.0,
        }

    def example(self, index: int) -> dict[str, Any] | None:
        """Prompt, response token ids and loss mask of a row (None when no rollout could give it), as `collate`
        takes them."""
        self.build([index])
        return self._examples[index]

    def batch(self) -> list[dict[str, Any]]:
        chosen: list[dict[str, Any]] = []
        while len(chosen) < self.sft.batch_size:
            indices = self.stream.take(self.sft.batch_size - len(chosen))
            self.build(indices)
            for index in indices:
                example = self._examples[index]
                if example is not None:
                    chosen.append(example)
            if len(self._examples) == len(self.rows) and all(e is None for e in self._examples.values()):
                reasons = "; ".join(f"{count} row(s): {why}" for why, count in sorted(self.skipped.items()))
                raise FatalConfigError(
                    f"{demonstration_field(self.sft)}: no row gives a usable example ({reasons}); shorten the "
                    "demonstrations, raise those limits, or demonstrate turns the environment answers"
                )
        return chosen

    def step(self) -> dict[str, float]:
        """One supervised step on every rank (each takes its share of the same batch); the mean token loss."""
        learner = self.learner
        examples = self.batch()
        mine = examples[learner.rank :: learner.world_size]
        micro = learner._micro(mine)  # the RL update's micro-batches: trainer.microBatchSize / microBatchTokens
        local = sum(float(mb.response_mask.sum()) for mb in micro)
        tokens = float(learner._all_reduce(torch.tensor([local], dtype=torch.float64))[0])
        learner.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        loss_sum = 0.0
        for mb in micro:
            with learner.compute():
                loss, summed = sft_loss(learner.model, mb, tokens, learner.trainer.logprob_chunk_tokens)
            loss.backward()
            loss_sum += summed
        learner._sync_gradients()
        grad_norm = gradient_norm(learner.params, self.spec.trainer.grad_clip)  # over the shards under fsdp2
        # A non-finite warm-up update stops the actor as an RL one does (step 0: the warm-up's records' step).
        check_update(0, {"sft_loss": loss_sum, "grad_norm": grad_norm}, learner.world_size, learner.device)
        self.optimizer.step()
        total = float(learner._all_reduce(torch.tensor([loss_sum], dtype=torch.float64))[0])
        return {"sft_loss": total / max(tokens, 1.0), "sft_tokens": tokens, "sft_grad_norm": grad_norm}

    def _first_example(self) -> dict[str, Any]:
        return next(e for e in self._examples.values() if e is not None)

    def describe(self, example: dict[str, Any]) -> str:
        """An example as text: the prompt, then the trained turns as `model[...]` and the environment's tokens
        as `env[...]`, special tokens shown (a turn ends with the end-of-sequence token)."""
        parts = [repr(self.tokenizer.decode(example["prompt_ids"], skip_special_tokens=True))]
        tokens, mask = example["response_ids"], example["loss_mask"]
        start = 0
        for end in range(1, len(tokens) + 1):
            if end == len(tokens) or mask[end] != mask[start]:
                text = self.tokenizer.decode(tokens[start:end], skip_special_tokens=False)
                parts.append(f"{'model' if mask[start] else 'env'}[{text!r}]")
                start = end
        return " ".join(parts)

    def run(self, beat: Callable[[], None] = lambda: None) -> list[dict[str, Any]]:
        """`sft.steps` steps; one metrics record per step (`phase: sft`, `sft_step`, `sft_loss`, ...); `beat()`
        before each (the role's heartbeat)."""
        started = time.perf_counter()
        records = []
        total = self.sft.steps
        shown = {
            "spec.sft.turns": self.sft.turns,
            "spec.sft.responseKey": self.sft.response_key,
            "spec.sft.responseTemplate": self.sft.response_template,
        }
        field = demonstration_field(self.sft)
        self.log.info(
            "supervised warm-up: %d steps of %d demonstrations (%s %r%s) before RL",
            total,
            self.sft.batch_size,
            field.removeprefix("spec.sft."),
            shown[field],
            ", environment replies from the env role" if self.episodes is not None else "",
        )
        for k in range(1, total + 1):
            beat()
            stats = self.step()
            if k == 1:
                self.log.info("supervised warm-up: first example %s", self.describe(self._first_example()))
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
        for why, count in sorted(self.skipped.items()):
            self.log.warning("supervised warm-up: %d row(s) skipped: %s", count, why)
        self.optimizer.zero_grad(set_to_none=True)
        return records
