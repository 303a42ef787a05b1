"""Batched mixed-adapter LoRA kernels (punica's shrink and expand), in segment and gathered forms."""
from .expand import lora_expand
from .shrink import lora_shrink

__all__ = ["lora_expand", "lora_shrink"]
