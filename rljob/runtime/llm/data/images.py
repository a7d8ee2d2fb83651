"""Images in prompt rows, as EasyR1 and Hugging Face datasets carry them, turned into what a vision-language
policy reads.

A row's images are in `dataset.imageKey` (default `images`, or `image` when a row has only that): a list or a
single image, each a path (relative to the dataset file's directory, or absolute: a mounted volume), bytes (a
Parquet column, or a Hugging Face `Image` feature's `{"bytes": ..., "path": ...}`), a base64 `data:` URI, or an
already decoded PIL image (the builtin shapes dataset). Remote URLs are refused: rljob's roles never fetch
from the network at run time.

Each image is decoded once per row, scaled into [minPixels, maxPixels] (aspect kept, as EasyR1 does) and run
through the policy's image processor; what travels between roles and into the learner is the processor's output as
two numpy arrays (`VisionInputs`): the patches (`pixel_values`) and each image's patch grid (`image_grid_thw`).
The prompt's text gets the model's image tokens: one `<image>` placeholder in the template per image (or the
images before the text when it has none), expanded to as many image tokens as the image has merged patches.
This is the Qwen2-VL family's scheme (Qwen2-VL, Qwen2.5-VL and rljob's tiny-qwen2-vl).
"""

from __future__ import annotations

import base64
import binascii
import io
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from rljob.api.spec import DatasetSpec

IMAGE_PLACEHOLDER = "<image>"
"""Where an image goes in `task.llm.promptTemplate` (or in a row's prompt): one per image, in order."""
FIELD = "spec.task.llm.dataset"


class ImageError(ValueError):
    """A row's image cannot be used; the message names the row, the column and the fix."""


@dataclass(frozen=True)
class VisionInputs:
    """A prompt's images as the policy reads them: `pixel_values` [patches, patch features] float32 and
    `image_grid_thw` [images, 3] int64 (frames, patch rows, patch columns of each image).

    For a vLLM rollout, which runs the model's image processor itself, the images also travel as their pixels:
    `rgb` (every image's RGB bytes, one after the other, uint8) and `rgb_shapes` [images, 2] (height, width),
    more compact than the patches. `pixel_values` is empty in what such a rollout receives."""

    pixel_values: np.ndarray
    image_grid_thw: np.ndarray
    rgb: np.ndarray | None = None
    rgb_shapes: np.ndarray | None = None

    @property
    def images(self) -> int:
        return int(self.image_grid_thw.shape[0])

    @property
    def nbytes(self) -> int:
        return self.pixel_values.nbytes + (0 if self.rgb is None else self.rgb.nbytes)

    @staticmethod
    def concat(parts: list[VisionInputs | None]) -> VisionInputs | None:
        """The images of several prompts, in order (what one generate call or micro-batch reads); None when none
        of them has an image."""
        held = [p for p in parts if p is not None and p.images]
        if not held:
            return None
        pixels = all(p.rgb is not None and p.rgb_shapes is not None for p in held)
        return VisionInputs(
            np.concatenate([p.pixel_values for p in held]),
            np.concatenate([p.image_grid_thw for p in held]),
            np.concatenate([p.rgb for p in held if p.rgb is not None]) if pixels else None,
            np.concatenate([p.rgb_shapes for p in held if p.rgb_shapes is not None]) if pixels else None,
        )

    def to_wire(self) -> dict[str, np.ndarray]:
        """The patches, or (when the images carry their pixels: for a vLLM rollout) the pixels instead."""
        if self.rgb is not None and self.rgb_shapes is not None:
            return {"image_rgb": self.rgb, "image_shapes": self.rgb_shapes, "image_grid_thw": self.image_grid_thw}
        return {"pixel_values": self.pixel_values, "image_grid_thw": self.image_grid_thw}

    @staticmethod
    def from_wire(payload: dict[str, Any]) -> VisionInputs | None:
        if "image_rgb" in payload:
            grid = np.asarray(payload["image_grid_thw"])
            rgb, shapes = np.asarray(payload["image_rgb"], dtype=np.uint8), np.asarray(payload["image_shapes"])
            return VisionInputs(np.zeros((0, 0), dtype=np.float32), grid, rgb, shapes)
        if "pixel_values" not in payload:
            return None
        return VisionInputs(np.asarray(payload["pixel_values"]), np.asarray(payload["image_grid_thw"]))

    def pil_images(self) -> list[Any]:
        """The images as PIL images, in order (from `rgb`: what a vLLM engine's processor reads)."""
        from PIL import Image

        if self.rgb is None or self.rgb_shapes is None:
            raise ValueError("these images travelled as patches only, not as pixels")
        images, offset = [], 0
        for height, width in self.rgb_shapes.tolist():
            size = height * width * 3
            images.append(Image.fromarray(self.rgb[offset : offset + size].reshape(height, width, 3), "RGB"))
            offset += size
        return images


