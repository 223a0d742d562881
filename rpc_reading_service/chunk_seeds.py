"""The seeds torchdata's ``SeedGenerator(seed).spawn(index)`` hands out first, computed directly.

A "dynamic" worker seeds its global RNGs for every leased chunk (16 positions by default)
from the epoch's seed and the chunk's index. Building the spawned ``SeedGenerator`` runs
torchdata's pure-Python Philox four times (the child's key, a spawn seed of the child that
is never used, and two blocks of seeds), about half of what a chunk of tiny items costs a
worker. This module runs torchdata's Philox4x32-10 block three times, on plain integers: the same
seeds (tests/test_chunk_seeds.py checks them against torchdata for many seeds and indexes).
"""

from __future__ import annotations

import functools
from typing import Tuple

from torchdata.dataloader2.random._philox import philox_10_round

__all__ = ["spawned_seeds"]

_MASK_32 = 0xFFFFFFFF
_MASK_64 = 0xFFFFFFFFFFFFFFFF


def _philox(key0: int, key1: int, c0: int, c1: int, c2: int, c3: int) -> Tuple[int, int, int, int]:
    """One Philox4x32-10 block, torchdata's own (``philox_10_round``)."""
    return tuple(philox_10_round((key0, key1), [c0, c1, c2, c3]))  # type: ignore[return-value]


@functools.lru_cache(maxsize=4)
def _spawn_key(seed: int) -> Tuple[int, int]:
    """The key from which a ``SeedGenerator(seed)`` spawns its children (once per epoch seed)."""
    seed &= _MASK_64
    return _philox(seed & _MASK_32, seed >> 32, 0, 0, 0, 0)[:2]


def spawned_seeds(seed: int, index: int) -> Tuple[int, int, int]:
    """The first three ``generate_seed()`` draws of ``SeedGenerator(seed).spawn(index)`` (uint64 each)."""
    if index < 0:
        raise ValueError(f"a spawned generator needs an index >= 0, got {index}")
    key0, key1 = _spawn_key(seed)
    pair = index & ~1  # a block of Philox gives the children of two consecutive indexes
    block = _philox(key0, key1, pair & _MASK_32, (pair >> 32) & _MASK_32, (pair >> 64) & _MASK_32, (pair >> 96) & _MASK_32)
    half = 2 * (index & 1)
    child0, child1 = block[half], block[half + 1]  # the child's seed: child1 << 32 | child0
    # A seeded engine's counter starts at 1 (block 0 is its spawn key); each block gives two draws.
    first = _philox(child0, child1, 1, 0, 0, 0)
    second = _philox(child0, child1, 2, 0, 0, 0)
    return first[1] << 32 | first[0], first[3] << 32 | first[2], second[1] << 32 | second[0]
