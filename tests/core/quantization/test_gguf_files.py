"""A GGUF file written here with the `gguf` package (a random Llama, its projections in Q4_0, Q4_1
and Q8_0, the SmolLM2 tokenizer's metadata) is served from its 4-bit blocks where the blocks are
int4 groups and dequantized elsewhere, with the greedy tokens of its dequantized fp32 path."""
from __future__ import annotations

import gguf
import numpy as np
import pytest
from corectl import LLM
from gguf import GGMLQuantizationType as Q
from gguf.quants import quantize
from helpers import build_random_checkpoint, smollm2_gguf
from quant_checkpoints import greedy_divergences, random_prompts
from safetensors.torch import load_file

ENGINE = {"kv_cache_memory_gib": 0.05, "max_model_len": 128}
# projection -> storage type; layer 1's down projection stays Q8_0 (dequantized at load)
TYPES = {"attn_q": Q.Q4_0, "attn_k": Q.Q4_0, "attn_v": Q.Q4_0, "attn_output": Q.Q4_1, "ffn_gate": Q.Q4_1,
         "ffn_up": Q.Q4_1, "ffn_down": Q.Q4_1}
HF_NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
            "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
            "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}


def _copy_tokenizer(writer: gguf.GGUFWriter) -> None:
    reader = gguf.GGUFReader(smollm2_gguf())
    strings = lambda key: [bytes(reader.fields[key].parts[i]).decode() for i in reader.fields[key].data]  # noqa: E731
    scalar = lambda key: reader.fields[key].parts[reader.fields[key].data[0]][0].item()  # noqa: E731
    writer.add_tokenizer_model(bytes(reader.fields["tokenizer.ggml.model"].parts[-1]).decode())
    writer.add_token_list(strings("tokenizer.ggml.tokens"))
    writer.add_token_types([int(reader.fields["tokenizer.ggml.token_type"].parts[i][0])
                            for i in reader.fields["tokenizer.ggml.token_type"].data])
    writer.add_token_merges(strings("tokenizer.ggml.merges"))
    writer.add_bos_token_id(scalar("tokenizer.ggml.bos_token_id"))
    writer.add_eos_token_id(scalar("tokenizer.ggml.eos_token_id"))


def _permute_rotary_rows(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's q/k row order (each head's rotary halves interleaved), which the loader undoes."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, -1).swapaxes(1, 2).reshape(w.shape)


def _write_gguf(dense, path, config) -> None:
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_freq_base(10000.0)
    _copy_tokenizer(writer)
    for name, tensor in load_file(dense / "model.safetensors").items():
        values = tensor.float().numpy()
        if name in ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"):
            writer.add_tensor({"model.embed_tokens.weight": "token_embd.weight", "lm_head.weight": "output.weight",
                               "model.norm.weight": "output_norm.weight"}[name], values)
            continue
        layer, module = name.split(".")[2], ".".join(name.split(".")[3:-1])
        kind = HF_NAMES[module]
        if kind not in TYPES:
            writer.add_tensor(f"blk.{layer}.{kind}.weight", values)
            continue
        if kind in ("attn_q", "attn_k"):
            values = _permute_rotary_rows(values, config["num_attention_heads" if kind == "attn_q" else "num_key_value_heads"])
        qtype = Q.Q8_0 if (layer, kind) == ("1", "ffn_down") else TYPES[kind]
        writer.add_tensor(f"blk.{layer}.{kind}.weight", quantize(values, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory, default_model_dir):
    import json

    root = tmp_path_factory.mktemp("gguf")
    dense = build_random_checkpoint("llama", root / "dense", default_model_dir, seed=5, hidden_size=128,
                                    intermediate_size=256, initializer_range=0.1)
    path = root / "tiny-llama.gguf"
    _write_gguf(dense, path, json.loads((dense / "config.json").read_text()))
    return path


def test_mixed_gguf_keeps_its_int4_layers_and_matches_the_dequantized_path(gguf_file):
    ours = LLM(str(gguf_file), **ENGINE)
    assert ours.engine.info.quantization == "gguf (Q4_0/Q4_1 int4 layers via cpu_int4pack)"
    layers = ours.engine.executor.worker.runner.model.model.layers
    assert hasattr(layers[0].mlp.down_proj, "packed_weight")
    assert getattr(layers[1].mlp.down_proj, "quant_method", None) is None  # Q8_0: dequantized (and prepacked)
    reference = LLM(str(gguf_file), quantization="none", dtype="float32", **ENGINE)
    divergences = greedy_divergences(ours, reference, random_prompts())
    print(f"tiny Llama GGUF (Q4_0/Q4_1/Q8_0) vs fp32: {len(divergences)} near-tie divergences {divergences}")
