"""A transformers KV cache whose rows can be selected and repeated: what running a prompt once for many rows needs.

The trainer's shared prompt prefix (`logprobs.model_inputs`) and the hf engine's shared prefill both fill a
`DynamicCache` with prompts and then give each row its prompt's copy. That works for caches of plain keys and
values (full or sliding-window attention). Layers that carry other state (linear attention's convolution and
recurrent states in Qwen3.5, Qwen3-Next, LFM2; indexed or quantized layers) cannot be copied row by row: those
models run every row whole.
"""

from __future__ import annotations

from typing import Any

from torch import nn


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
