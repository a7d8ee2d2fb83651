"""The actor role of llm jobs: the GRPO-family trainer group. Rank 0 is the single controller of the loop.

Per step, rank 0 takes `trainer.batchSize` prompts from the prompt stream, renders and tokenizes them,
has the rollout replicas sample `groupSize` responses per prompt, the reward replicas score them, builds
group advantages (with DAPO's dynamic sampling and overlong shaping when configured), shares the batch with
every rank, and every rank runs the same update. Rank 0 then pushes the new weights, logs, evaluates and
checkpoints. With `rollout.async.maxStaleness` k >= 1 the next step's prompts are sent before this step
trains, so generation overlaps training; every group is checked against k before the update.

With a text environment (`task.llm.env`) the rows travel with the prompts and the rollouts return multi-turn
episodes (`rljob.runtime.llm.episodes.multiturn`): the reward functions score the final model turn, the environment's
step rewards are added, and the loss mask keeps the environment's tokens out of the update.

With `spec.sft` every rank first runs the supervised warm-up (`rljob.runtime.llm.training.sft`) on the training rows;
its records go to metrics.jsonl as step 0 with `phase: sft`, and a resume from a checkpoint never repeats it.
"""

from __future__ import annotations

import contextlib
import copy
import math
import time
from array import array
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from rljob.algorithms import group_advantages, informative_groups, overlong_penalty
from rljob.api.rules import response_budget
from rljob.api.spec import OFFLINE_STAGES, AlgorithmSpec
from rljob.runtime.llm.data.images import ImageError, VisionCache, VisionInputs, sharded_image_problem
from rljob.runtime.llm.data.prompts import PromptEncoder
from rljob.runtime.llm.data.rows import PromptStream, Row, split_off
from rljob.runtime.llm.engines.base import Sampling, chunk_size
from rljob.runtime.llm.episodes.multiturn import episode_metrics, episode_runner
from rljob.runtime.llm.models.policy import (
    ModelSourceError,
    enable_gradient_checkpointing,
    freeze_vision_tower,
    is_vision_language,
    load_policy,
)
from rljob.runtime.llm.replicas.membership import RolloutMembership
from rljob.runtime.llm.replicas.pool import ChunkResult, RewardPool, RolloutPool
from rljob.runtime.llm.setup import add_job_lora, job_rows, load_job_policy, weights_dir
from rljob.runtime.llm.stage import train_stage
from rljob.runtime.llm.training.learner import LLMLearner, Sample
from rljob.runtime.llm.training.sft import Warmup
from rljob.runtime.llm.training.sharding import (
    CommandChannel,
    export_policy,
    follow,
    load_checkpoint,
    save_checkpoint,
    weight_source,
)
from rljob.runtime.optim.divergence import Diverged, diverged_exit
from rljob.runtime.records.checkpoint import (
    CheckpointError,
    CheckpointManager,
    capture_rng_state,
    final_export_dir,
    resolve_resume_across_ranks,
    restore_rng_state,
)
from rljob.runtime.records.metrics import (
    ROLLOUT_IDLE,
    ROLLOUT_RESTARTS,
    TRAINER_WAIT,
    RunMetrics,
    keep_records_until,
    phase_key,
)
from rljob.runtime.weights.ipc import IpcWeightPublisher
from rljob.runtime.weights.sync import FileWeightPublisher, WeightPublisher
from rljob.runtime.wire.context import FatalConfigError, RoleContext, start_trackers
from rljob.runtime.wire.deadlines import FIRST_S, FLOOR_S, LatencyDeadline, LateReplicas
from rljob.runtime.wire.health import wait_for_collocated_rollout
from rljob.runtime.wire.identity import EXIT_PREEMPTED
from rljob.runtime.wire.ranks import join_actor_group, nccl_config_error, rank_device
from rljob.runtime.wire.role_http import ProgressTracker
from rljob.runtime.wire.transport import process_tag

GROUP_TIMEOUT_MINUTES = 10
ENV_WAIT_S = 600.0
"""How long the warm-up waits for an env replica to answer (they start beside the actor)."""
CORRECTNESS_FUNCTIONS = ("exact_match", "math_verify", "multiple_choice", "code_exec")


@dataclass
class Group:
    """`groupSize` completions of one prompt, as generated, then scored."""

    row: int
    prompt_ids: list[int]
    completions: list[dict[str, Any]]
    version: int
    rewards: np.ndarray | None = None
    terms: dict[str, list[float]] | None = None
    vision: VisionInputs | None = None
    """The prompt's images as the policy read them (vision-language policies); the learner reads the same."""


