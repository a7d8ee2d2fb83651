"""The hf engine: batched sampling with transformers' `generate`, on the job's own copy of the policy."""

from __future__ import annotations

import copy
import dataclasses
import math
import threading
from typing import Any

import torch

from rljob.runtime.llm.data.images import VisionInputs
from rljob.runtime.llm.engines.base import (
    Completion,
    Sampling,
    WeightSyncSettings,
    WeightUpdate,
    chunk_size,
)
from rljob.runtime.llm.models.kv_cache import fill_prefix, selectable_cache
from rljob.runtime.llm.models.policy import vision_kwargs, vision_token_ids
from rljob.runtime.weights.ipc import manifest_of, mark_loaded, open_weights
from rljob.runtime.weights.sync import WeightSubscriber, read_weights_file


def compiles_decode(device: torch.device, collocated: bool) -> bool:
    """Whether the hf engine generates with a static KV cache, which transformers compiles the decode step for.

    On a GPU the decode step is launch-bound (NOTES.md): a static cache lets transformers compile it. Not when
    collocated: its CUDA graphs would keep the memory `sleep` frees and point at the moved weights."""
    return device.type == "cuda" and not collocated


def batch_bucket(prompts: int, buckets: tuple[int, ...]) -> int:
    """The number of prompts a generate call of `prompts` runs with: the smallest bucket that holds them, and
    past the largest the next power of two (still a handful of shapes, however large the calls)."""
    fitting = [b for b in buckets if b >= prompts]
    return min(fitting) if fitting else 1 << math.ceil(math.log2(prompts))


def generate_buckets(spec: Any) -> tuple[int, ...]:
    """The batch buckets of a job's compiled decode: powers of two below its training chunk, and that chunk.

    The actor sends a step's prompts in chunks of `chunk_size`, so the usual call runs unpadded; smaller calls (the
    last chunk, prompts re-sent one by one, a multi-turn episode's later turns with fewer episodes left) pad to a
    power of two: at most twice their rows, in log2(chunk) + 1 shapes."""
    replicas = spec.roles.rollout.replicas or 1
    chunk = chunk_size(spec.trainer.batch_size, replicas, spec.rollout.async_.max_staleness)
    powers = tuple(1 << i for i in range(chunk.bit_length()) if 1 << i < chunk)
    return (*powers, chunk)


KEPT_GENERATION_SETTINGS = (
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "cache_implementation",
    "cache_config",
    "compile_config",
    "disable_compile",
)
"""What the hf engine keeps of a model's own generation config: its special tokens, its cache and how its decode
is compiled; nothing that changes which token is drawn."""


def token_settings(config: Any) -> Any:
    """`config` (a model's `generation_config`) without its sampling defaults.

    transformers fills every setting a `generate` call leaves unset from the model's generation config, and
    instruct checkpoints ship sampling defaults there (Qwen2.5-Instruct: `repetition_penalty` 1.05): the engine
    would sample with a penalty the job never asked for, vLLM does not apply (it takes only the end-of-sequence
    ids from that file), and the reported log-probs (`sampling_logprobs`) and the trainer's leave out. The job's
    `spec.rollout` settings are the only sampling settings."""
    from transformers import GenerationConfig

    return GenerationConfig(**{key: getattr(config, key, None) for key in KEPT_GENERATION_SETTINGS})


class _EndPaddingRows:
    """A logits processor that ends the padding rows (from row `first` on) at their first token, an end of
    sequence: they never keep the decode loop running after the real rows are done."""

    def __init__(self, first: int, eos: int) -> None:
        self.first = first
        self.eos = eos

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        scores = scores.clone()
        scores[self.first :] = -math.inf
        scores[self.first :, self.eos] = 0.0
        return scores


class _SampledLogprobs:
    """The first logits processor of a call: it sees each step's raw logits, before any processor, suppression or
    warper, keeps log softmax(logits / T) of that step only, and at the next step, whose input ends with the token
    drawn from it, takes that token's log-prob (`finish` takes the last step's).

    `output_logits=True` would keep one fp32 rows x vocabulary tensor per generated token until the call ends (256
    rows x 1,024 tokens x a 152k vocabulary: 160 GB); this holds one step's."""

    def __init__(self, temperature: float) -> None:
        self.temperature = temperature if temperature > 0 else 1.0  # greedy has no distribution: as the trainer
        self._step: torch.Tensor | None = None
        self.taken: list[torch.Tensor] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self._step is not None:
            self.taken.append(self._step.gather(-1, input_ids[:, -1:]).squeeze(-1))
        self._step = torch.log_softmax(scores.float() / self.temperature, dim=-1)
        return scores

    def finish(self, sequences: torch.Tensor) -> torch.Tensor:
        """[rows, generated tokens]: every drawn token's log-prob (`sequences` ends with the last one drawn)."""
        if self._step is not None:
            self.taken.append(self._step.gather(-1, sequences[:, -1:]).squeeze(-1))
            self._step = None
        return torch.stack(self.taken, dim=1) if self.taken else sequences.new_zeros((sequences.shape[0], 0)).float()


