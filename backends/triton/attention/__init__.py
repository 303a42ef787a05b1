"""Paged attention: the attention backend of the CUDA and ROCm platforms (`backend.py`), its decode and
prefill kernels, the online-softmax loop they share, and the KV-cache store."""
