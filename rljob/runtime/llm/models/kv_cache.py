"""A transformers KV cache whose rows can be selected and repeated: what running a prompt once for many rows needs.

The trainer's shared prompt prefix (`logprobs.model_inputs`) and the hf engine's shared prefill both fill a
`DynamicCache` with prompts and then give each row its prompt's copy. That works for caches of plain keys and
values (full or sliding-window attention). Layers that carry other state (linear attention's convolution and
recurrent states in Qwen3.5, Qwen3-Next, LFM2; indexed or quantized layers) cannot be copied row by row: those
models run every row whole.
"""

from __future__ import annotations

import inspect
from typing import Any

from torch import Tensor, nn


def selectable_cache(model: nn.Module) -> Any | None:
    """A fresh `DynamicCache` for `model` when every layer of it holds plain keys and values, else None."""
    config = getattr(model, "config", None)
    if config is None or getattr(config, "is_encoder_decoder", False):
        return None
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

    cache = DynamicCache(config=config)
    if all(type(layer) in (DynamicLayer, DynamicSlidingWindowLayer) for layer in cache.layers):
        return cache
    return None


def fill_prefix(model: nn.Module, input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor) -> tuple[Any, Any]:
    """Left-padded prefixes run through `model` into a fresh `selectable_cache`: (the cache, the model's output).

    Only the cache is wanted: the LM head runs on the last position alone where the model takes `logits_to_keep`,
    not vocabulary-sized logits for every prefix position."""
    cache = selectable_cache(model)
    if cache is None:
        raise ValueError(f"{type(model).__name__}'s cache keeps more than keys and values: its rows cannot be shared")
    keep = {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}
    out = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        past_key_values=cache,
        use_cache=True,
        **keep,
    )
    return cache, out
