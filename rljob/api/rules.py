"""Defaults that depend on the task, and the cross-field rules a schema alone cannot express.

The rules that Kubernetes CEL can express are also in the CRD (see `cel(...)` in `spec.py`) with
the same meaning; the tests evaluate both on the same manifests.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator

from rljob.api.job import MAX_NAME_LENGTH, RLJob
from rljob.api.kubernetes import Volume
from rljob.api.presets import PRESET_FIELDS, PRESETS, AlgorithmPreset, departures, preset_of, resolve_algorithm
from rljob.api.problems import Problem
from rljob.api.spec import GROUP_ALGORITHMS, OFFLINE_STAGES, ROLE_NAMES, BuiltinNetwork, JudgeSpec, RLJobSpec

DNS1123_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
DEFAULT_GROUP_SIZE = 8


class _BlankFields(dict[str, str]):
    """Any {field} renders as empty: enough to find a template's syntax errors."""

    def __missing__(self, key: str) -> str:
        return ""


def response_budget(spec: RLJobSpec) -> int | None:
    """Tokens a sample's response can hold, what the overlong penalty counts down to (None for gym tasks): with a
    text environment the whole episode's `task.llm.maxResponseLength` (`rollout.maxTokens` caps each turn of it),
    else one call's `rollout.maxTokens` (`maxResponseLength` when unset)."""
    llm = spec.task.llm
    if llm is None:
        return None
    if llm.env is not None:
        return llm.max_response_length
    return spec.rollout.max_tokens or llm.max_response_length


def resolve_defaults(job: RLJob, *, in_place: bool = False) -> RLJob:
    """Fill the defaults that depend on the task type, so the resolved job says everything. A copy, unless
    `in_place` (a job just validated, which nothing else holds: the operator validates one per spec change)."""
    if not in_place:
        job = job.model_copy(deep=True)
    spec = job.spec
    gym = spec.task.type == "gym"
    offline = spec.algorithm.name in OFFLINE_STAGES
    if spec.algorithm.group_size is None:  # ppo and the offline stages: one response per prompt
        spec.algorithm.group_size = 1 if spec.algorithm.name == "ppo" or offline else DEFAULT_GROUP_SIZE
    if offline and "replicas" not in spec.roles.rollout.model_fields_set:
        spec.roles.rollout.replicas = 0  # the actor alone trains on the rows; a rollout set by hand is refused below
    if spec.rollout.engine is None:
        spec.rollout.engine = "torch" if gym else "vllm"
    if spec.rollout.max_tokens is None and spec.task.llm is not None:
        spec.rollout.max_tokens = spec.task.llm.max_response_length
    if spec.model.source == "builtin" and spec.model.builtin.architecture is None:
        spec.model.builtin.architecture = ("tiny-qwen2-vl" if spec.model.vla else "mlp") if gym else "tiny-qwen2"
    if spec.roles.env.replicas is None:
        text_env = spec.task.llm is not None and spec.task.llm.env is not None
        spec.roles.env.replicas = 1 if (gym or text_env) and not offline else 0
    if spec.roles.reward.replicas is None:
        spec.roles.reward.replicas = 0 if gym or offline else 1
    # Before the task defaults: the task does not change presets, and the checks below read resolved values.
    # DAPO's buffer is a fifth of the longest response (which maxTokens may make shorter than maxResponseLength),
    # and below maxResponseLength (the CRD checks that).
    llm, budget = spec.task.llm, response_budget(spec)
    spec.algorithm = resolve_algorithm(
        spec.algorithm, None if llm is None or budget is None else min(budget, llm.max_response_length)
    )
    if spec.rollout.vllm.tensor_parallel_size is None:
        # One engine per rollout pod spans all of the pod's GPUs (a collocated one, the actor's).
        rollout = spec.roles.rollout
        gpus = spec.roles.actor.gpus_per_replica if rollout.collocated else rollout.gpus_per_replica
        spec.rollout.vllm.tensor_parallel_size = max(1, gpus)
    return job


def check(job: RLJob) -> list[Problem]:
    """Every cross-field problem of a (resolved) job, each with the field to change and how."""
    problems = list(_check_name(job.metadata.name))
    problems += [Problem(f"spec.{path}", message) for path, message in _check_spec(job.spec)]
    return problems


def advisories(job: RLJob) -> list[Problem]:
    """Valid settings that probably do not do what the user wants: printed as warnings, never refused."""
    spec = job.spec
    found: list[Problem] = []
    staleness = spec.rollout.async_.max_staleness
    if staleness > 0 and spec.algorithm.off_policy.type == "none":
        found.append(
            Problem(
                "spec.algorithm.offPolicy.type",
                f"none trains on batches up to {staleness} policy versions old (rollout.async.maxStaleness) "
                "without importance weighting: set tis or icepop to correct for the older policy, or "
                "maxStaleness 0 to stay on-policy",
            )
        )
    return found


