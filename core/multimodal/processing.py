"""A vision-language model's image preprocessing: its published image processor from transformers
(the one its `preprocessor_config.json` names) and how one image's placeholder token grows into
the run of tokens its encoder output fills.

The chat template writes one placeholder token per image (Qwen2.5-VL's `<|image_pad|>`); `expand`
widens each into the image's full token run, as the model's transformers processor does, and
records where it landed (`MultiModalInput.offset`).
"""
from __future__ import annotations

import io
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import InvalidRequestError
from .inputs import MultiModalInput


@dataclass(frozen=True)
class ProcessedImage:
    pixels: np.ndarray
    grid_thw: list[int]
    num_tokens: int


def decode_image(data: bytes, max_pixels: int):
    """The RGB image in `data` (any format PIL reads); the size in its header is checked against
    `max_pixels` before a pixel is decoded, so a small file cannot unpack into gigabytes."""
    from PIL import Image, UnidentifiedImageError

    try:
        image = Image.open(io.BytesIO(data))
    except Image.DecompressionBombError as exc:  # PIL's own bound, far above ours, hit on opening
        raise InvalidRequestError(f"the image is too large to decode ({exc})", param="messages",
                                  code="image_too_large") from exc
    except (UnidentifiedImageError, OSError, ValueError) as exc:
        raise InvalidRequestError(f"the image cannot be read ({type(exc).__name__}: {exc})",
                                  param="messages", code="invalid_image") from exc
    check_pixels(image.size, max_pixels)
    try:
        return image.convert("RGB")
    except (OSError, ValueError, SyntaxError) as exc:  # a truncated or corrupt body under a valid header
        raise InvalidRequestError(f"the image is corrupt ({type(exc).__name__}: {exc})",
                                  param="messages", code="invalid_image") from exc


def check_pixels(size: tuple[int, int], max_pixels: int) -> None:
    width, height = size
    if width * height > max_pixels:
        raise InvalidRequestError(f"the image is {width} x {height} = {width * height} pixels, over the limit of "
                                  f"{max_pixels} pixels (--max-image-pixels)", param="messages",
                                  code="image_too_large")


class ImageProcessing:
    """Preprocessing for one served model.

        processing = image_processing_for(model_dir, hf_config)   # processors.py; None: text-only
        processed = [processing.process(image) for image in images]
        token_ids, items = processing.expand(token_ids, processed)
    """

    def __init__(self, image_processor: Any, hf_config):
        self.image_processor = image_processor
        self.image_token_id: int = hf_config.image_token_id
        # The token the chat template writes for each image.
        self.placeholder_id: int = self.image_token_id
        # Tokens around each image's run (Gemma 3: "\n\n<start_of_image>" and "<end_of_image>\n\n").
        self.wrap: tuple[list[int], list[int]] = ([], [])
        # Newline-run tokens by length, for tokenizers with one token per run (Gemma's): a wrap's
        # newlines merge with the prompt's next to them, as the processor's re-tokenized text does.
        self.newlines: dict[int, int] = {}
        self.merge_size = getattr(hf_config.vision_config, "spatial_merge_size", 1)

    def process(self, image) -> ProcessedImage:
        """Pixel values, patch grid and placeholder count of one RGB PIL image."""
        out = self.image_processor(images=[image], return_tensors="np")
        pixels = np.asarray(out["pixel_values"], dtype=np.float32)
        grid = [int(g) for g in np.asarray(out["image_grid_thw"])[0]]
        return ProcessedImage(pixels, grid, int(np.prod(grid)) // self.merge_size ** 2)

    def expand(self, token_ids: list[int], images: list[ProcessedImage]) -> tuple[list[int], list[MultiModalInput]]:
        """`token_ids` with each image's placeholder widened to its token run, and the images'
        records in prompt order."""
        spots = [i for i, t in enumerate(token_ids) if t == self.placeholder_id]
        if len(spots) != len(images):
            raise InvalidRequestError(f"the prompt holds {len(spots)} image placeholders for {len(images)} images "
                                      "(the chat template writes one per image part)", param="messages")
        out: list[int] = []
        items: list[MultiModalInput] = []
        last = 0
        before, after = self.wrap
        for spot, image in zip(spots, images):
            self._join(out, token_ids[last:spot])
            self._join(out, before)
            items.append(MultiModalInput.build(image.pixels, image.grid_thw, len(out), image.num_tokens))
            out += [self.image_token_id] * image.num_tokens + after
            last = spot + 1
        self._join(out, token_ids[last:])
        return out, items

    def _join(self, out: list[int], tokens: list[int]) -> None:
        """Append `tokens`, one newline run where `out` ends and `tokens` begins with newlines."""
        runs = {token: n for n, token in self.newlines.items()}
        if out and tokens and out[-1] in runs and tokens[0] in runs:
            merged = self.newlines.get(runs[out[-1]] + runs[tokens[0]])
            if merged is not None:
                out[-1:] = [merged]
                tokens = tokens[1:]
        out += tokens

    def prompt(self, token_ids: list[int], images: list) -> dict:
        """The engine's prompt for a rendered conversation and its RGB PIL images, in order."""
        ids, items = self.expand(token_ids, [self.process(image) for image in images])
        return {"prompt_token_ids": ids, "mm_inputs": items}