def image_column(row: dict[str, Any], dataset: DatasetSpec) -> str | None:
    """The column holding the row's images, or None for a text-only row."""
    if dataset.image_key in row:
        return dataset.image_key
    if dataset.image_key == "images" and "image" in row:
        return "image"
    return None


def image_values(row: dict[str, Any], dataset: DatasetSpec) -> list[Any]:
    column = image_column(row, dataset)
    if column is None or row[column] is None:
        return []
    value = row[column]
    return list(value) if isinstance(value, list | tuple) else [value]


def sharded_image_problem(rows: list[dict[str, Any]], dataset: DatasetSpec) -> str | None:
    """Why `trainer.parallelism: fsdp2` cannot train a vision-language policy on these rows, or None.

    fsdp2 shards the vision tower's blocks too, and gathering a block's shards is a collective: every actor rank
    must run the tower at every pass, or the ranks' collectives stop pairing and the group hangs. A pass of
    text-only prompts on one rank would skip it, so every row needs an image."""
    missing = [number for number, row in enumerate(rows) if not image_values(row, dataset)]
    if not missing:
        return None
    more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
    return (
        f"fsdp2 shards a vision-language policy's vision tower over the actor ranks, and every rank must run it at "
        f"every pass: row {missing[0]} of the dataset has no image{more}. Give every row an image, or train with "
        "trainer.parallelism: ddp"
    )


def decode_image(value: Any, base_dir: Path | None, where: str) -> Any:
    """A PIL image (RGB) from one of the forms above; `where` ("row 3's images[0]") goes into every error."""
    from PIL import Image, UnidentifiedImageError

    if isinstance(value, Image.Image):
        return value.convert("RGB")
    path: Path | None = None
    data: bytes | None = None
    if isinstance(value, dict):  # a Hugging Face Image feature: bytes, or a path when the bytes are not embedded
        data = value.get("bytes")
        if data is None and value.get("path"):
            value = value["path"]
    if isinstance(value, bytes | bytearray | memoryview):
        data = bytes(value)
    elif isinstance(value, str):
        if value.startswith(("http://", "https://")):
            raise ImageError(
                f"{FIELD}: {where} is a remote URL ({value[:80]}); rljob's roles do not fetch images from the "
                "network: download them and point the column at files (or embed their bytes)"
            )
        if value.startswith("data:"):
            try:
                data = base64.b64decode(value.partition(",")[2], validate=True)
            except (binascii.Error, ValueError):
                raise ImageError(f"{FIELD}: {where} is a data: URI whose base64 does not decode") from None
        else:
            path = Path(value).expanduser()
            if not path.is_absolute() and base_dir is not None:
                path = base_dir / path
    elif data is None:
        raise ImageError(
            f"{FIELD}: {where} is {type(value).__name__}; an image is a path, bytes, a base64 data: URI or "
            '{"bytes": ...}'
        )
    try:
        if path is not None:
            if not path.is_file():
                raise ImageError(
                    f"{FIELD}: {where} is {path}, which does not exist (paths are relative to the "
                    "dataset file's directory)"
                )
            with Image.open(path) as image:
                return image.convert("RGB")
        assert data is not None
        with Image.open(io.BytesIO(data)) as image:
            return image.convert("RGB")
    except (UnidentifiedImageError, OSError) as exc:
        shown = str(path) if path is not None else f"{len(data or b'')} bytes"
        raise ImageError(f"{FIELD}: {where} ({shown}) is not a readable image ({exc})") from None


def fit_pixels(image: Any, min_pixels: int, max_pixels: int) -> Any:
    """`image` scaled (aspect kept) so that its pixel count lies in [min_pixels, max_pixels]; as it is inside."""
    pixels = image.width * image.height
    if min_pixels <= pixels <= max_pixels:
        return image
    factor = math.sqrt((max_pixels if pixels > max_pixels else min_pixels) / pixels)
    size = (max(1, int(image.width * factor)), max(1, int(image.height * factor)))
    return image.resize(size)


def row_images(row: dict[str, Any], number: int, dataset: DatasetSpec, base_dir: Path | None) -> list[Any]:
    """The row's images, decoded and fitted; ImageError names row `number` and the column."""
    column = image_column(row, dataset) or dataset.image_key
    return [
        fit_pixels(
            decode_image(value, base_dir, f"row {number}'s {column}[{i}]"), dataset.min_pixels, dataset.max_pixels
        )
        for i, value in enumerate(image_values(row, dataset))
    ]


