"""PEFT LoRA adapters with random A and B (PEFT's `init_lora_weights=False`), saved as PEFT saves them."""
from __future__ import annotations

from pathlib import Path

import torch

ALL_PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def save_adapter(base_dir: Path, folder: Path, rank: int, seed: int, targets=ALL_PROJECTIONS, **config):
    """A PEFT adapter with random A and B (PEFT's `init_lora_weights=False`) saved in `folder`;
    returns the PeftModel, the reference."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    torch.manual_seed(seed)
    model = get_peft_model(base, LoraConfig(r=rank, lora_alpha=config.pop("lora_alpha", 2 * rank),
                                            target_modules=targets, init_lora_weights=False, **config))
    model.save_pretrained(folder)
    return model.eval()
