"""Safetensors checkpoints on disk: which files make up one, and streaming their tensors."""
from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch
from safetensors import safe_open

from ..errors import ModelNotFoundError

INDEX_FILE = "model.safetensors.index.json"
logger = logging.getLogger("corectl.loaders")
# Within a long file, a progress line at most this often.
_PROGRESS_SECONDS = 5.0


def safetensors_files(directory: Path) -> list[Path]:
    """The files of the checkpoint in `directory`: the shards its index names, else every `*.safetensors`.

    The index decides when present because some repos also ship a second copy of the weights
    (e.g. Mistral's `consolidated.safetensors`) that must not be loaded on top.
    """
    index = directory / INDEX_FILE
    if not index.is_file():
        return sorted(directory.glob("*.safetensors"))
    files = [directory / name for name in index_shards(index)]
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise ModelNotFoundError(f"{index} names shard files that are missing from {directory}: {', '.join(missing)}")
    return files


def index_shards(index: Path) -> list[str]:
    """The shard file names a `model.safetensors.index.json` refers to."""
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (json.JSONDecodeError, KeyError) as exc:
        raise ModelNotFoundError(f"{index} is not a valid safetensors index (no weight_map): {exc}") from exc
    return sorted(set(weight_map.values()))


def tensor_names(files: Sequence[Path]) -> list[str]:
    """The names of the tensors in `files`, file by file (reads only the headers)."""
    names = []
    for file in files:
        with safe_open(file, framework="pt", device="cpu") as f:
            names.extend(f.keys())
    return names


def count_tensors(files: Sequence[Path]) -> int:
    """Number of tensors in `files` (reads only the headers)."""
    return len(tensor_names(files))


def iter_safetensors(files: Sequence[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, cpu tensor) one tensor at a time, so a checkpoint is never held in memory whole.
    Logs the files and bytes read so far (after each file, and every few seconds inside one)."""
    total = sum(file.stat().st_size for file in files)
    done, last_log = 0, time.monotonic()
    for index, file in enumerate(files, 1):
        with safe_open(file, framework="pt", device="cpu") as f:
            for name in f.keys():
                tensor = f.get_tensor(name)
                done += tensor.nbytes
                if time.monotonic() - last_log > _PROGRESS_SECONDS:
                    last_log = time.monotonic()
                    _log_progress(index - 1, len(files), done, total)
                yield name, tensor
        _log_progress(index, len(files), done, total)


def _log_progress(files_done: int, num_files: int, done: int, total: int) -> None:
    logger.info("loading weights: %d/%d files, %.2f/%.2f GiB", files_done, num_files, min(done, total) / 2**30,
                total / 2**30)
