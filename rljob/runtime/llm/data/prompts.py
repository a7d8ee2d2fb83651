"""A row to the prompt the policy reads: token ids, and for a vision-language policy its images' `VisionInputs`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rljob.api.spec import LLMTask
from rljob.runtime.llm.data.images import IMAGE_PLACEHOLDER, VisionInputs, VisionPrompts, images_base_dir, row_images
from rljob.runtime.llm.data.rows import Row, encode_prompt, render_prompt


class PromptEncoder:
    """Encodes rows as `encode_prompt` does; with an image processor (a vision-language policy's, carried by its
    tokenizer as `image_processor`) the row's images go into the prompt too.

    `encode` raises `ImageError` (naming the row and the column) for a row whose image cannot be used."""

    def __init__(self, task: LLMTask, tokenizer: Any, base_dir: Path | None = None, keep_pixels: bool = False) -> None:
        self.task = task
        self.tokenizer = tokenizer
        processor = getattr(tokenizer, "image_processor", None)
        # A vLLM rollout runs the image processor itself: the images go to it as pixels (`keep_pixels`).
        self.vision = None if processor is None else VisionPrompts(tokenizer, processor, keep_pixels=keep_pixels)
        self.base_dir = images_base_dir(task.dataset, base_dir)

    def encode(self, row: Row, number: int) -> tuple[list[int], VisionInputs | None]:
        if self.vision is None:
            return encode_prompt(self.task, row, self.tokenizer), None
        images = row_images(row, number, self.task.dataset, self.base_dir)
        key = self.task.dataset.prompt_key
        if images and IMAGE_PLACEHOLDER not in self.task.prompt_template + str(row[key]):
            # The images open the prompt, inside the user's turn when the chat template wraps it (as EasyR1 does).
            row = {**row, key: IMAGE_PLACEHOLDER * len(images) + str(row[key])}
        text = self.vision.place(render_prompt(self.task, row, self.tokenizer), len(images), f"row {number}")
        bos = getattr(self.tokenizer, "bos_token", None)
        return self.vision.encode(text, images, add_special_tokens=not (bos and text.startswith(bos)))
