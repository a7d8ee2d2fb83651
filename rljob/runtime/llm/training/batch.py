"""How scored samples are laid out for one forward/backward pass of the policy (a micro-batch).

Two layouts give the same per-token log-probs:

- `collate`: every sample a right-padded prompt+response row.
- `collate_shared`: GRPO samples `groupSize` responses of each prompt, so a micro-batch holds each prompt many
  times. Here each distinct prompt but its last token (the *prefix*) is a row of its own, run through the model
  once; its KV cache is then repeated for every response to it, and each sample's row is only its prompt's last
  token and its response. The prompt's tokens cost one forward and backward per prompt instead of one per
  response: with 8 responses of 1k tokens to a 1k-token prompt, 56% of the tokens; on the tiny arithmetic example,
  half. Attention over the cached prefix gives the same numbers as over the whole row, up to float order, and the
  backward sums each prefix's gradient over its responses, as the whole rows did.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from itertools import chain, repeat
from typing import Any

import torch
from torch import Tensor

from rljob.runtime.llm.data.images import VisionInputs

Sample = dict[str, Any]
"""One scored completion: `prompt_ids`, `response_ids`, `rollout_logprobs` (lists), `advantage`,
`reward` and `version` (the policy version that generated it); optionally `loss_mask`, one 0/1 per response
token, 0 where the token is not the model's own (a text environment's reply): those are never trained on; and
`vision`, the prompt's images as the rollout's engine read them (a vision-language policy's `VisionInputs`)."""


@dataclass
class SharedPrefix:
    """The distinct prompts of a micro-batch without their last token, left-padded so that all end in the last
    column: the part of the rows that runs through the model once, before the rows themselves."""

    input_ids: Tensor
    """[U, W] token ids; padding on the left."""
    attention_mask: Tensor
    position_ids: Tensor
    """[U, W]: counted from each prompt's first token, as in a whole row."""
    rows: Tensor
    """[B]: the prefix each sample of the micro-batch continues (an index into the U prefixes)."""

    def to(self, device: torch.device) -> SharedPrefix:
        return SharedPrefix(*(getattr(self, f.name).to(device) for f in fields(self)))


@dataclass
class MicroBatch:
    input_ids: Tensor
    """[B, S]: prompt+response rows, or with `prefix` each prompt's last token and the response."""
    attention_mask: Tensor
    """[B, S], or with `prefix` [B, W + S]: the prefix's columns, then the row's."""
    response_mask: Tensor
    """[B, S-1]: 1 where position t predicts a response token."""
    targets: Tensor
    advantages: Tensor
    rollout_logprobs: Tensor
    prefix: SharedPrefix | None = None
    """The shared prompt prefixes these rows continue (`collate_shared`), or None: the rows are whole."""
    position_ids: Tensor | None = None
    """[B, S] with `prefix`: where each row's tokens sit after its prefix."""
    vision: VisionInputs | None = None
    """The rows' images in row order (a vision-language policy's); whole rows only (no `prefix`)."""

    def to(self, device: torch.device) -> MicroBatch:
        moved = {f.name: getattr(self, f.name) for f in fields(self)}
        return MicroBatch(
            **{
                name: value.to(device) if isinstance(value, Tensor | SharedPrefix) else value
                for name, value in moved.items()
            }
        )


def collate(samples: list[Sample], pad_id: int) -> MicroBatch:
    """Right-padded prompt+response rows and per-position tensors aligned with next-token predictions.

    Built from flat per-token lists with masked writes in row-major order (no Python loop over rows).
    """
    prompt_lengths = torch.tensor([len(s["prompt_ids"]) for s in samples], dtype=torch.long)
    response_lengths = torch.tensor([len(s["response_ids"]) for s in samples], dtype=torch.long)
    lengths = prompt_lengths + response_lengths
    width = int(lengths.max())
    columns = torch.arange(width)
    filled = columns < lengths.unsqueeze(1)
    ids = torch.full((len(samples), width), pad_id, dtype=torch.long)
    ids[filled] = torch.tensor(
        list(chain.from_iterable(chain(s["prompt_ids"], s["response_ids"]) for s in samples)), dtype=torch.long
    )
    # Position t predicts token t + 1: a response spans positions [p - 1, p - 1 + r) on the [B, S - 1] grid.
    start = (prompt_lengths - 1).unsqueeze(1)
    answer = (columns[:-1] >= start) & (columns[:-1] < start + response_lengths.unsqueeze(1))
    response = torch.zeros((len(samples), width - 1))
    rollout = torch.zeros((len(samples), width - 1))
    advantages = torch.zeros((len(samples), width - 1))
    # A loss mask leaves out response tokens the model did not generate.
    response[answer] = torch.tensor(
        list(
            chain.from_iterable(
                repeat(1.0, len(s["response_ids"])) if s.get("loss_mask") is None else s["loss_mask"] for s in samples
            )
        ),
        dtype=torch.float32,
    )
    rollout[answer] = torch.tensor(
        list(chain.from_iterable(s["rollout_logprobs"] for s in samples)), dtype=torch.float32
    )
    per_sample = torch.tensor([float(s["advantage"]) for s in samples], dtype=torch.float32)
    advantages[answer] = per_sample.repeat_interleave(response_lengths)
    vision = VisionInputs.concat([s.get("vision") for s in samples])
    return MicroBatch(ids, filled.long(), response, ids[:, 1:].clone(), advantages, rollout, vision=vision)


def collate_shared(samples: list[Sample], pad_id: int, min_saving: float = 0.0) -> MicroBatch | None:
    """The `collate_shared` layout (module docstring), or None where it saves too little: no prompt appears twice,
    a prompt has a single token (no prefix to share), or the padded token positions it computes (prefixes, then
    rows) are more than `1 - min_saving` of the whole rows' (and never as many). Per-token tensors are on the
    [B, S - 1] grid of the rows' own positions: position 0, the prompt's last token, predicts the first response
    token."""
    index: dict[tuple[int, ...], int] = {}
    rows = [index.setdefault(tuple(s["prompt_ids"]), len(index)) for s in samples]
    if len(index) == len(samples) or min(len(p) for p in index) < 2:
        return None
    prefix_lengths = torch.tensor([len(p) - 1 for p in index], dtype=torch.long)
    width = int(prefix_lengths.max())
    whole = len(samples) * max(len(s["prompt_ids"]) + len(s["response_ids"]) for s in samples)
    shared = len(index) * width + len(samples) * (1 + max(len(s["response_ids"]) for s in samples))
    if shared >= whole or shared > (1.0 - min_saving) * whole:
        return None
    columns = torch.arange(width)
    pad = (width - prefix_lengths).unsqueeze(1)
    filled = columns >= pad
    ids = torch.full((len(index), width), pad_id, dtype=torch.long)
    ids[filled] = torch.tensor(list(chain.from_iterable(p[:-1] for p in index)), dtype=torch.long)
    prefix = SharedPrefix(ids, filled.long(), (columns - pad).clamp(min=0), torch.tensor(rows, dtype=torch.long))
    # Each row: its prompt's last token, then the response, laid out as `collate` lays out a one-token prompt.
    tails = collate([{**s, "prompt_ids": s["prompt_ids"][-1:]} for s in samples], pad_id)
    starts = prefix_lengths[prefix.rows].unsqueeze(1)
    return MicroBatch(
        tails.input_ids,
        torch.cat([prefix.attention_mask[prefix.rows], tails.attention_mask], dim=1),
        tails.response_mask,
        tails.targets,
        tails.advantages,
        tails.rollout_logprobs,
        prefix,
        starts + torch.arange(tails.input_ids.shape[1]),
    )


def by_prompt(samples: list[Sample]) -> list[Sample]:
    """`samples` with the responses to one prompt next to each other (prompts in order of first appearance, each
    prompt's samples in their order): micro-batches cut from it hold whole groups, which `collate_shared` needs."""
    order: dict[tuple[int, ...], list[Sample]] = {}
    for s in samples:
        order.setdefault(tuple(s["prompt_ids"]), []).append(s)
    return list(chain.from_iterable(order.values()))
