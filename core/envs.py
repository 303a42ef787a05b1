"""Every environment variable corectl reads, in one place."""
from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """Where converted weights (e.g. dequantized GGUF) are cached: CORECTL_CACHE_DIR, else
    $XDG_CACHE_HOME/corectl, else ~/.cache/corectl."""
    explicit = os.environ.get("CORECTL_CACHE_DIR")
    if explicit:
        return Path(explicit).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base).expanduser() / "corectl"


def default_model_override() -> str | None:
    """CORECTL_DEFAULT_MODEL replaces the embedded default model (a path or hub id)."""
    return os.environ.get("CORECTL_DEFAULT_MODEL") or None


def log_level() -> str:
    return os.environ.get("CORECTL_LOG_LEVEL", "INFO").upper()


def hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes")


def fused_kernels_enabled() -> bool:
    """CORECTL_FUSED_KERNELS=0 makes workers keep the models' torch layer code (for measurement)."""
    return _switch("CORECTL_FUSED_KERNELS", True)


def pdl_enabled() -> bool:
    """CORECTL_PDL=0 launches GPU kernels without programmatic dependent launch (for measurement)."""
    return _switch("CORECTL_PDL", True)


def custom_allreduce_enabled() -> bool:
    """Tensor-parallel ranks sum small messages with their platform's own all-reduce where it has one
    (`Platform.device_communicator`: one-shot over NVLink on CUDA); CORECTL_CUSTOM_ALLREDUCE=0 keeps
    the group's collective (NCCL, gloo) for every size (for measurement)."""
    return _switch("CORECTL_CUSTOM_ALLREDUCE", True)


def fp8_fast_accum() -> bool:
    """CORECTL_FP8_FAST_ACCUM=0 makes the FP8 W8A8 GEMMs (`torch._scaled_mm`) promote their partial
    sums to fp32 periodically instead of accumulating in the tensor cores' own precision."""
    return _switch("CORECTL_FP8_FAST_ACCUM", True)


def graph_verify_enabled() -> bool:
    """CUDA workers replay speculative decoding's verify steps in the decode graphs (one row per
    verified token); CORECTL_GRAPH_VERIFY=0 runs them eagerly (for measurement)."""
    return _switch("CORECTL_GRAPH_VERIFY", True)


def piecewise_graphs_enabled() -> bool:
    """CUDA workers replay steps that are not pure decodes (prefill chunks, mixed steps) in graphs
    cut at each attention call (corectl.backends.cuda.piecewise); CORECTL_PIECEWISE_GRAPHS=0 runs
    them eagerly (for measurement)."""
    return _switch("CORECTL_PIECEWISE_GRAPHS", True)


def gemm_row_padding_enabled() -> bool:
    """GPU workers time each unquantized GEMM's row count against zero-padded ones while CUDA graphs
    are captured and run the faster (corectl.backends.triton.gemm.padded_rows);
    CORECTL_GEMM_ROW_PADDING=0 runs every GEMM at its own row count (for measurement)."""
    return _switch("CORECTL_GEMM_ROW_PADDING", True)


def lora_sorted_enabled() -> bool:
    """Decode steps of over 16 tokens, and prefill and mixed steps, run the LoRA kernels on tiles of
    tokens sorted by adapter (corectl.lora.layers); CORECTL_LORA_SORTED=0 keeps the per-token gathered
    kernels in decode steps and the segment form in the others (for measurement)."""
    return _switch("CORECTL_LORA_SORTED", True)


def lora_tile_rows() -> tuple[int, int]:
    """Rows of a sorted LoRA tile (corectl.lora.layers): a decode step's (CORECTL_LORA_TILE, default
    16) and a prefill or mixed step's (CORECTL_LORA_PREFILL_TILE, default 64; 0 keeps the segment
    form there, a tile grid per request, for measurement). Each 16, 32, 64 or 128."""
    tiles = []
    for name, default in (("CORECTL_LORA_TILE", 16), ("CORECTL_LORA_PREFILL_TILE", 64)):
        value = int(os.environ.get(name, default))
        if value not in (16, 32, 64, 128) and not (value == 0 and name == "CORECTL_LORA_PREFILL_TILE"):
            raise ValueError(f"{name}={value}: expected 16, 32, 64 or 128" +
                             (" (or 0)" if name == "CORECTL_LORA_PREFILL_TILE" else ""))
        tiles.append(value)
    return tiles[0], tiles[1]


def lora_knobs(kind: str) -> tuple[int, ...] | None:
    """CORECTL_LORA_DECODE_KNOBS or CORECTL_LORA_PREFILL_KNOBS (`kind`: decode or prefill): the sorted
    LoRA kernels' launch knobs for that kind of tile, "shrink_programs,shrink_splits,expand_programs"
    with an optional ",block_n" (a power of two, 16 to 256; backends/triton/lora/config.py), in place
    of the defaults (for measurement); None when unset."""
    name = f"CORECTL_LORA_{kind.upper()}_KNOBS"
    value = os.environ.get(name, "")
    if not value:
        return None
    knobs = tuple(int(part) for part in value.split(","))
    if len(knobs) not in (3, 4) or min(knobs) < 1 or (len(knobs) == 4 and knobs[3] not in (16, 32, 64, 128, 256)):
        raise ValueError(f"{name}={value!r}: expected shrink_programs,shrink_splits,expand_programs[,block_n]")
    return knobs


def lora_stacked(default: bool) -> bool:
    """Whether dense LoRA layers hold their adapters' A rows under the base weight, so a batch-1
    step's base GEMV computes the shrink too (corectl.lora.layers): CORECTL_LORA_STACKED=1 or 0, else
    `default` (the layer's choice for its device); 0 keeps A apart and the shrink launch (for measurement)."""
    return _switch("CORECTL_LORA_STACKED", default)


def _switch(name: str, default: bool) -> bool:
    """An on/off variable: 0, false or no turn it off, any other value on; unset or "auto" is `default`."""
    value = os.environ.get(name, "").lower()
    return default if value in ("", "auto") else value not in ("0", "false", "no")
