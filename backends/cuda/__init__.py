"""The CUDA platform: Triton paged-attention kernels, memory profiling and CUDA graphs for decode."""
