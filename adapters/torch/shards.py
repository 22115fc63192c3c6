"""``NativeTorchAdapter``'s shard I/O through torch.distributed.checkpoint (``resume.adapter.ShardIO``,
``StagedShardIO``): saved checksummed while written, loaded with the restricted readers."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import mmap
import os
import threading
import warnings
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint._sharded_tensor_utils import _flatten_sharded_tensors
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.tensor import DTensor

from resume.background import Prepared
from resume.collective import Collective, concat
from resume.comm import Comm
from resume.errors import CorruptCheckpointError, DamagedShardsError, ResumeError, SaveFailedError
from resume.manifest import Manifest
from resume.storage import Storage
from resume.text import clip

from ..dcp.filesystem import make_reader, make_writer, prefetch_files, without_torch_crc32
from ..dcp.index import INDEX_FILE, partial_metadata, requests_for
from ..dcp.plan_cache import SavePlanCache
from ..dcp.reader import SafeLoadPlanner
from .failures import DAMAGE, explain_save_failure, load_failure
from .fingerprint import fingerprint_states
from .metadata import CheckedMetadata, has_index, recorded_for_shards

__all__ = ["DcpShardsMixin", "IndexedLoadMixin", "copy_tree", "distcp_owner", "quiet_single_process",
           "stage_for_load"]


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
        return self._files_of_this_rank(writer.fs.written, metadata)

    def _files_of_this_rank(self, written: dict, metadata: Any) -> dict:
        """``{path: (size, checksum) or None}``: every file this rank's writer wrote, as taken
        while writing. Rank 0 also owns ".metadata" (and whatever else it wrote in ``finish``)
        and any file .metadata names that no "__<rank>_<n>.distcp" name attributes (None: read
        back). Only rank 0 holds the full ``Metadata`` after ``dcp.save`` (a ``KeptMetadata``):
        the other ranks receive a ``MetadataSummary`` and read nothing from it."""
        mine: dict = dict(written)
        if self.comm.rank == 0:
            storage = getattr(metadata, "storage_data", None)
            written = getattr(storage, "written", None)  # written.StorageEntries: its files, no walk
            named = set(written.files) if written is not None else \
                {info.relative_path for info in storage.values()} if isinstance(storage, dict) else set()
            for name in sorted(named | {".metadata"}):
                if distcp_owner(name) is None:
                    mine.setdefault(name, None)
        return dict(sorted(mine.items()))

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
        # Before the first, the buffers made ahead (prepare_staging) are taken once their thread
        # ended, whole or in part; every tensor is copied into them here, so nothing they held
        # before reaches a checkpoint.
        reuse = self._staged_state
        if isinstance(reuse, Prepared):
            reuse = reuse.take()
        staged = copy_tree(state, reuse)
        self._staged_state = staged
        return {"state": staged, "owners": owners}

    def prepare_staging(self) -> None:
        """Host buffers for the first staged copy, allocated and their pages faulted in by a
        thread of their own from now on (``_staged_state`` holds the ``Prepared`` until
        ``stage_shards`` takes it): the first asynchronous save then copies into memory the
        process has touched, as every later one does. Nothing once a staged copy exists."""
        if self._staged_state is not None:
            return
        try:
            shapes = buffer_shapes(self._sharded_state([o for o in self.optimizers if o.state]))
        except Exception:  # noqa: BLE001 - an optimisation: the save reads the same state, and fails there
            return
        self._staged_state = Prepared.start(functools.partial(make_buffers, shapes), name="resume-staging")

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

    def verify_while_loading(self, manifest: Manifest, storage: Storage | None = None,
                             step_dir: str | None = None) -> set[str]:
        """Where the step has the index: the files the restore's checksum pass leaves out. The
        .distcp files, which the next ``load_shards`` of ``manifest`` hashes from the bytes it
        reads; and ``.metadata``, which it does not read (613 MiB at 5,120 ranks; ``resume verify``
        checks it, and plain DCP tools read it)."""
        if not has_index(manifest):
            files: set[str] = set()
        else:
            files = {rel for rel in manifest.files if rel.endswith(".distcp")} | ({".metadata"} & set(manifest.files))
            local = storage.local_path(step_dir) if storage is not None and step_dir is not None else None
            if local is not None:  # its own files into memory while the restore prepares
                own = sorted(rel for rel in files if distcp_owner(rel) == self.comm.rank)
                prefetch_files([os.path.join(local, rel) for rel in own])
        self._verify_load = (manifest.step, files)
        return files

    def _saved_state(self, metadata: Any) -> tuple[list, dict]:
        """(the optimizers the checkpoint has state of, the state dict to load into). A fresh
        optimizer has no state; DCP needs tensors to load into, so it is created (zero-LR step)
        and then trimmed to what was saved: the optimizers and parameters that had no state
        then have none now."""
        saved_fqns = {key[len("optim.state."):].rsplit(".", 1)[0]
                      for key in metadata.state_dict_metadata if key.startswith("optim.state.")}
        saved_optimizers = [o for o, fqns in zip(self.optimizers, self._fqns_per_optimizer(), strict=True)
                            if fqns & saved_fqns]
        state = self._sharded_state(saved_optimizers)
        for fqn in [f for f in state["optim"].get("state", {}) if f not in saved_fqns]:
            del state["optim"]["state"][fqn]
        if "state" in state:  # a registered object's tensors: those saved (the others are named later)
            keys = metadata.state_dict_metadata
            state["state"] = {name: kept for name, paths in state["state"].items()
                              if (kept := {p: t for p, t in paths.items() if f"state.{name}.{p}" in keys})}
        return saved_optimizers, state

    def _load_shards(self, storage: Storage, step_dir: str, manifest: Manifest | None) -> None:
        if has_index(manifest):
            assert manifest is not None
            return self._load_indexed(storage, step_dir, manifest)
        # Refuse a hostile .metadata here, with our error, before DCP sees it: its shape and
        # bounds checked against the manifest's files (the one reader below loads it).
        metadata, recorded = self._metadata.read(self.comm, storage, step_dir, manifest)
        saved_optimizers, state = self._saved_state(metadata)
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


class IndexedLoadMixin:
    """The load of a step with the index: each rank plans from its own entries, reads into
    staging memory (hashing what it reads), and the live objects are written only once every
    rank has read, and every file checked, without a problem."""

    def _load_indexed(self, storage: Storage, step_dir: str, manifest: Manifest) -> None:
        fresh = [o for o in self.optimizers if not o.state]
        self._fresh_at_load = {id(o) for o in fresh}
        try:
            saved_optimizers, staged = self._staged_load(storage, step_dir, manifest)
        except BaseException:
            for opt in fresh:  # made for this load (a zero-LR step): a fresh start stays fresh
                opt.state.clear()
            raise
        finally:
            self._fresh_at_load = set()
        self._prepared_ids = set()  # loaded now: no longer fresh for a later load
        self._set_loaded(staged, saved_optimizers)
        for opt in self.optimizers:
            if opt not in saved_optimizers:
                opt.state.clear()

    def _staged_load(self, storage: Storage, step_dir: str, manifest: Manifest) -> tuple[list, dict]:
        verify = getattr(self, "_verify_load", None)
        self._verify_load = None
        hashed = {rel for rel in verify[1] if rel.endswith(".distcp")} \
            if verify is not None and verify[0] == manifest.step else set()
        live = self._sharded_state(self.optimizers)
        requests = requests_for(flatten_state_dict(_flatten_sharded_tensors(live))[0])
        answer = self._metadata.read_own(self.comm, storage, step_dir, manifest, requests, hashed)
        loaded: dict = {}

        def read() -> list[str]:  # local: every rank's outcome is agreed on below
            try:
                metadata, mine = partial_metadata(answer, requests, source=storage.url(f"{step_dir}/{INDEX_FILE}"))
            except CorruptCheckpointError as e:  # the index does not tile this rank's state
                return [str(e)]
            loaded["optimizers"], loaded["state"] = self._stage(metadata)
            return self._read_hashing(storage, step_dir, manifest, metadata, mine, loaded["state"])
        problems = Collective(self.comm).gather(read, f"load of {storage.url(step_dir)}",
                                                combine=lambda parts: concat(parts)[:20], everywhere=True)
        if problems:
            raise DamagedShardsError(f"{storage.url(step_dir)}: shards damaged, found while loading (nothing "
                                     f"loaded): {'; '.join(problems)}")
        return loaded["optimizers"], loaded["state"]

    def _stage(self, metadata: Any) -> tuple[list, dict]:
        """(the optimizers the checkpoint has state of, the state dict the load reads into): new
        memory for what holds value now (``stage_for_load``)."""
        saved_optimizers, state = self._saved_state(metadata)
        fresh = {fqn for o in saved_optimizers if id(o) in self._fresh_ids() for fqn in self._fqns_of(o)}
        return saved_optimizers, stage_for_load(state, fresh)

    def _read_hashing(self, storage: Storage, step_dir: str, manifest: Manifest, metadata: Any, mine: list[str],
                      staged: dict) -> list[str]:
        """This rank's load from its own entries (no DCP collectives), hashing the files it was
        given; problems found (a mismatch explains a failed read: the read's error is raised only
        where every checksum matched)."""
        reader = make_reader(storage, step_dir)
        reader.preloaded_metadata = metadata
        reader.compressed = recorded_for_shards(manifest)["compression"] == "zstd"
        reader.hash_files = {rel: (manifest.files[rel].size, manifest.files[rel].checksum) for rel in mine
                             if rel in manifest.files}
        error = None
        try:
            with quiet_single_process():
                dcp.load(staged, storage_reader=reader, planner=SafeLoadPlanner(), no_dist=True)
        except CheckpointException as e:
            error = load_failure(e, storage, step_dir)
        except DAMAGE as e:
            error = CorruptCheckpointError(f"{storage.url(step_dir)}: loading the shards failed: "
                                           f"{type(e).__name__}: {clip(str(e), 300)}")
        problems = reader.verify_hashed(lambda rel: storage.url(f"{step_dir}/{rel}"))
        if error is not None and not problems:
            raise error
        return problems

    def _fresh_ids(self) -> set[int]:
        """Optimizers whose state this restore made (``prepare_load`` or the load itself): loaded
        into directly, nothing of value is in it yet."""
        return set(getattr(self, "_prepared_ids", ())) | set(getattr(self, "_fresh_at_load", ()))

    def _fqns_of(self, opt: Any) -> set[str]:
        return self._fqns_per_optimizer()[self.optimizers.index(opt)]


def stage_for_load(state: dict, fresh: set[str]) -> dict:
    """``state`` with new memory for every tensor a load must not write before it is checked:
    the model's, the registered objects', and the optimizer state of parameters not in ``fresh``
    (state made for this load is written directly). A DTensor keeps its mesh and placements."""
    def new(t: Any) -> Any:
        if not isinstance(t, torch.Tensor):
            return t
        if isinstance(t, DTensor):
            local = torch.empty_like(t.to_local())
            return DTensor.from_local(local, t.device_mesh, t.placements, run_check=False, shape=t.shape,
                                      stride=t.stride())
        return torch.empty_like(t, device="cpu")
    optim = dict(state["optim"])
    optim["state"] = {fqn: (entry if fqn in fresh else {k: new(v) for k, v in entry.items()})
                      for fqn, entry in state["optim"].get("state", {}).items()}
    registered = {name: {p: new(t) for p, t in paths.items()} for name, paths in state.get("state", {}).items()}
    return {**state, "model": {k: new(v) for k, v in state["model"].items()}, "optim": optim,
            **({"state": registered} if registered else {})}


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


@dataclasses.dataclass(frozen=True, slots=True)
class BufferShape:
    """What ``copy_tree`` needs of a buffer to copy a tensor into it."""

    size: torch.Size
    stride: tuple[int, ...]
    dtype: torch.dtype


def buffer_shapes(state: Any) -> Any:
    """``state``'s containers, with a ``BufferShape`` for each plain, contiguous, non-empty tensor
    (the ones ``copy_tree`` copies into a buffer it is given) and None for anything else: read on
    the loop's thread, so that ``make_buffers`` never looks at a live tensor."""
    if isinstance(state, torch.Tensor):
        plain = type(state) is torch.Tensor and state.is_contiguous() and state.numel() > 0
        return BufferShape(state.shape, state.stride(), state.dtype) if plain else None
    if isinstance(state, dict):
        return {k: buffer_shapes(v) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return [buffer_shapes(v) for v in state]
    return None


def make_buffers(shapes: Any, stop: threading.Event) -> Any:
    """A CPU tensor for each ``BufferShape`` of ``shapes`` (containers kept), every page of it
    written once; None for those not begun before ``stop``. Contents: zeros and garbage, never
    read (``copy_tree`` writes every element of a buffer it uses)."""
    if isinstance(shapes, BufferShape):
        if stop.is_set():
            return None
        buffer = torch.empty_strided(shapes.size, shapes.stride, dtype=shapes.dtype)
        touch_pages(buffer, stop)
        return buffer
    if isinstance(shapes, dict):
        return {k: make_buffers(v, stop) for k, v in shapes.items()}
    if isinstance(shapes, list):
        return [make_buffers(v, stop) for v in shapes]
    return None


TOUCH_PAGES = 4096
"""Pages written per call: below torch's parallel grain (32,768), so that faulting them in stays
on this one thread and leaves the loop's cores alone; a ``stop`` is seen within one such call."""


def touch_pages(buffer: torch.Tensor, stop: threading.Event) -> None:
    """A byte of every page of contiguous ``buffer`` written: the kernel gives it its pages now
    (fresh memory is faulted in page by page at its first write, slower than a copy into it)."""
    flat = buffer.view(-1).view(torch.uint8)
    pages = flat[::mmap.PAGESIZE]
    for start in range(0, pages.numel(), TOUCH_PAGES):
        if stop.is_set():
            return
        pages[start:start + TOUCH_PAGES].zero_()
    flat[-1:].zero_()
