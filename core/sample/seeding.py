"""Seeds of a seeded request's random numbers, one per output position (a counter-based stream).

`position_seed(seed, position)` mixes the two with splitmix64's finaliser, so nearby seeds and
positions give unrelated streams (n > 1 samples take seeds seed, seed + 1, ...), and the same pair
always gives the same numbers.
"""
from __future__ import annotations

_MASK = (1 << 64) - 1


def _mix(x: int) -> int:
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9 & _MASK
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB & _MASK
    return x ^ (x >> 31)


def position_seed(seed: int, position: int) -> int:
    """A torch generator seed (in [0, 2**63)) for output `position` of a request seeded `seed`."""
    return _mix((_mix(seed & _MASK) + 0x9E3779B97F4A7C15 * (position + 1)) & _MASK) >> 1
