"""DAPO dynamic sampling (Yu et al. 2025, sec. 3.2): keep only prompt groups that carry a learning signal.

A group whose samples all earned the same reward has zero advantage under every group baseline,
so it adds nothing to the gradient but still dilutes the batch. DAPO drops such groups and keeps
generating until the batch is full of informative ones; the refilling is the learner's job, this
module only says which groups to keep.
"""

from __future__ import annotations

from torch import Tensor


def informative_groups(rewards: Tensor) -> Tensor:
    """[prompts] bool: True where a group's rewards are not all equal (non-zero variance).

    `rewards` is [prompts, group_size], one row per prompt. Equality is exact, as DAPO's
    `0 < |{correct}| < G` on binary rewards: any difference at all gives the group a non-zero
    advantage, and a tolerance would drop groups that still have a signal.
    """
    if rewards.dim() != 2 or rewards.shape[1] < 2:
        raise ValueError(
            f"informative_groups needs rewards of shape [prompts, group_size >= 2], got {tuple(rewards.shape)}"
        )
    return (rewards != rewards[:, :1]).any(dim=1)