def departure_note(job: RLJob) -> Problem | None:
    """The algorithm settings a job writes that depart from its paper's preset, for `rljob validate` to note.

    A departure is always something the manifest wrote (a preset fills only unset fields), so it is said where a
    user asks for a check, not on every run: it helps whoever copied settings from another framework unawares."""
    spec = job.spec
    if spec.task.type != "llm":  # a gym job runs ppo's own loss: its paper settings are the preset's
        return None
    algorithm = spec.algorithm
    changed = departures(algorithm)
    if not changed:
        return None
    settings = ", ".join(f"{key} {value} (paper: {paper})" for key, value, paper in changed)
    return Problem(
        "spec.algorithm",
        f"{settings} depart from {algorithm.name}'s paper defaults ({PRESETS[algorithm.name].reference}); "
        "fine when intended, else remove them to get the preset (docs/algorithms.md)",
    )


def _check_name(name: str) -> Iterator[Problem]:
    if not DNS1123_LABEL.match(name):
        yield Problem(
            "metadata.name",
            f"must be a DNS-1123 label: lowercase letters, digits and '-', starting and ending "
            f"with a letter or digit (got {name!r})",
        )
    if len(name) > MAX_NAME_LENGTH:
        yield Problem(
            "metadata.name",
            f"must be at most {MAX_NAME_LENGTH} characters so pod names '<job>-<role>-<i>' fit in 63 (got {len(name)})",
        )


def _check_spec(spec: RLJobSpec) -> Iterator[tuple[str, str]]:
    if spec.algorithm.name in OFFLINE_STAGES:
        yield from _check_offline_stage(spec)
    yield from _check_task(spec)
    yield from _check_gym_settings(spec)
    yield from _check_model(spec)
    yield from _check_algorithm(spec)
    yield from _check_batch(spec)
    yield from _check_reward(spec)
    yield from _check_roles(spec)
    yield from _check_sft(spec)
    yield from _check_collocation(spec)
    yield from _check_sft_shares(spec)
    yield from _check_trackers(spec)
    if spec.scheduling.gang == "kueue" and not spec.scheduling.queue:
        yield "scheduling.queue", "gang kueue needs scheduling.queue: the name of a Kueue LocalQueue"


def _check_trackers(spec: RLJobSpec) -> Iterator[tuple[str, str]]:
    seen: set[str] = set()
    for i, tracker in enumerate(spec.logging.trackers):
        at = f"logging.trackers[{i}]"
        if tracker.name in seen:
            yield f"{at}.name", f"tracker {tracker.name} is listed twice: keep one entry per tracker"
        seen.add(tracker.name)
        if tracker.name == "tensorboard" and tracker.dir is None:
            yield (
                f"{at}.dir",
                "tracker tensorboard needs dir: the directory its event files go to (a mounted volume in pods); "
                "logging.tensorboard already writes <run dir>/tb under `rljob run`",
            )
        if tracker.name == "tensorboard" and tracker.api_key_secret is not None:
            yield f"{at}.apiKeySecret", "tracker tensorboard takes no apiKeySecret: remove it"


def _check_task(spec: RLJobSpec) -> Iterator[tuple[str, str]]:
    task = spec.task
    if task.type == "gym":
        if task.gym is None:
            yield "task.gym", "task.type gym needs a task.gym section with at least envId"
        if task.llm is not None:
            yield "task.llm", "task.type is gym: remove task.llm (or set task.type to llm)"
        if spec.algorithm.name != "ppo":
            yield "algorithm.name", f"gym tasks are trained with ppo (got {spec.algorithm.name!r})"
        if spec.rollout.engine not in (None, "torch"):
            yield "rollout.engine", f"gym tasks use the torch engine (got {spec.rollout.engine!r})"
    else:
        if task.llm is None:
            yield "task.llm", "task.type llm needs a task.llm section with a dataset"
        if task.gym is not None:
            yield "task.gym", "task.type is llm: remove task.gym (or set task.type to gym)"
        if spec.rollout.engine == "torch":
            yield "rollout.engine", "llm tasks generate with vllm or hf (got 'torch')"
        if spec.evaluation.interval and not spec.evaluation.size:
            yield "evaluation.size", "evaluation.interval needs held-out rows: set evaluation.size (e.g. 64)"
    if task.llm is not None:
        yield from _check_text_env(spec)
        template = task.llm.prompt_template
        if "{prompt}" not in template:
            yield "task.llm.promptTemplate", f"must contain {{prompt}}, where the row's prompt goes (got {template!r})"
        else:
            try:
                template.format_map(_BlankFields())
            except (ValueError, IndexError) as exc:
                yield (
                    "task.llm.promptTemplate",
                    f"is not a Python format string ({exc}); write literal braces as {{{{ and }}}}",
                )
        dataset = task.llm.dataset
        chosen = [k for k in ("path", "name", "builtin") if getattr(dataset, k) is not None]
        if len(chosen) != 1:
            yield "task.llm.dataset", f"set exactly one of path, name or builtin (got {chosen or 'none'})"
        if dataset.min_pixels > dataset.max_pixels:
            yield (
                "task.llm.dataset.minPixels",
                f"must be at most maxPixels {dataset.max_pixels} (got {dataset.min_pixels})",
            )
        if vision_job(spec):
            yield from vision_problems(spec)
        max_len = spec.rollout.vllm.max_model_len
        total = task.llm.max_prompt_length + task.llm.max_response_length
        if max_len is not None and total > max_len:
            yield (
                "rollout.vllm.maxModelLen",
                f"must cover maxPromptLength + maxResponseLength = {total} (got {max_len})",
            )


