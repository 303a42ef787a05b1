"""Reasoning parsers: split a model's `<think>...</think>` reasoning from its answer
(`--reasoning-parser NAME`), found by name through the `corectl_reasoning_parsers` hook."""
