"""The ROCm platform: AMD GPUs through torch's HIP build, reusing the Triton kernels."""