def vision_job(spec: RLJobSpec) -> bool:
    """What the spec alone says of images: the builtin vision-language model or the builtin image dataset. A local
    or hub checkpoint is known to be one only once its config is read (`rljob.runtime.preflight`)."""
    builtin = spec.model.builtin.architecture if spec.model.source == "builtin" else None
    llm = spec.task.llm
    return builtin == "tiny-qwen2-vl" or (llm is not None and llm.dataset.builtin == "shapes")


def vision_problems(spec: RLJobSpec) -> Iterator[tuple[str, str]]:
    """What a vision-language job cannot combine with yet: each refused here, never run half-way."""
    if spec.model.source == "builtin" and spec.model.builtin.architecture != "tiny-qwen2-vl":
        yield (
            "model.builtin.architecture",
            "the shapes dataset's prompts are images: use tiny-qwen2-vl (or a vision-language checkpoint) "
            f"(got {spec.model.builtin.architecture!r})",
        )
    llm = spec.task.llm
    if llm is not None and llm.env is not None:
        yield "task.llm.env", "vision-language jobs are single-turn: multi-turn text environments take no images yet"
    if spec.sft.steps > 0:
        yield "sft.steps", "the supervised warm-up reads text only: set 0 for a vision-language job"


def _check_sft(spec: RLJobSpec) -> Iterator[tuple[str, str]]:
    sft = spec.sft
    if sft.steps == 0:
        return
    given = [sft.response_template is not None, sft.response_key is not None, sft.turns is not None]
    if sum(given) != 1:
        yield (
            "sft",
            "sft.steps > 0 needs exactly one of sft.responseTemplate (e.g. 'calc({expression})'), "
            "sft.responseKey (a dataset column) or sft.turns (e.g. ['calc({expression})', '{answer}'])",
        )
    templates = [("sft.responseTemplate", sft.response_template)] if sft.response_template is not None else []
    templates += [(f"sft.turns[{i}]", turn) for i, turn in enumerate(sft.turns or [])]
    for field, template in templates:
        try:
            template.format_map(_BlankFields())
        except (ValueError, IndexError) as exc:
            yield field, f"is not a Python format string ({exc}); write literal braces as {{{{ and }}}}"
    if sft.turns is not None and len(sft.turns) > 1 and spec.task.llm is not None:
        env = spec.task.llm.env
        if env is None:
            yield (
                "sft.turns",
                f"{len(sft.turns)} turns need a text environment (task.llm.env) to reply between them; configure "
                "one, or demonstrate a single turn",
            )
        elif len(sft.turns) > env.max_turns:
            yield (
                "sft.turns",
                f"{len(sft.turns)} turns, but an episode has at most task.llm.env.maxTurns ({env.max_turns}): a "
                "rollout never reaches the later ones; demonstrate fewer turns or raise maxTurns",
            )


