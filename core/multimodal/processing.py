"""A vision-language model's image preprocessing: its published image processor from transformers
(the one its `preprocessor_config.json` names) and how one image's placeholder token grows into
the run of tokens its encoder output fills.

The chat template writes one placeholder token per image (Qwen2.5-VL's `<|image_pad|>`); `expand`
widens each into the image's full token run, as the model's transformers processor does, and
records where it landed (`MultiModalInput.offset`). An image the processor cuts into several
pieces (Gemma 3's pan-and-scan crops) gets one run and one record per piece.

Options a caller may set on the processor (vLLM's `mm_processor_kwargs`: the engine's
`--mm-processor-kwargs`, and a request's own over them) are the model's `OPTIONS`, each checked
before any image is read.
"""
from __future__ import annotations

import io
from collections.abc import Callable, Mapping
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


@dataclass(frozen=True)
class Option:
    """One processor option a caller may set: `accepts` its value, which `wanted` describes."""

    accepts: Callable[[Any], bool]
    wanted: str


def checked_options(allowed: Mapping[str, Option], kwargs: Mapping[str, Any] | None) -> dict[str, Any]:
    """`kwargs` (vLLM's mm_processor_kwargs) once every name is one of `allowed` and every value fits."""
    if kwargs is None:
        return {}
    if not isinstance(kwargs, Mapping):
        raise InvalidRequestError(f"mm_processor_kwargs must be a JSON object, got {kwargs!r}",
                                  param="mm_processor_kwargs")
    for name, value in kwargs.items():
        if name not in allowed:
            takes = f"it takes {', '.join(sorted(allowed))}" if allowed else "it takes none"
            raise InvalidRequestError(f"mm_processor_kwargs: this model's image processor has no option {name!r} "
                                      f"({takes})", param="mm_processor_kwargs")
        if not allowed[name].accepts(value):
            raise InvalidRequestError(f"mm_processor_kwargs: {name} must be {allowed[name].wanted}, got {value!r}",
                                      param="mm_processor_kwargs")
    return dict(kwargs)


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
        return _rgb(image)
    except (OSError, ValueError, SyntaxError) as exc:  # a truncated or corrupt body under a valid header
        raise InvalidRequestError(f"the image is corrupt ({type(exc).__name__}: {exc})",
                                  param="messages", code="invalid_image") from exc


def _rgb(image):
    """RGB pixels; transparent ones over white, as transformers' `convert_to_rgb` and vLLM composite
    them (dropping the alpha would show whatever colour a transparent pixel happens to hold)."""
    from PIL import Image

    if not image.has_transparency_data:
        return image.convert("RGB")
    rgba = image.convert("RGBA")
    return Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba).convert("RGB")


def check_pixels(size: tuple[int, int], max_pixels: int) -> None:
    width, height = size
    if width * height > max_pixels:
        raise InvalidRequestError(f"the image is {width} x {height} = {width * height} pixels, over the limit of "
                                  f"{max_pixels} pixels (--max-image-pixels)", param="messages",
                                  code="image_too_large")


class ImageProcessing:
    """Preprocessing for one served model.

        processing = image_processing_for(model_dir, hf_config, defaults)   # processors.py; None: text-only
        options = processing.options(request_kwargs)       # the defaults, with a request's own over them
        processed = [processing.process(image, options) for image in images]
        token_ids, items = processing.expand(token_ids, processed)
    """

    # The processor options a caller may set (none for Qwen2.5-VL).
    OPTIONS: Mapping[str, Option] = {}

    def __init__(self, image_processor: Any, hf_config, defaults: Mapping[str, Any] | None = None):
        self.image_processor = image_processor
        self.image_token_id: int = hf_config.image_token_id
        # The token the chat template writes for each image.
        self.placeholder_id: int = self.image_token_id
        # Newline-run tokens by length, for tokenizers with one token per run (Gemma's): the newlines
        # an image's tokens begin and end with merge with the prompt's next to them, as the
        # processor's re-tokenized text does.
        self.newlines: dict[int, int] = {}
        self.merge_size = getattr(hf_config.vision_config, "spatial_merge_size", 1)
        self.defaults = checked_options(self.OPTIONS, defaults)

    def options(self, kwargs: Mapping[str, Any] | None) -> dict[str, Any]:
        """The engine's options with a request's `kwargs` over them, checked."""
        return {**self.defaults, **checked_options(self.OPTIONS, kwargs)}

    def process(self, image, options: Mapping[str, Any] | None = None) -> ProcessedImage:
        """Pixel values, patch grid and placeholder count of one RGB PIL image."""
        out = self.image_processor(images=[image], return_tensors="np", **(options or {}))
        pixels = np.asarray(out["pixel_values"], dtype=np.float32)
        grid = [int(g) for g in np.asarray(out["image_grid_thw"])[0]]
        return ProcessedImage(pixels, grid, int(np.prod(grid)) // self.merge_size ** 2)

    def replacement(self, image: ProcessedImage) -> tuple[list[int], list[tuple[int, ProcessedImage]]]:
        """The tokens an image's placeholder becomes, and each piece the encoder reads with the
        offset of its run in those tokens: here the one run of image tokens."""
        return [self.image_token_id] * image.num_tokens, [(0, image)]

    def expand(self, token_ids: list[int], images: list[ProcessedImage]) -> tuple[list[int], list[MultiModalInput]]:
        """`token_ids` with each image's placeholder widened to its tokens, and the records of the
        pieces the encoder reads, in prompt order."""
        spots = [i for i, t in enumerate(token_ids) if t == self.placeholder_id]
        if len(spots) != len(images):
            raise InvalidRequestError(f"the prompt holds {len(spots)} image placeholders for {len(images)} images "
                                      "(the chat template writes one per image part)", param="messages")
        out: list[int] = []
        items: list[MultiModalInput] = []
        last = 0
        for spot, image in zip(spots, images):
            self._join(out, token_ids[last:spot])
            tokens, pieces = self.replacement(image)
            self._join(out, tokens)
            # `_join` may merge the first token into the last one before it; the rest end `out`.
            start = len(out) - len(tokens)
            items += [MultiModalInput.build(piece.pixels, piece.grid_thw, start + at, piece.num_tokens)
                      for at, piece in pieces]
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

    def prompt(self, token_ids: list[int], images: list, options: Mapping[str, Any] | None = None) -> dict:
        """The engine's prompt for a rendered conversation and its RGB PIL images, in order;
        `options` as `options()` gives them (None: the engine's)."""
        options = self.defaults if options is None else options
        ids, items = self.expand(token_ids, [self._processed(image, options) for image in images])
        return {"prompt_token_ids": ids, "mm_inputs": items}

    def _processed(self, image, options: Mapping[str, Any]) -> ProcessedImage:
        """`process`, with the model's processor refusing an image (an aspect ratio it cannot resize,
        say) as the request's fault."""
        try:
            return self.process(image, options)
        except InvalidRequestError:
            raise
        except ValueError as exc:
            raise InvalidRequestError(f"the image cannot be processed for this model ({exc})", param="messages",
                                      code="invalid_image") from exc
