"""GGUF files written here with the `gguf` package: a random HF Llama's projections in chosen block
types (Q4_K through a quantizer of our own: the package only dequantizes it), with a synthetic
vocabulary of the config's size: the tests prompt with token ids, and reading SmolLM2's 49,152
tokens back from a GGUF costs seconds at every open. Used by tests/core/quantization and tests/gpu."""
from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as Q
from gguf.quants import quantize
from safetensors.torch import load_file

HF_NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
            "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
            "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
TOP_LEVEL = {"model.embed_tokens.weight": "token_embd.weight", "lm_head.weight": "output.weight",
             "model.norm.weight": "output_norm.weight"}


def quantize_q4_k(values: np.ndarray) -> np.ndarray:
    """fp32 [N, K] (K a multiple of 256) as Q4_K blocks, uint8 [N, K / 256 * 144]: per 32 values an
    affine 4-bit grid (scale d*sc, min dmin*m) with sc and m 6-bit steps of the super-block's d, dmin."""
    n = values.shape[0]
    sub = values.reshape(-1, 8, 32).astype(np.float32)
    lo = np.minimum(sub.min(axis=2), 0.0)
    scale = (sub.max(axis=2) - lo) / 15
    d = np.maximum(scale.max(axis=1), 1e-8) / 63
    dmin = np.maximum(-lo.min(axis=1), 1e-8) / 63
    d16, dmin16 = d.astype(np.float16), dmin.astype(np.float16)
    sc = np.clip(np.round(scale / d16[:, None].astype(np.float32)), 1, 63).astype(np.uint8)
    m = np.clip(np.round(-lo / dmin16[:, None].astype(np.float32)), 0, 63).astype(np.uint8)
    step = d16[:, None].astype(np.float32) * sc
    offset = dmin16[:, None].astype(np.float32) * m
    codes = np.clip(np.round((sub + offset[..., None]) / step[..., None]), 0, 15).astype(np.uint8)
    packed_scales = np.concatenate([(sc[:, :4] & 0x3F) | ((sc[:, 4:] >> 4) << 6),
                                    (m[:, :4] & 0x3F) | ((m[:, 4:] >> 4) << 6),
                                    (sc[:, 4:] & 0x0F) | ((m[:, 4:] & 0x0F) << 4)], axis=1)
    # Each 32-byte chunk holds sub-blocks 2c (low nibbles) and 2c + 1 (high nibbles).
    pairs = codes.reshape(-1, 4, 2, 32)
    qs = (pairs[:, :, 0] | (pairs[:, :, 1] << 4)).reshape(-1, 128)
    blocks = np.concatenate([d16.reshape(-1, 1).view(np.uint8), dmin16.reshape(-1, 1).view(np.uint8),
                             packed_scales, qs], axis=1)
    return blocks.reshape(n, -1)


def quantize_q6_k(values: np.ndarray) -> np.ndarray:
    """fp32 [N, K] (K a multiple of 256) as Q6_K blocks, uint8 [N, K / 256 * 210]: per 16 values a
    symmetric 6-bit grid (q - 32) of scale d*sc, sc an int8 step of the super-block's d."""
    n = values.shape[0]
    sub = values.reshape(-1, 16, 16).astype(np.float32)
    scale = np.abs(sub).max(axis=2) / 31
    d16 = (np.maximum(scale.max(axis=1), 1e-8) / 127).astype(np.float16)
    sc = np.clip(np.round(scale / d16[:, None].astype(np.float32)), 1, 127).astype(np.int8)
    step = d16[:, None].astype(np.float32) * sc
    q = (np.clip(np.round(sub / step[..., None]), -32, 31) + 32).astype(np.uint8).reshape(-1, 2, 4, 32)
    # Per 128-value half: byte j of the low nibbles holds values j and j + 64, byte j of the high
    # bits values j, j + 32, j + 64 and j + 96 at bit pairs 0, 2, 4, 6.
    low = (q[:, :, :2] & 0x0F) | ((q[:, :, 2:] & 0x0F) << 4)
    high = sum(((q[:, :, s] >> 4) & 0x03) << (2 * s) for s in range(4))
    blocks = np.concatenate([low.reshape(-1, 128), high.reshape(-1, 64).astype(np.uint8), sc.view(np.uint8),
                             d16.reshape(-1, 1).view(np.uint8)], axis=1)
    return blocks.reshape(n, -1)


def quantize_blocks(values: np.ndarray, qtype: Q) -> np.ndarray:
    """GGUF blocks of `qtype`: the gguf package's quantizer, or ours for the K-quants it lacks."""
    own = {Q.Q4_K: quantize_q4_k, Q.Q6_K: quantize_q6_k}
    return own[qtype](values) if qtype in own else quantize(values, qtype)


def _synthetic_tokenizer(writer: gguf.GGUFWriter, vocab_size: int) -> None:
    """A byte-level BPE vocabulary `t0`..`t{n-1}` (t1 = BOS, t2 = EOS), the GGUF twin of
    gpu_helpers.write_tokenizer: enough for token-id prompts and their detokenization. No token
    splits into two others, so the merges a reader derives from the scores are none."""
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([f"t{i}" for i in range(vocab_size)])
    writer.add_token_types([1] * vocab_size)
    writer.add_token_scores([0.0] * vocab_size)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)


def _permute_rotary_rows(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's q/k row order (each head's rotary halves interleaved), which the loader undoes."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, -1).swapaxes(1, 2).reshape(w.shape)


def _add_header(writer: gguf.GGUFWriter, config: dict) -> None:
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_freq_base(10000.0)
    _synthetic_tokenizer(writer, config["vocab_size"])


def write_gguf(dense: Path, path: Path, types: dict[str, Q],
               exceptions: dict[tuple[str, str], Q] | None = None) -> Path:
    """The HF Llama in `dense` as a GGUF file: projection kind (attn_q, ffn_down, ...) -> block type,
    `exceptions` (layer index, kind) -> another type; norms and embeddings in fp32; the vocabulary
    tokens t0..t{n-1} for the config's vocab_size."""
    config = json.loads((dense / "config.json").read_text())
    writer = gguf.GGUFWriter(str(path), "llama")
    _add_header(writer, config)
    for name, tensor in load_file(dense / "model.safetensors").items():
        values = tensor.float().numpy()
        if name in TOP_LEVEL:
            writer.add_tensor(TOP_LEVEL[name], values)
            continue
        layer, module = name.split(".")[2], ".".join(name.split(".")[3:-1])
        kind = HF_NAMES[module]
        if kind not in types:
            writer.add_tensor(f"blk.{layer}.{kind}.weight", values)
            continue
        if kind in ("attn_q", "attn_k"):
            heads = config["num_attention_heads" if kind == "attn_q" else "num_key_value_heads"]
            values = _permute_rotary_rows(values, heads)
        qtype = (exceptions or {}).get((layer, kind), types[kind])
        writer.add_tensor(f"blk.{layer}.{kind}.weight", quantize_blocks(values, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
