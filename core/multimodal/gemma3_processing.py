"""Gemma 3's image prompts: its chat template writes `<start_of_image>` per image, which
transformers' Gemma3Processor widens to "\\n\\n<start_of_image>" + mm_tokens_per_image image
tokens + "<end_of_image>\\n\\n" in the text before tokenizing. Here the same happens on token ids,
each wrap's "\\n\\n" merged with a neighbouring newline run into one token as Gemma's tokenizer
writes it (vLLM's rule).

Pan-and-scan (the processor's `do_pan_and_scan`, off unless the checkpoint's processor config, the
engine's `--mm-processor-kwargs` or a request's `mm_processor_kwargs` turns it on) cuts an image
whose sides differ enough into 2 to `pan_and_scan_max_num_crops` crops; the processor gives the
whole image's square, then each crop's. The placeholder then becomes Gemma3Processor's text
"Here is the original image <image> and here are some crops to help you see better <image> <image>"
with each <image> a full wrap: one run of image tokens, and one `MultiModalInput`, per square.
"""
from __future__ import annotations

import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
from transformers import AutoTokenizer

from .processing import ImageProcessing, Option, ProcessedImage

# Gemma's vocabulary holds one token for each run of up to 31 newlines.
_LONGEST_NEWLINE_RUN = 31
# Crops of one image at most: each is a square of pixels the request holds until it finishes
# (9.6 MB in float32 at the published 896 x 896), and 256 more prompt tokens.
MAX_CROPS = 16


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


PAN_AND_SCAN_OPTIONS = {
    "do_pan_and_scan": Option(lambda v: isinstance(v, bool), "true or false"),
    "pan_and_scan_min_crop_size": Option(_positive_int, "a positive integer (pixels)"),
    "pan_and_scan_max_num_crops": Option(lambda v: _positive_int(v) and v <= MAX_CROPS,
                                         f"an integer from 1 to {MAX_CROPS}"),
    "pan_and_scan_min_ratio_to_activate": Option(
        lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0, "a positive number"),
}


class Gemma3ImageProcessing(ImageProcessing):
    OPTIONS = PAN_AND_SCAN_OPTIONS

    def __init__(self, image_processor: Any, hf_config, model_dir: Path, defaults: Mapping[str, Any] | None = None):
        super().__init__(image_processor, hf_config, defaults)
        # What Gemma3Processor passes for the options the checkpoint's processor config leaves null.
        self.processor_defaults = {name: value for name, value in _gemma3_processor_defaults().items()
                                   if name in self.OPTIONS and getattr(image_processor, name, None) is None}
        self.tokenizer = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
        self.placeholder_id = hf_config.boi_token_id
        self.num_tokens = hf_config.mm_tokens_per_image
        for n in range(1, _LONGEST_NEWLINE_RUN + 1):
            ids = self.tokenizer.encode("\n" * n, add_special_tokens=False)
            if len(ids) == 1:
                self.newlines[n] = ids[0]
        boi, eoi, image = self.tokenizer.convert_ids_to_tokens(
            [hf_config.boi_token_id, hf_config.eoi_token_id, hf_config.image_token_id])
        self._full_image = f"\n\n{boi}{image * self.num_tokens}{eoi}\n\n"
        # By crop count: the replacement's tokens and where each square's run of image tokens starts.
        self._sequences: dict[int, tuple[list[int], list[int]]] = {}
        # Requests preprocess in several threads; the tokenizer is not safe to share across them.
        self._lock = threading.Lock()

    def process(self, image, options: Mapping[str, Any] | None = None) -> ProcessedImage:
        options = {**self.processor_defaults, **(options or {})}
        out = self.image_processor(images=[image], return_tensors="np", **options)
        return ProcessedImage(np.asarray(out["pixel_values"], dtype=np.float32), [], self.num_tokens)

    def replacement(self, image: ProcessedImage) -> tuple[list[int], list[tuple[int, ProcessedImage]]]:
        squares = image.pixels.shape[0]
        tokens, starts = self._sequence(squares - 1)
        return tokens, [(at, ProcessedImage(image.pixels[i:i + 1], [], self.num_tokens))
                        for i, at in enumerate(starts)]

    def _sequence(self, crops: int) -> tuple[list[int], list[int]]:
        """Gemma3Processor's text for an image with `crops` crops, tokenized as its prompt is."""
        with self._lock:
            if crops not in self._sequences:
                text = self._full_image if crops == 0 else (
                    f"Here is the original image {self._full_image} and here are some crops to help you see "
                    f"better " + " ".join([self._full_image] * crops))
                tokens = self.tokenizer.encode(text, add_special_tokens=False)
                starts = [i for i, t in enumerate(tokens)
                          if t == self.image_token_id and (i == 0 or tokens[i - 1] != self.image_token_id)]
                self._sequences[crops] = tokens, starts
            return self._sequences[crops]


def _gemma3_processor_defaults() -> dict[str, Any]:
    """Gemma3Processor's image options (transformers 5: a class attribute; 4.x: its kwargs class)."""
    from transformers.models.gemma3 import processing_gemma3

    processor = processing_gemma3.Gemma3Processor
    if isinstance(getattr(processor, "images_kwargs", None), dict):
        return processor.images_kwargs
    return processing_gemma3.Gemma3ProcessorKwargs._defaults["images_kwargs"]