def _check_offline_stage(spec: RLJobSpec) -> Iterator[tuple[str, str]]:
    """An offline stage (sft, dpo) is the actor training on the dataset's rows: what only RL uses is refused, named."""
    stage = spec.algorithm.name
    unused = f"an {stage} stage" if stage == "sft" else f"a {stage} stage"
    unused += " trains the actor on the dataset's rows alone"
    if spec.task.type != "llm":
        return  # the gym rules name algorithm.name already
    roles = spec.roles
    if roles.rollout.replicas:
        yield (
            "roles.rollout",
            f"{unused}: the rollout role is not used; remove spec.roles.rollout (got replicas "
            f"{roles.rollout.replicas})",
        )
    if roles.rollout.collocated or roles.rollout.autoscale is not None:
        yield "roles.rollout", f"{unused}: the rollout role is not used; remove collocated and autoscale"
    for role in ("env", "reward"):
        if roles.get(role).replicas:
            yield (
                f"roles.{role}.replicas",
                f"{unused}: the {role} role is not used; set 0 or remove it (got {roles.get(role).replicas})",
            )
    if spec.reward.functions:
        yield "reward.functions", f"{unused}: nothing is scored, the reward functions are not used; remove them"
    llm = spec.task.llm
    if llm is not None and llm.env is not None:
        yield "task.llm.env", f"{unused}: no episode is played, the text environment is not used; remove it"
    if spec.sft.steps:
        yield (
            "sft.steps",
            "the supervised warm-up runs before RL; this job is an offline stage: set 0 (supervised training on "
            "its own is algorithm.name sft)",
        )
    if spec.trainer.parallelism == "fsdp2":
        yield "trainer.parallelism", f"{stage} stages train replicated actor ranks for now: use ddp"
    if vision_job(spec):
        yield "task.llm.dataset", f"{stage} stages read text rows only for now: use a text model and dataset"
    if stage == "dpo" and spec.algorithm.dpo.loss_type == "ipo" and spec.algorithm.dpo.label_smoothing:
        yield (
            "algorithm.dpo.labelSmoothing",
            "ipo does not use label smoothing: set 0, or lossType robust (or sigmoid) for noisy labels",
        )


def _check_text_env(spec: RLJobSpec) -> Iterator[tuple[str, str]]:
    assert spec.task.llm is not None
    env = spec.task.llm.env
    replicas = spec.roles.env.replicas
    if env is None:
        if replicas:
            yield (
                "roles.env.replicas",
                f"llm jobs run env replicas only for a text environment (task.llm.env): set 0 or configure "
                f"task.llm.env (got {replicas})",
            )
        return
    if (env.builtin is None) == (env.module is None):
        yield "task.llm.env", "set exactly one of builtin (e.g. calculator) or module (file.py:ClassName)"
    if replicas == 0:
        yield "roles.env.replicas", "task.llm.env runs in env replicas: must be >= 1"


# Settings that only LLM training reads: a gym job that sets them would silently run without them.
_LLM_ONLY_SETTINGS: tuple[tuple[str, Callable[[RLJobSpec], object], object], ...] = (
    ("trainer.parallelism", lambda s: s.trainer.parallelism, "ddp"),
    ("evaluation.interval", lambda s: s.evaluation.interval, 0),
    ("trainer.precision", lambda s: s.trainer.precision, "fp32"),
    ("trainer.microBatchSize", lambda s: s.trainer.micro_batch_size, None),
    ("trainer.microBatchTokens", lambda s: s.trainer.micro_batch_tokens, None),
    ("trainer.logprobChunkTokens", lambda s: s.trainer.logprob_chunk_tokens, 512),
    ("trainer.sharedPrompts", lambda s: s.trainer.shared_prompts, True),
    ("algorithm.klCoef", lambda s: s.algorithm.kl_coef, 0.0),
    ("algorithm.lossAggregation", lambda s: s.algorithm.loss_aggregation, "token-mean"),
    ("rollout.temperature", lambda s: s.rollout.temperature, 1.0),
    ("rollout.topP", lambda s: s.rollout.top_p, 1.0),
    ("rollout.topK", lambda s: s.rollout.top_k, None),
    ("rollout.maxTokens", lambda s: s.rollout.max_tokens, None),
    ("rollout.weightSync.method", lambda s: s.rollout.weight_sync.method, "broadcast"),
    ("logging.metricsInterval", lambda s: s.logging.metrics_interval, 1),
    ("model.dtype", lambda s: s.model.dtype, "auto"),
    ("model.gradientCheckpointing", lambda s: s.model.gradient_checkpointing, False),
    ("model.reference", lambda s: s.model.reference, None),
    # Resolved to False for gym (never dapo), so an unset and a resolved job read alike.
    ("algorithm.dynamicSampling", lambda s: bool(s.algorithm.dynamic_sampling), False),
    ("algorithm.maxSamplingRounds", lambda s: s.algorithm.max_sampling_rounds, 4),
    ("algorithm.overlong", lambda s: s.algorithm.overlong, None),
    ("sft.steps", lambda s: s.sft.steps, 0),
)


def _filled_by_preset(path: str, value: object, preset: AlgorithmPreset) -> bool:
    """Whether a resolved `algorithm.*` value is its preset's: a gym job naming an llm algorithm is told about the
    name (see `_check_algorithm`), not about fields the user never wrote."""
    keys = {key: attribute for attribute, key in PRESET_FIELDS}
    section, _, key = path.partition(".")
    return section == "algorithm" and key in keys and getattr(preset, keys[key]) == value


