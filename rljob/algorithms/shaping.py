"""Reward shaping that depends on the response, not on the reward functions: DAPO's overlong penalty."""

from __future__ import annotations

import torch
from torch import Tensor


def overlong_penalty(response_lengths: Tensor, max_length: int, buffer: int, penalty: float = 1.0) -> Tensor:
    """DAPO soft overlong punishment (Yu et al. 2025, eq. 13), added to each response's reward.

    With L_max = `max_length` and L_cache = `buffer`:
      0                                          for |y| <= L_max - L_cache
      ((L_max - L_cache) - |y|) / L_cache * p    for L_max - L_cache < |y| <= L_max
      -p                                         for |y| > L_max
    so the penalty grows linearly from 0 to -`penalty` over the last `buffer` tokens and a
    truncated response gets the full -`penalty`: the model learns to finish before the cut
    instead of being punished for a cut it could not see coming.
    Returns a float tensor shaped like `response_lengths` (its dtype when that is floating).
    """
    if not 1 <= buffer < max_length:
        raise ValueError(f"overlong buffer must be in [1, max_length {max_length}), got {buffer}")
    if penalty < 0:
        raise ValueError(f"overlong penalty must be >= 0, got {penalty}")
    lengths = (
        response_lengths if response_lengths.is_floating_point() else response_lengths.to(torch.get_default_dtype())
    )
    into_buffer = (lengths - (max_length - buffer)) / buffer
    return -penalty * into_buffer.clamp(min=0.0, max=1.0)
