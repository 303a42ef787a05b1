"""`--batch-invariant` on CUDA/ROCm without a GPU: the flag reaches EngineConfig from every command
line that builds one, the platforms claim it, and each combination without invariant kernels is
refused with one line naming the flag and the feature (models built on the meta device)."""
from __future__ import annotations

import argparse

import pytest
import torch
from corectl.backends.cpu.attention import TorchSDPABackend
from corectl.backends.cpu.platform import CPUPlatform
from corectl.backends.cuda.batch_invariant import (
    check_invariant_config,
    check_invariant_model,
    check_invariant_quantization,
    make_attention_invariant,
)
from corectl.backends.cuda.platform import CUDAPlatform, gpu_caps
from corectl.backends.triton.attention.backend import TritonAttentionBackend
from corectl.config import EngineConfig
from corectl.errors import ConfigError
from corectl.models.registry import resolve_model_class
from corectl.quantization.fp8 import Fp8Config
from corectl.worker.worker import build_model
from corectl.server.cli.engine_args import add_engine_args, config_from_args

SMALL = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=128)


def test_the_flag_reaches_the_engine_config():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert config_from_args(parser.parse_args(["--batch-invariant"])).batch_invariant
    assert not config_from_args(parser.parse_args([])).batch_invariant
    assert gpu_caps((9, 0)).batch_invariance and CPUPlatform().capabilities().batch_invariance


@pytest.mark.parametrize("option, value, names", [
    ("enable_lora", True, "LoRA adapters"),
    ("tensor_parallel_size", 2, "tensor parallelism"),
    ("speculative_config", {"method": "ngram", "num_speculative_tokens": 2}, "speculative decoding"),
])
def test_refuses_options_that_split_work_by_the_batch(option, value, names):
    check_invariant_config(EngineConfig(**{option: value}))  # accepted without the flag
    with pytest.raises(ConfigError, match=f"^{option}: --batch-invariant has no batch-invariant kernels for {names}"):
        CUDAPlatform().check_config(EngineConfig(batch_invariant=True, **{option: value}))


def test_refuses_torch_layer_code(monkeypatch):
    monkeypatch.setenv("CORECTL_FUSED_KERNELS", "0")
    with pytest.raises(ConfigError, match="CORECTL_FUSED_KERNELS=0"):
        CUDAPlatform().check_config(EngineConfig(batch_invariant=True))


def test_refuses_quantized_weights():
    check_invariant_quantization(None)
    with pytest.raises(ConfigError, match="^quantization: --batch-invariant .* 'fp8' quantized weights"):
        check_invariant_quantization(Fp8Config())


def _meta_model(hf, arch: str):
    hf.architectures = [arch]
    return build_model(resolve_model_class(hf), hf, torch.bfloat16, "meta", 64)


def test_accepts_dense_decoders_and_refuses_layers_outside_the_fused_kernels():
    from transformers import BertConfig, DeepseekV2Config, LlamaConfig, Qwen3MoeConfig

    check_invariant_model(_meta_model(LlamaConfig(**SMALL), "LlamaForCausalLM"))
    moe = Qwen3MoeConfig(**SMALL, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, head_dim=16)
    with pytest.raises(ConfigError, match=r"mixture-of-experts layers \(model.layers.0.mlp.experts\)"):
        check_invariant_model(_meta_model(moe, "Qwen3MoeForCausalLM"))
    latent = DeepseekV2Config(**{**SMALL, "num_key_value_heads": 4}, kv_lora_rank=32, q_lora_rank=None,
                              qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, first_k_dense_replace=2)
    with pytest.raises(ConfigError, match=r"multi-head latent attention \(model.layers.0.self_attn\)"):
        check_invariant_model(_meta_model(latent, "DeepseekV2ForCausalLM"))
    encoder = BertConfig(**{k: v for k, v in SMALL.items() if k != "num_key_value_heads"})
    with pytest.raises(ConfigError, match=r"BertModel's \S+ \(an nn.Linear outside the fused layers\)"):
        check_invariant_model(_meta_model(encoder, "BertModel"))


def test_switches_the_triton_backend_and_refuses_others():
    backend = TritonAttentionBackend(4, 2, 16, torch.bfloat16, torch.device("cpu"), 16)
    make_attention_invariant(backend)
    assert backend.batch_invariant and not TritonAttentionBackend.batch_invariant
    sdpa = TorchSDPABackend(4, 2, 16, torch.float32, torch.device("cpu"), 16)
    with pytest.raises(ConfigError, match="^attention_backend: --batch-invariant .* the 'torch_sdpa' attention backend"):
        make_attention_invariant(sdpa)
