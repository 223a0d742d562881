"""The seeds torchdata's ``SeedGenerator(seed).spawn(index)`` hands out first, computed directly.

A "dynamic" worker seeds its global RNGs for every leased chunk (16 positions by default)
from the epoch's seed and the chunk's index. Building the spawned ``SeedGenerator`` runs
torchdata's pure-Python Philox four times (the child's key, a spawn seed of the child that
is never used, and two blocks of seeds), about half of what a chunk of tiny items costs a
worker. This module computes the same Philox4x32-10 blocks three times (two, when the
previous chunk shared the child's block), with torchdata's rounds unrolled on plain
integers: 3 us a block instead of torchdata's 9 (its rounds build lists and call a function
per multiplication). The same seeds: tests/test_chunk_seeds.py checks them, and each block,
against torchdata for many seeds and indexes.
"""

from __future__ import annotations

import functools
from typing import Tuple

from .seed_generator import kPhilox10A, kPhilox10B, kPhiloxSA, kPhiloxSB

__all__ = ["spawned_seeds"]

_MASK_32 = 0xFFFFFFFF
_MASK_64 = 0xFFFFFFFFFFFFFFFF


def _philox(key0: int, key1: int, c0: int, c1: int, c2: int, c3: int) -> Tuple[int, int, int, int]:
    """One Philox4x32-10 block of 32-bit words: torchdata's ``philox_10_round``, its ten rounds
    written out (each: two 32x32-bit products, their halves swapped and xored with the key;
    the key bumped between rounds)."""
    a, b, mask = kPhiloxSA, kPhiloxSB, _MASK_32
    bump0, bump1 = kPhilox10A, kPhilox10B
    for _ in range(9):
        p0, p1 = a * c0, b * c2
        c0, c1, c2, c3 = (p1 >> 32) ^ c1 ^ key0, p1 & mask, (p0 >> 32) ^ c3 ^ key1, p0 & mask
        key0, key1 = (key0 + bump0) & mask, (key1 + bump1) & mask
    p0, p1 = a * c0, b * c2
    return (p1 >> 32) ^ c1 ^ key0, p1 & mask, (p0 >> 32) ^ c3 ^ key1, p0 & mask


@functools.lru_cache(maxsize=4)
def _spawn_key(seed: int) -> Tuple[int, int]:
    """The key from which a ``SeedGenerator(seed)`` spawns its children (once per epoch seed)."""
    seed &= _MASK_64
    return _philox(seed & _MASK_32, seed >> 32, 0, 0, 0, 0)[:2]


@functools.lru_cache(maxsize=2)
def _children(key0: int, key1: int, pair: int) -> Tuple[int, int, int, int]:
    """The block of the children ``pair`` and ``pair + 1`` (a walk's next chunk is often the second)."""
    return _philox(key0, key1, pair & _MASK_32, (pair >> 32) & _MASK_32, (pair >> 64) & _MASK_32, (pair >> 96) & _MASK_32)


def spawned_seeds(seed: int, index: int) -> Tuple[int, int, int]:
    """The first three ``generate_seed()`` draws of ``SeedGenerator(seed).spawn(index)`` (uint64 each)."""
    if index < 0:
        raise ValueError(f"a spawned generator needs an index >= 0, got {index}")
    block = _children(*_spawn_key(seed), index & ~1)
    half = 2 * (index & 1)
    child0, child1 = block[half], block[half + 1]  # the child's seed: child1 << 32 | child0
    # A seeded engine's counter starts at 1 (block 0 is its spawn key); each block gives two draws.
    first = _philox(child0, child1, 1, 0, 0, 0)
    second = _philox(child0, child1, 2, 0, 0, 0)
    return first[1] << 32 | first[0], first[3] << 32 | first[2], second[1] << 32 | second[0]
