"""The base model's projection shapes an adapter is checked against (no torch: intake uses it too)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ProjectionShape:
    """A base projection's full (unsharded) input and output features."""

    in_features: int
    out_features: int


def projection_shapes(hf_config) -> dict[str, ProjectionShape]:
    """Each supported projection's full shape in a Llama-family model built from `hf_config`."""
    heads = hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
    hidden, ffn = hf_config.hidden_size, hf_config.intermediate_size
    return {
        "q_proj": ProjectionShape(hidden, heads * head_dim),
        "k_proj": ProjectionShape(hidden, kv_heads * head_dim),
        "v_proj": ProjectionShape(hidden, kv_heads * head_dim),
        "o_proj": ProjectionShape(heads * head_dim, hidden),
        "gate_proj": ProjectionShape(hidden, ffn),
        "up_proj": ProjectionShape(hidden, ffn),
        "down_proj": ProjectionShape(ffn, hidden),
    }


@dataclass(frozen=True)
class BaseModelShape:
    """What an adapter is checked against: the base's projections and layer count, the rank limit."""

    projections: dict[str, ProjectionShape]
    num_layers: int
    max_lora_rank: int

    @classmethod
    def of(cls, hf_config, max_lora_rank: int) -> BaseModelShape:
        return cls(projection_shapes(hf_config), hf_config.num_hidden_layers, max_lora_rank)