class Controller:
    """Rank 0's side of the loop: prompts out, scored groups in."""

    def __init__(self, context: RoleContext, learner: LLMLearner, tokenizer: Any, rows: list[Row]) -> None:
        spec = context.job.spec
        identity = context.identity
        assert spec.task.llm is not None
        self.context, self.spec, self.task = context, spec, spec.task.llm
        self.learner, self.tokenizer, self.rows = learner, tokenizer, rows
        self.log = context.log
        self.tag = process_tag()
        self.staleness = spec.rollout.async_.max_staleness
        self.group_size = spec.algorithm.group_size or 1
        self.max_tokens = spec.rollout.max_tokens or self.task.max_response_length
        self.sampling = Sampling.from_spec(spec.rollout, self.group_size, self.max_tokens).to_wire()
        publisher: WeightPublisher | FileWeightPublisher | IpcWeightPublisher
        if spec.rollout.weight_sync.method == "filesystem":
            publisher = FileWeightPublisher(weights_dir(context), self.tag)
        elif spec.rollout.weight_sync.method == "ipc":
            publisher = IpcWeightPublisher(self.tag)
        else:
            publisher = WeightPublisher(
                identity.master_addr,
                identity.sync_port,
                self.tag,
                spec.rollout.weight_sync.bucket_size_mb,
                ranks_per_replica=sync_ranks_per_replica(spec),
            )
        membership = RolloutMembership(identity.endpoints["rollout"], identity.rollout_members_file)
        self.late = LateReplicas(context.log)
        """Replicas past their request deadline: named in the log, `/progress` and a Stalled condition."""
        rollout_deadline = LatencyDeadline("rollout", spec.roles.request_timeout("rollout"), first_s=FLOOR_S["rollout"])
        self.rollouts = RolloutPool(membership, publisher, self.tag, self.late, rollout_deadline)
        sandbox_s = spec.reward.sandbox.timeout_seconds  # one sample may take this long to score
        reward_deadline = LatencyDeadline(
            "reward",
            spec.roles.request_timeout("reward"),
            floor_s=max(FLOOR_S["reward"], sandbox_s + 5),
            first_s=max(FIRST_S, sandbox_s + 30),
        )
        self.rewards = RewardPool(identity.endpoints["reward"], reward_deadline, self.late)
        self.stream = PromptStream(len(rows), spec.trainer.seed)
        self.skipped_too_long = 0
        self.bad_images: set[int] = set()
        """Rows skipped because an image cannot be read (each named once in the log)."""
        self.answer_key = self.task.dataset.answer_key
        self.prompts = PromptEncoder(self.task, tokenizer, Path.cwd(), keep_pixels=spec.rollout.engine == "vllm")
        self._vision = VisionCache()
        self._encoded: dict[int, array[int] | None] = {}
        """Each row's prompt ids once encoded, 4 bytes a token (a list of fresh Python ints takes ~36: tens of GB
        over an epoch of a dataset of a million long prompts)."""
        self.groups: list[Group] = []
        self.outstanding = 0
        self.generation_s = 0.0
        """Seconds the rollouts spent generating the chunks accepted since the last `take_generation_seconds`."""
        self.reward_errors: dict[str, int] = {}
        self.reward_unparsed: dict[str, int] = {}
        """Per generative judge: the last scored batch's samples whose judge output held no score."""
        self.text_env = self.task.env is not None
        self.weights: Any = learner.model
        """What weight syncs publish: the model, or its shards gathered on the fly (`sharding.weight_source`)."""
        self.collocated = spec.roles.rollout.collocated
        """The rollout shares the actor's GPUs: it sleeps while the actor trains and wakes before it generates."""

    def take_generation_seconds(self) -> float:
        seconds, self.generation_s = self.generation_s, 0.0
        return seconds

    def close(self) -> None:
        self.rollouts.close()
        self.rewards.close()

    def encode(self, row: int) -> list[int] | None:
        """Prompt token ids of a row, or None when longer than maxPromptLength or its image cannot be read
        (skipped, counted)."""
        if row not in self._encoded:
            try:
                ids, vision = self.prompts.encode(self.rows[row], row)
            except ImageError as exc:
                self.bad_images.add(row)
                self.log.warning("%s: the row is skipped (%d so far)", exc, len(self.bad_images))
                self._encoded[row] = None
                return None
            self._encoded[row] = array("i", ids) if len(ids) <= self.task.max_prompt_length else None
            if vision is not None:
                self._vision.put(row, vision)
        encoded = self._encoded[row]
        return None if encoded is None else encoded.tolist()

    def vision_of(self, row: int) -> VisionInputs | None:
        """The row's images as encoded (again, when they left the cache); None for a text policy or row."""
        if self.prompts.vision is None:
            return None
        cached = self._vision.get(row)
        if cached is None:
            _, cached = self.prompts.encode(self.rows[row], row)
            if cached is not None:
                self._vision.put(row, cached)
        return cached

    def submit(self, count: int, step: int) -> None:
        """Take `count` usable prompts from the stream and send them to the rollouts."""
        chosen: list[tuple[int, list[int]]] = []
        while len(chosen) < count:
            row = next(self.stream)
            ids = self.encode(row)
            if ids is None and row in self.bad_images:
                if len(self.bad_images) == len(self.rows):
                    raise FatalConfigError(
                        f"spec.task.llm.dataset.imageKey: no row's images can be read (the log names each row's "
                        f"problem); fix the {self.task.dataset.image_key!r} column"
                    )
                continue
            if ids is None:
                self.skipped_too_long += 1
                if self.skipped_too_long in (1, 10, 100) or self.skipped_too_long % 1000 == 0:
                    self.log.warning(
                        "%d prompt(s) longer than task.llm.maxPromptLength (%d tokens) skipped so far",
                        self.skipped_too_long,
                        self.task.max_prompt_length,
                    )
                if self.skipped_too_long > 10 * len(self.rows):
                    raise FatalConfigError(
                        f"spec.task.llm.maxPromptLength: every prompt is longer than "
                        f"{self.task.max_prompt_length} tokens; raise it"
                    )
                continue
            chosen.append((row, ids))
        self._send(chosen, min_version=max(step - self.staleness, 0))

    def _send(self, chosen: list[tuple[int, list[int]]], min_version: int) -> None:
        size = chunk_size(len(chosen), len(self.rollouts.links), self.staleness)
        for i in range(0, len(chosen), size):
            part = chosen[i : i + size]
            rows = [wire_row(self.rows[row]) for row, _ in part] if self.text_env else None
            vision = VisionInputs.concat([self.vision_of(row) for row, _ in part]) if self.prompts.vision else None
            self.rollouts.submit(
                [ids for _, ids in part], self.sampling, min_version, [row for row, _ in part], rows, vision
            )
        self.outstanding += len(chosen)

    def _accept(self, result: ChunkResult, step: int) -> None:
        self.generation_s += result.seconds  # measured by the rollout itself: its busy time
        rows: list[int] = result.chunk.meta
        for row, prompt_ids, completions in zip(rows, result.chunk.prompts, result.completions, strict=True):
            self.outstanding -= 1
            if step - result.version > self.staleness:  # too old for this step: ask again with fresh weights
                self._send([(row, prompt_ids)], min_version=max(step - self.staleness, 0))
                continue
            self.groups.append(Group(row, prompt_ids, completions, result.version, vision=self.vision_of(row)))

    def collect(self, count: int, step: int) -> tuple[list[Group], float]:
        """`count` groups usable at `step` (submitted earlier); seconds spent waiting for generation."""
        started = time.perf_counter()
        while len(self.groups) < count:
            self.context.heartbeat.beat()  # waiting for generations is alive; a poll that never returns is not
            if self.context.stop.is_set():
                raise InterruptedError("stopping")
            if self.outstanding + len(self.groups) < count:
                self.submit(count - self.outstanding - len(self.groups), step)
            for result in self.rollouts.poll():
                self._accept(result, step)
        taken, self.groups = self.groups[:count], self.groups[count:]
        return taken, time.perf_counter() - started

    def score(self, groups: list[Group]) -> None:
        samples = []
        for g in groups:
            prompt = self.tokenizer.decode(g.prompt_ids, skip_special_tokens=True)
            row = wire_row(self.rows[g.row])
            for c in g.completions:
                # A multi-turn episode is scored on its final model turn, not on the environment's replies.
                response = c.get("response_text")
                samples.append(
                    {
                        "prompt": prompt,
                        "response": self.tokenizer.decode(c["token_ids"], skip_special_tokens=True)
                        if response is None
                        else response,
                        "row": row,
                        "finish_reason": c["finish_reason"],
                        "response_tokens": len(c["token_ids"]),
                    }
                )
        rewards, terms, errors, unparsed = self.rewards.score(samples)
        if self.text_env:
            rewards = rewards + np.array([c["env_reward"] for g in groups for c in g.completions], dtype=np.float64)
        rewards = rewards + overlong_shaping(self.spec, [s["response_tokens"] for s in samples])
        start = 0
        for g in groups:  # evaluation groups hold evaluation.samplesPerPrompt completions, not groupSize
            part = slice(start, start + len(g.completions))
            start = part.stop
            g.rewards = rewards[part]
            g.terms = {name: values[part] for name, values in terms.items()}
        self.reward_errors = errors
        self.reward_unparsed = unparsed

    def sync(self, version: int) -> float:
        return self.rollouts.sync(version, self.weights)

    def make_room(self) -> float:
        """Before training: a collocated rollout frees the GPU memory it shares with the actor; seconds."""
        return self.rollouts.sleep() if self.collocated else 0.0

    def take_room_back(self) -> float:
        """After training, before weights and generation: the collocated rollout takes its memory back; seconds."""
        return self.rollouts.wake() if self.collocated else 0.0


