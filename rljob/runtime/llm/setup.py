"""What every llm role process builds first: its device, the job's rows and the starting policy."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from rljob.api.spec import OFFLINE_STAGES
from rljob.runtime.llm.data.offline_rows import check_offline_rows, offline_texts
from rljob.runtime.llm.data.rows import DatasetError, Row, load_rows
from rljob.runtime.llm.episodes.rewards import check_reward_columns
from rljob.runtime.llm.models.lora import LoraTargetError, add_lora, head_names, trainable_bytes
from rljob.runtime.llm.models.policy import CHAT_TEXT, ModelSourceError, load_policy, policy_dtype
from rljob.runtime.llm.training.sft import check_sft_rows, demonstration_texts
from rljob.runtime.wire.context import FatalConfigError, RoleContext


def role_device(gpus_per_replica: int) -> torch.device:
    """This process's GPU when the role was given GPUs and one is visible, else the CPU."""
    if gpus_per_replica > 0 and torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def rollout_gpus(spec: Any) -> int:
    """GPUs a rollout replica generates on: the actor's when collocated (it shares them), else its own."""
    rollouts = spec.roles.rollout
    return spec.roles.actor.gpus_per_replica if rollouts.collocated else rollouts.gpus_per_replica


def job_rows(context: RoleContext) -> list[Row]:
    """The dataset's rows; a dataset that cannot be read, or lacks a column a reward function or the supervised
    warm-up reads, or a row an offline stage (sft, dpo) cannot train on, is a configuration error (exit 78)."""
    spec = context.job.spec
    assert spec.task.llm is not None
    stage = spec.algorithm.name if spec.algorithm.name in OFFLINE_STAGES else None
    try:
        rows = load_rows(spec.task.llm, seed=spec.trainer.seed, columns=stage is None)
    except DatasetError as exc:
        raise FatalConfigError(str(exc)) from None
    if stage is not None:
        problems = check_offline_rows(stage, spec.task.llm, rows)
    else:
        answer_key = spec.task.llm.dataset.answer_key
        problems = check_reward_columns(spec.reward, rows, answer_key) + check_sft_rows(spec.sft, rows)
    if problems:
        raise FatalConfigError("\n".join(f"{field}: {message}" for field, message in problems))
    return rows


def sent_dtype(spec: Any) -> torch.dtype:
    """The dtype the actor's weight sync carries: its policy's dtype on the actor's device. A rollout's staging
    copy must be of it (a broadcast into tensors of another dtype reads garbage), wherever the rollout runs."""
    actor_device = torch.device("cuda" if spec.roles.actor.gpus_per_replica > 0 else "cpu")
    return policy_dtype(spec.model, spec.trainer.precision, actor_device)


def load_job_policy(context: RoleContext, device: torch.device, rows: list[Row] | None = None) -> tuple[Any, Any]:
    """(model, tokenizer) as every process of the job builds them: the same starting weights everywhere (and
    the same builtin tokenizer, which also covers the warm-up's demonstrations)."""
    spec = context.job.spec
    assert spec.task.llm is not None
    rows = job_rows(context) if rows is None else rows
    try:
        return load_policy(
            spec.model,
            spec.task.llm,
            rows,
            spec.trainer.seed,
            device,
            spec.trainer.precision,
            extra_texts=job_texts(spec, rows),
        )
    except ModelSourceError as exc:
        raise FatalConfigError(str(exc)) from None


def add_job_lora(context: RoleContext, model: Any) -> None:
    """`model.lora`: adapters on the loaded policy, in place (only they train afterwards); nothing without it."""
    lora = context.job.spec.model.lora
    if lora is None:
        return
    # A reward model's new scalar head has nothing to adapt: it trains in full beside the adapters.
    whole = head_names(model) if context.job.spec.algorithm.name == "reward_model" else []
    try:
        add_lora(model, lora, train_whole=whole)
    except LoraTargetError as exc:
        raise FatalConfigError(str(exc)) from None
    params, nbytes = trainable_bytes(model)
    context.log.info(
        "model.lora: %d adapter parameters train (%d bytes)%s, the base stays frozen",
        params,
        nbytes,
        f" with the head {', '.join(whole)} in full" if whole else "",
    )


def job_texts(spec: Any, rows: list[Row]) -> list[str]:
    """Texts the builtin tokenizer must cover beside prompts and answers: the warm-up's demonstrations, or every
    text of an offline stage's rows."""
    if spec.algorithm.name in OFFLINE_STAGES:
        return offline_texts(spec.task.llm, rows, CHAT_TEXT)
    return demonstration_texts(spec, rows)


def weights_dir(context: RoleContext) -> Path:
    """Where `weightSync.method: filesystem` puts weight files: `weights/` in the checkpoint directory.

    The checkpoint directory is the one volume the actor already writes (`checkpoint.volumeClaim` on a
    cluster, the run's `checkpoints/` locally), so rollouts read from it too."""
    spec = context.job.spec
    run_dir = context.identity.run_dir
    default = str(Path(run_dir) / "checkpoints") if run_dir else "/checkpoints"
    return Path(spec.checkpoint.dir or default) / "weights"