def _check_gym_settings(spec: RLJobSpec) -> Iterator[tuple[str, str]]:
    if spec.task.type != "gym":
        return
    preset = preset_of(spec.algorithm.name)
    for path, read, default in _LLM_ONLY_SETTINGS:
        value = read(spec)
        if value != default and not _filled_by_preset(path, value, preset):
            shown = "unset" if default is None else repr(default)
            fix = f"remove it or set {shown}"
            yield path, f"is used by llm tasks only; a gym job would ignore it: {fix} (got {value!r})"
    if spec.roles.reward.replicas:
        yield (
            "roles.reward.replicas",
            f"gym environments give their own reward: set 0 (got {spec.roles.reward.replicas})",
        )


def _check_cnn_layers(builtin: BuiltinNetwork) -> Iterator[tuple[str, str]]:
    layers = len(builtin.channels)
    for field, values in (("kernelSizes", builtin.kernel_sizes), ("strides", builtin.strides)):
        if len(values) != layers:
            yield (
                f"model.builtin.{field}",
                f"needs one entry per convolution: {layers} like model.builtin.channels (got {len(values)})",
            )


def _check_model(spec: RLJobSpec) -> Iterator[tuple[str, str]]:
    model = spec.model
    if model.source == "local" and not model.path:
        yield "model.path", "model.source local needs model.path: a directory with a Hugging Face model"
    if model.source == "hub" and not model.hub_id:
        yield "model.hubId", "model.source hub needs model.hubId, e.g. Qwen/Qwen2.5-0.5B"
    if model.source == "job" and not model.job:
        yield "model.job", "model.source job needs model.job: the name of the RLJob whose exported model to start from"
    gym = spec.task.type == "gym"
    if gym and model.source != "builtin" and model.vla is None:
        yield (
            "model.source",
            "gym tasks train the builtin mlp policy: set model.source to builtin (or set model.vla to train a "
            "vision-language-action checkpoint)",
        )
    if model.vla is not None and not gym:
        yield "model.vla", "vision-language-action policies act in gym environments: remove model.vla for llm tasks"
    arch = model.builtin.architecture
    if model.source == "builtin" and arch is not None:
        if gym and model.vla is not None and arch != "tiny-qwen2-vl":
            yield "model.builtin.architecture", f"model.vla builds on tiny-qwen2-vl (got {arch!r})"
        if gym and model.vla is None and arch not in ("mlp", "cnn"):
            yield (
                "model.builtin.architecture",
                f"gym tasks use mlp or cnn (got {arch!r}), or tiny-qwen2-vl with model.vla",
            )
        if not gym and arch not in ("tiny-qwen2", "tiny-qwen2-vl"):
            yield "model.builtin.architecture", f"llm tasks use tiny-qwen2 or tiny-qwen2-vl (got {arch!r})"
        if arch == "cnn":
            yield from _check_cnn_layers(model.builtin)
        if arch in ("tiny-qwen2", "tiny-qwen2-vl") and model.builtin.hidden_size % model.builtin.num_heads:
            yield (
                "model.builtin.numHeads",
                f"must divide hiddenSize {model.builtin.hidden_size} (got {model.builtin.num_heads})",
            )
    ref = model.reference
    if ref is not None and ref.source == "local" and not ref.path:
        yield "model.reference.path", "reference source local needs model.reference.path"
    if ref is not None and ref.source == "hub" and not ref.hub_id:
        yield "model.reference.hubId", "reference source hub needs model.reference.hubId"
    if ref is not None and ref.source == "job" and not ref.job:
        yield "model.reference.job", "reference source job needs model.reference.job: the RLJob whose model to use"
    if model.lora is not None:
        if gym:
            yield "model.lora", "LoRA adapts language models: gym tasks train the whole mlp policy; remove model.lora"
        if not gym and model.lora.sync == "adapters":
            yield from _check_adapter_sync(spec)


def _check_adapter_sync(spec: RLJobSpec) -> Iterator[tuple[str, str]]:
    """`model.lora.sync: adapters`: only a vLLM rollout serves adapters on its base, and only an RL job has one."""
    field = "model.lora.sync"
    if spec.algorithm.name in OFFLINE_STAGES:
        yield field, f"the {spec.algorithm.name} stage has no rollout to sync: remove model.lora.sync"
    elif spec.rollout.engine != "vllm":
        yield (
            field,
            "adapters serve on the vllm engine (vLLM's enable_lora); the hf engine loads merged weights: set "
            "rollout.engine vllm, or model.lora.sync merged",
        )
    elif spec.roles.rollout.collocated:
        yield (
            field,
            "a collocated vLLM rollout sleeps between steps, which adapters are not tried with yet: set "
            "model.lora.sync merged, or roles.rollout.collocated false",
        )


