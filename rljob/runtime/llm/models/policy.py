"""The policy of an llm job: a Hugging Face causal LM and its tokenizer, built, loaded and exported.

- `builtin: tiny-qwen2`: a small random Qwen2 whose character-level tokenizer is learned from the job's own
  rows (prompts, answers, template and system prompt), so any small dataset works; with a text environment
  (`task.llm.env`) it also covers printable ASCII and the line break, the text an environment may write.
  Built from the seed, so the actor and every rollout build the identical model without shipping files.
- `builtin: tiny-qwen2-vl`: the same language model behind a small Qwen2-VL vision tower (a vision-language
  policy), its tokenizer with Qwen2-VL's vision tokens.
- `local`: a directory with `config.json` (and weights, tokenizer) as written by `save_pretrained`.
- `hub`: a model id resolved through the Hugging Face cache (works offline from a pre-filled cache).

A vision-language policy (its config has a `vision_config`: Qwen2-VL, Qwen2.5-VL, tiny-qwen2-vl) is loaded with
`AutoModelForImageTextToText`; its tokenizer carries the model's image processor as `image_processor`, which the
prompts are encoded with (`rljob.runtime.llm.data.images`) and which the export writes beside it.

`export_hf` writes the trained policy as a directory that `from_pretrained` and vLLM load.
"""

from __future__ import annotations

import copy
import os
import shutil
import string
from pathlib import Path
from typing import Any

import torch

from rljob.api.spec import LLMTask, ModelSpec

SPECIAL_TOKENS = {"pad": "<pad>", "bos": "<s>", "eos": "</s>", "unk": "<unk>"}
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)
_CHAT_TEXT = "system: user: assistant: \n"
CHAT_TEXT = _CHAT_TEXT
"""The builtin chat template's own text (its roles and line breaks): a tokenizer must cover it to render chats."""
VISION_TOKENS = ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>")
"""Qwen2-VL's vision tokens, added to the builtin tokenizer of tiny-qwen2-vl."""


class ModelSourceError(ValueError):
    """The model cannot be loaded as configured; the message names the field and the fix."""


def resolve_precision(precision: str, device: torch.device) -> str:
    """`trainer.precision` on `device`: `auto` is bf16 on CUDA and fp32 elsewhere; the others as they say."""
    if precision == "auto":
        return "bf16" if device.type == "cuda" else "fp32"
    return precision


def policy_dtype(model: ModelSpec, precision: str, device: torch.device) -> torch.dtype:
    """The dtype the policy is loaded in on `device` (the actor's is the one weight sync carries)."""
    if model.dtype != "auto":
        return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[model.dtype]
    precision = resolve_precision(precision, device)
    if device.type == "cuda" and precision == "bf16":
        return torch.bfloat16
    if device.type == "cuda" and precision == "fp16":
        return torch.float16
    return torch.float32  # CPU kernels are fp32-first; bf16 on CPU is slower here and less exact