def overlong_shaping(spec: Any, lengths: list[int]) -> np.ndarray:
    """`algorithm.overlong`'s penalty for responses of `lengths` tokens (zeros when off), ramping up to the job's
    longest response (`response_budget`): with a text environment the whole episode's maxResponseLength, not the
    maxTokens that caps each of its turns."""
    overlong = spec.algorithm.overlong
    if overlong is None or not overlong.enabled or overlong.buffer is None:
        return np.zeros(len(lengths))
    budget = response_budget(spec)
    assert budget is not None
    tokens = torch.tensor(lengths, dtype=torch.float64)
    return overlong_penalty(tokens, budget, overlong.buffer, overlong.penalty).numpy()


def sync_ranks_per_replica(spec: Any) -> int:
    """Group ranks one rollout replica takes in a broadcast: one per vLLM tensor-parallel worker."""
    if spec.rollout.engine != "vllm":
        return 1
    return spec.rollout.vllm.tensor_parallel_size or 1


def _wire_safe(value: Any) -> bool:
    """Values msgpack carries as they are; an image column (PIL images, bytes) stays with the actor."""
    if isinstance(value, list | tuple):
        return all(_wire_safe(item) for item in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _wire_safe(v) for k, v in value.items())
    return value is None or isinstance(value, str | int | float | bool)


def wire_row(row: Row) -> Row:
    """The row's values that travel over the transport (what reward functions and text environments see)."""
    return {k: v for k, v in row.items() if _wire_safe(v)}


def trained_tokens(completion: dict[str, Any]) -> int:
    """Response tokens the update trains on: the model's own, not a text environment's replies."""
    mask = completion.get("loss_mask")
    return len(completion["token_ids"]) if mask is None else int(sum(mask))


