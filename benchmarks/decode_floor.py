"""The batch-1 decode floor of a preset: the bytes one token's step must read, over the device's copy
bandwidth, against the TPOT a `corectl bench latency` result measured.

A step reads every weight it uses once in its served bytes and the KV cache of its context (a
sliding-window layer at most its window), averaged over the decode steps of a request of
`--input-len` + `--output-len` tokens. Dense presets: every projection and the LM head (tied or not,
read once; it stays bf16 under `--quantization fp8`, whose linear layers read a byte a weight and an
fp32 scale a row). Mixtures of experts: the active parameters (attention, router, norms, the LM head,
the k routed experts' matrices and biases: MXFP4 experts 17/32 byte a weight, half a byte plus a
byte of scale per 32). The copy bandwidth is measured here (a device-to-device copy of 2 GiB, as the
HF peer's `ceilings`).

  python benchmarks/decode_floor.py --preset gpt-oss-20b --input-len 512 --output-len 128 --result w2oss.json
  python benchmarks/decode_floor.py --preset qwen3-14b --quantization fp8 --result q14.json

DeepSeek presets (`kv_lora_rank` in the config) count multi-head latent attention's cache instead: one
latent row per token and layer, not per head (`latent_step_bytes`).
"""
from __future__ import annotations

import argparse
import json
import time

import torch
from corectl.loaders.presets import PRESETS

BF16 = 2
FP32 = 4
FP8 = 1
MXFP4 = 17 / 32


def step_bytes(cfg: dict, context: float, weight_bytes: float = BF16) -> float:
    """Bytes a batch-1 decode step reads at `context` tokens: dense configs with their linear layers'
    weights at `weight_bytes` a weight (FP8: 1, plus a scale a row), gpt-oss-style mixtures of experts,
    or DeepSeek's."""
    if "kv_lora_rank" in cfg:
        return latent_step_bytes(cfg, context)
    if not is_moe(cfg):
        return dense_step_bytes(cfg, context, weight_bytes)
    h, layers = cfg["hidden_size"], cfg["num_hidden_layers"]
    q, kv, d = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    experts, k, inter = cfg["num_local_experts"], cfg["num_experts_per_tok"], cfg["intermediate_size"]
    attention = (h * (q + 2 * kv) * d + q * d * h + (q + 2 * kv) * d + h + q) * BF16
    router = (h * experts + experts) * BF16
    packed = (cfg.get("quantization_config") or {}).get("quant_method") == "mxfp4"
    expert = 3 * inter * h * (MXFP4 if packed else BF16) + (2 * inter + h) * BF16
    head = cfg["vocab_size"] * h * BF16
    return layers * (attention + router + k * expert + 2 * h * BF16) + kv_bytes(cfg, context) + head + 2 * h * BF16


def is_moe(cfg: dict) -> bool:
    return any(key in cfg for key in ("num_local_experts", "num_experts", "kv_lora_rank"))


def dense_step_bytes(cfg: dict, context: float, weight_bytes: float) -> float:
    """`step_bytes` of a dense config: q, k, v, o and the gated MLP's three matrices a layer, their
    scales (FP8) and biases, the layer's norms (Gemma's four), the LM head in bf16, the KV cache."""
    h, layers, inter = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["intermediate_size"]
    q, kv, d = cfg["num_attention_heads"], cfg["num_key_value_heads"], head_dim(cfg)
    weights = h * (q + 2 * kv) * d + q * d * h + 3 * inter * h
    rows = (q + 2 * kv) * d + h + 2 * inter + h  # an fp32 scale each under FP8
    scales = rows * FP32 if weight_bytes < BF16 else 0
    bias = (q + 2 * kv) * d * BF16 if cfg.get("attention_bias") or cfg["model_type"] == "qwen2" else 0
    norms = (4 if cfg["model_type"].startswith("gemma") else 2) * h * BF16
    layer = weights * weight_bytes + scales + bias + norms
    return layers * layer + kv_bytes(cfg, context) + cfg["vocab_size"] * h * BF16 + 2 * h * BF16


