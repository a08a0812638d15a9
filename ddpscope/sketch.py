"""The shard-sketch rule, shared by the rank-side probe and the analysis.

A rank keeps dataset index ``i`` in its sketch when ``mix64(i) & (mod - 1)``
is zero (``mod`` a power of two). The rule depends on the index alone, so two
ranks' sketches intersect exactly where their shards do. Both sides must
hash identically, hence one definition here (no torch: the watcher reads it).
"""

from __future__ import annotations

from collections.abc import Iterable

M64 = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15
C1 = 0xBF58476D1CE4E5B9
C2 = 0x94D049BB133111EB


def mix64(i: int) -> int:
    """splitmix64 finaliser of ``i`` taken modulo 2**64: the sketch's hash."""
    z = (i + GOLDEN) & M64
    z = ((z ^ (z >> 30)) * C1) & M64
    z = ((z ^ (z >> 27)) * C2) & M64
    return z ^ (z >> 31)


def keep(indices: Iterable[int], mask: int) -> list[int]:
    """The indices the rule keeps for ``mask = mod - 1`` (mix64 inlined: a hot loop)."""
    m, g, c1, c2 = M64, GOLDEN, C1, C2
    out = []
    for i in indices:
        z = (i + g) & m
        z = ((z ^ (z >> 30)) * c1) & m
        z = ((z ^ (z >> 27)) * c2) & m
        if not (z ^ (z >> 31)) & mask:
            out.append(i)
    return out
