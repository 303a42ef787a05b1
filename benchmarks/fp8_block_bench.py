"""The block-scaled FP8 W8A16 GEMM (`bash benchmarks/device_bench.sh sweep:fp8block`) on DeepSeek V3's
projection shapes, from a decode batch to a prefill chunk, against two peers in the same process:
cuBLAS bf16 on the dequantized weight (what serving the checkpoint in bf16 costs: twice the weight
bytes) and the torch path corectl falls back to without Triton (dequantize, then cuBLAS, every call).
Each time is one call replayed from a CUDA graph."""
import torch
from corectl.backends.triton.bench.fp8 import graph_us
from corectl.backends.triton.gemm.fp8_block import fp8_block_w8a16
from corectl.quantization.fp8_block import dequantize_blocks

BLOCK = (128, 128)
SHAPES = {"q_a": (1536, 7168), "kv_a": (576, 7168), "q_b": (24576, 1536), "o": (7168, 16384),
          "gate_up": (36864, 7168), "down": (7168, 18432)}
ROWS = (1, 16, 64, 256, 2048)


def main() -> None:
    print("layer       M   fp8-block us  bf16 cuBLAS us  vs bf16  torch path us  weight GB/s")
    for name, (n, k) in SHAPES.items():
        weight = (torch.randn(n, k, device="cuda") * 0.05).to(torch.float8_e4m3fn)
        scale = torch.rand(n // BLOCK[0] + (n % BLOCK[0] > 0), k // BLOCK[1], device="cuda") * 0.01 + 1e-3
        dense = dequantize_blocks(weight, scale, BLOCK).to(torch.bfloat16)
        for m in ROWS:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            ours = graph_us([lambda: fp8_block_w8a16(x, weight, scale, None, BLOCK)])
            cublas = graph_us([lambda: torch.nn.functional.linear(x, dense)])
            fallback = graph_us([lambda: torch.nn.functional.linear(
                x, dequantize_blocks(weight, scale, BLOCK).to(torch.bfloat16))])
            print(f"{name:8s} {m:5d}   {ours:12.1f}  {cublas:14.1f}  {cublas / ours:7.2f}  {fallback:13.1f}  "
                  f"{n * k / ours / 1e3:11.0f}", flush=True)


if __name__ == "__main__":
    main()