def _check_algorithm(spec: RLJobSpec) -> Iterator[tuple[str, str]]:
    algo = spec.algorithm
    if algo.name == "distill" and algo.distill is None:
        yield (
            "algorithm.distill",
            "distill needs its teacher: set algorithm.distill.teacher, e.g. {source: local, path: /models/teacher}",
        )
    teacher = algo.distill.teacher if algo.distill is not None else None
    if teacher is not None and teacher.source == "local" and not teacher.path:
        yield "algorithm.distill.teacher.path", "teacher.source local needs teacher.path: the teacher's model directory"
    if teacher is not None and teacher.source == "hub" and not teacher.hub_id:
        yield "algorithm.distill.teacher.hubId", "teacher.source hub needs teacher.hubId, e.g. Qwen/Qwen2.5-7B-Instruct"
    if teacher is not None and teacher.source == "job" and not teacher.job:
        yield "algorithm.distill.teacher.job", "teacher.source job needs teacher.job: the RLJob that exported it"
    if algo.distill is not None and algo.name != "distill":
        yield "algorithm.distill", f"goes with algorithm.name distill, not {algo.name}: remove it or set name distill"
    if algo.distill is not None and algo.distill.reward_weight > 0 and (algo.group_size or 1) < 2:
        yield (
            "algorithm.distill.rewardWeight",
            "weighs the rewards' group advantage, which compares groupSize samples of a prompt: set "
            f"algorithm.groupSize >= 2 (got {algo.group_size}) or rewardWeight 0",
        )
    if algo.name in GROUP_ALGORITHMS and algo.group_size is not None and algo.group_size < 2:
        yield (
            "algorithm.groupSize",
            f"{algo.name} compares samples of one prompt: must be >= 2 (got {algo.group_size})",
        )
    if algo.dynamic_sampling and spec.task.type == "llm" and algo.name not in GROUP_ALGORITHMS:
        yield (
            "algorithm.dynamicSampling",
            f"drops prompt groups whose samples all got one reward, which needs a group algorithm "
            f"({', '.join(GROUP_ALGORITHMS)}): set false (got algorithm.name {algo.name!r})",
        )
    llm = spec.task.llm
    buffer = algo.overlong.buffer if algo.overlong is not None else None
    if buffer is not None and llm is not None and buffer >= llm.max_response_length:
        yield (
            "algorithm.overlong.buffer",
            f"must be below task.llm.maxResponseLength {llm.max_response_length}: the penalty ramps up over "
            f"the last buffer tokens of a response (got {algo.overlong.buffer})",
        )
    budget = response_budget(spec)
    shorter = budget is not None and llm is not None and budget < llm.max_response_length  # maxTokens cuts first
    if shorter and buffer is not None and buffer >= budget:
        yield (
            "algorithm.overlong.buffer",
            f"must be below rollout.maxTokens {budget}, the longest response a rollout generates: the penalty "
            f"ramps up over the last buffer tokens of it (got {buffer}); lower it or raise rollout.maxTokens",
        )
    if algo.off_policy.low >= algo.off_policy.high:
        yield (
            "algorithm.offPolicy.low",
            f"must be below offPolicy.high {algo.off_policy.high} (got {algo.off_policy.low})",
        )


def _check_batch(spec: RLJobSpec) -> Iterator[tuple[str, str]]:
    """A step's samples split into equal minibatches, and each minibatch into equal shares per actor rank."""
    batch = spec.trainer.batch_size
    if spec.task.gym is not None:
        envs = spec.task.gym.num_envs
        if batch % envs:
            yield (
                "trainer.batchSize",
                f"gym batches are numEnvs x steps per env: must be a multiple of numEnvs {envs} (got {batch})",
            )
        samples, counted = batch, f"trainer.batchSize {batch}"
    else:
        group = spec.algorithm.group_size or 1
        samples, counted = batch * group, f"trainer.batchSize {batch} x algorithm.groupSize {group}"
    budget, llm = spec.trainer.micro_batch_tokens, spec.task.llm
    if budget is not None and llm is not None and budget < llm.max_prompt_length + llm.max_response_length:
        longest = llm.max_prompt_length + llm.max_response_length
        yield (
            "trainer.microBatchTokens",
            f"must hold one whole sequence: at least task.llm.maxPromptLength + maxResponseLength = {longest} "
            f"(got {budget})",
        )
    minibatches = spec.algorithm.minibatches
    if samples % minibatches:
        yield (
            "algorithm.minibatches",
            f"must divide the {samples} samples of a step ({counted}) into equal minibatches: "
            f"use a divisor of {samples} (got {minibatches})",
        )
        return
    size = samples // minibatches
    ranks = spec.roles.actor.replicas
    if size % ranks:
        yield (
            "roles.actor.replicas",
            f"every actor rank trains an equal share of each minibatch of {size} samples "
            f"({samples} / algorithm.minibatches {minibatches}): use a divisor of {size} (got {ranks})",
        )


