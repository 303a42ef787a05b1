"""Fused mixture-of-experts: routing, the sort of (token, slot) pairs by expert, and the two expert GEMMs."""