def build_samples(groups: list[Group], algorithm: AlgorithmSpec, group_size: int) -> list[Sample]:
    rewards = torch.tensor(np.stack([g.rewards for g in groups]), dtype=torch.float32)
    distill = algorithm.distill if algorithm.name == "distill" else None
    if distill is not None and (distill.reward_weight == 0 or group_size < 2):
        advantages = torch.zeros_like(rewards)  # the teacher's per-token signal is the whole advantage
    elif group_size > 1:
        token_counts = torch.tensor([[trained_tokens(c) for c in g.completions] for g in groups])
        advantages = group_advantages(
            algorithm.name, rewards, scale_by_std=algorithm.normalize_advantages, token_counts=token_counts
        )
    else:
        advantages = rewards - rewards.mean()
    if distill is not None:
        advantages = advantages * distill.reward_weight
    # One conversion to Python floats (the same values) instead of a tensor index per sample.
    advantage_rows, reward_rows = advantages.tolist(), rewards.tolist()
    samples = []
    for i, g in enumerate(groups):
        for j, c in enumerate(g.completions):
            samples.append(
                {
                    "prompt_ids": g.prompt_ids,
                    "response_ids": c["token_ids"],
                    "rollout_logprobs": c["logprobs"],
                    "advantage": advantage_rows[i][j],
                    "reward": reward_rows[i][j],
                    "version": g.version,
                }
            )
            if "loss_mask" in c:
                samples[-1]["loss_mask"] = c["loss_mask"]
            if g.vision is not None:
                samples[-1]["vision"] = g.vision
    return samples


def load_teacher(spec: Any, task: Any, rows: list[Row], device: torch.device, tokenizer: Any) -> torch.nn.Module:
    """The frozen teacher of `algorithm.distill`, checked to read the student's token ids as the student does."""
    source = spec.algorithm.distill.teacher
    field = "spec.algorithm.distill.teacher"
    update = {"source": source.source, "path": source.path, "hub_id": source.hub_id, "lora": None}
    try:
        teacher, teacher_tokenizer = load_policy(
            spec.model.model_copy(update=update), task, rows, spec.trainer.seed, device, spec.trainer.precision
        )
    except ModelSourceError as exc:
        raise FatalConfigError(str(exc).replace("spec.model.", f"{field}.")) from None
    mine, theirs = tokenizer.get_vocab(), teacher_tokenizer.get_vocab()
    if mine != theirs:
        differing = sorted(set(mine.items()) ^ set(theirs.items()), key=lambda item: item[1])[:3]
        raise FatalConfigError(
            f"{field}: the teacher's tokenizer differs from the student's ({len(theirs)} tokens against "
            f"{len(mine)}; e.g. {differing}): distillation compares both models' log-probabilities of the same "
            "token ids, so the teacher must share the student's tokenizer (the same model family)"
        )
    return teacher.eval().requires_grad_(False)


def accuracy_term(spec: Any) -> str | None:
    """The reward term that says right or wrong: the first correctness builtin (its metric label)."""
    seen: dict[str, int] = {}
    for fn in spec.reward.functions:
        label = fn.name or fn.builtin or (fn.module or "").rpartition(":")[2]
        seen[label] = seen.get(label, 0) + 1
        if fn.builtin in CORRECTNESS_FUNCTIONS:
            return label if seen[label] == 1 else f"{label}_{seen[label]}"
    return None


def run_actor(context: RoleContext) -> int:
    spec = context.job.spec
    identity = context.identity
    assert spec.task.llm is not None
    rank, world = identity.rank, identity.world_size
    actor = spec.roles.actor
    device = rank_device(actor.gpus_per_replica, identity.local_rank)
    try:
        if world > 1:
            join_actor_group(identity, device, GROUP_TIMEOUT_MINUTES)
    except RuntimeError as exc:
        fatal = nccl_config_error(actor.replicas, actor.gpus_per_replica, exc)
        if fatal is None:
            raise
        raise fatal from None
    from rljob.runtime.wire.health import RoleHealth

    # The replica's health and metrics endpoint (its pod's readiness probe) is served by its local rank 0.
    health = RoleHealth(context, counters={}) if identity.local_rank == 0 else None
    try:
        if spec.algorithm.name in OFFLINE_STAGES:  # sft, dpo: the actor alone, on the dataset's rows
            return train_stage(context, health, rank, world, device)
        return _train(context, health, rank, world, device)
    except InterruptedError:
        context.log.info("stopped before the first step: nothing to checkpoint")
        return EXIT_PREEMPTED
    except Diverged as exc:
        return diverged_exit(context, exc)
    finally:
        if health is not None:
            health.close()
        if world > 1 and dist.is_initialized():
            dist.destroy_process_group()


@contextlib.contextmanager
def fits_beside_rollout(collocated: bool, engine: str, device: torch.device) -> Iterator[None]:
    """A collocated actor's model (or its reference) that runs out of GPU memory beside the rollout's engine is a
    setting to change (FatalConfigError, exit 78), not a failure a restart gets past."""
    try:
        yield
        return
    except torch.OutOfMemoryError:
        if not collocated:
            raise
    torch.cuda.empty_cache()  # the exception and what it held are gone here: what is free is what stays free
    raise FatalConfigError(collocated_oom(engine, device))


