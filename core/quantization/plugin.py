"""The built-in quantization methods, registered through the `corectl` entry-point group like any other."""
from __future__ import annotations

from corectl.plugins import QuantizationMethodSpec, hookimpl


@hookimpl
def corectl_quantization_methods():
    yield QuantizationMethodSpec("gguf", "corectl.quantization.gguf:GGUFConfig",
                                 "GGUF blocks kept quantized (Q4_0, Q4_1, Q4_K as int4 groups of 32; w4a16 on GPUs, "
                                 "cpu_int4pack on CPUs)")
    yield QuantizationMethodSpec("fp8", "corectl.quantization.fp8:Fp8Config",
                                 "FP8 W8A8: per-channel weight scales, dynamic per-token activation scales; "
                                 "block-scaled checkpoints (weight_block_size, DeepSeek V3) W8A16")
    yield QuantizationMethodSpec("compressed-tensors", "corectl.quantization.fp8:CompressedTensorsFp8Config",
                                 "compressed-tensors checkpoints with FP8 weights and activations")
    yield QuantizationMethodSpec("awq", "corectl.quantization.int4:AWQConfig", "AWQ 4-bit weight-only")
    yield QuantizationMethodSpec("gptq", "corectl.quantization.int4:GPTQConfig",
                                 "GPTQ 4-bit weight-only, with or without act-order (g_idx)")
    yield QuantizationMethodSpec("mxfp4", "corectl.quantization.mxfp4:Mxfp4Config",
                                 "MXFP4 experts (gpt-oss: e2m1 with an e8m0 scale per 32): served packed by the "
                                 "platform's mxfp4_moe kernel (CUDA), dequantized at load elsewhere")
