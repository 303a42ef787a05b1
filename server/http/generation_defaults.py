"""Sampling defaults from the model's `generation_config.json` (vLLM's `--generation-config auto`).

A request's field that is unset takes the model's value where the checkpoint sets one, as in vLLM:
temperature, top_p, top_k, min_p, repetition_penalty, and max_new_tokens as max_tokens.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

logger = logging.getLogger("corectl.server")

# generation_config.json key -> SamplingParams field (vLLM's `get_diff_sampling_param`).
_FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
           "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def generation_defaults(source: str, model_dir: str | None) -> dict[str, Any]:
    """`source`: "vllm" (no defaults), "auto" (the model folder's file) or a folder holding one."""
    if source == "vllm":
        return {}
    folder = model_dir if source == "auto" else source
    path = None if folder is None else Path(folder) / "generation_config.json"
    if path is None or not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        logger.warning("ignoring %s: %s", path, exc)
        return {}
    defaults = {field: config[key] for key, field in _FIELDS.items() if config.get(key) is not None}
    if defaults:
        logger.info("sampling defaults from %s (requests that leave them unset): %s", path,
                    ", ".join(f"{k}={v}" for k, v in sorted(defaults.items())))
    return defaults
