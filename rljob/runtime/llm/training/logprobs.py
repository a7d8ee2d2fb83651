"""Per-token log-probabilities and entropy of a causal LM, computed chunk by chunk over the response tokens.

The full logits of a batch are [tokens, vocabulary] floats: 4.6 GiB in fp32 for 8k tokens of Qwen2's
151,936-token vocabulary, more than the rest of the activations. Here the LM head runs, inside the model's own
forward, on the final hidden states of the response positions only, `chunk_tokens` rows at a time: each chunk
is projected, log-softmaxed in fp32, gathered at its targets and reduced to its entropy, and its logits are
dropped. Under autograd each chunk is a `torch.utils.checkpoint` region whose backward recomputes that chunk's
logits, so forward and backward alike hold one [chunk, vocabulary] block at a time.

Only the head's `forward` is swapped, for one call: its parameters (tied to the embeddings or not, sharded by
FSDP or not) are used as the model holds them. A model whose forward changes the head's output before returning
it (Gemma 2's softcapping, a logit scale) returns another tensor than the head gave: that model goes back to the
full logits, logged once, rather than train on numbers its forward does not compute.

A micro-batch laid out with a shared prompt prefix (`batch.collate_shared`) runs in two calls: the prefixes into a
KV cache, then the rows over it (`model_inputs`).
"""

from __future__ import annotations

import inspect
import logging
import weakref
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from rljob.runtime.llm.models.kv_cache import fill_prefix, selectable_cache
from rljob.runtime.llm.models.policy import is_vision_language, vision_kwargs

if TYPE_CHECKING:
    from rljob.runtime.llm.training.batch import MicroBatch

log = logging.getLogger("rljob.actor")

_FULL_LOGITS: weakref.WeakSet[nn.Module] = weakref.WeakSet()
"""Models whose forward transforms the head's output: they always take the full-logits path."""


def shares_prompts(model: nn.Module) -> bool:
    """Whether `model` can run a shared prompt prefix into a KV cache and its rows over it, with gradients through
    both: a decoder-only transformers model that takes a cache and position ids, whose cache layers hold plain keys
    and values (`kv_cache`), and not under gradient checkpointing (transformers' checkpointed layers drop the
    cache; those rows run whole)."""
    if is_vision_language(getattr(model, "config", None)):
        return False  # its rows carry images, whose tokens' positions (M-RoPE) a prefix of its own would not have
    if getattr(model, "is_gradient_checkpointing", False):
        log.info("model.gradientCheckpointing: every prompt runs once per response (its layers drop the KV cache)")
        return False
    accepted = inspect.signature(model.forward).parameters
    if "past_key_values" not in accepted or "position_ids" not in accepted:
        return False
    if selectable_cache(model) is None:
        log.info(
            "%s keeps more than keys and values in its cache: every prompt runs once per response", type(model).__name__
        )
        return False
    return True


def model_inputs(model: nn.Module, batch: MicroBatch) -> dict[str, Any]:
    """The keyword arguments of the model call that computes `batch`'s rows. With a shared prefix, that prefix
    runs first (no logits but its last position's) and the returned cache holds its keys and values, one copy
    per row, still attached to autograd: the rows' backward flows into the prefix's."""
    if batch.prefix is None:
        return {
            "input_ids": batch.input_ids,
            "attention_mask": batch.attention_mask,
            **vision_kwargs(model, batch.input_ids, batch.vision),
            "use_cache": False,
        }
    prefix = batch.prefix
    cache, out = fill_prefix(model, prefix.input_ids, prefix.attention_mask, prefix.position_ids)
    if torch.is_grad_enabled() and _is_fsdp(model):
        # FSDP gathers a layer's weights for backward when the gradient reaches that layer's output. The prefix's
        # gradient arrives through the cache instead, after the rows' backward has freed them again: tie the
        # cache to the prefix's output (with weight 0) so that its backward passes through every layer's output.
        first = cache.layers[0]
        first.keys = first.keys + 0.0 * out.logits.sum().to(first.keys.dtype)
    cache.batch_select_indices(prefix.rows)
    return {
        "input_ids": batch.input_ids,
        "attention_mask": batch.attention_mask,
        "position_ids": batch.position_ids,
        "past_key_values": cache,
        "use_cache": True,
    }


