"""What a vision-language model adds to the memory profile that sizes the KV cache (vLLM's
`profile_run` with `_dummy_mm_inputs`).

Two things live outside the KV cache and grow with images:
- the vision tower's activations for the largest batch of images one step may encode. The
  scheduler's `EncoderBudget` starts at most `max_num_batched_tokens` encoder rows a step (and
  never more than the encoder cache holds), except that an image larger than that runs alone; no
  image is longer than `max_model_len` (its placeholders sit in one prompt). `worst_case_images`
  fills that bound with the largest images the model's image processor admits, then smaller ones
  for the rest (Qwen2.5-VL's resolution varies; Gemma 3's is one square, and each of its
  pan-and-scan crops is one more such square, its own item: the budget bounds them all alike).
- the encoder cache: `ENCODER_CACHE_ROWS` rows of the language model's width, which the
  scheduler fills with the images it keeps.

The pixels are zeros: the tower's memory depends on the patch count, not on what the patches hold.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from .budget import ENCODER_CACHE_ROWS
from .inputs import MultiModalInput

logger = logging.getLogger("corectl.multimodal")


@dataclass(frozen=True)
class DummyImage:
    """One synthetic image as the processor would give it: pixel values' shape, grid, encoder rows."""

    pixel_shape: tuple[int, ...]
    grid_thw: tuple[int, ...]
    rows: int


@dataclass
class EncodedBatch:
    """The worst-case batch, encoded: its outputs stay referenced (`outputs`) for as long as the
    text dummy step runs, as a real step's encoder rows are while the language model reads them."""

    images: list[MultiModalInput]
    outputs: list[torch.Tensor]
    # The encoder cache full: its capacity in rows at the outputs' width and dtype.
    cache_bytes: int

    @property
    def rows(self) -> int:
        return sum(item.length for item in self.images)


def worst_case_images(hf_config, model_dir: Path | None, budget_rows: int, max_model_len: int) -> list[MultiModalInput]:
    """The images of the step that encodes the most rows; none when this model folder has no
    image processor (the server then refuses images, so the tower never runs)."""
    largest = _sizer(hf_config, model_dir)
    if largest is None:
        return []
    sizes = [largest(max_model_len)]
    if sizes[0] is None:
        return []
    room = min(budget_rows, ENCODER_CACHE_ROWS) - sizes[0].rows
    while room > 0:
        image = largest(min(room, max_model_len))
        if image is None:
            break
        sizes.append(image)
        room -= image.rows
    return [_dummy_input(image, i) for i, image in enumerate(sizes)]


def encode(model, images: list[MultiModalInput]) -> EncodedBatch:
    """The batch through the model's tower, as `MultiModalStep` encodes a step's images."""
    with torch.inference_mode():
        outputs = model.encode_images(images)
    return EncodedBatch(images, outputs, encoder_cache_bytes(outputs[0].shape[-1], outputs[0].element_size()))


def encoder_cache_bytes(width: int, itemsize: int) -> int:
    """The encoder cache full: `ENCODER_CACHE_ROWS` rows of the language model's width."""
    return ENCODER_CACHE_ROWS * width * itemsize


def serves_images(model_cls: type, model_dir: Path | None) -> bool:
    """Whether an engine of `model_cls` on this folder encodes images (and so keeps an encoder cache):
    a vision-language model whose folder holds an image processor config."""
    return hasattr(model_cls, "encode_images") and _image_processor(model_dir) is not None


def _dummy_input(image: DummyImage, index: int) -> MultiModalInput:
    values = bytes(4 * math.prod(image.pixel_shape))
    return MultiModalInput(f"profile-{index}", 0, image.rows, values, list(image.pixel_shape), list(image.grid_thw))


def _sizer(hf_config, model_dir: Path | None):
    """A function of a row limit giving the largest image the model's processor admits within it
    (None: no image is that small), or None when the folder holds no image processor config."""
    processor = _image_processor(model_dir)
    if processor is None:
        return None
    vision = hf_config.vision_config
    if getattr(hf_config, "model_type", None) == "gemma3":
        rows = hf_config.mm_tokens_per_image
        square = DummyImage((1, vision.num_channels, vision.image_size, vision.image_size), (), rows)
        return lambda limit: square if rows <= limit else None
    return lambda limit: _largest_grid_image(processor, vision, limit)


def _largest_grid_image(processor, vision, limit: int) -> DummyImage | None:
    """Qwen2.5-VL's processor resizes an image to a grid of (patch x merge)-pixel cells between its
    min and max pixel counts; one merged cell is one row. The largest square within both bounds."""
    cell = processor.patch_size * processor.merge_size
    side = min(math.isqrt(processor.size["longest_edge"]) // cell, math.isqrt(limit))
    if side == 0 or (side * cell) ** 2 < processor.size["shortest_edge"]:
        return None
    grid = side * processor.merge_size
    patch = vision.in_channels * processor.temporal_patch_size * processor.patch_size ** 2
    return DummyImage((grid * grid, patch), (1, grid, grid), side * side)


def _image_processor(model_dir: Path | None):
    if model_dir is None:
        return None
    # transformers' image stack costs seconds to import: only a vision-language model's profile pays it.
    from transformers import AutoImageProcessor

    try:
        return AutoImageProcessor.from_pretrained(str(model_dir), local_files_only=True)
    except (OSError, ValueError) as exc:
        logger.info("no image processor in %s (%s): images cannot be served, so none are profiled", model_dir, exc)
        return None
