"""DCP save-plan caching (``DefaultSavePlanner(enable_plan_caching=True)``), made safe to leave on.

Why: DCP's global save planning runs on rank 0 at every save; with 5,120 ranks of the
reference layout it takes about 55 s (benchmarks/scale.py, ``dcp_plan_s``). With caching, a
rank whose local plan is unchanged sends an empty plan, and when every rank's is, rank 0 reuses
its cached global plan and ``Metadata`` (0.2 ms, ``dcp_plan_cached_s``).

What torch 2.13 caches (class-level dicts of ``SavePlanner``, keyed by ``_cached_plans_key``):
every rank its last local plan and its last final plan; rank 0 also every rank's local plan,
the global plan and the ``Metadata`` written to ``.metadata``. The cached plans and metadata
hold names, shapes, offsets and dtypes, never tensor data: the values come from the state at
every save.

What this module adds, for what torch leaves unsafe:

1. DCP decides "unchanged" with ``_compare_save_plans``: fqn, offsets, index hint, size and
   chunk. It does not compare ``tensor_data.properties`` (dtype, layout, requires_grad, ...)
   nor the plan's ``planner_data`` (the flattening map, saved as ``Metadata.planner_data``).
   A tensor cast to bf16 with its shape kept would reuse the cached ``Metadata`` and record
   the old dtype in ``.metadata``. ``CachingSavePlanner`` sends its full plan unless it is
   *equal* to the cached one (every field: DCP's comparison and dataclass equality), so rank 0
   plans it anew (DCP's merge of changed plans); rank 0 likewise sends a rank its new final
   plan when it differs in anything from the cached one.
2. DCP's key defaults to the planner's class name: one cache for the whole process, shared
   with a user's own DCP saves and with every other adapter (two runs in one process). Each
   ``SavePlanCache`` (one per adapter) has keys of its own, a uuid, and one key per save path
   (the live state and the staged copy of an asynchronous save differ in ``requires_grad``;
   one key for both would replan at every switch) and per (rank, world size) in the group.
3. A failed save may leave the caches half promoted (rank 0 caches the new plans before the
   ranks promote theirs). The entries of that key are dropped on this rank whenever the save
   raises, and a DCP failure raises on every rank, so the next save plans from scratch. If the
   ranks nevertheless disagree (rank 0 has no cache while a rank sent an empty plan), rank 0
   refuses the save rather than write a ``.metadata`` missing that rank's items; the refusal
   fails the save on every rank and so drops every rank's entries.
4. A new process (an elastic restart, at any world size) starts with empty caches: torch's
   dicts are class attributes created at import and never persisted. A restore does not touch
   the save caches (loading has its own planner and keeps nothing).

Memory: rank 0 keeps every rank's local plan, the global plan and the Metadata, per key (the
live state; with ``async_save`` also the staged copy, once a blocking save has used both). For
the reference layout (5,120 ranks, 1,000 tensor shards per rank: 5.1 M write items) that is
about 0.9 KB per write item as Python objects (measured with tracemalloc on
``benchmarks/scale.py``'s plans at 64 and 640 ranks: 929 and 847 B), about 4.3 GB at 5,120
ranks per key; every other rank keeps its own local and final plan (1,000 items, about 1 MB).
That is DCP's design; ``NativeTorchAdapter(plan_caching=False)`` gives it up. The entries are
dropped when their adapter is garbage-collected.

Relies on torch internals (``_cached_plans_key``, the ``SavePlanner._cached_*`` dicts, the
pending local plan promoted in ``finish_plan``) as of torch 2.13; where they are missing,
``SavePlanCache.planner`` returns None and DCP plans every save as before.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import uuid
import weakref
from collections.abc import Iterator
from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner

from resume.errors import PlanCacheMismatchError

log = logging.getLogger("resume")

__all__ = ["CachingSavePlanner", "PlanCacheMismatchError", "SavePlanCache", "is_supported"]

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


class CachingSavePlanner(DefaultSavePlanner):
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

    ``enabled=False`` (or a torch without plan caching): ``planner`` returns None, DCP's
    default planner, which plans every save in full."""

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

    def planner(self, path: str, group: Any = None) -> CachingSavePlanner | None:
        if not self.enabled:
            return None
        key = self.key(path, group)
        self._keys.add(key)
        return CachingSavePlanner(key)

    @contextlib.contextmanager
    def dropped_on_failure(self, planner: CachingSavePlanner | None) -> Iterator[None]:
        """Around ``dcp.save``: a save that raises leaves none of its key's entries here."""
        try:
            yield
        except BaseException:
            if planner is not None:
                forget(planner.key)
                log.debug("resume: DCP plan cache %s dropped after a failed save", planner.key)
            raise

    def forget(self) -> None:
        """Drop every entry of this cache (the next save of each path plans in full)."""
        _forget_all(self._keys)

    def keys(self) -> set[str]:
        return set(self._keys)
