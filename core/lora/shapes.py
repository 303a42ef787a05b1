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
class ExpertShape:
    """One mixture-of-experts layer's experts: how many, and one expert's full (unsharded) widths."""

    num_experts: int
    hidden: int
    intermediate: int


# The model types whose experts take adapters (their experts are `corectl.models.moe.FusedMoE`
# with SiLU gating), by the config keys of their expert count and one expert's width.
EXPERT_CONFIG_KEYS = {"qwen3_moe": ("num_experts", "moe_intermediate_size"),
                      "mixtral": ("num_local_experts", "intermediate_size")}


def expert_shape(hf_config) -> ExpertShape | None:
    """The experts an adapter may target in a model built from `hf_config` (None: no such experts)."""
    keys = EXPERT_CONFIG_KEYS.get(getattr(hf_config, "model_type", None))
    if keys is None or not getattr(hf_config, keys[0], 0):
        return None
    return ExpertShape(getattr(hf_config, keys[0]), hf_config.hidden_size, getattr(hf_config, keys[1]))


@dataclass(frozen=True)
class BaseModelShape:
    """What an adapter is checked against: the base's projections and layer count, the rank limit,
    and its mixture-of-experts experts where adapters may target them."""

    projections: dict[str, ProjectionShape]
    num_layers: int
    max_lora_rank: int
    experts: ExpertShape | None = None

    @classmethod
    def of(cls, hf_config, max_lora_rank: int) -> BaseModelShape:
        return cls(projection_shapes(hf_config), hf_config.num_hidden_layers, max_lora_rank,
                   expert_shape(hf_config))
