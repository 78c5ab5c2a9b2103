"""Every seeded random number's key, derived from a seed by one hash along a path of names.

A request's draws come from keys derived from its seed along a path, as JAX splits keys:
``derive(seed, "request", 3)`` is the third request's seed, ``derive(that, "cycle", 7)`` its
seventh cycle's resampling key. A key depends on its path alone, never on how many other
draws were made, and distinct paths give unrelated keys. The hash is splitmix64's
finalizer; a name is folded in eight bytes at a time. Nothing here holds state.
"""

from __future__ import annotations

import torch

MASK64 = (1 << 64) - 1


def mix64(x: int) -> int:
    """A 64-bit integer hash (the splitmix64 finalizer): nearby inputs give unrelated outputs."""
    x = (x + 0x9E3779B97F4A7C15) & MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


def _part(part: int | str) -> int:
    """A path element as 64 bits: an integer as itself, a name hashed (its length folded in)."""
    if isinstance(part, int):
        return part & MASK64
    data, h = part.encode(), mix64(len(part))
    for i in range(0, len(data), 8):
        h = mix64(h ^ int.from_bytes(data[i : i + 8], "little"))
    return h


def derive(seed: int, *path: int | str) -> int:
    """The key (63 bits, a valid seed anywhere) of ``path`` under ``seed``."""
    key = mix64(seed & MASK64)
    for part in path:
        key = mix64(key ^ _part(part))
    return key >> 1


def generator(key: int) -> torch.Generator:
    """A host generator seeded by ``key`` (resampling, the output's choice, token-level draws)."""
    return torch.Generator().manual_seed(key)