def _check_sft_shares(spec: RLJobSpec) -> Iterator[tuple[str, str]]:
    """fsdp2 ranks run equal warm-up passes: the batch splits over the actor replicas (each has at least one rank;
    the actor checks its GPUs' ranks too when it starts)."""
    ranks = spec.roles.actor.replicas
    if spec.sft.steps and spec.trainer.parallelism == "fsdp2" and spec.sft.batch_size % ranks:
        yield (
            "sft.batchSize",
            f"fsdp2 actor ranks share the warm-up batch equally: use a multiple of roles.actor.replicas {ranks} "
            f"(got {spec.sft.batch_size})",
        )


def _check_reward(spec: RLJobSpec) -> Iterator[tuple[str, str]]:
    functions = spec.reward.functions
    for i, fn in enumerate(functions):
        if [fn.builtin, fn.module, fn.model, fn.judge].count(None) != 3:
            yield f"reward.functions[{i}]", "set exactly one of builtin, module, model or judge"
        if fn.model is not None and (fn.model.path is None) == (fn.model.job is None):
            yield (
                f"reward.functions[{i}].model",
                "set exactly one of path (the model's directory) or job (the reward_model RLJob that exported it)",
            )
        if fn.judge is not None:
            yield from _check_judge(fn.judge, f"reward.functions[{i}].judge")
    if spec.task.type == "llm" and not functions and spec.algorithm.name not in OFFLINE_STAGES:
        yield "reward.functions", "llm tasks need at least one reward function, e.g. {builtin: exact_match}"
    if spec.task.type == "gym" and functions:
        yield "reward.functions", "gym environments give their own reward: remove spec.reward.functions"


def _check_judge(judge: JudgeSpec, at: str) -> Iterator[tuple[str, str]]:
    if [judge.path, judge.hub_id, judge.job].count(None) != 2:
        yield at, "judge: set exactly one of path, hubId or job (the RLJob that exported the judge)"
    if "{response}" not in judge.rubric:
        yield (
            f"{at}.rubric",
            "must hold {response}, where the policy's response goes (also {question} or {prompt}, and {answer} for "
            "the row's answer), e.g. 'Question: {question}\\nAnswer: {response}\\nGrade it 0-10 and end with Score: N'",
        )
    try:
        groups = re.compile(judge.score_pattern).groups
    except re.error as exc:
        yield f"{at}.scorePattern", f"'{judge.score_pattern}' is not a valid regex: {exc}"
    else:
        if groups < 1:
            yield (
                f"{at}.scorePattern",
                f"'{judge.score_pattern}' has no group: put the score in parentheses, e.g. 'Score:\\s*(\\d+)'",
            )
    if judge.min_score >= judge.max_score:
        yield (
            f"{at}.minScore",
            f"judge.minScore must be below judge.maxScore (got {judge.min_score:g} and {judge.max_score:g})",
        )


def _volume_sources(volume: Volume) -> list[str]:
    return [
        field.alias or name
        for name, field in Volume.model_fields.items()
        if name != "name" and getattr(volume, name) is not None
    ]


