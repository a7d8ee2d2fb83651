"""One preflight: what `rljob run` (locally or `--ray`), `rljob validate` and the operator check before anything
starts, so that a job one of them refuses is refused by all of them with the same words.

Three depths, each a superset of the one before:

- the job itself (`job_problems`): the API's cross-field rules (`rljob.api.rules.check`, which every loaded
  manifest has already passed), the roles an llm job needs, and how each minibatch splits over the actor ranks.
  Pure: the operator runs it without torch, datasets or user code.
- what the job reads and loads (`loaded_problems`, `load=True`): the dataset's rows, the model source, the
  reward functions (their modules, the sandbox they need, the dataset columns they read), the warm-up's
  demonstrations, the text environment and one gym environment. The launchers always run it; `rljob validate
  --load` does on request. The operator never does: its pod has neither the data nor the user's code.
- where the roles start (`engine_problems`, `gpu_problems`): the vLLM engine installed (`rljob run`, locally
  and `--ray`), the GPUs the job asks for visible on this machine (a local run only).

The libraries of the experiment trackers a job lists (`logging.trackers`) are checked with `load` or `engine`:
`rljob validate --load` and `rljob run`, never the operator (its image has none of them; the actor's says so
at its start).

Every problem is an `rljob.api.Problem`: the field to change and how. Pod-level clashes (reserved ports,
volumes, env names) are the pod builders' (`rljob.operator.manifests.checks`), which `rljob validate` and the
operator add on top of this.

May import everything below it in the runtime; the heavy parts (torch, datasets, user code) only inside the
checks that need them.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from rljob.api import ROLE_NAMES, Problem, RLJob
from rljob.api.rules import check
from rljob.api.spec import OFFLINE_STAGES
from rljob.runtime.records.trackers import tracker_problems
from rljob.runtime.wire.identity import actor_ranks_per_replica

Warn = Callable[[str], None]


class PreflightFailed(Exception):
    """The job cannot start; carries every problem found, each naming its field and the fix."""

    def __init__(self, problems: Sequence[Problem]) -> None:
        self.problems = list(problems)
        super().__init__("\n".join(problem.render() for problem in self.problems))


def _stderr(line: str) -> None:
    print(line, file=sys.stderr)


def preflight(
    job: RLJob,
    *,
    load: bool = False,
    engine: bool = False,
    local_gpus: bool = False,
    ranks_per_replica: int | None = None,
    base_dir: Path | None = None,
    visible_gpus: Sequence[str] | None = None,
    cuda_visible_devices: str | None = None,
    warn: Warn = _stderr,
) -> list[Problem]:
    """Every problem found at the depths asked for (`load`: what the job reads and loads; `engine`: its generation
    engine installed here; `local_gpus`: its GPUs on this machine); deeper checks run only once the shallower ones
    pass (a dataset is not read for a job whose spec is already wrong).

    `ranks_per_replica`: actor ranks in each actor replica (default: one per GPU it asks for). `base_dir`:
    where relative paths in the spec start (default: the working directory). `visible_gpus` and
    `cuda_visible_devices`: what torch sees here (default: asked of torch when the job wants GPUs).
    """
    problems = job_problems(job, ranks_per_replica)
    if engine and not problems:
        problems += engine_problems(job)
    if (load or engine) and not problems:
        problems += tracker_problems(job.spec)
    if load and not problems:
        problems += loaded_problems(job, Path.cwd() if base_dir is None else base_dir, warn)
    if local_gpus and not problems:
        problems += gpu_problems(job, visible_gpus, cuda_visible_devices)
    return problems


def ensure_startable(job: RLJob, **options: object) -> None:
    """`preflight`, raising PreflightFailed with every problem when there is any."""
    problems = preflight(job, **options)  # type: ignore[arg-type]
    if problems:
        raise PreflightFailed(problems)


# --- the job itself ---------------------------------------------------------------------------------------


def job_problems(job: RLJob, ranks_per_replica: int | None = None) -> list[Problem]:
    problems = check(job)
    if problems:
        return problems
    if job.spec.task.type == "llm" and job.spec.algorithm.name not in OFFLINE_STAGES:  # a stage: the actor alone
        problems += llm_role_problems(job)
    ranks = actor_ranks_per_replica(job) if ranks_per_replica is None else ranks_per_replica
    problems += actor_rank_problems(job, ranks)
    return problems


def llm_role_problems(job: RLJob) -> list[Problem]:
    return [
        Problem(f"spec.roles.{role}.replicas", f"llm jobs need at least one {role} replica")
        for role in ("rollout", "reward")
        if not job.spec.roles.get(role).replicas
    ]


def actor_rank_problems(job: RLJob, ranks_per_replica: int) -> list[Problem]:
    """With several ranks per actor replica, every minibatch must split evenly over all ranks."""
    spec = job.spec
    world = spec.roles.actor.replicas * ranks_per_replica
    minibatch = spec.trainer.batch_size // spec.algorithm.minibatches
    if ranks_per_replica <= 1 or minibatch % world == 0:
        return []
    return [
        Problem(
            "spec.roles.actor.gpusPerReplica",
            f"spec.roles.actor.replicas ({spec.roles.actor.replicas}) x {ranks_per_replica} ranks per replica = "
            f"{world} actor ranks, and each minibatch (spec.trainer.batchSize {spec.trainer.batch_size} / "
            f"spec.algorithm.minibatches {spec.algorithm.minibatches} = {minibatch} transitions) must split evenly "
            "over them",
        )
    ]


# --- what the job reads and loads -------------------------------------------------------------------------


def loaded_problems(job: RLJob, base_dir: Path, warn: Warn = _stderr) -> list[Problem]:
    if job.spec.task.type == "llm":
        return llm_loaded_problems(job, base_dir)
    return gym_loaded_problems(job, warn)


def llm_loaded_problems(job: RLJob, base_dir: Path) -> list[Problem]:
    """Read the dataset, find the model, load the reward functions, fill the warm-up's demonstrations and build
    the text environment (if any)."""
    from rljob.api.rules import vision_job
    from rljob.api.spec import OFFLINE_STAGES
    from rljob.runtime.llm.data.images import ImageError, check_images, images_base_dir, sharded_image_problem
    from rljob.runtime.llm.data.offline_rows import check_offline_rows
    from rljob.runtime.llm.data.rows import DatasetError, load_rows
    from rljob.runtime.llm.episodes.rewards import check_reward_columns, check_reward_spec
    from rljob.runtime.llm.episodes.textenv import check_text_env
    from rljob.runtime.llm.models.policy import ModelSourceError, check_model_source
    from rljob.runtime.llm.training.sft import check_sft_rows

    spec = job.spec
    assert spec.task.llm is not None
    stage = spec.algorithm.name if spec.algorithm.name in OFFLINE_STAGES else None
    try:
        rows = load_rows(spec.task.llm, seed=spec.trainer.seed, base_dir=base_dir, columns=stage is None)
        check_images(rows, spec.task.llm.dataset, images_base_dir(spec.task.llm.dataset, base_dir))
        check_model_source(spec.model, base_dir)
    except (DatasetError, ImageError, ModelSourceError) as exc:
        return [Problem("", str(exc))]
    if spec.model.lora is not None:
        from rljob.runtime.llm.models.lora import check_lora_targets

        missing = check_lora_targets(spec.model, spec.task.llm, rows, base_dir)
        if missing:
            return [Problem("spec.model.lora.targetModules", message.split(": ", 1)[1]) for message in missing]
    vision = checkpoint_problems(job, base_dir)
    if vision:
        return vision
    if spec.trainer.parallelism == "fsdp2" and (vision_job(spec) or checkpoint_is_vision_language(job, base_dir)):
        problem = sharded_image_problem(rows, spec.task.llm.dataset)
        if problem is not None:
            return [Problem("spec.trainer.parallelism", problem)]
    if stage is not None:  # the actor alone, on the rows: nothing is scored, no environment is played
        return [Problem(field, message) for field, message in check_offline_rows(stage, spec.task.llm, rows)]
    found = (
        check_reward_spec(spec.reward, base_dir)
        + check_reward_columns(spec.reward, rows, spec.task.llm.dataset.answer_key)
        + check_sft_rows(spec.sft, rows)
    )
    if spec.task.llm.env is not None:
        found += check_text_env(spec.task.llm.env, base_dir)
    return [Problem(field, message) for field, message in found]


def checkpoint_problems(job: RLJob, base_dir: Path) -> list[Problem]:
    """A local or hub checkpoint that turns out to be a vision-language model (its config has a vision tower) must
    meet the rules the builtin one meets from the spec alone (`rljob.api.rules.vision_problems`)."""
    from rljob.api.rules import vision_problems

    if not checkpoint_is_vision_language(job, base_dir):
        return []
    return [Problem(f"spec.{path}", message) for path, message in vision_problems(job.spec)]


def checkpoint_is_vision_language(job: RLJob, base_dir: Path) -> bool:
    """Whether the job's local or hub checkpoint is a vision-language model (False for a builtin model, and for a
    checkpoint that cannot be read: the roles say why, with the field, as `check_model_source` found)."""
    from rljob.runtime.llm.models.policy import is_vision_language, model_source

    spec = job.spec
    if spec.model.source == "builtin":
        return False
    try:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(
            model_source(spec.model, base_dir), trust_remote_code=spec.model.trust_remote_code
        )
    except (OSError, ValueError):
        return False
    return is_vision_language(config)


def gym_loaded_problems(job: RLJob, warn: Warn = _stderr) -> list[Problem]:
    """Create one environment of the task and check its spaces."""
    from rljob.runtime.gym.envs import GymConfigError, check_task

    assert job.spec.task.gym is not None
    try:
        model = job.spec.model
        observation_space, action_space = check_task(
            job.spec.task.gym, model.builtin if model.source == "builtin" else None, vla=model.vla is not None
        )
    except GymConfigError as exc:
        return [Problem("", str(exc))]
    except Exception as exc:  # not a configuration error (see make_env): the env role tries again, and is retried
        warn(
            f"warning: could not create {job.spec.task.gym.env_id!r} to check it before starting "
            f"({type(exc).__name__}: {exc}); the env role will try again"
        )
        return []
    return policy_space_problems(job, observation_space, action_space)


def policy_space_problems(job: RLJob, observation_space: object, action_space: object) -> list[Problem]:
    """Whether a VLA policy (`model.vla`) takes the env's spaces (images; Discrete or bounded Box actions), said
    before any role starts, in the words the roles would use."""
    vla = job.spec.model.vla
    if vla is None:
        return []
    from rljob.runtime.gym.models import UnsupportedSpaceError
    from rljob.runtime.vla.images import check_image_space
    from rljob.runtime.vla.tokens import ActionTokenizer

    try:
        ActionTokenizer.for_space(action_space, vla.action_bins)
        check_image_space(observation_space)
    except UnsupportedSpaceError as exc:
        return [Problem("", str(exc))]
    return []


# --- where the roles start -----------------------------------------------------------------------------------------


def engine_problems(job: RLJob) -> list[Problem]:
    """What the rollout role would exit 78 with for want of its engine, said before anything starts."""
    if job.spec.task.type != "llm" or job.spec.rollout.engine != "vllm":
        return []
    from rljob.api.rules import vision_job
    from rljob.runtime.llm.engines.vllm import NOT_INSTALLED, vision_problem, vllm_installed

    if not vllm_installed():
        return [Problem("", NOT_INSTALLED)]
    problem = vision_problem() if vision_job(job.spec) else None
    return [] if problem is None else [Problem("", problem)]


def most_replicas(job: RLJob, role: str) -> tuple[int, str]:
    """(the most replicas of `role` this run can have, the field that says so): an autoscaled rollout role can
    grow to its maxReplicas, and each of those replicas needs GPUs of its own from the start."""
    rs = job.spec.roles.get(role)
    autoscale = job.spec.roles.rollout.autoscale if role == "rollout" else None
    if autoscale is not None and autoscale.max_replicas > (rs.replicas or 0):
        return autoscale.max_replicas, "spec.roles.rollout.autoscale.maxReplicas"
    return rs.replicas or 0, f"spec.roles.{role}.replicas"


def gpus_asked(job: RLJob) -> list[tuple[str, int, int]]:
    """(role, gpusPerReplica, replicas) of every role that asks for GPUs, actors first."""
    asked = []
    for role in ROLE_NAMES:
        gpus, (replicas, _) = job.spec.roles.get(role).gpus_per_replica, most_replicas(job, role)
        if gpus > 0 and replicas > 0:
            asked.append((role, gpus, replicas))
    return asked


def gpu_problems(
    job: RLJob, visible: Sequence[str] | None = None, cuda_visible_devices: str | None = None
) -> list[Problem]:
    """The GPUs the job asks for on this machine must all exist: every rank needs a GPU of its own.

    `visible` is what torch sees (it honours CUDA_VISIBLE_DEVICES, whose value, if set, is
    `cuda_visible_devices`); asked of torch when not given and the job wants GPUs."""
    asked = gpus_asked(job)
    if not asked:
        return []
    if visible is None:
        visible, cuda_visible_devices = visible_gpus()
    total = sum(gpus * replicas for _, gpus, replicas in asked)
    device_count = len(visible)
    if total <= device_count:
        return []
    role = asked[0][0]
    terms = " + ".join(
        f"{most_replicas(job, r)[1]} ({replicas}) x spec.roles.{r}.gpusPerReplica ({gpus})"
        for r, gpus, replicas in asked
    )
    shown = (
        "CUDA_VISIBLE_DEVICES unset"
        if cuda_visible_devices is None
        else f"CUDA_VISIBLE_DEVICES={cuda_visible_devices!r}"
    )
    sees = f"torch sees {device_count} GPU{'s' if device_count != 1 else ''}" if device_count else "torch sees no GPU"
    return [
        Problem(
            f"spec.roles.{role}.gpusPerReplica",
            f"the job asks for {total} GPUs on this machine ({terms}) but {sees} ({shown}); every rank needs a GPU "
            f"of its own: lower the replicas or gpusPerReplica (--set spec.roles.{role}.gpusPerReplica=0 runs on "
            "the CPU)",
        )
    ]


def visible_gpus() -> tuple[list[str], str | None]:
    """(the GPUs torch sees, as CUDA_VISIBLE_DEVICES entries; the CUDA_VISIBLE_DEVICES value or None)."""
    import os

    import torch

    count = torch.cuda.device_count()
    raw = os.environ.get("CUDA_VISIBLE_DEVICES")
    if raw is None:
        return [str(i) for i in range(count)], None
    # torch counts the entries up to the first invalid one; those are the ones to hand out.
    return [e.strip() for e in raw.split(",") if e.strip()][:count], raw
