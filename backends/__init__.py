"""Hardware backends: one subpackage per platform, plus shared Triton kernels."""