def _is_fsdp(model: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def _chunk_logprobs(
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    targets: Tensor,
    temperature: float,
    with_entropy: bool,
    entropy_grad: bool,
) -> tuple[Tensor, Tensor]:
    """log p(target) and entropy (empty without `with_entropy`) of `hidden` [n, H] rows: the plain path's maths."""
    logits = F.linear(hidden, weight, bias).float()
    if temperature > 0:
        logits = logits / temperature
    log_probs = torch.log_softmax(logits, dim=-1)
    chosen = log_probs.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    if not with_entropy:
        return chosen, chosen.new_zeros(0)
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        entropy = -(log_probs.exp() * log_probs).sum(-1)
    return chosen, entropy


class _ResponseHead:
    """Stands in for the LM head's `forward` during one model call: per-position log-probs instead of logits."""

    def __init__(
        self,
        head: nn.Module,
        batch: MicroBatch,
        temperature: float,
        with_entropy: bool,
        entropy_grad: bool,
        chunk_tokens: int,
    ) -> None:
        self.head, self.batch, self.temperature = head, batch, temperature
        self.with_entropy, self.entropy_grad, self.chunk_tokens = with_entropy, entropy_grad, chunk_tokens
        self.logprobs: Tensor | None = None
        self.entropy: Tensor | None = None

    def __call__(self, hidden: Tensor) -> Tensor:
        batch = self.batch
        if hidden.dim() != 3 or tuple(hidden.shape[:2]) != tuple(batch.input_ids.shape):
            # Not the whole sequence (a model that slices differently): leave it to the full-logits path.
            return nn.Linear.forward(self.head, hidden)  # type: ignore[arg-type]
        where = (batch.response_mask > 0).nonzero(as_tuple=True)
        # Only response positions need a log-prob: select their hidden states before the projection.
        rows = hidden[:, :-1][where]
        targets = batch.targets[where]
        weight, bias = self.head.weight, getattr(self.head, "bias", None)
        recompute = torch.is_grad_enabled() and (rows.requires_grad or weight.requires_grad)
        chosen, entropies = [], []
        # No response token still runs one empty chunk: the loss stays connected to every parameter (zero
        # gradients), which FSDP's per-backward reduce-scatter and `loss.backward()` both need.
        for start in range(0, max(rows.shape[0], 1), self.chunk_tokens):
            args = (
                rows[start : start + self.chunk_tokens],
                weight,
                bias,
                targets[start : start + self.chunk_tokens],
                self.temperature,
                self.with_entropy,
                self.entropy_grad,
            )
            if recompute:  # keeps only the chunk's inputs for backward, which recomputes its logits
                lp, ent = checkpoint(_chunk_logprobs, *args, use_reentrant=False)
            else:
                lp, ent = _chunk_logprobs(*args)
            chosen.append(lp)
            entropies.append(ent)
        grid = torch.zeros(batch.response_mask.shape, dtype=torch.float32, device=hidden.device)
        self.logprobs = grid.index_put(where, torch.cat(chosen))
        if self.with_entropy:
            self.entropy = grid.index_put(where, torch.cat(entropies))
        return self.logprobs


def full_logprobs(
    model: nn.Module, batch: MicroBatch, temperature: float, with_entropy: bool, entropy_grad: bool = True
) -> tuple[Tensor, Tensor | None]:
    """The same from the full [B, S - 1, vocabulary] logits at once: every position, and the reference maths."""
    logits = model(**model_inputs(model, batch)).logits
    logits = logits[:, :-1].float()
    if temperature > 0:
        logits = logits / temperature
    log_probs = torch.log_softmax(logits, dim=-1)
    chosen = log_probs.gather(-1, batch.targets.unsqueeze(-1)).squeeze(-1)
    entropy = None
    if with_entropy:
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            entropy = -(log_probs.exp() * log_probs).sum(-1)
    return chosen, entropy


def chunked_logprobs(
    model: nn.Module,
    batch: MicroBatch,
    temperature: float,
    with_entropy: bool,
    entropy_grad: bool = True,
    chunk_tokens: int = 512,
) -> tuple[Tensor, Tensor | None]:
    """`full_logprobs` at the response positions (0 elsewhere), with at most `chunk_tokens` rows of logits alive.

    Falls back to `full_logprobs` for a model without a linear output head or whose forward transforms the
    head's output (see the module docstring).
    """
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if model in _FULL_LOGITS or not isinstance(head, nn.Linear):
        return full_logprobs(model, batch, temperature, with_entropy, entropy_grad)
    inputs = model_inputs(model, batch)  # before the swap: a prefix call's head is the plain one
    swap = _ResponseHead(head, batch, temperature, with_entropy, entropy_grad, chunk_tokens)
    head.forward = swap  # type: ignore[method-assign]  # an instance attribute, for this one call
    try:
        out = model(**inputs)
    finally:
        del head.forward
    if swap.logprobs is None or out.logits is not swap.logprobs:
        _FULL_LOGITS.add(model)
        log.warning(
            "%s does not return its LM head's output as its logits (a logit scale or softcap): log-probs come "
            "from the full logits, trainer.logprobChunkTokens does not apply to it",
            type(model).__name__,
        )
        return full_logprobs(model, batch, temperature, with_entropy, entropy_grad)
    return swap.logprobs, swap.entropy