def collocated_oom(engine: str, device: torch.device) -> str:
    """What to change when a collocated actor's model did not fit on the GPU beside its rollout's engine."""
    free, total = torch.cuda.mem_get_info(device)
    held = f"{free / 2**30:.1f} of {total / 2**30:.1f} GiB of {device} was free"
    if engine == "vllm":
        return (
            "spec.rollout.vllm.gpuMemoryUtilization: the actor's model did not fit on the GPU beside the collocated "
            f"rollout's vLLM engine, which took its share first ({held}); lower it, leaving room for the actor's "
            "weights, gradients and optimizer states, or give the actor more GPUs (spec.roles.actor.gpusPerReplica)"
        )
    return (
        "spec.roles.actor.gpusPerReplica: the actor's model did not fit on the GPU beside the collocated rollout's "
        f"engine ({held}); give the actor more GPUs, or run the rollout on GPUs of its own "
        "(spec.roles.rollout.collocated: false)"
    )


def _train(context: RoleContext, health: Any, rank: int, world: int, device: torch.device) -> int:
    spec = context.job.spec
    identity = context.identity
    task = spec.task.llm
    assert task is not None
    all_rows = job_rows(context)
    torch.manual_seed(spec.trainer.seed)
    collocated = spec.roles.rollout.collocated and device.type == "cuda"
    if collocated:
        wait_for_collocated_rollout(context)
    with fits_beside_rollout(collocated, spec.rollout.engine, device):
        model, tokenizer = load_job_policy(context, device, all_rows)
    lora = spec.model.lora
    add_job_lora(context, model)
    if spec.model.gradient_checkpointing:
        enable_gradient_checkpointing(model)
    if spec.trainer.parallelism == "fsdp2" and is_vision_language(model.config):
        problem = sharded_image_problem(all_rows, task.dataset)
        if problem is not None:
            raise FatalConfigError(f"spec.trainer.parallelism: {problem}")
    if spec.model.freeze_vision_tower:
        frozen = freeze_vision_tower(model)
        context.log.info("model.freezeVisionTower: %d vision tower parameters kept as loaded", frozen)
    evaluation = spec.evaluation
    train_rows, eval_rows = all_rows, []
    if evaluation.interval and evaluation.size:
        train_rows, eval_rows = split_off(all_rows, evaluation.size, spec.trainer.seed)
    reference = None
    ref = spec.model.reference
    # LoRA never changes the base weights: the base (adapters off) is the initial policy, no second copy needed.
    reference_is_base = lora is not None and (ref is None or ref.source == "initial")
    if spec.algorithm.kl_coef > 0 and not reference_is_base:
        with fits_beside_rollout(collocated, spec.rollout.engine, device):
            if ref is None or ref.source == "initial":
                reference = copy.deepcopy(model)
            else:
                update = {"source": ref.source, "path": ref.path, "hub_id": ref.hub_id}
                ref_model = spec.model.model_copy(update=update)
                try:
                    precision = spec.trainer.precision
                    reference, _ = load_policy(ref_model, task, all_rows, spec.trainer.seed, device, precision)
                except ModelSourceError as exc:
                    raise FatalConfigError(str(exc).replace("spec.model.", "spec.model.reference.")) from None
        reference.eval().requires_grad_(False)
    teacher = None
    if spec.algorithm.distill is not None:
        with fits_beside_rollout(collocated, spec.rollout.engine, device):
            teacher = load_teacher(spec, task, all_rows, device, tokenizer)
    learner = LLMLearner(
        model,
        spec.algorithm,
        spec.trainer,
        pad_id=tokenizer.pad_token_id,
        temperature=spec.rollout.temperature,
        max_response_tokens=response_budget(spec) or task.max_response_length,  # Dr. GRPO: an episode's budget
        reference=reference,
        reference_is_base=reference_is_base,
        teacher=teacher,
        merge_on_export=lora is None or lora.merge_on_export,
        rank=rank,
        world_size=world,
        returns_memory=collocated,
    )
    default_dir = str(Path(identity.run_dir) / "checkpoints") if identity.run_dir else "/checkpoints"
    checkpoints = CheckpointManager(spec.checkpoint.dir or default_dir, keep=spec.checkpoint.keep)
    try:
        resumed = resolve_resume_across_ranks(spec.checkpoint.resume, checkpoints)
    except CheckpointError as exc:
        raise FatalConfigError(str(exc)) from None
    stream_state = None
    samples_seen = 0
    channel = CommandChannel(rank, world)
    sft_steps_done = 0
    if resumed is not None:
        step, state, path = resumed
        try:
            load_checkpoint(learner, state["learner"], path)
        except CheckpointError as exc:
            raise FatalConfigError(str(exc)) from None
        restore_rng_state(state["rng"])
        stream_state, samples_seen = state["stream"], int(state["samples"])
        sft_steps_done = int(state.get("sft_steps", 0))
        context.log.info("resumed from %s (step %d)", path, step)
    # The warm-up runs once, before RL step 0: a checkpoint (written after it) holds its result.
    started = time.time()
    sft_records: list[dict[str, Any]] = []
    if spec.sft.steps and resumed is None:
        # With a text environment the demonstrations are episodes: the env role replies between their turns.
        episodes = episode_runner(context, None, tokenizer)
        try:
            if episodes is not None:
                episodes.env.wait_ready(ENV_WAIT_S, context.stop, context.log)
            warmup = Warmup(spec, learner, tokenizer, train_rows, context.log, episodes)
            sft_records = warmup.run(context.heartbeat.beat)
        finally:
            if episodes is not None:
                episodes.close()
        sft_steps_done = spec.sft.steps
    elif spec.sft.steps:
        context.log.info("supervised warm-up: %d steps done before the checkpoint, not repeated", sft_steps_done)

    total = spec.trainer.steps
    if rank != 0:
        if health is not None:
            health.ready()
        try:
            # Rank 0's updates, weight gathers, checkpoints and exports, until it ends; this rank's stop request
            # is its vote at each step boundary.
            preempted = follow(learner, channel, context.stop, device, context.heartbeat.beat)
        except Diverged as exc:
            raise exc.with_checkpoint(checkpoints.checkpoints()) from None
        learner.leave_group()
        if preempted:
            context.log.info("stopped at step %d with rank 0, which checkpointed it", learner.step)
            return EXIT_PREEMPTED
        return 0

    controller = Controller(context, learner, tokenizer, train_rows)
    controller.weights = weight_source(learner, channel, adapters_only=lora is not None and lora.sync == "adapters")
    if stream_state is not None:
        controller.stream.load_state_dict(stream_state)
    accuracy_key = accuracy_term(spec)
    tracker = ProgressTracker(
        total_steps=total,
        step=learner.step,
        issue=lambda: "; ".join(x for x in (controller.late.issue(), controller.rollouts.issue) if x),
        late=controller.late.snapshot,
    )
    health.server.set_progress_provider(tracker.snapshot)
    run_metrics = None
    if identity.run_dir:
        # After a resume the steps past the checkpoint are redone: their old records go, wall time continues.
        # Without a checkpoint everything is redone, the warm-up's records (step 0) included.
        kept_until = learner.step if resumed is not None else -1
        previous_wall = keep_records_until(Path(identity.run_dir) / "metrics.jsonl", kept_until)
        run_metrics = RunMetrics(
            identity.run_dir,
            spec.logging.tensorboard,
            start_time=time.time() - previous_wall if resumed is not None else started,
        )
        for record in sft_records:
            run_metrics.log(0, record, tensorboard_step=record["sft_step"])
    trackers = start_trackers(context)
    health.ready()
    context.log.info(
        "training %d steps from step %d: %d prompts x %d samples per step, %d actor rank(s)%s, %d rollout(s)",
        total,
        learner.step,
        spec.trainer.batch_size,
        controller.group_size,
        world,
        " (fsdp2: the policy sharded over them)" if learner.sharded else "",
        len(controller.rollouts.links),
    )
    batch = spec.trainer.batch_size
    algo = spec.algorithm
    stopping = False
    stream_after_step = controller.stream.state_dict()
    """The prompt stream as the last finished step left it (what a checkpoint of that step holds)."""
    last_saved = learner.step if resumed is not None else -1

    def write_checkpoint() -> Path:
        """The last finished step's checkpoint: the learner, RNG, and the prompt stream as that step left it."""
        state = {
            "learner": learner.state_dict(),
            "rng": capture_rng_state(),
            "stream": stream_after_step,
            "samples": samples_seen,
            "sft_steps": sft_steps_done,
        }
        return save_checkpoint(checkpoints, learner, learner.step, state, channel)

    completed = False
    try:
        sync_s = controller.sync(learner.step)
        controller.submit(batch, learner.step)
        while learner.step < total:
            context.heartbeat.beat()
            step_started = time.perf_counter()
            controller.take_generation_seconds()  # only this step's chunks (not the last evaluation's)
            version = learner.step
            try:
                groups, generate_s = controller.collect(batch, version)
                reward_started = time.perf_counter()
                controller.score(groups)
                reward_s = time.perf_counter() - reward_started
                filled = 0
                if algo.dynamic_sampling:
                    groups, extra_generate_s, extra_reward_s, filled = _dynamic_sampling(controller, groups, version)
                    generate_s += extra_generate_s
                    reward_s += extra_reward_s
            except InterruptedError:  # asked to stop while generating: this step is abandoned, nothing trained
                context.log.info("asked to stop while generating step %d: that step is abandoned", version + 1)
                stopping = True
                break
            stream_after_step = controller.stream.state_dict()
            if controller.staleness > 0 and learner.step + 1 < total:
                controller.submit(batch, version + 1)  # generated while this step trains
            staleness = [version - g.version for g in groups]
            if max(staleness) > controller.staleness:
                raise RuntimeError(f"got data {max(staleness)} versions old (maxStaleness {controller.staleness})")
            samples = build_samples(groups, algo, controller.group_size)
            sync_s += controller.make_room()
            train_started = time.perf_counter()
            channel.send("update", samples)
            try:
                stats = learner.update(samples)
            except Diverged as exc:  # nothing from this update reaches a rollout or a checkpoint
                raise exc.with_checkpoint(checkpoints.checkpoints()) from None
            train_s = time.perf_counter() - train_started
            # Every rank's stop request, at this boundary: a stopping run finishes this step (records, checkpoints
            # it) but neither syncs, evaluates nor generates (its rollouts may be stopping too).
            stopping = learner.step < total and channel.vote_to_stop(context.stop.is_set(), device)
            if not stopping:
                sync_s += controller.take_room_back()
            evaluate = (
                bool(evaluation.interval)
                and not stopping
                and (learner.step % evaluation.interval == 0 or learner.step == total)
            )
            if not stopping and (learner.step < total or evaluate):  # evaluation uses the weights just trained
                sync_s += controller.sync(learner.step)
            if not stopping and learner.step < total and controller.staleness == 0:
                controller.submit(batch, learner.step)
            samples_seen += len(samples)
            record = _record(controller, groups, samples, stats, accuracy_key, staleness, filled)
            wall = max(time.perf_counter() - step_started, 1e-9)
            record.update(
                load_shares(generate_s, controller.take_generation_seconds(), len(controller.rollouts.links), wall)
            )
            record.update(
                {
                    "samples": samples_seen,
                    "epoch": controller.stream.epoch,
                    phase_key("generate"): generate_s,
                    phase_key("reward"): reward_s,
                    phase_key("train"): train_s,
                    phase_key("sync"): sync_s,
                    "tokens_per_s": record["response_tokens"] / wall,
                }
            )
            sync_s = 0.0
            if evaluate:
                record.update(_evaluate(controller, eval_rows, learner.step))
            line = run_metrics.log(learner.step, record) if run_metrics else {"step": learner.step, **record}
            trackers.log(learner.step, line)
            health.metrics.observe(line)
            tracker.update(
                learner.step,
                record["reward_mean"],
                record["accuracy"],
                trainer_wait=record[TRAINER_WAIT],
                rollout_idle=record[ROLLOUT_IDLE],
                entropy=record["entropy"],
                mismatch_kl=record["mismatch_kl"],
            )
            if learner.step % 10 == 0 or learner.step == total or learner.step == 1:
                context.log.info(
                    "step %d/%d reward %.3f accuracy %s",
                    learner.step,
                    total,
                    record["reward_mean"],
                    "-" if record.get("accuracy") is None else f"{record['accuracy']:.3f}",
                )
            interval = spec.checkpoint.interval
            if (interval and (learner.step % interval == 0 or learner.step == total)) or stopping:
                path = write_checkpoint()
                last_saved = learner.step
                if not stopping:  # the grace period is for the checkpoint; hf-latest waits for the next one
                    trackers.log_model(str(export_policy(learner, tokenizer, path.parent / "hf-latest", channel)))
            if stopping:
                break
        if stopping and last_saved != learner.step and learner.step > 0:
            # Stopped mid-step: the checkpoint is the last finished step's, with the stream as that step left it.
            write_checkpoint()
        completed = not stopping
    finally:
        controller.close()
        if run_metrics is not None:
            run_metrics.close()
        if not completed:  # a completed run's trackers close after the export below
            trackers.close()
    if stopping:
        channel.send("end", True)
        learner.leave_group()
        context.log.info(
            "stopped at step %d of %d (asked to stop): checkpoint in %s; the next actor group resumes at step %d",
            learner.step,
            total,
            checkpoints.directory,
            learner.step + 1,
        )
        return EXIT_PREEMPTED
    exported = export_policy(learner, tokenizer, final_export_dir(identity.run_dir, checkpoints.directory), channel)
    context.log.info("exported the trained policy to %s", exported)
    trackers.log_model(str(exported))
    trackers.close()
    channel.send("end")
    learner.leave_group()
    context.log.info("reached trainer.steps (%d)", total)
    return 0


