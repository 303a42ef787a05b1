"""Speculative decoding: proposers of draft tokens and the rejection sampler that verifies them
(see docs/speculative.md)."""
from .config import SpeculativeConfig, resolve_speculative_config

__all__ = ["SpeculativeConfig", "resolve_speculative_config"]