def check_images(rows: list[dict[str, Any]], dataset: DatasetSpec, base_dir: Path | None) -> None:
    """Every image of every row can be read (its header: cheap for a large dataset); the first that cannot is an
    ImageError naming its row. Run before anything starts (`rljob run`, `rljob validate --load`)."""
    from PIL import Image, UnidentifiedImageError

    for number, row in enumerate(rows):
        column = image_column(row, dataset) or dataset.image_key
        for i, value in enumerate(image_values(row, dataset)):
            where = f"row {number}'s {column}[{i}]"
            if isinstance(value, str) and not value.startswith(("http://", "https://", "data:")):
                path = Path(value).expanduser()
                path = path if path.is_absolute() or base_dir is None else base_dir / path
                if not path.is_file():
                    decode_image(value, base_dir, where)  # raises, naming the row
                try:
                    with Image.open(path):
                        pass
                except (UnidentifiedImageError, OSError) as exc:
                    raise ImageError(f"{FIELD}: {where} ({path}) is not a readable image ({exc})") from None
            else:
                decode_image(value, base_dir, where)


class VisionPrompts:
    """Renders and encodes the prompts of a vision-language policy: text with image tokens, and `VisionInputs`.

    `image_processor` is the policy's (a Qwen2-VL image processor: `merge_size`, `__call__(images=...)` returning
    `pixel_values` and `image_grid_thw`); `tokenizer` knows the model's vision tokens."""

    def __init__(
        self, tokenizer: Any, image_processor: Any, image_token: str = "<|image_pad|>", keep_pixels: bool = False
    ) -> None:
        self.tokenizer = tokenizer
        self.keep_pixels = keep_pixels
        """Whether `VisionInputs` also carry the images' pixels (for a vLLM rollout)."""
        self.image_processor = image_processor
        self.image_token = image_token
        self.image_token_id = tokenizer.convert_tokens_to_ids(image_token)
        self.merge = int(getattr(image_processor, "merge_size", 2)) ** 2
        self.image_text = f"<|vision_start|>{image_token}<|vision_end|>"

    def place(self, text: str, images: int, where: str) -> str:
        """`text` with each `<image>` placeholder replaced by the model's image markup; without placeholders the
        images come first (as EasyR1 does); a count that differs from the row's images is an error."""
        found = text.count(IMAGE_PLACEHOLDER)
        if found == 0:
            return self.image_text * images + text
        if found != images:
            raise ImageError(
                f"{FIELD}: {where} has {images} image(s) but its prompt has {found} {IMAGE_PLACEHOLDER} "
                "placeholder(s): one placeholder per image, or none (the images then go first)"
            )
        return text.replace(IMAGE_PLACEHOLDER, self.image_text)

    def encode(
        self, text: str, images: list[Any], add_special_tokens: bool = True
    ) -> tuple[list[int], VisionInputs | None]:
        """Token ids with each image token repeated once per merged patch, and the images' processor output (None
        for a text-only prompt)."""
        ids = self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]
        if not images:
            return ids, None
        processed = self.image_processor(images=images, return_tensors="np")
        grid = np.asarray(processed["image_grid_thw"], dtype=np.int64)
        counts = iter((grid.prod(-1) // self.merge).tolist())
        expanded: list[int] = []
        for token in ids:
            expanded.extend([token] * next(counts) if token == self.image_token_id else [token])
        pixels = np.asarray(processed["pixel_values"], dtype=np.float32)
        if not self.keep_pixels:
            return expanded, VisionInputs(pixels, grid)
        arrays = [np.asarray(image.convert("RGB"), dtype=np.uint8) for image in images]
        rgb = np.concatenate([a.reshape(-1) for a in arrays])
        return expanded, VisionInputs(pixels, grid, rgb, np.asarray([a.shape[:2] for a in arrays], dtype=np.int64))


def images_base_dir(dataset: DatasetSpec, base_dir: Path | None) -> Path | None:
    """Where a row's relative image paths start: the dataset file's directory (or the dataset directory)."""
    if dataset.path is None:
        return base_dir
    path = Path(dataset.path).expanduser()
    if not path.is_absolute() and base_dir is not None:
        path = base_dir / path
    return path if path.is_dir() else path.parent


class VisionCache:
    """Encoded images of the rows most recently used, up to `max_bytes`: a row's images are decoded and processed
    once while it stays here (a group's samples and a re-sent chunk reuse them), without holding a large dataset's
    pixels in memory."""

    def __init__(self, max_bytes: int = 512 * 2**20) -> None:
        self.max_bytes = max_bytes
        self.bytes = 0
        self._entries: dict[int, VisionInputs] = {}

    def get(self, key: int) -> VisionInputs | None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            self._entries[key] = entry  # most recent last
        return entry

    def put(self, key: int, value: VisionInputs) -> None:
        self.bytes += value.nbytes
        self._entries[key] = value
        while self.bytes > self.max_bytes and len(self._entries) > 1:
            oldest = next(iter(self._entries))
            self.bytes -= self._entries.pop(oldest).nbytes
