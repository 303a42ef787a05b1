"""Engines that need no particular weights: the `llama-tiny` preset with random weights on the CPU and
a small KV cache, which starts in about a second. Tests add what they exercise:
`LLM(**TINY, max_queued_requests=1)` or `{**TINY, "runner": "pooling"}`."""
from __future__ import annotations

TINY = {"model": "llama-tiny", "load_format": "dummy", "platform": "cpu", "kv_cache_memory_gib": 0.01}
