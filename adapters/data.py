"""Data position that survives restarts and resizes.

``GlobalPositionSampler`` is a batch sampler whose whole state is the global
sample offset: global batch ``b`` is made of the samples at global positions
``[b*G, (b+1)*G)`` of a seeded per-epoch permutation, and rank ``r`` of ``W``
takes the ``r``-th contiguous slice of it. The global sample stream is thus
the same for any data-parallel size; only who computes which slice changes.

``StatefulLoader`` turns a map-style dataset and that sampler into batches in
the training process (no prefetch), so its state is exact at every boundary.
Any other loader with ``state_dict``/``load_state_dict`` works with the
adapter too.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch

__all__ = ["GlobalPositionSampler", "StatefulLoader"]


class GlobalPositionSampler:
    """Yields, per global batch, the dataset indices of this rank's slice."""

    def __init__(self, num_samples: int, global_batch: int, *, rank: int = 0, world_size: int = 1,
                 seed: int = 0, shuffle: bool = True) -> None:
        if num_samples < 1:
            raise ValueError(f"num_samples: expected >= 1, actual {num_samples}")
        if global_batch < 1 or global_batch % world_size:
            raise ValueError(f"global_batch: expected a positive multiple of world_size "
                             f"{world_size}, actual {global_batch}")
        self.num_samples = num_samples
        self.global_batch = global_batch
        self.rank = rank
        self.world_size = world_size
        self.seed = seed
        self.shuffle = shuffle
        self.offset = 0
        self._perm_epoch = -1
        self._perm: torch.Tensor | None = None

    @property
    def local_batch(self) -> int:
        return self.global_batch // self.world_size

    def state_dict(self) -> dict:
        return {"offset": self.offset, "seed": self.seed, "num_samples": self.num_samples}

    def load_state_dict(self, state: dict) -> None:
        self.offset = int(state["offset"])

    def index_at(self, position: int) -> int:
        """The dataset index of the sample at global stream ``position``."""
        epoch, within = divmod(position, self.num_samples)
        if not self.shuffle:
            return within
        if epoch != self._perm_epoch:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._perm = torch.randperm(self.num_samples, generator=g)
            self._perm_epoch = epoch
        assert self._perm is not None
        return int(self._perm[within])

    def __iter__(self) -> Iterator[list[int]]:
        while True:
            start = self.offset + self.rank * self.local_batch
            indices = [self.index_at(p) for p in range(start, start + self.local_batch)]
            self.offset += self.global_batch
            yield indices


class StatefulLoader:
    """Batches of ``dataset[i]`` for the sampler's indices, collated by ``collate``.

    Items are dicts of tensors; the collated batch gets an ``ids`` tensor with
    the dataset indices (what the continuity check records as sample ids).
    """

    def __init__(self, dataset: Any, sampler: GlobalPositionSampler,
                 collate: Callable[[list], Any] | None = None) -> None:
        self.dataset = dataset
        self.sampler = sampler
        self.collate = collate or _stack

    def state_dict(self) -> dict:
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.sampler.load_state_dict(state)

    def __iter__(self) -> Iterator[Any]:
        for indices in self.sampler:
            batch = self.collate([self.dataset[i] for i in indices])
            batch["ids"] = torch.tensor(indices, dtype=torch.long)
            yield batch


def _stack(items: list[dict]) -> dict:
    return {k: torch.stack([item[k] for item in items]) for k in items[0]}
