"""The policy of an llm job: a Hugging Face causal LM and its tokenizer, built, loaded and exported.

- `builtin: tiny-qwen2`: a small random Qwen2 whose character-level tokenizer is learned from the job's own
  rows (prompts, answers, template and system prompt), so any small dataset works; with a text environment
  (`task.llm.env`) it also covers printable ASCII and the line break, the text an environment may write.
  Built from the seed, so the actor and every rollout build the identical model without shipping files.
- `local`: a directory with `config.json` (and weights, tokenizer) as written by `save_pretrained`.
- `hub`: a model id resolved through the Hugging Face cache (works offline from a pre-filled cache).

`export_hf` writes the trained policy as a directory that `AutoModelForCausalLM.from_pretrained` and vLLM load.
"""

from __future__ import annotations

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
    for row in rows:
        texts.append(str(row[task.dataset.prompt_key]))
        texts.append(str(row[task.dataset.answer_key]))
    return texts


def build_tiny_qwen2(spec_model: ModelSpec, tokenizer: Any, max_length: int, seed: int) -> torch.nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    b = spec_model.builtin
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=b.hidden_size,
        intermediate_size=4 * b.hidden_size,
        num_hidden_layers=b.num_layers,
        num_attention_heads=b.num_heads,
        num_key_value_heads=b.num_heads,
        max_position_embeddings=max_length,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return Qwen2ForCausalLM(config)


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
        model = build_tiny_qwen2(spec_model, tokenizer, max_length, seed)
        return model.to(device=device, dtype=dtype), tokenizer
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source, kwargs = _source(spec_model, base_dir)
    field = "spec.model.path" if spec_model.source == "local" else "spec.model.hubId"
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, trust_remote_code=spec_model.trust_remote_code, **kwargs)
        model = AutoModelForCausalLM.from_pretrained(
            source, dtype=dtype, trust_remote_code=spec_model.trust_remote_code, **kwargs
        )
    except (OSError, ValueError) as exc:
        raise ModelSourceError(f"{field}: cannot load {source!r} ({exc})") from None
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    return model.to(device), tokenizer


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
    old = target.with_name(f".old-{target.name}")
    shutil.rmtree(old, ignore_errors=True)
    if target.exists():
        target.rename(old)
    tmp.rename(target)
    shutil.rmtree(old, ignore_errors=True)
    return target
