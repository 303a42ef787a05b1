"""Gemma 3's image prompts: its chat template writes `<start_of_image>` per image, which
transformers' Gemma3Processor widens to "\\n\\n<start_of_image>" + mm_tokens_per_image image
tokens + "<end_of_image>\\n\\n" in the text before tokenizing. Here the same happens on token ids,
each wrap's "\\n\\n" merged with a neighbouring newline run into one token as Gemma's tokenizer
writes it (vLLM's rule). Pan-and-scan (extra crops of large images) is off: every image is one
square of `vision_config.image_size`, whatever the processor config says.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
from transformers import AutoTokenizer

from .processing import ImageProcessing, ProcessedImage

logger = logging.getLogger("corectl.multimodal")

# Gemma's vocabulary holds one token for each run of up to 31 newlines.
_LONGEST_NEWLINE_RUN = 31


class Gemma3ImageProcessing(ImageProcessing):
    def __init__(self, image_processor: Any, hf_config, model_dir: Path):
        super().__init__(image_processor, hf_config)
        tokenizer = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
        self.placeholder_id = hf_config.boi_token_id
        self.num_tokens = hf_config.mm_tokens_per_image
        for n in range(1, _LONGEST_NEWLINE_RUN + 1):
            ids = tokenizer.encode("\n" * n, add_special_tokens=False)
            if len(ids) == 1:
                self.newlines[n] = ids[0]
        newline = tokenizer.encode("\n\n", add_special_tokens=False)
        self.wrap = ([*newline, hf_config.boi_token_id], [hf_config.eoi_token_id, *newline])
        if getattr(image_processor, "do_pan_and_scan", False):
            logger.warning("the image processor asks for pan-and-scan crops; corectl reads each image as one "
                           "square without them")

    def process(self, image) -> ProcessedImage:
        out = self.image_processor(images=[image], do_pan_and_scan=False, return_tensors="np")
        return ProcessedImage(np.asarray(out["pixel_values"], dtype=np.float32), [], self.num_tokens)
