"""Data position that survives restarts and resizes.

``GlobalPositionSampler`` is a batch sampler whose whole state is the global sample offset:
global batch ``b`` is the samples at positions ``[b*G, (b+1)*G)`` of a seeded per-epoch
permutation, and rank ``r`` of ``W`` takes the ``r``-th contiguous slice, so the global sample
stream is the same for any data-parallel size. ``StatefulLoader`` makes batches of a map-style
dataset with it in the training process (no prefetch): its state is exact at every boundary.
``IndexedDataset`` adds each sample's index as ``ids``, which the continuity check records; with
it and the sampler, torchdata's ``StatefulDataLoader`` with workers continues with exactly the
next batch (this module never imports torchdata; save ``loader.state_dict()``, never the
sampler's).

``loader_state``/``load_loader_state`` wrap a loader's state with what a restore checks first;
each refusal is a ``ContinuityError`` naming its item: ``data.num_workers`` (another worker
count), ``data.sampler`` (another sampler class), ``data.sampler.num_replicas`` (a
``DistributedSampler`` restored on another data-parallel size). ``in_order=False`` with workers
is a ``UsageError``. Loaders and their limits: docs/pytorch.md.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch

from resume.errors import ContinuityError, UsageError
from resume.skips import Skips
from resume.text import short

from . import jsonstate

__all__ = ["GlobalPositionSampler", "IndexedDataset", "StatefulLoader", "check_loader",
           "load_loader_state", "loader_state", "skip_loader_samples"]

STATEFUL_DATA_LOADER = "torchdata.StatefulDataLoader"
"""The tag of a wrapped ``StatefulDataLoader`` state (its ``__loader__`` field)."""


class GlobalPositionSampler:
    """Yields, per global batch, the dataset indices of this rank's slice.

    A batch sampler (``StatefulDataLoader(..., batch_sampler=this)``) that is
    torchdata ``Stateful`` (``state_dict``/``load_state_dict``): its state is the
    global offset of the next batch it draws, the same on every rank.
    """

    def __init__(self, num_samples: int, global_batch: int, *, rank: int = 0, world_size: int = 1,
                 seed: int = 0, shuffle: bool = True, skips: Any = ()) -> None:
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
        self.skips = skips if isinstance(skips, Skips) else Skips(skips)
        """Ranges of positions passed over (``resume.skips``; a rewind's declared skip): a global
        batch takes the next ``global_batch`` positions outside them."""
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
            if not self.skips:
                start = self.offset + self.rank * self.local_batch
                positions: Any = range(start, start + self.local_batch)
                self.offset += self.global_batch
            else:
                spans, end = self.skips.spans(self.offset, self.global_batch)
                every = [p for a, b in spans for p in range(a, b)]
                positions = every[self.rank * self.local_batch:(self.rank + 1) * self.local_batch]
                self.offset = end
            yield [self.index_at(p) for p in positions]


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


def skip_loader_samples(loader: Any, skips: Skips) -> None:
    """A rewind's skip, given to the ``GlobalPositionSampler`` that orders ``loader`` (directly,
    in a ``StatefulLoader``, or as a ``StatefulDataLoader``'s ``batch_sampler``); any other loader
    cannot pass over samples exactly: ``UsageError`` naming it."""
    sampler = loader if isinstance(loader, GlobalPositionSampler) else (
        loader.sampler if isinstance(loader, StatefulLoader) else _position_sampler(loader))
    if not isinstance(sampler, GlobalPositionSampler):
        raise UsageError(f"data: expected a loader ordered by resume.adapters.data.GlobalPositionSampler to pass "
                         f"over the rewind's skipped samples {skips.to_list()} exactly, actual "
                         f"{type(loader).__name__} ordered by {type(sampler).__name__}: restart with it, or "
                         "rewind without --skip-samples")
    sampler.skips = skips


def _stack(items: list[dict]) -> dict:
    return {k: torch.stack([item[k] for item in items]) for k in items[0]}


class IndexedDataset:
    """``dataset[i]`` (a dict) with ``ids`` = ``i`` added: the sample ids the continuity check
    records, for a loader that collates the items itself (``StatefulDataLoader``, ``DataLoader``)."""

    def __init__(self, dataset: Any, key: str = "ids") -> None:
        self.dataset = dataset
        self.key = key

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> dict:
        item = self.dataset[index]
        if not isinstance(item, dict):
            raise TypeError(f"IndexedDataset: expected dataset items that are dicts, actual "
                            f"{type(item).__name__}")
        return {**item, self.key: index}


# -- torchdata's StatefulDataLoader (looked up, never imported: torchdata is optional) --------

def _is_stateful_data_loader(loader: Any) -> bool:
    module = sys.modules.get("torchdata.stateful_dataloader.stateful_dataloader")
    cls = getattr(module, "StatefulDataLoader", None)
    return cls is not None and isinstance(loader, cls)


def _per_rank_state(loader: Any) -> tuple[int, int] | None:
    """(dp_rank, dp_world_size) of a StatefulDataLoader subclass that keeps one state per
    data-parallel rank (torchtitan's ``ParallelAwareDataloader``); None for any other loader.

    Such a loader wraps torchdata's state in a pickle (``pickle.dumps``/``loads``) keyed by its
    rank; ``resume`` saves and loads the state underneath it instead (``StatefulDataLoader``'s
    own ``state_dict``), so that loading runs no code from the checkpoint."""
    rank, size = getattr(loader, "dp_rank", None), getattr(loader, "dp_world_size", None)
    if type(rank) is int and type(size) is int and _is_stateful_data_loader(loader):
        return rank, size
    return None


def _torchdata_state_dict(loader: Any) -> Any:
    cls = sys.modules["torchdata.stateful_dataloader.stateful_dataloader"].StatefulDataLoader
    return cls.state_dict(loader) if _per_rank_state(loader) else loader.state_dict()


def _torchdata_load_state_dict(loader: Any, state: Any) -> None:
    cls = sys.modules["torchdata.stateful_dataloader.stateful_dataloader"].StatefulDataLoader
    (cls.load_state_dict if _per_rank_state(loader) else type(loader).load_state_dict)(loader, state)


def _position_sampler(loader: Any) -> Any:
    """What decides the order: the sampler inside a ``BatchSampler`` (``sampler=`` with
    ``batch_size=``, or a torch ``BatchSampler`` given as ``batch_sampler=``), else the batch
    sampler given, else the sampler (``batch_size=None``)."""
    batch_sampler = getattr(loader, "batch_sampler", None)
    if batch_sampler is None:
        return getattr(loader, "sampler", None)
    inner = getattr(batch_sampler, "sampler", None)
    if isinstance(batch_sampler, torch.utils.data.BatchSampler) and inner is not None:
        return inner
    return batch_sampler


def _describe_sampler(sampler: Any) -> dict:
    out: dict[str, Any] = {"class": type(sampler).__name__}
    from torch.utils.data.distributed import DistributedSampler

    if isinstance(sampler, DistributedSampler):
        out.update(num_replicas=int(sampler.num_replicas), rank=int(sampler.rank))
    return out


def check_loader(loader: Any) -> None:
    """Refuse a loader whose saved state would not give exactly the next batch (``UsageError``)."""
    if not _is_stateful_data_loader(loader):
        return
    if isinstance(getattr(loader, "sampler", None), GlobalPositionSampler):
        raise UsageError("StatefulDataLoader: GlobalPositionSampler yields whole batches: pass it as "
                         "batch_sampler=, not sampler=")
    if loader.num_workers > 0 and not loader.in_order:
        raise UsageError("StatefulDataLoader(in_order=False): with worker processes its state_dict is "
                         "not exact (torchdata gives no guarantee), so the next batch after a restart "
                         "would not be the one recorded: use in_order=True (the default)")


def loader_state(loader: Any) -> Any:
    """The loader's position as JSON (None for a loader without ``state_dict``), taken as it is
    now, i.e. after the batches the training loop got, before the next one is fetched."""
    if _is_stateful_data_loader(loader):
        check_loader(loader)
        # Whether the loop was iterating already: if not, this very state_dict() makes the
        # iterator, and with it draws its seed from torch's generator (see _iterator_as_saved).
        iterating = getattr(loader, "_iterator", None) is not None
        out = {"__loader__": STATEFUL_DATA_LOADER, "num_workers": int(loader.num_workers),
               "sampler": _describe_sampler(_position_sampler(loader)), "iterating": iterating,
               "state": jsonstate.encode(_torchdata_state_dict(loader))}
        per_rank = _per_rank_state(loader)
        if per_rank is not None:
            out["per_rank"] = {"class": type(loader).__name__, "dp_rank": per_rank[0],
                               "dp_world_size": per_rank[1]}
        return out
    state_dict = getattr(loader, "state_dict", None)
    return jsonstate.encode(state_dict()) if callable(state_dict) else None


def load_loader_state(loader: Any, state: Any) -> None:
    """Put a ``loader_state`` back; a state that cannot give the saved next batch is refused
    (``ContinuityError`` naming the item) before anything is loaded. A loader without
    ``load_state_dict`` keeps its position (the continuity check reports it)."""
    if isinstance(state, dict) and "__loader__" in state:
        if state["__loader__"] != STATEFUL_DATA_LOADER:
            raise ContinuityError("data.loader", state["__loader__"], type(loader).__name__,
                                  "a loader this version does not know saved this state")
        if not _is_stateful_data_loader(loader):
            raise ContinuityError("data.loader", "StatefulDataLoader (as saved)", type(loader).__name__,
                                  "the saved position is torchdata's StatefulDataLoader state: restart "
                                  "with that loader")
        _check_compatible(loader, state)
        _torchdata_load_state_dict(loader, jsonstate.decode(state["state"]))
        if state.get("iterating", True):
            _iterator_as_saved(loader)
        return
    load = getattr(loader, "load_state_dict", None)
    if state is not None and callable(load):
        load(jsonstate.decode(state))


def _iterator_as_saved(loader: Any) -> None:
    """Make the restored iterator now without touching any generator.

        Every DataLoader iterator draws its workers' base seed from a generator when it is made; the
        saving run drew before its saved random state, so a restart that drew again would run one
        draw off. ``state_dict()`` makes the iterator from the loaded state and keeps it for the next
        ``iter(loader)``. A state taken before the first iteration is left to draw, as the saving run
        did.
        """
    generator = getattr(loader, "generator", None)
    saved = generator.get_state() if generator is not None else None
    with torch.random.fork_rng(devices=[]):
        loader.state_dict()
    if generator is not None:
        generator.set_state(saved)


def _check_per_rank(loader: Any, state: dict) -> None:
    """A per-rank loader state (``_per_rank_state``) goes back only to the same rank of the same
    data-parallel size: ``ContinuityError`` naming the loader and the way out otherwise."""
    saved, live = state.get("per_rank"), _per_rank_state(loader)
    if saved is None and live is None:
        return
    name = (saved or {}).get("class") or type(loader).__name__
    if saved is None or live is None:
        raise ContinuityError("data.loader", f"{name if saved else 'StatefulDataLoader'} (as saved)",
                              type(loader).__name__, "restart with the loader the checkpoint was saved with")
    if saved.get("dp_world_size") != live[1]:
        raise ContinuityError(
            "data.dp_world_size", f"{short(saved.get('dp_world_size'))} (as saved)", live[1],
            f"{name} keeps one state per data-parallel rank, which is no position on another "
            "data-parallel size: restart on the saved size, or train with a loader whose state is a "
            "global position (torchdata's StatefulDataLoader with batch_sampler="
            "resume.adapters.data.GlobalPositionSampler)")
    if saved.get("dp_rank") != live[0]:
        raise ContinuityError("data.dp_rank", f"{short(saved.get('dp_rank'))} (as saved)", live[0],
                              f"{name}'s state is one data-parallel rank's: each rank must load its own")


def _check_compatible(loader: Any, state: dict) -> None:
    _check_per_rank(loader, state)
    saved_workers, workers = int(state["num_workers"]), int(loader.num_workers)
    if saved_workers != workers:
        raise ContinuityError("data.num_workers", f"{saved_workers} (as saved)", workers,
                              "StatefulDataLoader keeps one state per worker process and restores only "
                              f"the same count: restart with num_workers={saved_workers}")
    saved, live = state["sampler"], _describe_sampler(_position_sampler(loader))
    if saved["class"] != live["class"]:
        raise ContinuityError("data.sampler", f"{saved['class']} (as saved)", live["class"],
                              "the saved position is that sampler's: restart with the same sampler")
    if "num_replicas" in saved and saved["num_replicas"] != live.get("num_replicas"):
        raise ContinuityError(
            "data.sampler.num_replicas", f"{saved['num_replicas']} (as saved)", live.get("num_replicas"),
            f"StatefulDataLoader with {saved['class']} saves this rank's count of samples drawn, which "
            "is no position on another data-parallel size: restart on the saved size, or train with "
            "batch_sampler=resume.adapters.data.GlobalPositionSampler (state: the global sample "
            "offset, any data-parallel size)")
    if "rank" in saved and saved["rank"] != live.get("rank"):
        raise ContinuityError("data.sampler.rank", f"{saved['rank']} (as saved)", live.get("rank"),
                              f"{saved['class']}'s state is one rank's: each rank must load its own")
