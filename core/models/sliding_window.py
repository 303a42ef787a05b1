"""Which attention layers of a checkpoint attend within a sliding window, read from its HF config.

transformers describes it in three ways, all handled here:
  - `layer_types` (Gemma 2/3, Qwen2 with `use_sliding_window`, most configs of transformers 5): a
    layer marked "sliding_attention" keeps to `sliding_window`, one marked "full_attention" sees all;
  - `sliding_window` alone (Mistral): every layer keeps to it;
  - no `sliding_window` (or null, or `use_sliding_window` false): every layer sees the whole context.
"""
from __future__ import annotations


def layer_sliding_windows(config) -> list[int | None]:
    """One entry per layer: its window in tokens (a key j is visible from position p when
    p - window < j <= p), or None for a layer that attends to the whole context."""
    num_layers = config.num_hidden_layers
    window = getattr(config, "sliding_window", None)
    if not window or getattr(config, "use_sliding_window", True) is False:
        return [None] * num_layers
    layer_types = getattr(config, "layer_types", None)
    if layer_types is None:
        return [window] * num_layers
    if len(layer_types) != num_layers:
        raise ValueError(f"the config lists {len(layer_types)} layer_types for {num_layers} layers")
    return [window if kind == "sliding_attention" else None for kind in layer_types]
