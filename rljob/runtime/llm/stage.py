"""The actor of an offline post-training stage (`algorithm.name` sft, dpo or reward_model): training on the dataset's
rows alone.

No rollout, env or reward replica exists: every actor rank reads the rows, checks them (a bad row stops the job
before the first step, exit 78, naming the row and the column), builds the same starting policy and walks the rows
in the same seeded order, taking its share of each batch (`rljob.runtime.llm.training.offline`). dpo keeps a frozen
copy of the starting policy as its reference (made before a checkpoint is loaded, so a resumed job measures against
the same reference); reward_model puts the starting policy's transformer under a scalar head
(`models.policy.reward_model_from`), exported as a `...ForSequenceClassification` a reward role can load.

Rank 0 writes metrics.jsonl (`loss`; for dpo and reward_model also the rewards of the chosen and rejected responses,
their margin and the preference accuracy), evaluates the held-out rows every `evaluation.interval` steps (`eval_*`),
checkpoints every `checkpoint.interval` steps (with `hf-latest`, a Hugging Face export) and exports the final model
to `<run dir>/model`, as RL jobs do. Rows whose prompt is over `task.llm.maxPromptLength` or a response over
`maxResponseLength` tokens (with EOS) are skipped and counted; none left is a configuration error.
"""

from __future__ import annotations

import copy
import time
from pathlib import Path
from typing import Any

import torch

from rljob.runtime.llm.data.offline_rows import Encoded, check_offline_rows, encode_offline_row
from rljob.runtime.llm.data.rows import PromptStream, Row, split_off
from rljob.runtime.llm.models.policy import reward_model_from
from rljob.runtime.llm.setup import add_job_lora, job_rows, load_job_policy
from rljob.runtime.llm.training.learner import LLMLearner
from rljob.runtime.llm.training.offline import OfflineUpdate
from rljob.runtime.llm.training.sharding import CommandChannel, export_policy, load_checkpoint, save_checkpoint
from rljob.runtime.optim.divergence import Diverged
from rljob.runtime.records.checkpoint import (
    CheckpointError,
    CheckpointManager,
    capture_rng_state,
    final_export_dir,
    resolve_resume_across_ranks,
    restore_rng_state,
)
from rljob.runtime.records.metrics import RunMetrics, keep_records_until
from rljob.runtime.wire.context import FatalConfigError, RoleContext, start_trackers
from rljob.runtime.wire.identity import EXIT_PREEMPTED
from rljob.runtime.wire.ranks import agree_to_stop
from rljob.runtime.wire.role_http import ProgressTracker


class StageExamples:
    """The rows as token ids, encoded once each; rows too long for the task's limits are skipped and counted."""

    def __init__(self, stage: str, task: Any, rows: list[Row], tokenizer: Any) -> None:
        self.stage, self.task, self.rows, self.tokenizer = stage, task, rows, tokenizer
        self._encoded: dict[int, Encoded | None] = {}
        self.skipped = 0

    def get(self, index: int) -> Encoded | None:
        if index not in self._encoded:
            encoded = encode_offline_row(self.stage, self.task, self.rows[index], self.tokenizer)
            fits = len(encoded.prompt) <= self.task.max_prompt_length and all(
                len(r) <= self.task.max_response_length for r in encoded.responses
            )
            self._encoded[index] = encoded if fits else None
            self.skipped += not fits
        return self._encoded[index]

    def usable(self) -> list[Encoded]:
        return [e for i in range(len(self.rows)) if (e := self.get(i)) is not None]

    def take(self, stream: PromptStream, count: int) -> list[Encoded]:
        chosen: list[Encoded] = []
        while len(chosen) < count:
            example = self.get(next(stream))
            if example is not None:
                chosen.append(example)
        return chosen


