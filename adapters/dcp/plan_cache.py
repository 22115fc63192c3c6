"""DCP save-plan caching (``DefaultSavePlanner(enable_plan_caching=True)``), made safe to leave on.

With caching, a rank whose local plan is unchanged sends an empty plan, and when every rank's
is, rank 0 reuses its cached global plan and ``Metadata`` instead of planning anew. torch
caches (class-level dicts of ``SavePlanner``, keyed by ``_cached_plans_key``) names, shapes,
offsets and dtypes, never tensor data. What this module adds, for what torch leaves unsafe:

1. A plan counts as unchanged only when *equal* to the cached one in every field
   (``CachingSavePlanner``): DCP's own comparison ignores dtypes and ``planner_data``, so a
   tensor cast with its shape kept would record the old dtype in ``.metadata``.
2. Keys of our own: each ``SavePlanCache`` (one per adapter) has a uuid, one key per save
   path (live state, staged copy) and per (rank, world size), never DCP's process-wide default.
3. A failed save drops its key's entries on this rank (``dropped_on_failure``), so the next
   save plans from scratch; rank 0 refuses a save whose ranks disagree about the cache.
4. A new process starts with empty caches; a restore does not touch them.
5. DCP ends a save by broadcasting rank 0's ``Metadata`` to every rank (``all_reduce("write")``:
   613 MiB pickled at 5,120 ranks). Our planners (``KeepingSavePlanner``, caching or not) hand
   DCP a ``KeptMetadata``, which pickles to a ``MetadataSummary`` of a few fields: rank 0 keeps
   the real object, the others receive the summary. ``.metadata`` itself is written from a
   plain ``Metadata`` (``plain_metadata``; ``filesystem.StepWriter``), the bytes DCP writes.

Memory: rank 0 keeps every rank's local plan, the global plan and the Metadata per key
(``NativeTorchAdapter(plan_caching=False)`` gives it up); entries are dropped when their
adapter is garbage-collected. Relies on torch internals (``_cached_plans_key``, the
``SavePlanner._cached_*`` dicts, ``finish_plan``) as of torch 2.13; where they are missing,
``SavePlanCache.planner`` returns a ``KeepingSavePlanner`` without caching, which plans every save.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import logging
import uuid
import weakref
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner

from resume.errors import PlanCacheMismatchError

log = logging.getLogger("resume")

__all__ = ["CachingSavePlanner", "KeepingSavePlanner", "KeptMetadata", "MetadataSummary",
           "PlanCacheMismatchError", "SavePlanCache", "is_supported", "plain_metadata"]

_CACHES = ("_cached_save_plan", "_cached_all_plans", "_cached_global_plan", "_cached_metadata",
           "_cached_final_save_plan")


def is_supported() -> bool:
    """Whether this torch has the plan caching this module was written against (torch 2.13)."""
    try:
        from torch.distributed.checkpoint.planner_helpers import _compare_save_plans  # noqa: F401
    except ImportError:
        return False
    return (all(isinstance(getattr(SavePlanner, name, None), dict) for name in _CACHES)
            and "enable_plan_caching" in inspect.signature(DefaultSavePlanner.__init__).parameters)


def forget(key: str) -> None:
    """Drop every DCP cache entry under ``key`` in this process."""
    for name in _CACHES:
        cache = getattr(SavePlanner, name, None)
        if isinstance(cache, dict):
            cache.pop(key, None)


def _forget_all(keys: set[str]) -> None:
    for key in list(keys):
        forget(key)


def same_plan(plan: SavePlan, other: SavePlan) -> bool:
    """Equal in everything ``.metadata`` is made of: DCP's comparison (which also checks the
    index hints, left out of ``MetadataIndex`` equality) and every field of every write item
    (dtype and the other tensor properties included) and of the plan (``planner_data``)."""
    from torch.distributed.checkpoint.planner_helpers import _compare_save_plans

    return _compare_save_plans(plan, other) and plan == other


@dataclass(frozen=True, slots=True)
class MetadataSummary:
    """What a rank other than DCP's coordinator receives at the end of a save in place of the
    checkpoint's ``Metadata``: a few numbers, the same size at 2 ranks and at 5,120."""

    items: int
    """Entries of ``state_dict_metadata`` (tensors and objects saved)."""
    chunks: int
    """Entries of ``storage_data`` (items written: chunks and objects)."""
    version: str | None
    """DCP's metadata version, as ``.metadata`` records it."""


class KeptMetadata(Metadata):
    """DCP's ``Metadata``, kept on the rank that made it: pickled (as DCP's end-of-save broadcast
    does), it is a ``MetadataSummary``. Copies stay ``KeptMetadata``; ``plain_metadata`` gives
    the ``Metadata`` that ``.metadata`` holds."""

    def __reduce__(self) -> tuple:
        # Counts only: a walk of storage_data would cost rank 0 seconds at 5,120 ranks, every save.
        storage = self.storage_data if isinstance(self.storage_data, Mapping) else {}
        return MetadataSummary, (len(self.state_dict_metadata or ()), len(storage), self.version)

    def __copy__(self) -> KeptMetadata:
        other = KeptMetadata.__new__(KeptMetadata)
        vars(other).update(vars(self))
        return other

    def __deepcopy__(self, memo: dict) -> KeptMetadata:
        other = KeptMetadata.__new__(KeptMetadata)
        memo[id(self)] = other
        vars(other).update(copy.deepcopy(vars(self), memo))
        return other


