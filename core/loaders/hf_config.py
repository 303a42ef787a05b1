"""Reading a checkpoint's config.json into a transformers config, with the user's overrides."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from transformers import CONFIG_MAPPING, PretrainedConfig

from ..errors import ConfigError, ModelNotFoundError

DTYPE_NAMES = ("float32", "bfloat16", "float16")


def remote_code_note(config: dict[str, Any]) -> str:
    """What to say about a checkpoint whose config points at its own Python code (`auto_map`)."""
    auto_map = config.get("auto_map")
    if not isinstance(auto_map, dict) or not auto_map:
        return ""
    return (f"; the checkpoint ships its own model code (auto_map: {', '.join(sorted(auto_map))}), which corectl "
            "never runs, --trust-remote-code or not: it serves the architectures it implements (`corectl plugins`)")


def load_hf_config(source: Path, overrides: dict[str, Any] | None) -> tuple[PretrainedConfig, str | None]:
    """(config, checkpoint dtype name or None) from a folder holding config.json, or a config file.

    Overrides join the raw dict before the config class is built, so derived fields (e.g. the rope
    parameters transformers computes from `rope_theta`/`rope_scaling`) see them.
    """
    try:
        config_dict, _ = PretrainedConfig.get_config_dict(str(source))
    except (OSError, ValueError) as exc:
        raise ModelNotFoundError(f"cannot read a model config from {source}: {exc}") from exc
    except (TypeError, AttributeError, KeyError) as exc:  # transformers reads the JSON as a mapping
        raise ConfigError("model", f"the config at {source} is not an object of model settings "
                                   f"({type(exc).__name__}: {exc})") from exc
    if not isinstance(config_dict, dict):
        raise ConfigError("model", f"the config at {source} holds a JSON {type(config_dict).__name__}, "
                                   "not an object of model settings")
    config_dict = _with_overrides(config_dict, overrides or {})
    model_type = config_dict.get("model_type")
    if not isinstance(model_type, str) or model_type not in CONFIG_MAPPING:
        raise ConfigError(
            "model",
            f"config at {source} has model_type {model_type!r}, which the installed transformers does not know "
            "(a decoder-only model such as llama, mistral, qwen2 or qwen3 is expected)" + remote_code_note(config_dict),
        )
    try:
        config = CONFIG_MAPPING[model_type].from_dict(config_dict)
    except Exception as exc:  # transformers checks fields its own way: any refusal is the file's fault
        raise ConfigError("model", f"the config at {source} is not a valid {model_type} config: "
                                   f"{type(exc).__name__}: {exc}") from exc
    lift_text_config(config)
    return config, checkpoint_dtype(config_dict)


# Rope keys of older configs (and vLLM's --rope-theta/--rope-scaling), which transformers folds into
# `rope_parameters` only where the file has none.
_OLD_ROPE_KEYS = ("rope_theta", "rope_scaling")


def _with_overrides(config: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """The config with `overrides` on top. An override of `rope_theta` or `rope_scaling` on a config
    that already states `rope_parameters` (a flat dict, not per layer type) goes into them, where it
    would otherwise be ignored."""
    merged = {**config, **overrides}
    rope = merged.get("rope_parameters")
    old = {key: overrides[key] for key in _OLD_ROPE_KEYS if key in overrides}
    if not old or "rope_parameters" in overrides or not isinstance(rope, dict) or "rope_theta" not in rope:
        return merged
    scaling = dict(old.get("rope_scaling") or {})
    if "type" in scaling:  # the oldest spelling of rope_type
        scaling.setdefault("rope_type", scaling.pop("type"))
    folded = {**rope, **scaling, **({"rope_theta": old["rope_theta"]} if "rope_theta" in old else {})}
    # Left beside rope_parameters, transformers would rebuild them from these keys alone.
    rest = {key: value for key, value in merged.items() if key not in old}
    return {**rest, "rope_parameters": folded}


# What the engine reads off a config to size the KV cache, the context and the vocabulary.
_TEXT_FIELDS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "head_dim", "max_position_embeddings", "sliding_window", "rms_norm_eps")


def lift_text_config(config: PretrainedConfig) -> None:
    """A vision-language config keeps its language model's sizes in `text_config`; they are
    copied to the top, where the engine reads them for every model (the model class itself builds
    from `get_text_config()`)."""
    text = config.get_text_config()
    if text is config:
        return
    for name in _TEXT_FIELDS:
        if getattr(config, name, None) is None and getattr(text, name, None) is not None:
            setattr(config, name, getattr(text, name))


def checkpoint_dtype(config_dict: dict[str, Any]) -> str | None:
    """The dtype the checkpoint declares ("dtype" in transformers 5, "torch_dtype" before), normalised."""
    declared = config_dict.get("dtype") or config_dict.get("torch_dtype")
    name = str(declared).removeprefix("torch.") if declared else None
    return name if name in DTYPE_NAMES else None
