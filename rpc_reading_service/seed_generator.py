"""torchdata's ``SeedGenerator`` (Philox4x32-10 seeds), without needing torchdata.

torchdata 0.10 removed ``torchdata.dataloader2`` and with it the generator that seeds every
DataPipe graph: this is its code (torchdata 0.9, BSD-3-Clause, Meta Platforms, Inc.), with the
same attributes, draws and pickled form, so that seeds, checkpoints and the parity with
``MultiProcessingReadingService`` stay the same under any torchdata or none.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch

__all__ = [
    "SeedGenerator",
    "PhiloxEngine",
    "dist_share_seed",
    "kPhilox10A",
    "kPhilox10B",
    "kPhiloxSA",
    "kPhiloxSB",
]

kPhilox10A = 0x9E3779B9
kPhilox10B = 0xBB67AE85
kPhiloxSA = 0xD2511F53
kPhiloxSB = 0xCD9E8D57

_MASK_32 = 0xFFFFFFFF
_MASK_64 = 0xFFFFFFFFFFFFFFFF
_HALF_UINT64 = 0x8000000000000000
_UINT64_UPPER_BOUND = 2**64


def _single_round(key: List[int], ctr: List[int]) -> List[int]:
    """One Philox round."""
    product0, product1 = kPhiloxSA * ctr[0], kPhiloxSB * ctr[2]
    lo0, hi0 = product0 & _MASK_32, (product0 >> 32) & _MASK_32
    lo1, hi1 = product1 & _MASK_32, (product1 >> 32) & _MASK_32
    return [hi1 ^ ctr[1] ^ key[0], lo1, hi0 ^ ctr[3] ^ key[1], lo0]


def _philox_10_round(key: Tuple[int, int], ctr: List[int]) -> List[int]:
    """One Philox4x32-10 block."""
    key_, ctr_ = list(key), list(ctr)
    for _ in range(9):
        ctr_ = _single_round(key_, ctr_)
        key_[0] = (key_[0] + kPhilox10A) & _MASK_32
        key_[1] = (key_[1] + kPhilox10B) & _MASK_32
    return _single_round(key_, ctr_)


class PhiloxEngine:
    """A counter-based generator of uint64 seeds that spawns independent children.

    Args:
        seed: The engine's seed (None: unseeded, seed it before drawing).
    """

    def __init__(self, seed: Optional[int] = None) -> None:
        self._seed: Tuple[int, int] = (-1, -1)
        self._ctr: List[int] = [0] * 4
        self._generated_seeds: Optional[List[int]] = None
        self._spawn_seed: Tuple[int, int] = (-1, -1)
        if seed is not None:
            self.seed(seed)

    def _incr_ctr(self) -> None:
        for i in range(3):
            self._ctr[i] += 1
            if self._ctr[i] <= _MASK_32:
                return
            self._ctr[i] = 0
        self._ctr[3] += 1
        if self._ctr[3] > _MASK_32:  # past 2**128: back to the first counter
            self._ctr[3] = 0
            self._incr_ctr()

    def seed(self, seed: int) -> "PhiloxEngine":
        """Seed the engine (an int64 is taken as uint64), resetting its counter."""
        seed = seed & _MASK_64
        if seed < 0:
            seed = seed + _HALF_UINT64
        self._seed = (seed & _MASK_32, (seed >> 32) & _MASK_32)
        self._ctr = [0] * 4
        self._generated_seeds = None
        self._spawn_seed = tuple(_philox_10_round(self._seed, self._ctr)[:2])  # type: ignore[assignment]
        self._incr_ctr()
        return self

    def generate(self) -> int:
        """The next uint64 seed."""
        assert self._seed != (-1, -1), "Please provide seed to PhiloxEngine"
        if self._generated_seeds is None:
            self._generated_seeds = _philox_10_round(self._seed, self._ctr)
            self._incr_ctr()
            res = self._generated_seeds[:2]
        else:
            res = self._generated_seeds[2:]
            self._generated_seeds = None
        return (res[1] << 32) + res[0]

    def clone(self) -> "PhiloxEngine":
        """A copy in the same state."""
        new_engine = PhiloxEngine(None)
        new_engine._seed = self._seed
        new_engine._ctr = self._ctr.copy()
        new_engine._generated_seeds = None if self._generated_seeds is None else self._generated_seeds.copy()
        new_engine._spawn_seed = self._spawn_seed
        return new_engine

    def spawn(self, index: int) -> "PhiloxEngine":
        """The child engine number ``index`` (>= 0)."""
        assert index >= 0, f"Expected a non-negative value for spawn, but found {index}"
        assert self._spawn_seed != (-1, -1), "Please provide seed to PhiloxEngine"
        offset = index % 2
        val = index if offset == 0 else index - 1
        ctr = []
        for _ in range(4):
            ctr.append(val & _MASK_32)
            val = val >> 32
        res = _philox_10_round(self._spawn_seed, ctr)[offset * 2 : offset * 2 + 2]
        return PhiloxEngine((res[1] << 32) + res[0])


def _torch_random_seed() -> int:
    """A uint64 drawn from torch's global generator, leaving it as it was."""
    with torch.random.fork_rng():
        iinfo = torch.iinfo(torch.int64)
        return int(torch.randint(iinfo.min, iinfo.max, ()).item()) + 2**63


