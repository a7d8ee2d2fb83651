"""Generation engines behind one interface: token ids in, sampled token ids with their logprobs out.

An engine owns a copy of the policy. `generate` samples `n` completions per prompt and reports, per token,
the log-probability of the sampled token under the *sampling* distribution (logits / temperature, before
top-k/top-p truncation): the trainer recomputes exactly that quantity, so their gap is the engine mismatch.
`model` is the module weight sync writes into; `version` is the policy version it holds.

Engines: `hf` (transformers `generate`, here) and `vllm` (its own module, added by the vLLM engine).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from rljob.api.spec import RolloutSpec


@dataclass(frozen=True)
class Sampling:
    """What to sample: `n` completions per prompt; temperature 0 (or `greedy`) picks the argmax."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    max_tokens: int = 16
    stop: tuple[str, ...] = ()
    greedy: bool = False

    @classmethod
    def from_spec(cls, rollout: RolloutSpec, n: int, max_tokens: int, greedy: bool = False) -> Sampling:
        return cls(
            n=n,
            temperature=rollout.temperature,
            top_p=rollout.top_p,
            top_k=rollout.top_k,
            max_tokens=max_tokens,
            greedy=greedy or rollout.temperature == 0.0,
        )

    def to_wire(self) -> dict[str, Any]:
        return {**self.__dict__, "stop": list(self.stop)}

    @classmethod
    def from_wire(cls, data: dict[str, Any]) -> Sampling:
        return cls(**{**data, "stop": tuple(data.get("stop", ()))})


@dataclass
class Completion:
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    """`stop` (end-of-sequence token or a stop string) or `length` (max tokens reached)."""


@dataclass
class EngineStats:
    prompts: int = 0
    tokens: int = 0
    seconds: float = 0.0
    extra: dict[str, float] = field(default_factory=dict)


class GenerationEngine(Protocol):
    model: torch.nn.Module

    def generate(self, prompts: list[list[int]], sampling: Sampling) -> list[list[Completion]]:
        """`n` completions for each prompt, in prompt order."""


def sampling_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float) -> torch.Tensor:
    """log p(token) under softmax(logits / temperature) (temperature 0 counts as 1: greedy has no distribution)."""
    scaled = logits.float() / (temperature if temperature > 0 else 1.0)
    return torch.log_softmax(scaled, dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


class HFEngine:
    """Batched sampling with transformers' `generate` (KV cache; a static, compiled cache on CUDA)."""

    def __init__(self, model: torch.nn.Module, tokenizer: Any, device: torch.device) -> None:
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.device = device
        self.pad_id = tokenizer.pad_token_id
        self.eos_ids = {tokenizer.eos_token_id}
        generation_config = getattr(model, "generation_config", None)
        extra_eos = getattr(generation_config, "eos_token_id", None)
        if extra_eos is not None:
            self.eos_ids |= set(extra_eos if isinstance(extra_eos, list) else [extra_eos])
        # On a GPU the decode step is launch-bound (NOTES.md): a static cache lets transformers compile it.
        self.cache_implementation = "static" if device.type == "cuda" else None

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], sampling: Sampling) -> list[list[Completion]]:
        from transformers import GenerationConfig

        if not prompts:
            return []
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, p in enumerate(prompts):  # left padding: every prompt ends where generation starts
            ids[i, width - len(p) :] = torch.tensor(p, dtype=torch.long)
            mask[i, width - len(p) :] = 1
        copies = 1
        if sampling.greedy and sampling.n > 1:
            # transformers refuses num_return_sequences > 1 without sampling: repeat the prompts instead.
            ids, mask = ids.repeat_interleave(sampling.n, dim=0), mask.repeat_interleave(sampling.n, dim=0)
            copies = sampling.n
        config = GenerationConfig(
            max_new_tokens=sampling.max_tokens,
            do_sample=not sampling.greedy,
            temperature=sampling.temperature if not sampling.greedy else None,
            top_p=sampling.top_p if not sampling.greedy else None,
            top_k=(sampling.top_k or 0) if not sampling.greedy else None,
            num_return_sequences=sampling.n // copies,
            pad_token_id=self.pad_id,
            eos_token_id=sorted(self.eos_ids),
            stop_strings=list(sampling.stop) or None,
            return_dict_in_generate=True,
            output_logits=True,
            cache_implementation=self.cache_implementation,
        )
        out = self.model.generate(
            input_ids=ids.to(self.device),
            attention_mask=mask.to(self.device),
            generation_config=config,
            tokenizer=self.tokenizer if sampling.stop else None,
        )
        new_tokens = out.sequences[:, width:]
        logits = torch.stack(out.logits, dim=1)  # [B * n, T, V], before any logits processor
        # Whole tensors to lists once: indexing a tensor row by row costs more than the rest of this loop.
        logprob_rows = sampling_logprobs(logits, new_tokens, sampling.temperature).cpu().tolist()
        completions: list[list[Completion]] = [[] for _ in prompts]
        for row, tokens in enumerate(new_tokens.cpu().tolist()):
            length, reason = self._length(tokens, sampling)
            completions[row // sampling.n].append(Completion(tokens[:length], logprob_rows[row][:length], reason))
        return completions

    def _length(self, tokens: list[int], sampling: Sampling) -> tuple[int, str]:
        """Tokens that belong to the completion (through the end token) and why it ended."""
        for i, token in enumerate(tokens):
            if token in self.eos_ids:
                return i + 1, "stop"
        if sampling.stop:
            text = ""
            for i, token in enumerate(tokens):
                text += self.tokenizer.decode([token])
                if any(s in text for s in sampling.stop):
                    return i + 1, "stop"
        return len(tokens), "length"


def build_engine(engine: str, model: torch.nn.Module, tokenizer: Any, device: torch.device) -> GenerationEngine:
    if engine == "hf":
        return HFEngine(model, tokenizer, device)
    raise ValueError(f"spec.rollout.engine {engine!r}: this runtime's llm rollout generates with hf")