def load_shares(wait_s: float, busy_s: float, rollouts: int, wall_s: float) -> dict[str, float]:
    """The rollout autoscaler's signal for one step of `wall_s` seconds: the trainer's wait for generations and
    the share of the rollouts' time (`busy_s` summed over them, as they measured it) without work, both 0..1."""
    wall_s = max(wall_s, 1e-9)
    idle = 1.0 - busy_s / (max(rollouts, 1) * wall_s)
    return {TRAINER_WAIT: min(max(wait_s / wall_s, 0.0), 1.0), ROLLOUT_IDLE: min(max(idle, 0.0), 1.0)}


def _dynamic_sampling(controller: Controller, groups: list[Group], step: int) -> tuple[list[Group], float, float, int]:
    """DAPO: keep groups whose rewards differ; generate more until the batch is full or rounds run out.

    A batch still short after `maxSamplingRounds` is completed with zero-variance groups (advantage 0: they
    add nothing to the gradient) so its shape stays what the minibatch split expects; the count is logged.
    """
    spec = controller.spec
    wanted = len(groups)
    keep = [g for g, ok in zip(groups, _informative(groups), strict=True) if ok]
    spare = [g for g, ok in zip(groups, _informative(groups), strict=True) if not ok]
    generate_s = reward_s = 0.0
    for _ in range(spec.algorithm.max_sampling_rounds - 1):
        if len(keep) >= wanted:
            break
        controller.submit(wanted - len(keep), step)
        more, seconds = controller.collect(wanted - len(keep), step)
        generate_s += seconds
        started = time.perf_counter()
        controller.score(more)
        reward_s += time.perf_counter() - started
        flags = _informative(more)
        keep += [g for g, ok in zip(more, flags, strict=True) if ok]
        spare += [g for g, ok in zip(more, flags, strict=True) if not ok]
    filled = max(0, wanted - len(keep))
    return (keep + spare[:filled])[:wanted], generate_s, reward_s, filled


