"""Sampling defaults from the model's `generation_config.json` (vLLM's `generation_config` option).

A sampling field the caller leaves unset takes the model's value where the checkpoint sets one, as in
vLLM: temperature, top_p, top_k, min_p, repetition_penalty, and max_new_tokens as max_tokens. The
server fills a request's unset fields with them; the offline `LLM` builds its default
SamplingParams from them. `source` is "auto" (the model folder's file), "vllm" (none: vLLM's own
defaults) or a folder holding a generation_config.json. vLLM's `override_generation_config` (the
same keys, a dict or its JSON text) sets fields over whatever the source gives.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from .errors import ConfigError
from .json_option import decode_json_option

logger = logging.getLogger("corectl")

GENERATION_CONFIG_CHOICES = ("auto", "vllm")
# generation_config.json key -> SamplingParams field (vLLM's `get_diff_sampling_param`).
_FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
           "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def check_generation_config(source: str) -> str:
    """`source` if it is one of the choices or an existing folder; else a ConfigError naming the option."""
    if source not in GENERATION_CONFIG_CHOICES and not Path(source).is_dir():
        raise ConfigError("generation_config", f"must be auto, vllm or a folder, got {source!r}")
    return source


def check_generation_overrides(overrides: Any) -> dict[str, Any]:
    """The SamplingParams fields vLLM's `override_generation_config` sets (generation_config.json keys),
    checked as sampling params; a ConfigError names the option."""
    from .sampling_params import SamplingParams

    field = "override_generation_config"
    overrides = decode_json_option(field, overrides) if overrides is not None else {}
    if not isinstance(overrides, dict):
        raise ConfigError(field, f"must be a JSON object such as {{\"temperature\": 0.5}}, got {overrides!r}")
    unknown = sorted(set(overrides) - set(_FIELDS))
    if unknown:
        raise ConfigError(field, f"{unknown[0]!r} is not a sampling default; the keys are {', '.join(_FIELDS)}")
    fields = {_FIELDS[key]: value for key, value in overrides.items() if value is not None}
    for key, value in fields.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(field, f"{key} must be a number, got {value!r}")
    try:
        SamplingParams(**fields)
    except (TypeError, ValueError) as exc:
        raise ConfigError(field, str(exc)) from None
    return fields


def generation_defaults(source: str, model_dir: str | None, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """The SamplingParams fields `source` sets (empty for "vllm", or when there is no file), then
    `overrides` (`check_generation_overrides`'s) over them."""
    return {**_source_defaults(source, model_dir), **(overrides or {})}


def _source_defaults(source: str, model_dir: str | None) -> dict[str, Any]:
    if check_generation_config(source) == "vllm":
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
        logger.info("sampling defaults from %s (for the fields left unset): %s", path,
                    ", ".join(f"{k}={v}" for k, v in sorted(defaults.items())))
    return defaults