QWEN2_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"""
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
"""Qwen2's pre-tokenizer split (transformers' Qwen2Tokenizer): the char tokenizer splits text exactly as it does."""


def build_char_tokenizer(texts: list[str]) -> Any:
    """A character-level fast tokenizer whose vocabulary is every character of `texts` (sorted: deterministic).

    It is Qwen2's byte-level BPE with single-byte tokens and no merges, because `AutoTokenizer` loads any
    directory whose config says `qwen2` as a `Qwen2Tokenizer`, rebuilt from the vocabulary and merges alone:
    a tokenizer of another kind (WordLevel, say) would come back tokenizing differently from the exported
    model's (and vLLM's) point of view. ASCII characters are one token each; a character outside ASCII is
    one token per UTF-8 byte. Characters that no text holds have no token (Qwen2's BPE has no unknown token).
    """
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    chars = sorted({c for text in texts for piece, _ in byte_level.pre_tokenize_str(text) for c in piece})
    specials = [SPECIAL_TOKENS[k] for k in ("pad", "bos", "eos", "unk")]
    vocab = {token: i for i, token in enumerate([*specials, *chars])}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], continuing_subword_prefix="", end_of_word_suffix=""))
    core.normalizer = normalizers.NFC()
    core.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE_REGEX), behavior="isolated", invert=False), byte_level]
    )
    core.decoder = decoders.ByteLevel()
    bos = SPECIAL_TOKENS["bos"]
    core.post_processor = processors.TemplateProcessing(single=f"{bos} $A", special_tokens=[(bos, vocab[bos])])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token=SPECIAL_TOKENS["pad"],
        bos_token=SPECIAL_TOKENS["bos"],
        eos_token=SPECIAL_TOKENS["eos"],
        unk_token=SPECIAL_TOKENS["unk"],
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.padding_side = "left"
    return tokenizer


def tokenizer_texts(task: LLMTask, rows: list[dict[str, Any]], extra: list[str] | None = None) -> list[str]:
    """Every text the model reads or writes: the rows, the template around them, the chat markup if used, and
    `extra` texts (a supervised warm-up's demonstrations)."""
    texts = [task.prompt_template.replace("{prompt}", ""), task.system_prompt or "", *(extra or [])]
    if task.system_prompt is not None:
        texts.append("\n")  # the line break after the system prompt
    if task.apply_chat_template:
        texts.append(_CHAT_TEXT)
    if task.env is not None:
        texts.append(string.printable)
    for row in rows:  # an offline stage's rows may lack both: their texts come as `extra`
        texts += [str(row[key]) for key in (task.dataset.prompt_key, task.dataset.answer_key) if key in row]
    return texts


def build_tiny_qwen2(spec_model: ModelSpec, tokenizer: Any, max_length: int, seed: int) -> torch.nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(**tiny_text_config(spec_model, tokenizer, max_length))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return Qwen2ForCausalLM(config)


def tiny_text_config(spec_model: ModelSpec, tokenizer: Any, max_length: int) -> dict[str, Any]:
    """The language model of tiny-qwen2 (and of tiny-qwen2-vl) from `model.builtin`, sized for the tokenizer."""
    b = spec_model.builtin
    return {
        "vocab_size": len(tokenizer),
        "hidden_size": b.hidden_size,
        "intermediate_size": 4 * b.hidden_size,
        "num_hidden_layers": b.num_layers,
        "num_attention_heads": b.num_heads,
        "num_key_value_heads": b.num_heads,
        "max_position_embeddings": max_length,
        "tie_word_embeddings": True,
        "pad_token_id": tokenizer.pad_token_id,
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
    }


def build_tiny_qwen2_vl(spec_model: ModelSpec, tokenizer: Any, max_length: int, seed: int) -> torch.nn.Module:
    """tiny-qwen2's language model behind a Qwen2-VL vision tower of `visionLayers` blocks of `visionHiddenSize`,
    reading `patchSize` pixel patches (2 x 2 of them merged into one image token)."""
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    b = spec_model.builtin
    head_dim = b.hidden_size // b.num_heads
    half = head_dim // 2  # M-RoPE splits each head's rotary half into temporal, height and width sections
    sections = [half - 2 * (half // 3), half // 3, half // 3]
    token = tokenizer.convert_tokens_to_ids
    config = Qwen2VLConfig(
        text_config={
            **tiny_text_config(spec_model, tokenizer, max_length),
            "rope_scaling": {"type": "mrope", "mrope_section": sections},
        },
        vision_config={
            "depth": b.vision_layers,
            "embed_dim": b.vision_hidden_size,
            "hidden_size": b.hidden_size,
            "num_heads": max(1, b.vision_hidden_size // 16),
            "mlp_ratio": 2,
            "patch_size": b.patch_size,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "in_channels": 3,
        },
        image_token_id=token("<|image_pad|>"),
        video_token_id=token("<|video_pad|>"),
        vision_start_token_id=token("<|vision_start|>"),
        vision_end_token_id=token("<|vision_end|>"),
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return Qwen2VLForConditionalGeneration(config)


def tiny_image_processor(spec_model: ModelSpec) -> Any:
    """tiny-qwen2-vl's image processor (the PIL one: no torchvision needed). Its own pixel bounds only round each
    image to whole merged patches: `task.llm.dataset.minPixels` / `maxPixels` have scaled it already."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    side = 2 * spec_model.builtin.patch_size
    return Qwen2VLImageProcessorPil(
        patch_size=spec_model.builtin.patch_size,
        temporal_patch_size=2,
        merge_size=2,
        min_pixels=side * side,
        max_pixels=16384 * side * side,
    )


def is_vision_language(config: Any) -> bool:
    """Whether a model config is a vision-language model's (it has a vision tower)."""
    return getattr(config, "vision_config", None) is not None


def vision_kwargs(model: torch.nn.Module, input_ids: torch.Tensor, vision: Any) -> dict[str, Any]:
    """What a vision-language model's forward (or `generate`) takes beside `input_ids` for `vision` (the prompts'
    `rljob.runtime.llm.data.images.VisionInputs`, or None): the patches, each
    image's patch grid and which tokens are image tokens (Qwen2-VL's M-RoPE positions need them). Empty without
    images. Shared by the hf engine and the learner, so both feed the model the same inputs."""
    if vision is None:
        return {}
    core = getattr(model, "module", model)  # under DDP, the wrapped model
    device = input_ids.device
    dtype = next(p for p in core.parameters() if p.is_floating_point()).dtype
    image_token = core.config.image_token_id
    return {
        "pixel_values": torch.from_numpy(vision.pixel_values).to(device=device, dtype=dtype),
        "image_grid_thw": torch.from_numpy(vision.image_grid_thw).to(device),
        "mm_token_type_ids": (input_ids == image_token).int(),
    }


def vision_token_ids(config: Any) -> list[int]:
    """A vision-language model's image and video markup tokens: never sampled (a response holding an image token
    would ask the model for image features nobody gave it)."""
    if not is_vision_language(config):
        return []
    names = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")
    return sorted({int(v) for v in (getattr(config, n, None) for n in names) if v is not None})


def image_processor_of(tokenizer: Any) -> Any | None:
    """The image processor a vision-language policy's tokenizer carries (None for a text policy)."""
    return getattr(tokenizer, "image_processor", None)


def freeze_vision_tower(model: torch.nn.Module) -> int:
    """`model.freezeVisionTower`: the vision tower's parameters stop requiring gradients (the projector that
    merges its patches into the language model's width still trains, as in EasyR1). Returns how many froze."""
    tower = getattr(getattr(model, "model", model), "visual", None)
    if tower is None:
        return 0
    frozen = 0
    for name, parameter in tower.named_parameters():
        if not name.startswith("merger."):
            parameter.requires_grad_(False)
            frozen += parameter.numel()
    return frozen


def _source(spec_model: ModelSpec, base_dir: Path | None) -> tuple[str, dict[str, Any]]:
    """What `from_pretrained` takes, and its keyword arguments; errors name the field."""
    if spec_model.source == "local":
        assert spec_model.path is not None
        path = Path(spec_model.path).expanduser()
        if not path.is_absolute() and base_dir is not None:
            path = base_dir / path
        if not (path / "config.json").is_file():
            why = "does not exist" if not path.exists() else "has no config.json"
            raise ModelSourceError(
                f"spec.model.path: {path} {why}; it must be a Hugging Face model directory (save_pretrained output)"
            )
        return str(path), {}
    if spec_model.source == "job":  # the launchers resolve it before any role starts
        raise ModelSourceError(f"spec.model.job: RLJob {spec_model.job!r} was not resolved to its exported model")
    assert spec_model.hub_id is not None
    return spec_model.hub_id, {}


def model_source(spec_model: ModelSpec, base_dir: Path | None = None) -> str:
    """What `from_pretrained` (or vLLM) loads for a local or hub model: the directory, or the hub id."""
    return _source(spec_model, base_dir)[0]


def check_model_source(spec_model: ModelSpec, base_dir: Path | None = None) -> None:
    """Fail before start on a model that cannot be found (a local dir without config, a hub id not cached)."""
    if spec_model.source == "builtin":
        return
    source, _ = _source(spec_model, base_dir)
    if spec_model.source == "hub":
        from huggingface_hub import try_to_load_from_cache

        offline = os.environ.get("HF_HUB_OFFLINE") == "1" or os.environ.get("TRANSFORMERS_OFFLINE") == "1"
        cached = try_to_load_from_cache(source, "config.json")
        if offline and not isinstance(cached, str):
            raise ModelSourceError(
                f"spec.model.hubId: {source!r} is not in the Hugging Face cache and the hub is offline "
                "(HF_HUB_OFFLINE=1); pre-fill the cache or use model.source local"
            )


def load_policy(
    spec_model: ModelSpec,
    task: LLMTask,
    rows: list[dict[str, Any]],
    seed: int,
    device: torch.device,
    precision: str = "fp32",
    base_dir: Path | None = None,
    extra_texts: list[str] | None = None,
) -> tuple[torch.nn.Module, Any]:
    """(model on `device`, tokenizer). Every process of a job that calls this gets the same starting policy;
    `extra_texts` are more texts the builtin tokenizer must cover (see `tokenizer_texts`)."""
    dtype = policy_dtype(spec_model, precision, device)
    if spec_model.source == "builtin":
        tokenizer = build_char_tokenizer(tokenizer_texts(task, rows, extra_texts))
        max_length = 8 + 2 * (task.max_prompt_length + task.max_response_length)
        if spec_model.builtin.architecture == "tiny-qwen2-vl":
            tokenizer.add_special_tokens({"additional_special_tokens": list(VISION_TOKENS)})
            tokenizer.image_processor = tiny_image_processor(spec_model)
            model = build_tiny_qwen2_vl(spec_model, tokenizer, max_length, seed)
        else:
            model = build_tiny_qwen2(spec_model, tokenizer, max_length, seed)
        return model.to(device=device, dtype=dtype), tokenizer
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText, AutoTokenizer

    source, kwargs = _source(spec_model, base_dir)
    field = "spec.model.path" if spec_model.source == "local" else "spec.model.hubId"
    remote = spec_model.trust_remote_code
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, trust_remote_code=remote, **kwargs)
        vision = is_vision_language(AutoConfig.from_pretrained(source, trust_remote_code=remote, **kwargs))
        auto = AutoModelForImageTextToText if vision else AutoModelForCausalLM
        model = auto.from_pretrained(source, dtype=dtype, trust_remote_code=remote, **kwargs)
        if vision:
            from transformers import AutoImageProcessor

            tokenizer.image_processor = AutoImageProcessor.from_pretrained(source, trust_remote_code=remote, **kwargs)
    except (OSError, ValueError) as exc:
        raise ModelSourceError(f"{field}: cannot load {source!r} ({exc})") from None
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    return model.to(device), tokenizer


def reward_model_from(language_model: torch.nn.Module, pad_token_id: int, seed: int) -> torch.nn.Module:
    """The `reward_model` stage's network: `language_model`'s own transformer (its weights, dtype and device) under a
    scalar head (`num_labels` 1, seeded) instead of its LM head, as transformers' `...ForSequenceClassification`. A
    sequence's score is the head's output at its last token that is not padding (its EOS), so the export loads back
    with `AutoModelForSequenceClassification` and scores as it trained."""
    from transformers import AutoModelForSequenceClassification

    config = copy.deepcopy(language_model.config)
    config.num_labels = 1
    config.pad_token_id = pad_token_id
    config.architectures = None  # save_pretrained writes the class it saves
    parameter = next(language_model.parameters())
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForSequenceClassification.from_config(config, dtype=parameter.dtype)
    prefix = language_model.base_model_prefix
    getattr(model, prefix).load_state_dict(getattr(language_model, prefix).state_dict())
    return model.to(parameter.device)


def enable_gradient_checkpointing(model: torch.nn.Module) -> None:
    """`model.gradientCheckpointing`: each decoder layer keeps only its input and recomputes the rest in backward.

    Non-reentrant checkpointing: torch's recommended kind, right whatever requires grad and nestable with the
    chunked log-probs' own checkpoints. The KV cache that checkpointing rules out is off in every training
    forward already (`use_cache=False` there), not in the config, which exports would carry to generation.
    """
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def export_hf(
    model: torch.nn.Module, tokenizer: Any, directory: str | Path, state_dict: dict[str, torch.Tensor] | None = None
) -> Path:
    """Write a loadable Hugging Face model directory atomically (temp dir, then rename over the old one).

    `state_dict` replaces the model's own (a sharded model's, gathered whole: see `sharding.export_policy`).
    """
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # one bar per checkpoint is noise in a role's log
    target = Path(directory)
    tmp = target.with_name(f".tmp-{target.name}")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True, state_dict=state_dict)
    tokenizer.save_pretrained(tmp)
    image_processor = image_processor_of(tokenizer)
    if image_processor is not None:  # a vision-language policy loads back with its processor
        image_processor.save_pretrained(tmp)
    old = target.with_name(f".old-{target.name}")
    shutil.rmtree(old, ignore_errors=True)
    if target.exists():
        target.rename(old)
    tmp.rename(target)
    shutil.rmtree(old, ignore_errors=True)
    return target
