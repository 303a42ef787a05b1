"""Shape presets: model configs known by name, for random-weight benchmarks with no hub and no tokenizer.

    corectl bench throughput --model llama3-8b --load-format dummy --platform cuda

A preset is only a config: its config.json is written to the cache folder and then loads like any
dummy-weight config folder (no tokenizer files, so the engine takes token-id prompts only); a local
path of the same name is loaded instead. The
shapes are those of the HF transformers peer benchmark (`hf_baseline.py` SHAPES, section 5 of the
design), field for field, so both sides measure the same model; fields left out take the
transformers config class's defaults, exactly as the peer's constructor calls do.
"""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

from .. import envs

PRESETS: dict[str, dict[str, Any]] = {
    "llama3-8b": {
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "dtype": "bfloat16",
        "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
        "rope_theta": 500000.0, "max_position_embeddings": 8192,
    },
    # W8 (DESIGN.md section 5): ~141 GB of bf16 weights, for tensor parallelism over two H200s.
    "llama3-70b": {
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "dtype": "bfloat16",
        "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
        "num_attention_heads": 64, "num_key_value_heads": 8, "vocab_size": 128256,
        "rope_theta": 500000.0, "max_position_embeddings": 8192,
    },
    "qwen3-0.6b": {
        "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "dtype": "bfloat16",
        "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28,
        "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
        "vocab_size": 151936, "tie_word_embeddings": True, "max_position_embeddings": 8192,
    },
    # Mixtures of experts (W7): Qwen3-30B-A3B (128 experts, top 8, ~3.3B active parameters per
    # token) and Mixtral-8x7B (8 experts, top 2), as their published configs.
    "qwen3-30b-a3b": {
        "model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "dtype": "bfloat16",
        "hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768,
        "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
        "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True, "decoder_sparse_step": 1,
        "vocab_size": 151936, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "max_position_embeddings": 40960,
    },
    "mixtral-8x7b": {
        "model_type": "mixtral", "architectures": ["MixtralForCausalLM"], "dtype": "bfloat16",
        "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 8, "num_local_experts": 8, "num_experts_per_tok": 2,
        "vocab_size": 32000, "rope_theta": 1000000.0, "rms_norm_eps": 1e-5, "max_position_embeddings": 32768,
    },
    # gpt-oss-20b as published: 32 experts, top 4 (~3.6B active parameters), alternating 128-token
    # sliding-window and full attention with sinks, YaRN. Its experts are MXFP4 (the
    # quantization_config), so dummy weights are packed blocks and scales, served as the checkpoint's are.
    "gpt-oss-20b": {
        "model_type": "gpt_oss", "architectures": ["GptOssForCausalLM"], "dtype": "bfloat16",
        "hidden_size": 2880, "intermediate_size": 2880, "num_hidden_layers": 24, "num_attention_heads": 64,
        "num_key_value_heads": 8, "head_dim": 64, "num_local_experts": 32, "num_experts_per_tok": 4,
        "vocab_size": 201088, "sliding_window": 128, "swiglu_limit": 7.0, "rms_norm_eps": 1e-5,
        "attention_bias": True, "tie_word_embeddings": False, "max_position_embeddings": 131072,
        "rope_parameters": {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
                            "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 4096},
        "quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": [
            "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]},
    },
    # DeepSeek-V2-Lite as published (transformers' DeepseekV2Config names): multi-head latent attention
    # (a 512 + 64 latent row per token and layer, no q LoRA), 64 routed experts top-6 softmax-greedy plus
    # 2 shared from layer 1 on (~2.4B active parameters a token), YaRN x40.
    "deepseek-v2-lite": {
        "model_type": "deepseek_v2", "architectures": ["DeepseekV2ForCausalLM"], "dtype": "bfloat16",
        "hidden_size": 2048, "intermediate_size": 10944, "moe_intermediate_size": 1408, "num_hidden_layers": 27,
        "num_attention_heads": 16, "num_key_value_heads": 16, "kv_lora_rank": 512, "q_lora_rank": None,
        "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128, "n_routed_experts": 64,
        "n_shared_experts": 2, "num_experts_per_tok": 6, "first_k_dense_replace": 1, "topk_method": "greedy",
        "n_group": 1, "topk_group": 1, "norm_topk_prob": False, "routed_scaling_factor": 1.0,
        "vocab_size": 102400, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
        "max_position_embeddings": 163840, "bos_token_id": 100000, "eos_token_id": 100001,
        "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "beta_fast": 32.0,
                            "beta_slow": 1.0, "mscale": 0.707, "mscale_all_dim": 0.707,
                            "original_max_position_embeddings": 4096},
    },
    # Mistral-7B-v0.1: a 4096-token sliding window on every layer (the windowed-decode measurement).
    "mistral-7b": {
        "model_type": "mistral", "architectures": ["MistralForCausalLM"], "dtype": "bfloat16",
        "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 32000,
        "sliding_window": 4096, "max_position_embeddings": 32768,
    },
    # Dense shapes the decode GEMV's rule was not read off (issue 26 item 5), as their published
    # config.json files have them (Gemma 2: tied embeddings, the config class's default).
    "qwen3-8b": {
        "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "dtype": "bfloat16",
        "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36,
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936,
        "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
        "max_position_embeddings": 40960, "max_window_layers": 36,
    },
    "qwen3-14b": {
        "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "dtype": "bfloat16",
        "hidden_size": 5120, "intermediate_size": 17408, "num_hidden_layers": 40,
        "num_attention_heads": 40, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936,
        "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
        "max_position_embeddings": 40960, "max_window_layers": 40,
    },
    # Alternating 4096-token sliding-window and global layers, soft-capped attention scores and logits.
    "gemma-2-9b": {
        "model_type": "gemma2", "architectures": ["Gemma2ForCausalLM"], "dtype": "bfloat16",
        "hidden_size": 3584, "intermediate_size": 14336, "num_hidden_layers": 42,
        "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 256, "vocab_size": 256000,
        "hidden_activation": "gelu_pytorch_tanh", "query_pre_attn_scalar": 256, "sliding_window": 4096,
        "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0, "rope_theta": 10000.0,
        "rms_norm_eps": 1e-6, "max_position_embeddings": 8192,
    },
    "llama-3.2-3b": {
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "dtype": "bfloat16",
        "hidden_size": 3072, "intermediate_size": 8192, "num_hidden_layers": 28,
        "num_attention_heads": 24, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 128256,
        "rms_norm_eps": 1e-5, "tie_word_embeddings": True, "max_position_embeddings": 131072,
        "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "high_freq_factor": 4.0,
                            "low_freq_factor": 1.0, "original_max_position_embeddings": 8192},
    },
    # Two more untuned dense shapes: Qwen2.5-7B (q/k/v biases, 4 KV heads) and Mistral-NeMo-12B (128-wide
    # heads under a 5120-wide hidden state).
    "qwen2.5-7b": {
        "model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "dtype": "bfloat16",
        "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
        "num_attention_heads": 28, "num_key_value_heads": 4, "vocab_size": 152064,
        "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
        "max_position_embeddings": 131072, "max_window_layers": 28, "use_sliding_window": False,
    },
    "mistral-nemo-12b": {
        "model_type": "mistral", "architectures": ["MistralForCausalLM"], "dtype": "bfloat16",
        "hidden_size": 5120, "intermediate_size": 14336, "num_hidden_layers": 40,
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 131072,
        "rope_theta": 1000000.0, "rms_norm_eps": 1e-5, "sliding_window": None, "tie_word_embeddings": False,
        "max_position_embeddings": 1024000,
    },
    # Small enough for CPU tests of the whole preset path.
    "llama-tiny": {
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "dtype": "float32",
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512,
        "max_position_embeddings": 512,
    },
    "qwen3-moe-tiny": {
        "model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "dtype": "float32",
        "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "num_experts": 8,
        "num_experts_per_tok": 2, "norm_topk_prob": True, "vocab_size": 512, "max_position_embeddings": 512,
    },
}


def is_preset(name: str) -> bool:
    return name in PRESETS


def preset_config_dir(name: str) -> Path:
    """The cache folder holding the preset's config.json, (re)written when its content changed."""
    folder = envs.cache_dir() / "presets" / name
    text = json.dumps(PRESETS[name], indent=2, sort_keys=True) + "\n"
    target = folder / "config.json"
    if target.is_file() and target.read_text() == text:
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    # Write then rename, so a concurrent reader never sees half a file.
    fd, staging = tempfile.mkstemp(prefix=".config-", dir=folder)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(staging, target)
    return folder
