"""A tiny random Llama and PEFT adapters trained on nothing (random A and B), saved as PEFT saves them."""
from __future__ import annotations

from pathlib import Path

import pytest
from support.adapters import save_adapter


@pytest.fixture(scope="session")
def lora_base(tmp_path_factory, default_model_dir) -> Path:
    from support.models import build_random_checkpoint

    return build_random_checkpoint("llama", tmp_path_factory.mktemp("lora-base"), default_model_dir)


@pytest.fixture(scope="session")
def adapters(tmp_path_factory, lora_base):
    """Four adapters: ranks 8, 64 (rsLoRA), 16 and 8 (attention only) -> (folder, PeftModel)."""
    root = tmp_path_factory.mktemp("adapters")
    specs = {
        "r8": dict(rank=8, seed=1),
        "r64": dict(rank=64, seed=2, use_rslora=True, lora_alpha=16),
        "r16": dict(rank=16, seed=3),
        "attn": dict(rank=8, seed=4, targets=["q_proj", "v_proj"]),
    }
    return {name: (root / name, save_adapter(lora_base, root / name, **spec)) for name, spec in specs.items()}
