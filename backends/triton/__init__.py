"""Triton kernels shared by the CUDA and ROCm platforms, and the attention backend built on them.

Every kernel comes as a trio: the `@triton.jit` kernel, a launcher that validates shapes, strides,
dtypes and (optionally) index ranges before launching, and a plain torch reference in
`reference.py` that tests compare against. Importing this package imports nothing heavy; the
kernel modules import triton when they are used.
"""
