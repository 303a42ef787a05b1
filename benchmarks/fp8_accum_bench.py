"""torch._scaled_mm with row-wise scales, with and without fast accumulation (`bash benchmarks/device_bench.sh
sweep:fp8accum`): TFLOP/s at llama3-8b's projections for a prefill chunk (M = 8192) and a decode
batch (M = 256), and each form's error against the fp32 product of the same e4m3 operands."""
import torch
from corectl.backends.triton.bench.fp8 import graph_us
from corectl.quantization.fp8 import fp8_gemm_reference, quantize_rows

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}


def main() -> None:
    print("layer       M   accurate TFLOP/s  error     fast TFLOP/s  error")
    for name, (n, k) in SHAPES.items():
        weight, w_scale = quantize_rows(torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02)
        w_scale = w_scale.view(1, -1)
        for m in (8192, 256):
            xq, x_scale = quantize_rows(torch.randn(m, k, device="cuda", dtype=torch.bfloat16))
            ref = fp8_gemm_reference(xq, x_scale, weight, w_scale, None, torch.float32)
            row = f"{name:8s} {m:5d}"
            for fast in (False, True):
                def call(fast=fast):
                    return torch._scaled_mm(xq, weight.t(), scale_a=x_scale, scale_b=w_scale,
                                            out_dtype=torch.bfloat16, use_fast_accum=fast)
                error = ((call().float() - ref).norm() / ref.norm()).item()
                us = graph_us([call])
                row += f"   {2 * m * n * k / us / 1e6:10.0f}   {error:.1e}"
            print(row, flush=True)


if __name__ == "__main__":
    main()
