"""Random gpt-oss checkpoints on disk: dense, and with the experts quantized to MXFP4 in the
checkpoint's layout (`*_blocks`/`*_scales`, as the published gpt-oss models ship)."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from .arch_parity import save_random_model
from .new_arch_configs import gpt_oss_config, randomise_sinks


def gpt_oss_checkpoint(folder: Path, tokenizer_dir: Path, **config):
    """The transformers model of `gpt_oss_config(**config)` with large random sinks and biases, saved."""
    hf_model = save_random_model(gpt_oss_config(**config), folder, tokenizer_dir, seed=6)
    randomise_sinks(hf_model)
    hf_model.save_pretrained(folder)
    return hf_model


def quantize_mxfp4(dense: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[E, rows, K] -> (blocks uint8 [E, rows, K / 32, 16], scales uint8 [E, rows, K / 32]): each
    group's scale the power of two that brings its largest value within 6, values rounded to the
    nearest e2m1 code."""
    from corectl.quantization.mxfp4 import E2M1_VALUES

    groups = dense.unflatten(-1, (-1, 32))
    exponent = torch.ceil(torch.log2(groups.abs().amax(-1).clamp(min=1e-30) / 6.0)).clamp(-127, 127)
    scaled = groups / torch.exp2(exponent).unsqueeze(-1)
    codes = (scaled.unsqueeze(-1) - torch.tensor(E2M1_VALUES)).abs().argmin(-1).to(torch.uint8)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks, (exponent + 127).to(torch.uint8)


def mxfp4_checkpoint(folder: Path, tokenizer_dir: Path, **config):
    """`gpt_oss_checkpoint(**config)` with its experts quantized to MXFP4, and the transformers model
    whose experts are what its own MXFP4 dequantizer (`convert_moe_packed_tensors`) gives of them."""
    from safetensors.torch import save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    hf_model = gpt_oss_checkpoint(folder, tokenizer_dir, **config)
    state = {k: v.contiguous() for k, v in hf_model.state_dict().items()}
    for i, layer in enumerate(hf_model.model.layers):
        experts = layer.mlp.experts
        for stack in ("gate_up_proj", "down_proj"):
            # The checkpoint stores output rows first: [E, out, in].
            blocks, scales = quantize_mxfp4(getattr(experts, stack).data.transpose(1, 2))
            prefix = f"model.layers.{i}.mlp.experts.{stack}"
            del state[prefix]
            state[f"{prefix}_blocks"], state[f"{prefix}_scales"] = blocks, scales
            with torch.no_grad():
                getattr(experts, stack).copy_(convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["self_attn", "router",
                                                                                          "embed_tokens", "lm_head"]}
    (folder / "config.json").write_text(json.dumps(config))
    return hf_model
