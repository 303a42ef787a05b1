"""vLLM's compilation config (`-O` / `--compilation-config`, `LLM(compilation_config=...)`), as far as
it means something here: which steps replay CUDA graphs, and of which sizes.

corectl compiles nothing with torch.compile: a level (`-O3`, `{"level": 3}`, `{"mode": 3}`) and
the compiler's own keys (passes, custom ops, inductor settings) are accepted so launch scripts run
unchanged, and do nothing. What is honoured:

- `cudagraph_mode`: FULL_AND_PIECEWISE (the default: pure-decode steps replay whole-step graphs,
  other steps piecewise graphs cut at attention), FULL_DECODE_ONLY (whole-step graphs for decodes,
  other steps eager), FULL (taken as FULL_DECODE_ONLY: a mixed step's attention cannot be captured
  whole here), PIECEWISE (every step in pieces) and NONE (no graphs, as `--enforce-eager`);
  vLLM's older `use_cudagraph: false` means NONE.
- `cudagraph_capture_sizes`: the sizes captured, decode batch sizes (up to `max_num_seqs`) and
  piecewise token counts (up to `max_num_batched_tokens`) alike, as vLLM uses one list for both;
  `max_cudagraph_capture_size` caps them. Unset, each kind keeps its own sizes.
"""
from __future__ import annotations

import json
from typing import Any

import msgspec

from .errors import ConfigError
from .json_option import decode_json_option

FIELD = "compilation_config"
CUDAGRAPH_MODES = ("FULL_AND_PIECEWISE", "FULL_DECODE_ONLY", "FULL", "PIECEWISE", "NONE")
_DECODE_GRAPHS = ("FULL_AND_PIECEWISE", "FULL_DECODE_ONLY", "FULL")
_PIECEWISE_GRAPHS = ("FULL_AND_PIECEWISE", "PIECEWISE")
_HONOURED = ("cudagraph_mode", "cudagraph_capture_sizes", "max_cudagraph_capture_size", "use_cudagraph")


class CompilationConfig(msgspec.Struct, kw_only=True, frozen=True):
    """Resolved (`resolve_compilation_config`), `cudagraph_mode` is set and `use_cudagraph` folded
    into it; a dict converted to this struct keeps only these keys, the ones that mean something."""

    cudagraph_mode: str | None = None
    cudagraph_capture_sizes: tuple[int, ...] | None = None
    max_cudagraph_capture_size: int | None = None
    use_cudagraph: bool | None = None

    @property
    def decode_graphs(self) -> bool:
        """Whether pure-decode steps replay whole-step graphs."""
        return self.cudagraph_mode in _DECODE_GRAPHS

    @property
    def piecewise_graphs(self) -> bool:
        """Whether other steps (and, without decode graphs, decodes too) replay piecewise graphs."""
        return self.cudagraph_mode in _PIECEWISE_GRAPHS

    def sizes(self, limit: int, default: list[int]) -> list[int]:
        """The sizes to capture up to `limit`: the configured ones, else `default`; both within
        `max_cudagraph_capture_size`."""
        chosen = default if self.cudagraph_capture_sizes is None else sorted(set(self.cudagraph_capture_sizes))
        cap = limit if self.max_cudagraph_capture_size is None else min(limit, self.max_cudagraph_capture_size)
        return [size for size in chosen if size <= cap]


def resolve_compilation_config(value: Any) -> CompilationConfig:
    """The config from vLLM's forms: None, a level (int or its digit), a JSON object or its text, a
    list of `-O` fragments (JSON objects, levels, `.key=value`), or a `CompilationConfig`."""
    if isinstance(value, CompilationConfig):
        # Checked again: msgspec.convert builds one from a dict unchecked.
        value = {key: val for key, val in msgspec.structs.asdict(value).items() if val is not None}
    fields: dict[str, Any] = {}
    for fragment in value if isinstance(value, list) else [value]:
        fields.update(_fragment(fragment))
    mode = fields.get("cudagraph_mode")
    if fields.get("use_cudagraph") is False and mode is None:
        mode = "NONE"
    mode = "FULL_AND_PIECEWISE" if mode is None else str(mode).upper()
    if mode not in CUDAGRAPH_MODES:
        raise ConfigError(FIELD, f"cudagraph_mode must be one of {', '.join(CUDAGRAPH_MODES)}; got {mode!r}")
    cap = _positive(fields.get("max_cudagraph_capture_size"), "max_cudagraph_capture_size")
    return CompilationConfig(cudagraph_mode=mode, cudagraph_capture_sizes=_sizes(fields.get("cudagraph_capture_sizes")),
                             max_cudagraph_capture_size=cap)


def _fragment(fragment: Any) -> dict[str, Any]:
    """One `-O` argument's fields: a level gives none."""
    if fragment is None or isinstance(fragment, bool):
        return {}
    if isinstance(fragment, int) or (isinstance(fragment, str) and fragment.strip().isdigit()):
        return {}  # an optimisation level: torch.compile's, which corectl does not run
    if isinstance(fragment, (list, tuple)):
        raise ConfigError(FIELD, f"expected a JSON object or an optimisation level, got {fragment!r}")
    if isinstance(fragment, str) and fragment.startswith("."):
        key, sep, raw = fragment[1:].partition("=")
        if not sep or not key:
            raise ConfigError(FIELD, f"expected -O.key=value, got -O{fragment}")
        try:
            return {key: json.loads(raw)}
        except json.JSONDecodeError:
            return {key: raw}
    fragment = decode_json_option(FIELD, fragment)
    if not isinstance(fragment, dict):
        raise ConfigError(FIELD, f"expected a JSON object or an optimisation level, got {fragment!r}")
    return {key: val for key, val in fragment.items() if key in _HONOURED}


def _sizes(value: Any) -> tuple[int, ...] | None:
    if value is None:
        return None
    items = value if isinstance(value, (list, tuple)) else [value]
    if not items:
        raise ConfigError(FIELD, "cudagraph_capture_sizes is empty: give sizes, or cudagraph_mode NONE for no graphs")
    return tuple(_positive(item, "cudagraph_capture_sizes") for item in items)


def _positive(value: Any, name: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(FIELD, f"{name} must hold positive integers, got {value!r}")
    return value