def _informative(groups: list[Group]) -> list[bool]:
    rewards = torch.tensor(np.stack([g.rewards for g in groups]))
    return informative_groups(rewards).tolist()


def _record(
    controller: Controller,
    groups: list[Group],
    samples: list[Sample],
    stats: dict[str, float],
    accuracy_key: str | None,
    staleness: list[int],
    filled: int,
) -> dict[str, Any]:
    rewards = np.concatenate([g.rewards for g in groups])
    lengths = [len(s["response_ids"]) for s in samples]
    truncated = sum(c["finish_reason"] == "length" for g in groups for c in g.completions)
    record: dict[str, Any] = {
        "reward_mean": float(rewards.mean()),
        "reward_std": float(rewards.std()),
        "accuracy": None,
        "response_length_mean": float(np.mean(lengths)),
        "truncated_fraction": truncated / len(samples),
        "kl": stats["kl"],
        "entropy": stats["entropy"],
        "policy_loss": stats["policy_loss"],
        "clip_fraction": stats["clip_fraction"],
        "mismatch_kl": stats["mismatch_kl"],
        "mismatch_max_gap": stats["mismatch_max_gap"],
        "corrected_fraction": stats["corrected_fraction"],
        "grad_norm": stats["grad_norm"],
        "learning_rate": stats["learning_rate"],
        "response_tokens": stats["response_tokens"],
        "staleness_mean": float(np.mean(staleness)),
        "staleness_max": int(max(staleness)),
        "prompts_skipped_too_long": controller.skipped_too_long,
        "prompts_skipped_images": len(controller.bad_images),
        ROLLOUT_RESTARTS: controller.rollouts.restarts,
        "rollout_replicas": len(controller.rollouts.links),
    }
    if controller.spec.algorithm.dynamic_sampling:
        record["dynamic_sampling_filled"] = filled
    if controller.spec.algorithm.name == "distill":
        record["distill_kl"] = stats["distill_kl"]
    if controller.text_env:
        record.update(episode_metrics([c for g in groups for c in g.completions]))
    for name in groups[0].terms or {}:
        values = np.concatenate([np.asarray(g.terms[name], dtype=np.float64) for g in groups if g.terms])
        record[f"reward/{name}"] = float(values.mean())
        record[f"reward_errors/{name}"] = int(controller.reward_errors.get(name, 0))
        if name in controller.reward_unparsed:  # a judge: the share of its outputs that held no score
            record[f"reward_unparsed/{name}"] = controller.reward_unparsed[name] / max(len(values), 1)
    if accuracy_key is not None and f"reward/{accuracy_key}" in record:
        record["accuracy"] = record[f"reward/{accuracy_key}"]
    return record