def train_stage(context: RoleContext, health: Any, rank: int, world: int, device: torch.device) -> int:
    """Every actor rank of an offline stage: train `trainer.steps` steps; 0 when done, EXIT_PREEMPTED when stopped."""
    spec = context.job.spec
    identity = context.identity
    task = spec.task.llm
    assert task is not None
    stage = spec.algorithm.name
    rows = job_rows(context)
    problems = check_offline_rows(stage, task, rows)
    if problems:
        raise FatalConfigError("\n".join(f"{field}: {message}" for field, message in problems))
    torch.manual_seed(spec.trainer.seed)
    model, tokenizer = load_job_policy(context, device, rows)
    if stage == "reward_model":  # the starting policy's transformer under a scalar head (with LoRA: trained in full)
        model = reward_model_from(model, tokenizer.pad_token_id, spec.trainer.seed)
    lora = spec.model.lora
    add_job_lora(context, model)
    train_rows, eval_rows = rows, []
    if spec.evaluation.interval and spec.evaluation.size:
        train_rows, eval_rows = split_off(rows, spec.evaluation.size, spec.trainer.seed)
    train = StageExamples(stage, task, train_rows, tokenizer)
    if not train.usable():
        raise FatalConfigError(
            f"spec.task.llm.maxPromptLength: every training row's prompt or response is longer than "
            f"maxPromptLength {task.max_prompt_length} / maxResponseLength {task.max_response_length} tokens; "
            "raise them"
        )
    held_out = StageExamples(stage, task, eval_rows, tokenizer).usable()
    reference = None
    if stage == "dpo" and lora is None:  # the starting policy, before any checkpoint is loaded into the trained one
        reference = copy.deepcopy(model).eval().requires_grad_(False)
    learner = LLMLearner(
        model,
        spec.algorithm,
        spec.trainer,
        pad_id=tokenizer.pad_token_id,
        temperature=1.0,
        max_response_tokens=task.max_response_length,
        reference_is_base=lora is not None,  # dpo with LoRA: the starting policy is the base, adapters off
        merge_on_export=lora is None or lora.merge_on_export,
        rank=rank,
        world_size=world,
    )
    update = OfflineUpdate(learner, spec.algorithm, reference)
    default_dir = str(Path(identity.run_dir) / "checkpoints") if identity.run_dir else "/checkpoints"
    checkpoints = CheckpointManager(spec.checkpoint.dir or default_dir, keep=spec.checkpoint.keep)
    try:
        resumed = resolve_resume_across_ranks(spec.checkpoint.resume, checkpoints)
    except CheckpointError as exc:
        raise FatalConfigError(str(exc)) from None
    stream = PromptStream(len(train_rows), spec.trainer.seed)
    channel = CommandChannel(rank, world)
    if resumed is not None:
        step, state, path = resumed
        try:
            load_checkpoint(learner, state["learner"], path)
        except CheckpointError as exc:
            raise FatalConfigError(str(exc)) from None
        restore_rng_state(state["rng"])
        stream.load_state_dict(state["stream"])
        context.log.info("resumed from %s (step %d)", path, step)
    total = spec.trainer.steps
    tracker = ProgressTracker(total_steps=total, step=learner.step)
    run_metrics = None
    if rank == 0 and identity.run_dir:
        kept_until = learner.step if resumed is not None else -1
        previous_wall = keep_records_until(Path(identity.run_dir) / "metrics.jsonl", kept_until)
        started = time.time() - previous_wall if resumed is not None else time.time()
        run_metrics = RunMetrics(identity.run_dir, spec.logging.tensorboard, start_time=started)
    trackers = start_trackers(context) if rank == 0 else None
    if health is not None:
        if rank == 0:
            health.server.set_progress_provider(tracker.snapshot)
        health.ready()
    context.log.info(
        "%s stage: %d steps from step %d, %d examples per step over %d actor rank(s); %d training rows, %d held out",
        stage,
        total,
        learner.step,
        spec.trainer.batch_size,
        world,
        len(train_rows),
        len(held_out),
    )
    stopping = completed = False
    stream_after_step = stream.state_dict()

    def write_checkpoint() -> Path:
        state = {"learner": learner.state_dict(), "rng": capture_rng_state(), "stream": stream_after_step}
        return save_checkpoint(checkpoints, learner, learner.step, state, channel)

    try:
        while learner.step < total:
            context.heartbeat.beat()
            step_started = time.perf_counter()
            examples = train.take(stream, spec.trainer.batch_size)
            stream_after_step = stream.state_dict()
            try:
                stats = update.step(examples)
            except Diverged as exc:
                raise exc.with_checkpoint(checkpoints.checkpoints()) from None
            stopping = learner.step < total and bool(agree_to_stop(int(context.stop.is_set()), device, world))
            if rank != 0:
                if stopping:
                    break
                continue
            record: dict[str, Any] = {"stage": stage, **stats, "rows_skipped_too_long": train.skipped}
            interval = spec.evaluation.interval
            if interval and held_out and not stopping and (learner.step % interval == 0 or learner.step == total):
                record.update(update.evaluate(held_out))
            record["tokens_per_s"] = stats["tokens"] / max(time.perf_counter() - step_started, 1e-9)
            line = run_metrics.log(learner.step, record) if run_metrics else {"step": learner.step, **record}
            if trackers is not None:
                trackers.log(learner.step, line)
            if health is not None:
                health.metrics.observe(line)
            margin = record.get("reward_margin")
            accuracy = record.get("eval_preference_accuracy", record.get("eval_exact_match"))
            tracker.update(learner.step, margin, accuracy)
            if learner.step % 10 == 0 or learner.step in (1, total):
                evals = {k: v for k, v in record.items() if k.startswith("eval_") and k != "eval_examples"}
                shown = "".join(f" {k} {v:.4f}" for k, v in evals.items())
                context.log.info("step %d/%d loss %.4f%s", learner.step, total, stats["loss"], shown)
            every = spec.checkpoint.interval
            if (every and (learner.step % every == 0 or learner.step == total)) or stopping:
                path = write_checkpoint()
                if not stopping:
                    latest = export_policy(learner, tokenizer, path.parent / "hf-latest", channel)
                    if trackers is not None:
                        trackers.log_model(str(latest))
            if stopping:
                break
        completed = not stopping
    finally:
        if run_metrics is not None:
            run_metrics.close()
        if trackers is not None and not completed:  # a completed run's trackers close after the export below
            trackers.close()
    if train.skipped and rank == 0:
        context.log.warning(
            "%d training row(s) skipped: prompt over task.llm.maxPromptLength (%d) or a response over "
            "maxResponseLength (%d) tokens",
            train.skipped,
            task.max_prompt_length,
            task.max_response_length,
        )
    if stopping:
        learner.leave_group()
        context.log.info(
            "stopped at step %d of %d (asked to stop): checkpoint in %s", learner.step, total, checkpoints.directory
        )
        return EXIT_PREEMPTED
    if rank == 0:
        exported = export_policy(learner, tokenizer, final_export_dir(identity.run_dir, checkpoints.directory), channel)
        context.log.info("exported the trained policy to %s", exported)
        if trackers is not None:
            trackers.log_model(str(exported))
    if trackers is not None:
        trackers.close()
    learner.leave_group()
    context.log.info("reached trainer.steps (%d)", total)
    return 0
