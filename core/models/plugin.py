"""The built-in model plugin, registered through the `corectl` entry-point group like any other."""
from __future__ import annotations

from corectl.plugins import ModelSpec, hookimpl


@hookimpl
def corectl_model_architectures():
    yield ModelSpec("LlamaForCausalLM", "corectl.models.llama:LlamaForCausalLM")
    yield ModelSpec("MistralForCausalLM", "corectl.models.llama:MistralForCausalLM")
    yield ModelSpec("Qwen2ForCausalLM", "corectl.models.qwen:Qwen2ForCausalLM")
    yield ModelSpec("Qwen3ForCausalLM", "corectl.models.qwen:Qwen3ForCausalLM")
    yield ModelSpec("Qwen3MoeForCausalLM", "corectl.models.qwen3_moe:Qwen3MoeForCausalLM")
    yield ModelSpec("MixtralForCausalLM", "corectl.models.mixtral:MixtralForCausalLM")
    yield ModelSpec("Gemma2ForCausalLM", "corectl.models.gemma:Gemma2ForCausalLM")
    yield ModelSpec("Gemma3ForCausalLM", "corectl.models.gemma:Gemma3ForCausalLM")
    yield ModelSpec("Phi3ForCausalLM", "corectl.models.phi3:Phi3ForCausalLM")
    yield ModelSpec("GptOssForCausalLM", "corectl.models.gpt_oss:GptOssForCausalLM")
    yield ModelSpec("Llama4ForCausalLM", "corectl.models.llama4:Llama4ForCausalLM")