class HFEngine:
    """Batched sampling with transformers' `generate` (KV cache; a static, compiled cache on CUDA).

    Where the decode is compiled (`compiles_decode`), every new batch shape compiles it again and records new CUDA
    graphs: `batch_buckets` pads each call's prompts up to a bucket (copies of its last prompt, ended at their
    first token and dropped before anything sees them), and `cache_len` sizes the static cache for the job's
    longest prompt and response, so that calls of the same bucket reuse one compiled decode. Elsewhere (a dynamic
    cache) each prompt is prefilled once for its `n` rows (`_prefill_once`)."""

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: Any,
        device: torch.device,
        weight_sync: WeightSyncSettings | None = None,
        collocated: bool = False,
        batch_buckets: tuple[int, ...] | None = None,
        cache_len: int | None = None,
        compile_decode: bool = True,
    ) -> None:
        """`compile_decode` False: a dynamic cache even where the decode could be compiled (a generative judge's
        prompts have no job-wide bound to size a static cache for, and each new length would compile again)."""
        self.model = model.eval()
        self.weight_sync = weight_sync
        self._subscriber: WeightSubscriber | None = None
        self._staging: torch.nn.Module | None = None
        self._staging_lock = threading.Lock()
        """Held while weights are received into the staging copy and while they are copied out of it."""
        self._staged_version: int | None = None
        self.tokenizer = tokenizer
        self.device = device
        self.pad_id = tokenizer.pad_token_id
        self.eos_ids = {tokenizer.eos_token_id}
        generation_config = getattr(model, "generation_config", None)
        if generation_config is not None:
            self.model.generation_config = generation_config = token_settings(generation_config)
        extra_eos = getattr(generation_config, "eos_token_id", None)
        if extra_eos is not None:
            self.eos_ids |= set(extra_eos if isinstance(extra_eos, list) else [extra_eos])
        self.cache_implementation = "static" if compile_decode and compiles_decode(device, collocated) else None
        self.batch_buckets = batch_buckets
        """Prompt counts each call is padded up to (`batch_bucket`); None: every call runs as it comes."""
        self.cache_len = cache_len if self.cache_implementation == "static" else None
        self._static_caches: dict[int, tuple[int, Any]] = {}
        """The compiled decode's KV caches, one per row count (a batch bucket times `n`), with their length: kept and
        reset between calls, so a call of a bucket seen before reuses the tensors its compiled decode and CUDA graphs
        were made for (transformers would allocate a new cache per call, and the graphs would keep the old ones)."""
        self.suppressed = vision_token_ids(model.config)
        """A vision-language policy's markup tokens, never sampled (reported log-probs leave the suppression out,
        as they leave out top-k and top-p: the trainer recomputes the same unsuppressed quantity)."""
        self.end_id = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else min(self.eos_ids)
        self._copyable_cache = (
            getattr(generation_config, "cache_implementation", None) in (None, "hybrid")
            and selectable_cache(model) is not None
        )
        """transformers' dynamic cache rows of this model can be repeated: its cache holds plain keys and values
        (`kv_cache`), and its generation config names no cache (generate refuses one passed beside it; Gemma's
        "hybrid" it drops itself)."""

    @torch.no_grad()
    def generate(
        self, prompts: list[list[int]], sampling: Sampling, vision: VisionInputs | None = None
    ) -> list[list[Completion]]:
        """With `vision` (a vision-language policy's images) every row runs whole through `generate`: no bucket
        padding (its padding rows would need images too) and no shared prefill (the images' positions)."""
        from transformers import GenerationConfig

        if not prompts:
            return []
        if vision is not None and sampling.greedy and sampling.n > 1:  # n equal rows: decode once, copy them
            once = self.generate(prompts, dataclasses.replace(sampling, n=1), vision)
            return [[dataclasses.replace(group[0]) for _ in range(sampling.n)] for group in once]
        real = len(prompts)
        if self.batch_buckets is not None and vision is None:  # copies of a real prompt: rows computed as any
            prompts = prompts + [prompts[-1]] * (batch_bucket(real, self.batch_buckets) - real)
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, p in enumerate(prompts):  # left padding: every prompt ends where generation starts
            ids[i, width - len(p) :] = torch.tensor(p, dtype=torch.long)
            mask[i, width - len(p) :] = 1
        copies = 1
        cache = None
        if self.shares_prefill and sampling.n > 1 and width > 1 and vision is None:
            cache = self._prefill_once(ids, mask, sampling.n)
        if sampling.n > 1 and (sampling.greedy or cache is not None):
            # Rows of the shared cache, or greedy (transformers refuses num_return_sequences > 1 without sampling).
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
        )
        if self.cache_implementation == "static":
            cache = self._static_cache(len(prompts) * sampling.n, width + sampling.max_tokens)
        real_rows = real * sampling.n  # each prompt's n rows are adjacent, the padding prompts' rows last
        from transformers import LogitsProcessorList, SuppressTokensLogitsProcessor

        # The recorder first: the reported log-probs leave out the suppression and the padding rows' ending, as they
        # leave out top-k and top-p (the trainer recomputes the same unsuppressed quantity).
        recorder = _SampledLogprobs(sampling.temperature)
        processors = LogitsProcessorList([recorder])
        if self.suppressed:
            processors.append(SuppressTokensLogitsProcessor(self.suppressed, device=self.device))
        if len(prompts) > real:
            processors.append(_EndPaddingRows(real_rows, self.end_id))
        ids = ids.to(self.device)
        out = self.model.generate(
            input_ids=ids,
            attention_mask=mask.to(self.device),
            **vision_kwargs(self.model, ids, vision),
            generation_config=config,
            logits_processor=processors,
            tokenizer=self.tokenizer if sampling.stop else None,
            past_key_values=cache,
        )
        new_tokens = out.sequences[:real_rows, width:]
        # Whole tensors to lists once: indexing a tensor row by row costs more than the rest of this loop.
        logprob_rows = recorder.finish(out.sequences)[:real_rows].cpu().tolist()
        completions: list[list[Completion]] = [[] for _ in range(real)]
        for row, tokens in enumerate(new_tokens.cpu().tolist()):
            length, reason = self._length(tokens, sampling)
            completions[row // sampling.n].append(Completion(tokens[:length], logprob_rows[row][:length], reason))
        return completions

    def _static_cache(self, rows: int, length: int) -> Any:
        """The static KV cache for calls of `rows` rows, emptied; made once per row count, at the job's length
        (`cache_len`), or at `length` when a call needs more (then kept at that length)."""
        from transformers import StaticCache

        kept = self._static_caches.get(rows)
        if kept is not None and kept[0] >= length:
            kept[1].reset()
            return kept[1]
        size = max(length, self.cache_len or 0)
        self._static_caches.pop(rows, None)  # a shorter one goes before the longer is allocated
        cache = StaticCache(config=self.model.config.get_text_config(decoder=True), max_cache_len=size)
        self._static_caches[rows] = (size, cache)
        return cache

    @property
    def shares_prefill(self) -> bool:
        """Whether `generate` prefills each prompt once for its `n` rows (`_prefill_once`): dynamic cache only."""
        return self.cache_implementation is None and self._copyable_cache

    def _prefill_once(self, ids: torch.Tensor, mask: torch.Tensor, n: int) -> Any:
        """The dynamic KV cache of the left-padded prompts but their last token, computed once per prompt and
        repeated for each prompt's `n` rows.

        `generate` would expand every prompt to its `n` rows before the prefill, running its tokens through the
        model `n` times; from this cache it runs only each row's last prompt token, then decodes as usual (its
        sampling, logits processors, stop strings and `output_logits` unchanged). The positions are those
        `generate` derives from the attention mask, counted from each prompt's first real token. Not for the
        static cache (`cache_implementation`): it is compiled for the shapes `generate` allocates itself.
        Measured 2026-11-25, the tiny GRPO example's calls (16 prompts of 5 tokens x 8 samples of 2 tokens, one CPU
        thread): 22 ms per call with every row prefilled, 12.5 ms with this."""
        prefix, prefix_mask = ids[:, :-1].to(self.device), mask[:, :-1].to(self.device)
        positions = (prefix_mask.cumsum(-1) - 1).masked_fill(prefix_mask == 0, 0)
        cache, _ = fill_prefix(self.model, prefix, prefix_mask, positions)
        cache.batch_repeat_interleave(n)
        return cache

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

    def receive_weights(self, update: WeightUpdate) -> None:
        """Into a staging copy of the model, while `generate` goes on with the live one. The copy is on the
        model's device: an engine on a GPU of its own receives by NCCL from an actor on another GPU."""
        if self.weight_sync is None:
            raise RuntimeError("this engine was built without weight sync settings")
        with self._staging_lock:
            if self._staging is None:
                self._staging = copy.deepcopy(self.model)
            if self.weight_sync.method == "filesystem":
                self._staging.load_state_dict(read_weights_file(update.key))
            elif self.weight_sync.method == "ipc":
                tensors = open_weights(manifest_of(update.key))  # views of the actor's memory: copied, dropped
                self._staging.load_state_dict(tensors)
                del tensors
                mark_loaded(update.key)
            else:
                if self._subscriber is None:
                    s = self.weight_sync
                    self._subscriber = WeightSubscriber(s.host, s.port, s.bucket_mb)
                self._subscriber.receive(update.key, update.version, update.actor_tag, self._staging)
            self._staged_version = update.version

    def swap_in(self) -> int | None:
        with self._staging_lock:
            if self._staging is None or self._staged_version is None:
                return None
            with torch.no_grad():
                for dst, src in zip(self.model.state_dict().values(), self._staging.state_dict().values(), strict=True):
                    dst.copy_(src)
            version, self._staged_version = self._staged_version, None
            return version

    def sleep(self) -> None:
        """Move the weights (live and staged) to the CPU and hand the GPU's cached blocks back; a no-op on a CPU."""
        self._place(torch.device("cpu"))

    def wake(self) -> None:
        self._place(self.device)

    def _place(self, device: torch.device) -> None:
        with self._staging_lock:
            self.model.to(device)
            if self._staging is not None:
                self._staging.to(device)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def close(self) -> None:
        self._staging = None
        self._static_caches.clear()
