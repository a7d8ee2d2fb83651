"""Camera images -> a Qwen2-VL vision tower's inputs, for a whole batch at once in torch.

What the Qwen2-VL image processor does per image (scale to whole merged patches, rescale to [0, 1], normalize,
repeat the frame over the temporal patch, cut into patches in the merge order), done on a [B, H, W, C] tensor: the
rollout acts on every environment's frame each step, and the processor's per-image PIL path would cost more than
the tiny policy itself. Every frame of an environment has the same size, so every image gets the same grid."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from rljob.runtime.gym.models import UnsupportedSpaceError


class ObservationError(UnsupportedSpaceError):
    """The environment's observations are not images the VLA reads; the message names the field and the fix."""


def check_image_space(space: Any) -> None:
    """An `ObservationError` unless `space` holds RGB images: a Box of shape [height, width, 3]."""
    from gymnasium import spaces

    if not (isinstance(space, spaces.Box) and len(space.shape) == 3 and space.shape[-1] == 3):
        raise ObservationError(
            f"spec.task.gym.envId: the VLA reads camera images (a Box of shape [height, width, 3]), not {space}; "
            "choose an env with RGB observations or wrap it (e.g. gymnasium's AddRenderObservation)"
        )


@dataclass(frozen=True)
class Patcher:
    """One image size's patching: `image_tokens` tokens per image after the vision tower's 2 x 2 merge."""

    height: int
    width: int
    channels: int
    resized: tuple[int, int]
    patch_size: int
    merge_size: int
    temporal_patch_size: int
    mean: tuple[float, ...]
    std: tuple[float, ...]

    @classmethod
    def for_space(cls, space: object, image_processor: Any) -> Patcher:
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

        check_image_space(space)
        height, width, channels = (int(s) for s in space.shape)
        patch, merge = int(image_processor.patch_size), int(image_processor.merge_size)
        pixels = getattr(image_processor, "min_pixels", None), getattr(image_processor, "max_pixels", None)
        if pixels[0] is None:  # newer processors keep the bounds in `size`
            size = image_processor.size
            pixels = size["shortest_edge"], size["longest_edge"]
        resized = smart_resize(height, width, factor=patch * merge, min_pixels=pixels[0], max_pixels=pixels[1])
        return cls(
            height=height,
            width=width,
            channels=channels,
            resized=(int(resized[0]), int(resized[1])),
            patch_size=patch,
            merge_size=merge,
            temporal_patch_size=int(image_processor.temporal_patch_size),
            mean=tuple(float(v) for v in image_processor.image_mean),
            std=tuple(float(v) for v in image_processor.image_std),
        )

    @property
    def grid(self) -> tuple[int, int, int]:
        """(t, h, w) patches of one image: Qwen2-VL's `image_grid_thw` row."""
        return 1, self.resized[0] // self.patch_size, self.resized[1] // self.patch_size

    @property
    def image_tokens(self) -> int:
        _, h, w = self.grid
        return h * w // (self.merge_size * self.merge_size)

    def __call__(self, obs: Tensor) -> tuple[Tensor, Tensor]:
        """[B, H, W, C] (or [B, H*W*C] flat) pixel values 0..255 -> (pixel_values [B*h*w, C*T*p*p], grid [B, 3])."""
        b = obs.shape[0]
        images = obs.reshape(b, self.height, self.width, self.channels).permute(0, 3, 1, 2).float() / 255.0
        if self.resized != (self.height, self.width):
            images = F.interpolate(images, size=self.resized, mode="bicubic", align_corners=False, antialias=True)
        mean = torch.tensor(self.mean, device=obs.device).view(1, -1, 1, 1)
        std = torch.tensor(self.std, device=obs.device).view(1, -1, 1, 1)
        images = (images - mean) / std
        t, p, m = self.temporal_patch_size, self.patch_size, self.merge_size
        _, gh, gw = self.grid
        frames = images.unsqueeze(1).expand(b, t, *images.shape[1:])  # one frame, repeated over the temporal patch
        patches = frames.reshape(b, t, self.channels, gh // m, m, p, gw // m, m, p)
        patches = patches.permute(0, 3, 6, 4, 7, 2, 1, 5, 8)  # the processor's order, with the batch in front
        pixel_values = patches.reshape(b * gh * gw, self.channels * t * p * p)
        grid = torch.tensor([self.grid], device=obs.device).expand(b, 3)
        return pixel_values, grid