def _evaluate(controller: Controller, rows: list[Row], step: int) -> dict[str, Any]:
    """Held-out prompts at the current weights: `eval_reward_mean`, `eval_accuracy` (greedy unless configured)."""
    evaluation = controller.spec.evaluation
    if not rows:
        return {}
    sampling = Sampling.from_spec(
        controller.spec.rollout, evaluation.samples_per_prompt, controller.max_tokens, greedy=evaluation.greedy
    ).to_wire()
    prompts: list[tuple[int, list[int]]] = []
    visions: dict[int, VisionInputs | None] = {}
    for i, row in enumerate(rows):
        try:
            ids, visions[i] = controller.prompts.encode(row, i)
        except ImageError as exc:
            controller.log.warning("evaluation: %s: the row is left out", str(exc).replace("row ", "held-out row ", 1))
            continue
        if len(ids) <= controller.task.max_prompt_length:
            prompts.append((i, ids))
    replicas = max(1, len(controller.rollouts.links))
    size = max(1, math.ceil(len(prompts) / replicas))
    for i in range(0, len(prompts), size):
        part = prompts[i : i + size]
        wired = [wire_row(rows[r]) for r, _ in part] if controller.text_env else None
        vision = VisionInputs.concat([visions[r] for r, _ in part]) if controller.prompts.vision else None
        controller.rollouts.submit(
            [ids for _, ids in part], sampling, step, ("eval", [r for r, _ in part]), wired, vision
        )
    results: list[ChunkResult] = []
    while sum(len(r.chunk.prompts) for r in results) < len(prompts):
        controller.context.heartbeat.beat()
        for result in controller.rollouts.poll():
            if isinstance(result.chunk.meta, tuple):
                results.append(result)
            else:  # the next step's prompts, generated meanwhile (async)
                controller._accept(result, step)
    groups = [
        Group(row, ids, completions, r.version)
        for r in results
        for row, ids, completions in zip(r.chunk.meta[1], r.chunk.prompts, r.completions, strict=True)
    ]
    saved_rows, controller.rows = controller.rows, rows
    try:
        controller.score(groups)
    finally:
        controller.rows = saved_rows
    rewards = np.concatenate([g.rewards for g in groups])
    out: dict[str, Any] = {"eval_reward_mean": float(rewards.mean()), "eval_prompts": len(groups)}
    if controller.text_env:
        episodes = episode_metrics([c for g in groups for c in g.completions])
        out.update({"eval_turns_mean": episodes["turns_mean"], "eval_tool_call_rate": episodes["tool_call_rate"]})
    key = accuracy_term(controller.spec)
    if key is not None:
        out["eval_accuracy"] = float(np.mean(np.concatenate([g.terms[key] for g in groups])))
    return out