def plain_metadata(metadata: Metadata) -> Metadata:
    """A plain ``Metadata`` sharing ``metadata``'s fields (a shallow copy): what DCP pickles."""
    plain = Metadata.__new__(Metadata)
    vars(plain).update(vars(metadata))
    return plain


def kept(metadata: Metadata) -> Metadata:
    """``metadata`` made a ``KeptMetadata`` in place (the object DCP caches too); another
    subclass of ``Metadata`` (not DCP's planner's) is left as it is."""
    if type(metadata) is Metadata:
        metadata.__class__ = KeptMetadata
    return metadata


class KeepingSavePlanner(DefaultSavePlanner):
    """``DefaultSavePlanner`` whose global ``Metadata`` stays on the coordinator: the ranks
    receive a ``MetadataSummary`` at the end of the save. Plans every save (no caching)."""

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        delta, metadata = super().create_global_plan(all_plans)
        self.metadata = kept(metadata)
        return delta, self.metadata


class CachingSavePlanner(KeepingSavePlanner):
    """``DefaultSavePlanner`` with plan caching under ``key``, reused only for equal plans."""

    def __init__(self, key: str, **kwargs: Any) -> None:
        super().__init__(enable_plan_caching=True, **kwargs)
        self._cached_plans_key = key

    @property
    def key(self) -> str:
        return self._cached_plans_key

    def create_local_plan(self) -> SavePlan:
        sent = super().create_local_plan()
        if sent.usable:
            return sent
        # DCP found self.plan like the cached one by its own comparison: reuse only if equal.
        if same_plan(self.plan, SavePlanner._cached_save_plan[self.key]):
            return sent
        self._pending_local_plan = self.plan  # promoted by finish_plan once the plan succeeds
        return self.plan

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        cached = SavePlanner._cached_all_plans.get(self.key)
        if cached is not None and len(cached) != len(all_plans):  # another group under this key
            forget(self.key)
            cached = None
        if cached is None and not all(p.usable for p in all_plans):
            stale = [i for i, p in enumerate(all_plans) if not p.usable]
            raise PlanCacheMismatchError(
                f"DCP plan cache {self.key}: ranks {stale[:8]} sent no plan (their cached one is "
                "unchanged) but the coordinator has none cached; refusing to write a .metadata "
                "without their items. The failed save drops the cache: the next save plans anew")
        previous = SavePlanner._cached_global_plan.get(self.key)
        delta, metadata = super().create_global_plan(all_plans)
        replanned = any(p.usable for p in all_plans)  # else DCP reused every cached plan as is
        if previous is not None and replanned and len(previous) == len(delta):
            # DCP sends a rank nothing when its new final plan is like the cached one by DCP's
            # comparison: send it whenever it differs at all (a dtype), so the rank writes it.
            delta = [new if not d.usable and new is not old and not same_plan(new, old) else d
                     for d, new, old in zip(delta, self.global_plan, previous, strict=True)]
        return delta, metadata

    def finish_plan(self, new_plan: SavePlan) -> SavePlan:
        pending = getattr(self, "_pending_local_plan", None)
        finished = super().finish_plan(new_plan)
        if pending is not None:  # torch 2.13 has promoted it already; older ones may not
            SavePlanner._cached_save_plan[self.key] = pending
        return finished


class SavePlanCache:
    """One adapter's cache keys: private to it, dropped after a failed save and with it.

    ``enabled=False`` (or a torch without plan caching): ``planner`` returns a
    ``KeepingSavePlanner``, which plans every save in full."""

    def __init__(self, owner: str, *, enabled: bool = True) -> None:
        self.enabled = enabled and is_supported()
        self.prefix = f"{owner}:{uuid.uuid4().hex}"
        self._keys: set[str] = set()
        # Not a method of self: the finalizer must not keep the cache alive.
        weakref.finalize(self, _forget_all, self._keys)

    def key(self, path: str, group: Any = None) -> str:
        """The key of one save path (``"live"``, ``"staged"``) on this rank of ``group``."""
        if dist.is_available() and dist.is_initialized():
            where = f"{dist.get_rank(group)}/{dist.get_world_size(group)}"
        else:
            where = "0/1"
        return f"{self.prefix}:{path}:{where}"

    def planner(self, path: str, group: Any = None) -> KeepingSavePlanner:
        """The planner of one save: caching under this path's key, or (disabled) none."""
        if not self.enabled:
            return KeepingSavePlanner()
        key = self.key(path, group)
        self._keys.add(key)
        return CachingSavePlanner(key)

    @contextlib.contextmanager
    def dropped_on_failure(self, planner: KeepingSavePlanner | None) -> Iterator[None]:
        """Around ``dcp.save``: a save that raises leaves none of its key's entries here."""
        try:
            yield
        except BaseException:
            if isinstance(planner, CachingSavePlanner):
                forget(planner.key)
                log.debug("resume: DCP plan cache %s dropped after a failed save", planner.key)
            raise

    def forget(self) -> None:
        """Drop every entry of this cache (the next save of each path plans in full)."""
        _forget_all(self._keys)

    def keys(self) -> set[str]:
        return set(self._keys)
