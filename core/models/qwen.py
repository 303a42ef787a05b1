"""Qwen2 (bias on q/k/v) and Qwen3 (per-head RMSNorm on q and k) on the Llama-family implementation."""
from __future__ import annotations

from .llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    qkv_bias = True


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True
