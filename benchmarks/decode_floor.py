"""The batch-1 decode floor of a mixture-of-experts preset: the bytes one token's step must read, over
the device's copy bandwidth, against the TPOT a `corectl bench latency` result measured.

A step reads every active parameter once in its served bytes (attention, router, norms, the LM head,
the k routed experts' matrices and biases: MXFP4 experts 17/32 byte a weight, half a byte plus a
byte of scale per 32) and the KV cache of its context (a sliding-window layer at most its window),
averaged over the decode steps of a request of `--input-len` + `--output-len` tokens. The copy
bandwidth is measured here (a device-to-device copy of 2 GiB, as the HF peer's `ceilings`).

  python benchmarks/moe_decode_floor.py --preset gpt-oss-20b --input-len 512 --output-len 128 --result w2oss.json

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
MXFP4 = 17 / 32


def step_bytes(cfg: dict, context: float) -> float:
    """Bytes a batch-1 decode step reads at `context` tokens (gpt-oss-style config fields, or DeepSeek's)."""
    if "kv_lora_rank" in cfg:
        return latent_step_bytes(cfg, context)
    h, layers = cfg["hidden_size"], cfg["num_hidden_layers"]
    q, kv, d = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    experts, k, inter = cfg["num_local_experts"], cfg["num_experts_per_tok"], cfg["intermediate_size"]
    attention = (h * (q + 2 * kv) * d + q * d * h + (q + 2 * kv) * d + h + q) * BF16
    router = (h * experts + experts) * BF16
    packed = (cfg.get("quantization_config") or {}).get("quant_method") == "mxfp4"
    expert = 3 * inter * h * (MXFP4 if packed else BF16) + (2 * inter + h) * BF16
    window = cfg.get("sliding_window")
    kv_read = 0.0
    for layer in range(layers):
        sliding = window is not None and layer % 2 == 0  # gpt-oss: sliding, full, sliding, ...
        kv_read += (min(context, window) if sliding else context) * 2 * kv * d * BF16
    head = cfg["vocab_size"] * h * BF16
    return layers * (attention + router + k * expert + 2 * h * BF16) + kv_read + head + 2 * h * BF16


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
    parser.add_argument("--result", help="a `corectl bench latency --save-result` file to compare")
    args = parser.parse_args()
    cfg = PRESETS[args.preset]
    context = args.input_len + (args.output_len + 1) / 2
    read = step_bytes(cfg, context)
    bandwidth = copy_bandwidth()
    floor_ms = read / bandwidth * 1e3
    print(f"{args.preset}: {read / 1e9:.3f} GB a decode step (mean context {context:.0f}); copy bandwidth "
          f"{bandwidth / 1e12:.3f} TB/s; floor {floor_ms:.3f} ms")
    if args.result:
        with open(args.result) as f:
            tpot_ms = json.load(f)["decode_step_s"]["p50"] * 1e3
        print(f"TPOT median {tpot_ms:.3f} ms = {tpot_ms / floor_ms:.2f}x the floor (target <= 1.3x)")


if __name__ == "__main__":
    main()
