"""``NativeTorchAdapter``'s shard I/O through torch.distributed.checkpoint (``resume.adapter.ShardIO``,
``StagedShardIO``): saved checksummed while written, loaded with the restricted readers."""

from __future__ import annotations

import contextlib
import copy
import warnings
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from resume.comm import Comm
from resume.errors import CorruptCheckpointError, ResumeError, SaveFailedError
from resume.manifest import Manifest
from resume.storage import Storage
from resume.text import clip

from ..dcp.filesystem import make_reader, make_writer, without_torch_crc32
from ..dcp.plan_cache import SavePlanCache
from ..dcp.reader import SafeLoadPlanner
from .failures import DAMAGE, explain_save_failure, load_failure
from .fingerprint import fingerprint_states
from .metadata import CheckedMetadata

__all__ = ["DcpShardsMixin", "copy_tree", "distcp_owner", "quiet_single_process"]


class DcpShardsMixin:
    """Expects ``optimizers``, ``process_group``, ``comm``, ``compression``, ``_plan_cache``
    (a ``SavePlanCache``), ``_metadata`` (a ``CheckedMetadata``), ``_staged_state`` and the
    state methods of ``StateMixin``."""

    optimizers: list[torch.optim.Optimizer]
    process_group: Any
    comm: Comm
    compression: str | None
    _plan_cache: SavePlanCache
    _metadata: CheckedMetadata
    _staged_state: Any

    def save_shards(self, storage: Storage, step_dir: str) -> list[str]:
        # An optimizer without state (no update applied yet) is left out: making
        # its state up for the save would change the training that follows.
        self._check_visible(self.optimizers)
        state = self._sharded_state([o for o in self.optimizers if o.state])
        return self._dcp_save(state, storage, step_dir, self.process_group)

    def _dcp_save(self, state: Any, storage: Storage, step_dir: str, group: Any, *,
                  background: bool = False) -> dict:
        writer = make_writer(storage, step_dir, durable=True, compression=self.compression,
                             copy_ahead=not background)
        # torch.save's CRC switch is process-wide: only a save on the training thread
        # (the loop is waiting) turns it off; a background write keeps it.
        crc = contextlib.nullcontext() if background else without_torch_crc32()
        # Both paths cache their plans, under keys of their own: the coordinator never runs two
        # of this adapter's saves at once (a save waits for the background one in flight), and
        # even if it did, two keys share no entry. dcp.async_save is not used here.
        planner = self._plan_cache.planner("staged" if background else "live", group)
        try:
            with quiet_single_process(), crc, self._plan_cache.dropped_on_failure(planner):
                metadata = dcp.save(state, storage_writer=writer, planner=planner, process_group=group,
                                    no_dist=not dist.is_initialized())
        except CheckpointException as e:  # a BaseException: make it ours, with the cause
            raise SaveFailedError(explain_save_failure(e, state, storage, step_dir)) from e
        # Checksummed while written: no second read of the shards.
        return {rel: writer.fs.written.get(rel) for rel in self._files_of_this_rank(metadata)}

    def _files_of_this_rank(self, metadata: Any) -> list[str]:
        # DCP names data files "__<rank>_<n>.distcp"; rank 0 also owns ".metadata"
        # and anything it cannot attribute.
        rank = self.comm.rank
        files = {info.relative_path for info in metadata.storage_data.values()}
        mine = set()
        for name in files:
            owner = distcp_owner(name)
            if owner == rank or (owner is None and rank == 0):
                mine.add(name)
        if rank == 0:
            mine.add(".metadata")
        return sorted(mine)

    def can_stage(self) -> bool:
        return True

    def stage_shards(self) -> Any:
        """A private copy of the sharded state (model and optimizer tensors), for a background
        write, and which optimizer owns each parameter's state (for ``fingerprint_staged``)."""
        self._check_visible(self.optimizers)
        state = self._sharded_state([o for o in self.optimizers if o.state])
        names = self._param_names()
        owners = {fqn: (i, id(p)) for i, opt in enumerate(self.optimizers) for g in opt.param_groups
                  for p in g["params"] for fqn in names.get(p, ())}
        # The previous staged copy is reused (the coordinator has waited for its write): an
        # asynchronous save keeps one host copy of the state between saves, as a staging cache.
        staged = copy_tree(state, self._staged_state)
        self._staged_state = staged
        return {"state": staged, "owners": owners}

    def write_staged(self, staged: Any, storage: Storage, step_dir: str, comm: Any) -> dict:
        return self._dcp_save(staged["state"], storage, step_dir, getattr(comm, "group", None), background=True)

    def can_fingerprint_staged(self) -> bool:
        return True

    def fingerprint_staged(self, staged: Any) -> list[dict]:
        per_optimizer: list[list[dict]] = [[] for _ in self.optimizers]
        named: list[list[str]] = [[] for _ in self.optimizers]
        seen = set()
        # Sorted: a parameter under two names counts once, under its first (as moment_fingerprint).
        for fqn, entry in sorted(staged["state"]["optim"].get("state", {}).items()):
            owner = staged["owners"].get(fqn)
            if owner is None or owner in seen:
                continue
            seen.add(owner)
            per_optimizer[owner[0]].append(entry)
            named[owner[0]].append(fqn)
        return [fingerprint_states(states, names) for states, names in zip(per_optimizer, named)]

    def load_shards(self, storage: Storage, step_dir: str, manifest: Manifest | None = None) -> None:
        """Collective. ``manifest``: the step's, as the restore verified it (its file sizes bound
        every item of .metadata; its compression is the only transform honoured). None: a step
        no manifest of ours describes (no bounds, no compression)."""
        try:
            self._load_shards(storage, step_dir, manifest)
        except (ResumeError, MemoryError):
            raise
        except DAMAGE as e:  # what a damaged file makes torch or DCP raise outside dcp.load
            raise CorruptCheckpointError(f"{storage.url(step_dir)}: loading the shards failed: "
                                         f"{type(e).__name__}: {clip(str(e), 300)}") from e

    def shard_problems(self, storage: Storage, step_dir: str, manifest: Manifest | None = None) -> list[str]:
        """DCP's .metadata unpickled and checked in shape and bounds against the verified
        ``manifest``; kept for the load that follows (read and unpickled once per restore)."""
        return self._metadata.problems(storage, step_dir, manifest)

    def _load_shards(self, storage: Storage, step_dir: str, manifest: Manifest | None) -> None:
        # Refuse a hostile .metadata here, with our error, before DCP sees it: its shape and
        # bounds checked against the manifest's files (the one reader below loads it).
        metadata, recorded = self._metadata.read(self.comm, storage, step_dir, manifest)
        saved_fqns = {key[len("optim.state."):].rsplit(".", 1)[0]
                      for key in metadata.state_dict_metadata if key.startswith("optim.state.")}
        # A fresh optimizer has no state; DCP needs tensors to load into, so it
        # is created (zero-LR step) and then trimmed to what was saved: the
        # optimizers and parameters that had no state then have none now.
        saved_optimizers = [o for o, fqns in zip(self.optimizers, self._fqns_per_optimizer(), strict=True)
                            if fqns & saved_fqns]
        state = self._sharded_state(saved_optimizers)
        for fqn in [f for f in state["optim"].get("state", {}) if f not in saved_fqns]:
            del state["optim"]["state"][fqn]
        reader = make_reader(storage, step_dir)
        reader.preloaded_metadata = metadata  # parsed once above, not read again by every rank
        reader.compressed = recorded["compression"] == "zstd"
        try:
            with quiet_single_process():
                dcp.load(state, storage_reader=reader, planner=SafeLoadPlanner(),
                         process_group=self.process_group, no_dist=not dist.is_initialized())
        except CheckpointException as e:  # a BaseException: make it ours, naming what refused
            raise load_failure(e, storage, step_dir) from e
        # Every model key was loaded above (DCP fails on a missing one).
        self._set_loaded(state, saved_optimizers)
        for opt in self.optimizers:
            if opt not in saved_optimizers:
                opt.state.clear()


