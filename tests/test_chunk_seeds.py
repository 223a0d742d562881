"""spawned_seeds: torchdata's seeds of a spawned SeedGenerator, without building it."""

import random

import pytest
from torchdata.dataloader2.random import SeedGenerator

from torchdata.dataloader2.random._philox import philox_10_round

from rpc_reading_service.chunk_seeds import _philox, spawned_seeds


def _torchdata_draws(seed: int, index: int) -> tuple:
    child = SeedGenerator(seed).spawn(index)
    return child.generate_seed(), child.generate_seed(), child.generate_seed()


def test_spawned_seeds_are_torchdatas_for_edge_and_random_seeds_and_indexes():
    rng = random.Random(13)
    seeds = [0, 1, 11, 2**63, 2**64 - 1] + [rng.getrandbits(64) for _ in range(10)]
    indexes = [0, 1, 2, 3, 15, 16, 2**32 - 1, 2**32, 2**32 + 1, 2**64 + 5, 2**100 + 2] + [rng.getrandbits(40) for _ in range(8)]
    for seed in seeds:
        for index in indexes:
            assert spawned_seeds(seed, index) == _torchdata_draws(seed, index), (seed, index)


def test_spawned_seeds_refuse_a_negative_index():
    with pytest.raises(ValueError, match="index >= 0, got -1"):
        spawned_seeds(5, -1)


def test_a_philox_block_is_torchdatas():
    rng = random.Random(7)
    for words in [[0] * 6, [2**32 - 1] * 6] + [[rng.getrandbits(32) for _ in range(6)] for _ in range(2000)]:
        assert _philox(*words) == tuple(philox_10_round((words[0], words[1]), words[2:])), words
