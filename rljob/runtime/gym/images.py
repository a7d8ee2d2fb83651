"""Image observations as the builtin cnn reads them: which axes are channels, and what its convolutions leave.

Pure shape arithmetic (no torch), shared by the env role's space check and the network builder, so a job whose
images the cnn cannot take fails when its env role starts, before any pod trains.
"""

from __future__ import annotations

from dataclasses import dataclass

from gymnasium import spaces

ARCHITECTURE_FIELD = "spec.model.builtin.architecture"
LAYERS_FIELD = "spec.model.builtin.kernelSizes / strides"
WRAPPERS_FIELD = "spec.task.gym.wrappers"


class ImageSpaceError(ValueError):
    """The observation space is not an image the cnn can take; the message names the field and the fix."""


@dataclass(frozen=True)
class ImageLayout:
    """How a [*shape] observation becomes the cnn's [channels, height, width] input."""

    shape: tuple[int, ...]
    channels: int
    height: int
    width: int
    permutation: tuple[int, ...]
    """Axes of the observation in [stack..., channel, height, width] order: flattening the leading axes then gives
    channel-first input."""
    scale: float
    """1/255 for uint8 pixels, 1 for images already in floats."""


def is_image_space(space: spaces.Space) -> bool:
    """A Box of 2 to 4 axes: a grayscale image, an image with channels, or a stack of either."""
    return isinstance(space, spaces.Box) and 2 <= len(space.shape) <= 4


def is_pixel_space(space: spaces.Space) -> bool:
    """An image of uint8 pixels: what the mlp refuses (a float Box of several axes is stacked vectors, flattened)."""
    return is_image_space(space) and space.dtype == "uint8"  # type: ignore[union-attr]


def image_layout(space: spaces.Space) -> ImageLayout:
    """The layout of an image observation space.

    [H, W] is one channel. [A, B, C] is channel-first or channel-last, whichever end is smaller (84x84 frames stacked
    by `frame-stack` are [4, 84, 84]; MiniGrid's RGB views are [H, W, 3]). [S, A, B, C]: a stack of such images, its
    stack and channel axes merged into channels.
    """
    if not is_image_space(space):
        raise ImageSpaceError(
            f"the observation space is {space}, not an image: {ARCHITECTURE_FIELD} cnn reads images (a Box of 2 to 4 "
            f"axes, such as [84, 84], [4, 84, 84] or [28, 28, 3]); use mlp for vector observations, or add an image "
            f"wrapper (atari, minigrid-rgb) to {WRAPPERS_FIELD}"
        )
    assert isinstance(space, spaces.Box)
    shape = tuple(int(n) for n in space.shape)
    scale = 1 / 255 if space.dtype == "uint8" else 1.0
    if len(shape) == 2:
        return ImageLayout(shape, 1, shape[0], shape[1], (0, 1), scale)
    lead = len(shape) - 3  # a stack axis in front, or none
    first, last = shape[lead], shape[-1]
    # channel-last when the last axis is the smaller end
    permutation = (*range(lead), lead + 2, lead, lead + 1) if last < first else tuple(range(len(shape)))
    channel_axis, height_axis, width_axis = permutation[-3:]
    stack = shape[0] if lead else 1
    return ImageLayout(shape, stack * shape[channel_axis], shape[height_axis], shape[width_axis], permutation, scale)


def conv_output(size: int, kernel: int, stride: int) -> int:
    """Side of a valid (unpadded) convolution's output."""
    return (size - kernel) // stride + 1


def check_conv_fits(layout: ImageLayout, kernel_sizes: list[int], strides: list[int]) -> tuple[int, int]:
    """(height, width) after the convolutions; an image too small for them raises `ImageSpaceError`."""
    height, width = layout.height, layout.width
    for index, (kernel, stride) in enumerate(zip(kernel_sizes, strides, strict=True)):
        if height < kernel or width < kernel:
            raise ImageSpaceError(
                f"images of {layout.height}x{layout.width} pixels (observation shape {list(layout.shape)}) are too "
                f"small for the cnn: convolution {index} (kernel {kernel}, stride {stride}) gets {height}x{width}. "
                f"Set smaller {LAYERS_FIELD} (e.g. kernelSizes [3, 3], strides [1, 1] and channels [16, 32]), or "
                f"render larger images in {WRAPPERS_FIELD} (minigrid-rgb tile_size, atari screen_size)"
            )
        height, width = conv_output(height, kernel, stride), conv_output(width, kernel, stride)
    return height, width
