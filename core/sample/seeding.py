"""Seeds of a seeded request's random numbers, one per output position (a counter-based stream).

`position_seed(seed, position)` depends on the pair alone, so the same request draws the same
numbers whatever else is batched, after a prefix-cache hit or a preemption, and however many
drafts a verify step checks. n > 1 samples take seeds seed, seed + 1, ...; the multiplier keeps
their streams apart for outputs shorter than a million tokens.
"""
from __future__ import annotations

_MULTIPLIER = 1_000_003


def position_seed(seed: int, position: int) -> int:
    """A torch generator seed (in [0, 2**63)) for output `position` of a request seeded `seed`."""
    return (seed * _MULTIPLIER + position) % (1 << 63)