def _check_roles(spec: RLJobSpec) -> Iterator[tuple[str, str]]:
    for role in ROLE_NAMES:
        rs = spec.roles.get(role)
        base = f"roles.{role}"
        if rs.placement.gpu_product and rs.gpus_per_replica == 0:
            yield f"{base}.placement.gpuProduct", "needs gpusPerReplica > 0: only GPU pods are placed by product"
        if "nvidia.com/gpu" in rs.resources.limits or "nvidia.com/gpu" in rs.resources.requests:
            yield f"{base}.resources", "set GPUs with gpusPerReplica, not resources 'nvidia.com/gpu'"
        declared = {v.name for v in rs.volumes}
        for i, volume in enumerate(rs.volumes):
            sources = _volume_sources(volume)
            if len(sources) != 1:
                yield f"{base}.volumes[{i}]", f"needs exactly one volume source (got {sources or 'none'})"
        for i, mount in enumerate(rs.volume_mounts):
            if mount.name not in declared:
                yield (
                    f"{base}.volumeMounts[{i}].name",
                    f"no volume named {mount.name!r} in {base}.volumes (declared: {sorted(declared)})",
                )
    if spec.task.gym is not None:
        env_replicas = spec.roles.env.replicas
        if env_replicas == 0:
            yield "roles.env.replicas", "gym tasks step their environments in env replicas: must be >= 1"
        elif env_replicas is not None and env_replicas > spec.task.gym.num_envs:
            yield (
                "roles.env.replicas",
                f"each env replica serves at least one environment: must be <= numEnvs "
                f"{spec.task.gym.num_envs} (got {env_replicas})",
            )
        if spec.roles.rollout.autoscale is not None:
            yield (
                "roles.rollout.autoscale",
                "gym jobs cannot autoscale rollouts (their count is part of the env layout): remove autoscale "
                "(it is for llm jobs)",
            )
        rollouts = spec.roles.rollout.replicas
        if rollouts == 0:
            yield "roles.rollout.replicas", "gym tasks collect every batch through rollout replicas: must be >= 1"
        elif env_replicas is not None and rollouts > env_replicas >= 1:
            yield (
                "roles.rollout.replicas",
                f"each rollout replica drives its own env replicas: must be <= roles.env.replicas "
                f"{env_replicas} (got {rollouts})",
            )
    rollout = spec.roles.rollout
    scale = rollout.autoscale
    if scale is not None and scale.min_replicas > scale.max_replicas:
        yield (
            "roles.rollout.autoscale.minReplicas",
            f"must be <= maxReplicas {scale.max_replicas} (got {scale.min_replicas})",
        )
    tp = spec.rollout.vllm.tensor_parallel_size
    if spec.rollout.engine == "vllm" and rollout.gpus_per_replica and tp is not None and tp > rollout.gpus_per_replica:
        yield (
            "rollout.vllm.tensorParallelSize",
            f"must be <= roles.rollout.gpusPerReplica {rollout.gpus_per_replica} (got {tp})",
        )


def _check_collocation(spec: RLJobSpec) -> Iterator[tuple[str, str]]:
    """`roles.rollout.collocated`: one actor and one rollout replica on the same GPUs, weights by `ipc`."""
    rollout, method = spec.roles.rollout, spec.rollout.weight_sync.method
    if not rollout.collocated:
        if method == "ipc":
            yield (
                "rollout.weightSync.method",
                "ipc opens the actor's memory from the rollout beside it: set roles.rollout.collocated: true, "
                "or use broadcast or filesystem",
            )
        return
    if spec.task.type != "llm":
        yield "roles.rollout.collocated", "is for llm jobs: a gym job's rollouts run on the CPU; set false"
        return
    if method != "ipc":
        yield (
            "rollout.weightSync.method",
            f"a collocated rollout takes its weights from the actor beside it: set ipc (got {method!r})",
        )
    if spec.roles.actor.replicas != 1:
        yield (
            "roles.actor.replicas",
            f"a collocated job runs one actor replica, the rollout beside it: set 1 (got {spec.roles.actor.replicas}); "
            "use more GPUs per replica (gpusPerReplica), or collocated: false for several replicas",
        )
    if rollout.replicas != 1:
        yield (
            "roles.rollout.replicas",
            f"a collocated job runs one rollout replica, beside the actor: set 1 (got {rollout.replicas})",
        )
    if rollout.autoscale is not None:
        yield "roles.rollout.autoscale", "a collocated rollout shares the actor's GPUs and cannot scale: remove it"
    if rollout.gpus_per_replica:
        yield (
            "roles.rollout.gpusPerReplica",
            "a collocated rollout uses the actor's GPUs (roles.actor.gpusPerReplica): set 0 "
            f"(got {rollout.gpus_per_replica})",
        )
    staleness = spec.rollout.async_.max_staleness
    if staleness:
        yield (
            "rollout.async.maxStaleness",
            f"a collocated actor and rollout take turns on the GPUs, so generation cannot overlap training: set 0 "
            f"(got {staleness})",
        )
    tp, gpus = spec.rollout.vllm.tensor_parallel_size, spec.roles.actor.gpus_per_replica
    if spec.rollout.engine == "vllm" and gpus and tp is not None and tp > gpus:
        yield (
            "rollout.vllm.tensorParallelSize",
            f"a collocated engine shards over the actor's GPUs: must be <= roles.actor.gpusPerReplica {gpus} "
            f"(got {tp})",
        )
    if spec.sft.steps:
        yield (
            "sft.steps",
            "the supervised warm-up trains before a collocated rollout first sleeps, beside its whole engine: "
            "run the warm-up as a job without collocation and start this one from its exported model "
            "(model.source: path), or set 0",
        )