def copy_tree(obj: Any, reuse: Any = None) -> Any:
    """Tensors copied (to CPU), containers rebuilt, everything else shared (immutable scalars).

    ``reuse``: an earlier copy of the same structure; a plain tensor of the same shape and dtype
    there is copied into rather than allocated anew. Memory the process has touched before
    takes a copy faster than fresh pages that must be faulted in.
    """
    if isinstance(obj, torch.Tensor):
        if (type(obj) is torch.Tensor and type(reuse) is torch.Tensor and reuse.device.type == "cpu"
                and reuse.shape == obj.shape and reuse.dtype == obj.dtype and reuse.stride() == obj.stride()):
            return reuse.copy_(obj.detach())
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        old = reuse if isinstance(reuse, dict) else {}
        return {k: copy_tree(v, old.get(k)) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        old = reuse if isinstance(reuse, (list, tuple)) and len(reuse) == len(obj) else [None] * len(obj)
        items = [copy_tree(v, r) for v, r in zip(obj, old)]
        return items if isinstance(obj, list) else tuple(items)
    return copy.deepcopy(obj)


@contextlib.contextmanager
def quiet_single_process() -> Iterator[None]:
    """DCP warns that it "assumes" a single process; without a process group that is the intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def distcp_owner(name: str) -> int | None:
    if name.startswith("__") and name.endswith(".distcp"):
        head = name[2:].split("_", 1)[0]
        if head.isdigit():
            return int(head)
    return None
