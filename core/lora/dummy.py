"""Random PEFT adapters for a model's shape, for benchmarks with dummy weights (`corectl bench ...
--num-loras N`): real checkpoints on disk, read by the same loader as any adapter."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from .checkpoint import CONFIG_FILE, SUPPORTED_MODULES, WEIGHTS_FILE
from .request import LoRARequest
from .shapes import ExpertShape, expert_shape, projection_shapes

_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
_EXPERT_PARAMETERS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


def write_dummy_adapters(folder: Path, hf_config, num: int, rank: int, seed: int = 0,
                         dtype: torch.dtype = torch.bfloat16) -> list[LoRARequest]:
    """`num` adapters of `rank` on all seven projections of every layer (a mixture-of-experts
    layer's experts in peft's parameter-LoRA layout in place of its MLP's three), saved under
    `folder` (`dummy-0`, `dummy-1`, ...); A and B are small random values, so outputs stay finite."""
    from safetensors.torch import save_file

    shapes = projection_shapes(hf_config)
    experts = expert_shape(hf_config)
    generator = torch.Generator().manual_seed(seed)
    loras = []
    for index in range(num):
        path = Path(folder) / f"dummy-{index}"
        path.mkdir(parents=True, exist_ok=True)
        tensors = {}
        for layer in range(hf_config.num_hidden_layers):
            sparse = experts is not None and _has_experts(hf_config, layer)
            for proj in _ATTENTION if sparse else SUPPORTED_MODULES:
                stem = f"base_model.model.model.layers.{layer}.{'self_attn' if proj in _ATTENTION else 'mlp'}.{proj}"
                shape = shapes[proj]
                tensors[f"{stem}.lora_A.weight"] = _small((rank, shape.in_features), generator, dtype)
                tensors[f"{stem}.lora_B.weight"] = _small((shape.out_features, rank), generator, dtype)
            if sparse:
                tensors.update(_expert_pairs(f"base_model.model.model.layers.{layer}.mlp.experts", experts, rank,
                                             generator, dtype))
        save_file(tensors, str(path / WEIGHTS_FILE))
        config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(SUPPORTED_MODULES),
                  "bias": "none", "target_parameters": _EXPERT_PARAMETERS if experts is not None else None}
        (path / CONFIG_FILE).write_text(json.dumps(config))
        loras.append(LoRARequest(f"dummy-{index}", index + 1, str(path)))
    return loras


def _has_experts(hf_config, layer: int) -> bool:
    if hf_config.model_type == "qwen3_moe":
        from ..models.qwen3_moe import is_sparse_layer

        return is_sparse_layer(hf_config, layer)
    return True


def _expert_pairs(stem: str, experts: ExpertShape, rank: int, generator: torch.Generator, dtype: torch.dtype
                  ) -> dict[str, torch.Tensor]:
    """gate_up's pair (peft names it `base_layer.`, the first wrapped) and down's, stacked over experts."""
    e, h, i = experts.num_experts, experts.hidden, experts.intermediate
    return {f"{stem}.base_layer.lora_A.weight": _small((e * rank, h), generator, dtype),
            f"{stem}.base_layer.lora_B.weight": _small((2 * i, e * rank), generator, dtype),
            f"{stem}.lora_A.weight": _small((e * rank, i), generator, dtype),
            f"{stem}.lora_B.weight": _small((h, e * rank), generator, dtype)}


def _small(shape: tuple[int, int], generator: torch.Generator, dtype: torch.dtype) -> torch.Tensor:
    return (torch.randn(shape, generator=generator) * 0.01).to(dtype)
