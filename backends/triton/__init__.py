"""Triton kernels shared by the CUDA and ROCm platforms, and the attention backend built on them.

Every kernel comes as a trio: the `@triton.jit` kernel, a launcher that validates shapes, strides,
dtypes and (optionally) index ranges before launching, and a plain torch reference in
`reference.py` that tests compare against. Importing this package imports nothing heavy; the
kernel modules import triton when they are used.

Kernels are grouped by family: `attention/` (with the attention backend), `gemm/` (quantized GEMMs),
`moe/`, `elementwise/` (norms, rotary, activation) and `lora/`. `checks.py` (launcher validation), `pdl.py`,
`reference.py` and `layer_kernels.py` (the kernels as the models' layer kernels) serve them all; `bench/`
holds the GPU benchmarks and sweeps.
"""
