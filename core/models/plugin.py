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
    yield ModelSpec("Gemma3ForConditionalGeneration", "corectl.models.gemma3_mm:Gemma3ForConditionalGeneration")
    yield ModelSpec("Qwen2_5_VLForConditionalGeneration",
                    "corectl.models.qwen2_5_vl:Qwen2_5_VLForConditionalGeneration")
    yield ModelSpec("Phi3ForCausalLM", "corectl.models.phi3:Phi3ForCausalLM")
    yield ModelSpec("GptOssForCausalLM", "corectl.models.gpt_oss:GptOssForCausalLM")
    yield ModelSpec("Llama4ForCausalLM", "corectl.models.llama4:Llama4ForCausalLM")
    yield ModelSpec("Llama4ForConditionalGeneration", "corectl.models.llama4:Llama4ForConditionalGeneration")
    yield ModelSpec("DeepseekV2ForCausalLM", "corectl.models.deepseek:DeepseekV2ForCausalLM")
    yield ModelSpec("DeepseekV3ForCausalLM", "corectl.models.deepseek:DeepseekV3ForCausalLM")
    yield ModelSpec("BertModel", "corectl.models.bert:BertModel")
    yield ModelSpec("BertForSequenceClassification", "corectl.models.bert:BertForSequenceClassification")
    yield ModelSpec("XLMRobertaModel", "corectl.models.bert:XLMRobertaModel")
    yield ModelSpec("XLMRobertaForSequenceClassification", "corectl.models.bert:XLMRobertaForSequenceClassification")
    yield ModelSpec("LlamaForSequenceClassification",
                    "corectl.models.sequence_classification:LlamaForSequenceClassification")
    yield ModelSpec("Qwen2ForSequenceClassification",
                    "corectl.models.sequence_classification:Qwen2ForSequenceClassification")
    yield ModelSpec("Qwen3ForSequenceClassification",
                    "corectl.models.sequence_classification:Qwen3ForSequenceClassification")