def head_dim(cfg: dict) -> int:
    return cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]


def kv_bytes(cfg: dict, context: float) -> float:
    """The bf16 KV cache a step reads: every layer's keys and values at `context` tokens, a
    sliding-window layer's at most its window (gpt-oss and Gemma 2 alternate sliding and global
    layers, sliding first; Mistral slides on every layer)."""
    kv, d = cfg["num_key_value_heads"], head_dim(cfg)
    window = cfg.get("sliding_window")
    alternating = cfg["model_type"] in ("gpt_oss", "gemma2")
    total = 0.0
    for layer in range(cfg["num_hidden_layers"]):
        sliding = window is not None and (layer % 2 == 0 or not alternating)
        total += (min(context, window) if sliding else context) * 2 * kv * d * BF16
    return total


def latent_step_bytes(cfg: dict, context: float) -> float:
    """`step_bytes` of a DeepSeek config: MLA reads its projections in the absorbed form (W_UK and W_UV
    in place of kv_b_proj, the same count) and one latent row of kv_lora_rank + qk_rope_head_dim
    numbers per token and layer, shared by every head; the first `first_k_dense_replace` layers are
    dense, the rest read an fp32 router, the top-k routed and the shared experts."""
    h, layers, heads = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_attention_heads"]
    rank, rope, nope, v = cfg["kv_lora_rank"], cfg["qk_rope_head_dim"], cfg["qk_nope_head_dim"], cfg["v_head_dim"]
    q_lora = cfg.get("q_lora_rank")
    q_proj = h * heads * (nope + rope) if q_lora is None else h * q_lora + q_lora + q_lora * heads * (nope + rope)
    attention = (q_proj + h * (rank + rope) + rank + heads * (nope + v) * rank + heads * v * h) * BF16
    dense = cfg.get("first_k_dense_replace", 0)
    experts, k, inter = cfg["n_routed_experts"], cfg["num_experts_per_tok"], cfg["moe_intermediate_size"]
    moe = h * experts * 4 + (k + cfg.get("n_shared_experts", 0)) * 3 * inter * h * BF16
    mlps = dense * 3 * cfg["intermediate_size"] * h * BF16 + (layers - dense) * moe
    latent = layers * context * (rank + rope) * BF16
    return layers * (attention + 2 * h * BF16) + mlps + latent + cfg["vocab_size"] * h * BF16 + h * BF16


def copy_bandwidth() -> float:
    """Bytes per second of a device-to-device copy (read plus write)."""
    x = torch.empty(2 * 1024**3, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(10):
        y.copy_(x)
    torch.cuda.synchronize()
    return 2 * x.numel() * 10 / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="gpt-oss-20b", choices=sorted(PRESETS))
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--quantization", choices=["fp8"], help="the served weights (dense presets): FP8 W8A16")
    parser.add_argument("--result", help="a `corectl bench latency --save-result` file to compare")
    args = parser.parse_args()
    cfg = PRESETS[args.preset]
    if args.quantization and is_moe(cfg):
        parser.error("--quantization counts a dense preset's linear layers only")
    context = args.input_len + (args.output_len + 1) / 2
    read = step_bytes(cfg, context, FP8 if args.quantization else BF16)
    bandwidth = copy_bandwidth()
    floor_ms = read / bandwidth * 1e3
    dtype = args.quantization or "bf16"
    print(f"{args.preset} {dtype}: {read / 1e9:.3f} GB a decode step (mean context {context:.0f}); copy bandwidth "
          f"{bandwidth / 1e12:.3f} TB/s; floor {floor_ms:.3f} ms")
    if args.result:
        with open(args.result) as f:
            tpot_ms = json.load(f)["decode_step_s"]["p50"] * 1e3
        print(f"TPOT median {tpot_ms:.3f} ms = {tpot_ms / floor_ms:.2f}x the floor, {floor_ms / tpot_ms:.1%} of it")
        print(f"| {args.preset} | {dtype} | {tpot_ms:.3f} ms | {floor_ms:.3f} ms | {floor_ms / tpot_ms:.1%} |")


if __name__ == "__main__":
    main()