class SeedGenerator:
    """Seeds shared by every worker (``generate_shared_seed``) and seeds of one worker
    (``generate_seed``, after ``spawn(worker_id)``), from one base seed.

    Args:
        seed: The base seed (uint64); None draws one from torch's global generator.
    """

    _shared_rng: PhiloxEngine
    _worker_rng: PhiloxEngine

    def __init__(self, seed: Optional[int] = None, _rngs: Optional[Tuple[PhiloxEngine, PhiloxEngine]] = None) -> None:
        if seed is not None and _rngs is not None:
            raise ValueError("SeedGenerator doesn't allow both seed and _rng specified at the same time")
        if _rngs is None:
            self._shared_rng = PhiloxEngine()
            self._worker_rng = PhiloxEngine()
            self.seed(seed)
        else:
            assert len(_rngs) == 2
            self._shared_rng, self._worker_rng = _rngs

    def seed(self, seed: Optional[int] = None) -> None:
        """Reseed both streams (None: from torch's global generator)."""
        if seed is None:
            seed = _torch_random_seed()
        if seed >= _UINT64_UPPER_BOUND:
            raise ValueError(f"Expected an uint64 seed, but got {seed}.")
        self._shared_rng.seed(seed)
        self._worker_rng.seed(seed)

    def generate_shared_seed(self) -> int:
        """The next seed of the stream every worker shares."""
        return self._shared_rng.generate()

    def generate_seed(self) -> int:
        """The next seed of this worker's own stream."""
        return self._worker_rng.generate()

    def spawn(self, worker_id: int, inplace: bool = False) -> "SeedGenerator":
        """The generator of worker ``worker_id``: the same shared stream, its own worker stream.

        Args:
            worker_id: The worker's global index (>= 0).
            inplace: Change this generator instead of returning a new one.
        """
        if worker_id < 0:
            raise ValueError(f"Expected `rank` equal or larger than 0, but got {worker_id}.")
        if inplace:
            self._worker_rng = self._worker_rng.spawn(worker_id)
            return self
        return SeedGenerator(seed=None, _rngs=(self._shared_rng.clone(), self._worker_rng.spawn(worker_id)))

    def __getstate__(self):
        return (self._shared_rng, self._worker_rng)

    def __setstate__(self, state):
        self._shared_rng, self._worker_rng = state


def dist_share_seed(seed: int, process_group=None) -> int:
    """Rank 0's ``seed`` (uint64) on every rank of ``process_group`` (a broadcast)."""
    import torch.distributed as dist

    shared_seed = torch.tensor(seed - _HALF_UINT64, dtype=torch.int64)
    dist.broadcast(shared_seed, src=0, group=process_group)
    return int(shared_seed.item()) + _HALF_UINT64
