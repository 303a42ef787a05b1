"""GPU benchmarks and launch-config sweeps of the kernels (`python -m corectl.backends.triton.bench<name>`),
and the paged-attention inputs they share with the kernel tests (`paged_batch.py`)."""
