"""Turning `EngineConfig.model` (a path, a hub id, or nothing) into a `ModelSource`."""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path

from ..config import EngineConfig
from ..errors import ConfigError, ModelNotFoundError
from . import hub
from .checkpoint_files import safetensors_files
from .default_model import default_model
from .hf_config import load_hf_config
from .presets import PRESETS, is_preset, preset_config_dir
from .source import ModelSource

# Any of these makes a folder hold a tokenizer (tokenizer_config.json alone does not).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


@dataclass(frozen=True)
class _Checkpoint:
    config_source: Path  # a folder holding config.json, or (dummy weights only) a config file
    description: str
    weight_files: tuple[Path, ...]
    gguf_file: Path | None = None


def resolve_model_source(config: EngineConfig) -> ModelSource:
    """Locate (download or convert when needed) the checkpoint `config` names, and read its config."""
    spec = config.model or default_model()
    checkpoint = _resolve_checkpoint(spec, config)
    model_dir = checkpoint.config_source if checkpoint.config_source.is_dir() else checkpoint.config_source.parent
    hf_config, model_dtype = load_hf_config(checkpoint.config_source, config.hf_overrides)
    dummy = config.load_format == "dummy"
    return ModelSource(
        hf_config=hf_config,
        model_dir=model_dir,
        tokenizer_dir=_tokenizer_dir(config, model_dir),
        description=f"dummy weights, config from {checkpoint.description}" if dummy else checkpoint.description,
        model_dtype=model_dtype,
        weight_files=checkpoint.weight_files,
        dummy_seed=config.seed if dummy else None,
        gguf_file=checkpoint.gguf_file,
    )


def _resolve_checkpoint(spec: str, config: EngineConfig) -> _Checkpoint:
    path = Path(spec).expanduser()
    if is_preset(spec) and not path.exists():
        return _preset_checkpoint(spec, config.load_format)
    if path.is_file():
        return _file_checkpoint(path, config.load_format)
    if not path.is_dir() and _is_path_like(spec):
        raise ModelNotFoundError(f"model path {spec!r} does not exist")
    if config.load_format == "gguf":
        raise ConfigError("load_format", f"'gguf' needs the path of a .gguf file; {spec!r} is not one")
    if path.is_dir():
        return _dir_checkpoint(path, f"safetensors {path}", config.load_format)
    with_weights = config.load_format != "dummy"
    snapshot = hub.download_model(spec, config.revision, config.download_dir, with_weights=with_weights)
    return _dir_checkpoint(snapshot, f"hub {spec}@{config.revision or 'main'} ({snapshot})", config.load_format)


def _preset_checkpoint(name: str, load_format: str) -> _Checkpoint:
    if load_format != "dummy":
        raise ConfigError(
            "load_format",
            f"model {name!r} is a shape preset ({', '.join(PRESETS)}), which has no weights; "
            f"pass load_format 'dummy' (--load-format dummy) for random weights, not {load_format!r}",
        )
    return _Checkpoint(preset_config_dir(name), f"preset {name}", ())


def _file_checkpoint(path: Path, load_format: str) -> _Checkpoint:
    if path.suffix == ".gguf" or load_format == "gguf":
        if load_format == "safetensors":
            raise ConfigError("load_format", f"'safetensors' does not read the GGUF file {path}; use 'auto' or 'gguf'")
        cache = _converted_gguf(path)
        checkpoint = _dir_checkpoint(cache, f"gguf {path} (cached at {cache})", load_format)
        return dataclasses.replace(checkpoint, gguf_file=path)
    if load_format == "dummy" and path.suffix == ".json":
        return _Checkpoint(path, f"config {path}", ())
    raise ModelNotFoundError(
        f"model {path} is a file but not a .gguf checkpoint; pass a .gguf file, a folder holding "
        "config.json and *.safetensors, or a hub id"
    )


def _dir_checkpoint(folder: Path, description: str, load_format: str) -> _Checkpoint:
    if not (folder / "config.json").is_file():
        raise ModelNotFoundError(
            f"model folder {folder} has no config.json; a Hugging Face checkpoint folder is expected"
        )
    if load_format == "dummy":
        return _Checkpoint(folder, description, ())
    files = safetensors_files(folder)
    if not files:
        raise ModelNotFoundError(
            f"model folder {folder} has no *.safetensors weights (PyTorch .bin checkpoints are not read: "
            "convert them to safetensors, or use --load-format dummy for random weights)"
        )
    return _Checkpoint(folder, description, tuple(files))


def _tokenizer_dir(config: EngineConfig, model_dir: Path) -> Path | None:
    """Where the tokenizer lives, or None when the engine runs without one."""
    if config.skip_tokenizer_init:
        return None
    if config.tokenizer:
        return _resolve_tokenizer(config.tokenizer, config)
    # Random weights need only a config: a preset, or a config.json alone, still makes a benchmark.
    if config.load_format == "dummy" and not any((model_dir / name).is_file() for name in TOKENIZER_FILES):
        return None
    return model_dir


def _resolve_tokenizer(spec: str, config: EngineConfig) -> Path:
    path = Path(spec).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return _converted_gguf(path)
    if path.is_dir():
        return path
    if _is_path_like(spec):
        raise ModelNotFoundError(f"tokenizer path {spec!r} does not exist")
    return hub.download_tokenizer(spec, config.download_dir)


def _converted_gguf(path: Path) -> Path:
    # Imported here: only GGUF files need the gguf package, which GPU images running safetensors
    # checkpoints or random weights may not carry.
    from .gguf_cache import ensure_converted

    return ensure_converted(path)


def _is_path_like(spec: str) -> bool:
    """Specs that cannot be hub ids; the rest that are not local paths go to the hub."""
    return os.path.isabs(spec) or spec.startswith((".", "~"))
