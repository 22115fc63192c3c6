"""What a save and a restore cost the control plane at N ranks, simulated in one process.

    python benchmarks/scale.py [--ranks 8,64,640,5120] [--tensors-per-rank 1000] [--saves 6]
                               [--unpickle-cap-mb 64] [--dir DIR] [--json]

Layout for N ranks: TP = min(8, N), PP = min(8, N / TP), DP = the rest; 24 samples per
data-parallel rank per global batch. Rank 0 runs the library's own save and restore unchanged
(``Coordinator`` over ``NativeTorchAdapter``, ``StepCommit``, ``Collective``, the manifest,
retention, discovery, the continuity check) over ``SimComm``, N ranks in this process that count
the bytes each rank receives; the other ranks' parts are synthesized in the shape and size the
real code gives them (``synthesize``), and their own work is not counted as rank 0's. DCP's
global planning, ``.metadata`` and the index (``index.resume``) run for real on synthetic plans
shaped like the reference layout's, and so do rank 0's handling of that index at a restore (every
rank's requests answered), one other rank's, and its DCP load planning. Not simulated: network
and storage latency at scale, other ranks' CPU time. The method in full and the figures:
docs/performance.md. The last line with ``--json`` is one JSON object: ``ranks`` maps each N to
its figures, ``growth`` gives the ratios (``ratio``, of the ``GROWTH_KEYS``) from the
second-largest N (``from``) to the largest (``to``; ``ranks``: their ratio); ``tensors_per_rank``,
``saves``, ``elapsed_s`` and ``machine`` (cores, torch, python) describe the run.

Each N's figures (seconds ``_s``, sizes ``_bytes``; "rank 0" is the library's own code, timed):

The save, the control plane (``control_plane``):
    ``layout``; ``bytes_per_rank_per_save`` (the busiest non-0 rank) and ``rank0_bytes_per_save``,
    received through the collectives; ``rank0_save_s`` (the mean of the saves once retention
    deletes, ``rank0_saves_averaged`` of them), ``rank0_save_max_s`` (the slowest),
    ``rank0_save_parts_s`` (``manifest_write``, ``retention``, ``gather_and_rest``, and
    ``garbage_collection``: the collector's time in any part); ``collectives_per_save`` by kind.
The manifest and discovery:
    ``manifest_bytes``, ``manifest_files``, ``manifest_parse_s``, ``find_latest_s``.
The restore, the control plane (``restore``: rank 0, then ranks 1 and N - 1 replaying):
    ``rank0_restore_s``: rank 0's restore without shard I/O and without its index exchange, which
    runs over this process's tiny state (``rank0_restore_index_sim_s``, left out: the reference
    layout's is below); ``restore_control_bytes_received_per_rank``: what the busiest of those
    two ranks receives through the collectives, its index answer left out;
    ``restore_broadcasts_of_metadata``: broadcasts carrying DCP's metadata (0: the index is
    scattered); files read, every open reading the whole file, ``.metadata`` and the index at
    the reference layout's sizes: ``restore_bytes_read`` (shards apart), ``busiest_file``,
    ``busiest_file_bytes``, ``max_readers_per_file``, ``most_read_files`` (file, readers, opens,
    bytes), ``files_opened_by_rank0``.
DCP's save (``dcp_figures``):
    ``dcp_plans_build_s`` (making the synthetic local plans), ``dcp_plan_s`` and
    ``dcp_plan_cached_s`` (the global plan, uncached and cached), ``dcp_items_written``,
    ``dcp_local_plan_bytes``, ``dcp_plan_bytes_per_rank`` and ``dcp_plan_bytes_per_rank_cached``
    (what a rank receives of the global plan), ``dcp_final_broadcast_bytes`` (what DCP's
    end-of-save broadcast carries: the planner's Metadata pickled, a ``MetadataSummary``),
    ``dcp_bytes_per_rank_per_save`` and ``dcp_bytes_per_rank_per_save_cached`` (plan + that
    broadcast); rank 0 at the end of every save: ``results_gather_s`` (unpickling every rank's
    write results as ``StepWriter.write_data`` packs them; ``results_bytes_rank0`` their size;
    DCP's own writer's unpacked results beside them: ``dcp_results_gather_s``,
    ``dcp_results_bytes_rank0``), then ``StepWriter.finish``: ``metadata_write_s`` (DCP's
    ``.metadata``), ``index_write_s`` (``encode_index`` and the write) and ``index_bytes``;
    ``finish_s`` the gather and the finish together. At a later save of the same plan whose
    every rank wrote what it wrote the save before (the steady state: what is kept from the save
    before is used again; each the median of three such saves); ``metadata_write_first_s``, ``index_write_first_s``,
    ``finish_first_s`` at a process's first save; ``metadata_write_changed_s``,
    ``index_write_changed_s``, ``finish_changed_s`` at a later save where one rank's last item
    grew (an object entry of another size: laid out anew).
The index at a restore (``index_figures``; every rank's requests built from what it holds, as
``requests_for`` makes them, checked against it on ranks 0, 1 and N - 1):
    rank 0: ``index_rank0_s`` = ``index_read_s`` + ``index_parse_s`` (``CheckpointIndex.parse``
    with the files' sizes) + ``index_select_s`` (``select`` for all N ranks);
    ``index_rank0_comm_s`` (unpickling every rank's request and pickling every rank's answer, as
    torch's gather and scatter make it do), ``index_requests_bytes_rank0`` (the requests it
    receives); the other ranks: ``index_other_rank`` (the rank with the largest answer),
    ``index_other_rank_s`` (its ``partial_metadata``), ``index_bytes_per_rank`` (that answer) and
    ``index_bytes_per_rank_min``, ``index_scatter_bytes_per_rank`` (the answer as the scatter
    sends it); DCP's load planning of that rank (``plan_load``: what ``dcp.load(no_dist=True)``
    plans): ``load_plan_s`` from its own entries, ``load_plan_full_metadata_s`` from the whole
    Metadata (what plain ``dcp.load`` plans from, on every rank).
``.metadata``, the path of checkpoints written before the index (``metadata_figures``):
    ``metadata_bytes``; ``metadata_unpickle_s``, our allow-list unpickler (rank 0 at such a
    restore; ``metadata_unpickle``: measured, or extrapolated at the largest measured size's
    seconds per byte above ``--unpickle-cap-mb``, or not measured: null);
    ``metadata_plain_unpickle_s`` (every other rank, of what rank 0 sends) and
    ``metadata_pickle_s`` (rank 0 pickling the object to send it).
Totals:
    ``restore_bytes_received_per_rank``: every byte a non-0 rank receives at a restore, the
    control plane's collectives and its index answer (DCP's load makes no collective);
    ``elapsed_s``: this N's measurement, wall time.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import hashlib
import json
import logging
import os
import pickle
import platform
import re
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Self

import numpy as np
import torch
from bench_common import quiet

warnings.filterwarnings("ignore", message="torch.distributed is disabled")

from resume.adapters.data import GlobalPositionSampler, StatefulLoader
from resume.adapters.dcp.filesystem import make_writer
from resume.adapters.dcp.index import (
    INDEX_FILE,
    MAGIC,
    CheckpointIndex,
    Requests,
    key_hash,
    partial_metadata,
    requests_for,
    select,
)
from resume.adapters.dcp.plan_cache import CachingSavePlanner, MetadataSummary, forget
from resume.adapters.dcp.reader import SafeLoadPlanner
from resume.adapters.dcp.unpickle import restricted_load_metadata
from resume.adapters.dcp.written import PackedWrites
from resume.adapters.torch_native import NativeTorchAdapter
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import (
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import WriteResult

from resume import Coordinator
from resume.storage import LocalStorage, open_storage

DEFAULT_RANKS = (8, 64, 640, 5120)
SAMPLES_PER_DP_RANK = 24
KEEP = 3  # checkpoints retention keeps
"""Micro-batch 1, 24 micro-batches per data-parallel rank (the reference)."""
LAYER_TENSORS = ("input_layernorm.weight", "self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias",
                 "self_attention.linear_proj.weight", "self_attention.linear_proj.bias",
                 "pre_mlp_layernorm.weight", "mlp.linear_fc1.weight", "mlp.linear_fc1.bias",
                 "mlp.linear_fc2.weight", "mlp.linear_fc2.bias")
ROWS, COLS = 1536, 20480
"""One model tensor's shard per TP rank: 31.5M elements (500B parameters / 64 / 250 tensors)."""
_SHARD = re.compile(r"__(\d+)_(\d+)\.distcp$")
_RANK_FILE = re.compile(r"rank-(\d{5,})\.json$")


@dataclass(frozen=True)
class Layout:
    ranks: int
    tp: int
    pp: int
    dp: int

    @classmethod
    def of(cls, ranks: int) -> Layout:
        tp = min(8, ranks)
        pp = max(1, min(8, ranks // tp))
        if ranks % (tp * pp):
            raise ValueError(f"--ranks: expected multiples of 64 above 64 (TP8 x PP8 x DP), actual {ranks}")
        return cls(ranks, tp, pp, ranks // (tp * pp))

    def dp_rank(self, rank: int) -> int:
        return (rank // self.tp) % self.dp  # Megatron's default order: TP fastest, then DP, then PP

    def describe(self) -> str:
        return f"TP{self.tp} x PP{self.pp} x DP{self.dp}"


# -- the simulated Comm ---------------------------------------------------------------------------

def _salt(text: str, rank: int) -> str:
    """Another value of the same length and alphabet (a digest of another rank)."""
    prefix, _, body = text.rpartition(":")
    h = hashlib.blake2b(f"{rank}/{body}".encode(), digest_size=32).hexdigest()
    return (prefix + ":" if prefix else "") + (h * (len(body) // 64 + 1))[:len(body)]


class Synthesizer:
    """Rank ``r``'s part of a collective, from rank 0's: same structure, same size, its own values."""

    def __init__(self, layout: Layout, run_dir: str) -> None:
        self.layout = layout
        self.run_dir = run_dir
        self.seconds = 0.0

    def __call__(self, obj: Any, rank: int) -> Any:
        if rank == 0:
            return obj
        return self._part(obj, rank)

    def _part(self, obj: Any, rank: int) -> Any:
        if isinstance(obj, tuple) and len(obj) == 2 and obj[0] == "ok" and isinstance(obj[1], dict):
            return ("ok", self._dict(obj[1], rank))
        if isinstance(obj, dict):
            return self._dict(obj, rank)
        return obj

    def _dict(self, part: dict, rank: int) -> dict:
        out = dict(part)
        if isinstance(part.get("rng"), str):
            out["rng"] = _salt(part["rng"], rank)
        if part.get("optimizer") is not None:
            out["optimizer"] = _shift_ints(part["optimizer"], rank)
        if isinstance(part.get("batch"), list):
            dp = self.layout.dp_rank(rank)  # rank 0's TP and PP peers (dp 0) describe its very batch
            out["batch"] = [(int(i) + dp * SAMPLES_PER_DP_RANK, _salt(d, dp) if dp else d) for i, d in part["batch"]]
        if isinstance(part.get("files"), dict):
            out["files"] = self._files(part["files"], rank)
        return out

    def _files(self, files: dict, rank: int) -> dict:
        """Rank ``rank``'s records: its own state file and shard (links to rank 0's on disk)."""
        step_dir = self._newest_step_dir()
        out = {}
        for name, record in files.items():
            renamed = _rank_name(name, rank)
            if renamed is None:
                continue  # .metadata and what DCP cannot attribute: rank 0's alone
            out[renamed] = record
            if step_dir is not None:
                target = os.path.join(step_dir, renamed)
                if not os.path.exists(target):
                    os.link(os.path.join(step_dir, name), target)
        return out

    def _newest_step_dir(self) -> str | None:
        steps = sorted(n for n in os.listdir(self.run_dir) if n.startswith("step-"))
        return os.path.join(self.run_dir, steps[-1]) if steps else None


def _rank_name(name: str, rank: int) -> str | None:
    if _RANK_FILE.fullmatch(name):
        return f"rank-{rank:05d}.json"
    m = _SHARD.fullmatch(name)
    if m:
        return f"__{rank}_{m.group(2)}.distcp"
    return None


def _shift_ints(value: Any, by: int) -> Any:
    if isinstance(value, bool):
        return value
    if isinstance(value, int):
        return value + by
    if isinstance(value, dict):
        return {k: _shift_ints(v, by) for k, v in value.items()}
    if isinstance(value, list):
        return [_shift_ints(v, by) for v in value]
    return value


@dataclass
class Traffic:
    """Bytes the collectives delivered: to rank 0, and to the busiest other rank (a bound: the
    sum over collectives of each one's busiest receiver)."""

    rank0: int = 0
    other_max: int = 0
    collectives: dict[str, int] = field(default_factory=dict)

    def add(self, kind: str, rank0: int, other_max: int) -> None:
        self.rank0 += rank0
        self.other_max += other_max
        self.collectives[kind] = self.collectives.get(kind, 0) + 1


class SimComm:
    """``resume.comm.Comm`` for rank ``rank`` of ``world_size`` ranks in this process.

    Every other rank's part is ``synthesize(own part, r)``; rank 0's broadcasts and scatters are
    recorded (``record``) or, on another rank, replayed in order (``replay``). ``traffic`` counts the
    bytes each collective delivers; ``excluded_s`` is the time spent making and pickling the
    other ranks' parts (their work, not this rank's)."""

    def __init__(self, world_size: int, synthesize: Callable[[Any, int], Any], *, rank: int = 0,
                 replay: list[Any] | None = None) -> None:
        self.rank = rank
        self.world_size = world_size
        self.synthesize = synthesize
        self.replay = list(replay) if replay is not None else None
        self.record: list[Any] = []
        self.scattered: list[tuple[Any, int]] = []
        self.traffic = Traffic()
        self.excluded_s = 0.0

    def barrier(self) -> None:
        pass

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        if src != 0:
            raise NotImplementedError("SimComm: broadcasts from rank 0 only (all the library makes)")
        if self.rank != 0:
            if not self.replay:
                raise RuntimeError("SimComm: rank 0 broadcast less than this rank expects")
            obj = self.replay.pop(0)
        size = len(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))
        self.record.append(obj)
        self.traffic.add("broadcast", 0, size)
        return pickle.loads(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))

    def _parts(self, obj: Any) -> tuple[list[bytes], int]:
        started = time.perf_counter()
        # On another rank, its own part stands for rank 0's: every rank's part is made from it
        # as on rank 0, so the gathered list is the one rank 0 saw.
        blobs = [pickle.dumps(self.synthesize(obj, r), protocol=pickle.HIGHEST_PROTOCOL)
                 for r in range(self.world_size)]
        self.excluded_s += time.perf_counter() - started
        return blobs, sum(map(len, blobs))

    def all_gather_object(self, obj: Any) -> list[Any]:
        blobs, total = self._parts(obj)
        self.traffic.add("all_gather", total - len(blobs[0]), total - min(map(len, blobs[1:]), default=total))
        return [pickle.loads(b) for b in blobs]

    def gather_object(self, obj: Any, dst: int = 0) -> list[Any] | None:
        if dst != 0:
            raise NotImplementedError("SimComm: gathers to rank 0 only")
        if self.rank != 0:
            self.traffic.add("gather", 0, 0)
            return None
        blobs, total = self._parts(obj)
        self.traffic.add("gather", total - len(blobs[0]), 0)
        return [pickle.loads(b) for b in blobs]

    def scatter_object(self, objs: list[Any] | None, src: int = 0) -> Any:
        """Each rank receives its own object only (``traffic`` counts, for the busiest other
        rank, its own object's bytes); ``scattered`` keeps this rank's objects and sizes."""
        if src != 0:
            raise NotImplementedError("SimComm: scatters from rank 0 only (all the library makes)")
        if self.rank != 0:
            if not self.replay:
                raise RuntimeError("SimComm: rank 0 scattered less than this rank expects")
            objs = self.replay.pop(0)
        if objs is None or len(objs) != self.world_size:
            raise ValueError(f"SimComm: scatter: expected {self.world_size} objects")
        self.record.append(objs)
        if self.rank == 0:  # torch's scatter_object_list pickles every rank's object on the source
            sizes = [len(pickle.dumps(o, protocol=pickle.HIGHEST_PROTOCOL)) for o in objs]
            self.traffic.add("scatter", 0, max(sizes[1:], default=0))
            own = sizes[0]
        else:
            own = len(pickle.dumps(objs[self.rank], protocol=pickle.HIGHEST_PROTOCOL))
            self.traffic.add("scatter", 0, own)
        self.scattered.append((objs[self.rank], own))
        return pickle.loads(pickle.dumps(objs[self.rank], protocol=pickle.HIGHEST_PROTOCOL))

    def max_flags(self, flags: list[int]) -> list[int]:
        return [int(f) for f in flags]  # every rank agrees with rank 0 (no request, no signal)

    def fork(self) -> SimComm:
        return self


# -- rank 0's training state: real objects, the reference's names, tiny tensors -----------------

def _model(tensors: int) -> torch.nn.Module:
    root = torch.nn.Module()
    g = torch.Generator().manual_seed(1)
    for j in range(tensors):
        path = f"decoder.layers.{j // len(LAYER_TENSORS)}.{LAYER_TENSORS[j % len(LAYER_TENSORS)]}".split(".")
        module = root
        for part in path[:-1]:
            if not hasattr(module, part):
                module.add_module(part, torch.nn.Module())
            module = getattr(module, part)
        module.register_parameter(path[-1], torch.nn.Parameter(torch.randn(4, generator=g)))
    return root


class Samples:
    def __init__(self, n: int) -> None:
        self.x = torch.arange(n, dtype=torch.float32).unsqueeze(1) / n

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict:
        return {"x": self.x[i]}


@dataclass
class Trainer:
    coord: Coordinator
    comm: SimComm
    model: torch.nn.Module
    optim: torch.optim.Optimizer
    sched: Any
    adapter: NativeTorchAdapter

    def step(self) -> None:
        for batch in self.coord.batches():
            loss = sum(p.sum() for p in self.model.parameters()) * batch["x"].mean()
            self.optim.zero_grad()
            loss.backward()
            self.optim.step()
            self.sched.step()
            self.coord.update()
            return


def build_trainer(layout: Layout, run_dir: str, comm: SimComm, tensors: int) -> Trainer:
    torch.manual_seed(0)
    model = _model(max(1, tensors // 4))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(optim, lambda s: min(1.0, (s + 1) / 100))
    global_batch = SAMPLES_PER_DP_RANK * layout.dp
    # Data-parallel rank 0's slice on every simulated rank: a replayed rank's own part stands
    # for rank 0's (its state file is a link to rank 0's), the others are made from it.
    sampler = GlobalPositionSampler(global_batch * 50, global_batch, rank=0, world_size=layout.dp)
    loader = StatefulLoader(Samples(global_batch * 50), sampler)
    adapter = NativeTorchAdapter(model, optim, sched, loader, comm=comm)
    coord = Coordinator(run_dir, adapter, global_batch=global_batch, every=0, keep=KEEP, handle_signals=False)
    return Trainer(coord, comm, model, optim, sched, adapter)


@contextlib.contextmanager
def timing(obj: Any, name: str, into: list[float]) -> Any:
    """``obj.name`` timed, each call's seconds appended to ``into`` (the instance's own attribute)."""
    original = getattr(obj, name)

    def timed(*args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            into.append(time.perf_counter() - started)
    setattr(obj, name, timed)
    try:
        yield
    finally:
        with contextlib.suppress(AttributeError):
            delattr(obj, name)


# -- reads, as the code makes them --------------------------------------------------------------

class OpenLog:
    """Files opened for reading under ``root`` while ``watching``: through the run's storage
    (``LocalStorage``'s reading primitives, which open relative to a directory descriptor), and
    anything else (DCP's reader) seen by a Python audit hook on ``open`` with the full path."""

    def __init__(self) -> None:
        self.root: str | None = None
        self.paths: list[str] = []
        sys.addaudithook(self._hook)

    def _hook(self, event: str, args: tuple) -> None:
        if event != "open" or self.root is None:
            return
        path, mode, flags = args
        if isinstance(path, int | bytes) or path is None:
            return
        reading = ("r" in mode and "+" not in mode) if isinstance(mode, str) else (flags & os.O_ACCMODE) == os.O_RDONLY
        path = os.fspath(path)
        if reading and path.startswith(self.root) and not os.path.isdir(path):
            self.paths.append(os.path.relpath(path, self.root))

    @contextlib.contextmanager
    def watching(self, root: str) -> Any:
        self.root, self.paths = root, []
        originals = {name: getattr(LocalStorage, name) for name in ("read_bytes", "open_read", "get_file")}

        def recording(name: str) -> Callable:
            def read(storage: LocalStorage, path: str, *args: Any, **kwargs: Any) -> Any:
                if self.root is not None:
                    full = os.path.join(storage.root, path)
                    if full.startswith(self.root):
                        self.paths.append(os.path.relpath(full, self.root))
                return originals[name](storage, path, *args, **kwargs)
            return read
        for name in originals:
            setattr(LocalStorage, name, recording(name))
        try:
            yield self.paths
        finally:
            self.root = None
            for name, fn in originals.items():
                setattr(LocalStorage, name, fn)


_OPEN_LOG: OpenLog | None = None


def open_log() -> OpenLog:
    global _OPEN_LOG
    if _OPEN_LOG is None:
        _OPEN_LOG = OpenLog()
    return _OPEN_LOG


def _generic(path: str, rank: int) -> str:
    """A rank's own file named for any rank (so two ranks' reads of their own files compare)."""
    path = re.sub(rf"rank-0*{rank}\.json$", "rank-<r>.json", path) if rank else path
    return re.sub(rf"__{rank}_(\d+)\.distcp$", r"__<r>_\1.distcp", path) if rank else path


# -- the control plane: saves and a restore through the real Coordinator -------------------------

def control_plane(layout: Layout, root: str, tensors: int, saves: int, reference_sizes: dict[str, int]) -> dict:
    run_dir = os.path.join(root, f"run-{layout.ranks}")
    synth = Synthesizer(layout, run_dir)
    comm = SimComm(layout.ranks, synth)
    t = build_trainer(layout, run_dir, comm, tensors)
    save_s, shard_s, manifest_s, retention_s, per_save, gc_s = [], [], [], [], [], []
    collections = GcClock()
    with timing(t.adapter, "save_shards", shard_s), timing(t.coord.run, "write_manifest", manifest_s), \
            timing(t.coord.run, "apply_retention", retention_s), collections:
        for _ in range(saves):
            t.step()
            before_traffic, before_excluded, before_shards = (comm.traffic.rank0, comm.traffic.other_max), \
                comm.excluded_s, sum(shard_s)
            collections.seconds = 0.0
            started = time.perf_counter()
            t.coord.save()
            wall = time.perf_counter() - started
            save_s.append(wall - (comm.excluded_s - before_excluded) - (sum(shard_s) - before_shards))
            gc_s.append(collections.seconds)
            per_save.append((comm.traffic.rank0 - before_traffic[0], comm.traffic.other_max - before_traffic[1]))
    t.coord.close()
    step = t.coord.last_committed_step
    step_dir = os.path.join(run_dir, t.coord.run.dirname(step))
    manifest_path = os.path.join(step_dir, "manifest.json")
    manifest_bytes = os.path.getsize(manifest_path)
    storage = open_storage(run_dir)
    from resume.run import Run

    run = Run(storage)
    parse_s = min(_time(lambda: run.read_manifest(step)) for _ in range(3))
    find_s = min(_time(lambda: run.find_latest()) for _ in range(2))
    # The saves once keep (3) is reached, when retention deletes one checkpoint at every commit:
    # their mean (a full garbage collection lands in some saves and not others), and the most.
    steady = slice(KEEP, None) if saves > KEEP else slice(-1, None)

    def mean(values: list[float]) -> float:
        return sum(values[steady]) / len(values[steady])

    figures = {
        "layout": layout.describe(),
        "bytes_per_rank_per_save": per_save[-1][1],
        "rank0_bytes_per_save": per_save[-1][0],
        "rank0_save_s": mean(save_s),
        "rank0_save_max_s": max(save_s[steady]),
        "rank0_saves_averaged": len(save_s[steady]),
        "rank0_save_parts_s": {"manifest_write": mean(manifest_s), "retention": mean(retention_s),
                               "gather_and_rest": mean(save_s) - mean(manifest_s) - mean(retention_s),
                               "garbage_collection": mean(gc_s)},
        "collectives_per_save": {k: v // saves for k, v in comm.traffic.collectives.items()},
        "manifest_bytes": manifest_bytes,
        "manifest_files": len(run.read_manifest(step).files),
        "manifest_parse_s": parse_s,
        "find_latest_s": find_s,
    }
    figures.update(restore(layout, run_dir, tensors, step_dir, reference_sizes))
    return figures


class GcClock:
    """Seconds Python's cyclic garbage collector ran (rank 0's work too, counted in its time;
    reported apart because a full collection walks every object of the process)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._started = 0.0

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._started

    def __enter__(self) -> Self:
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._callback)


def _time(fn: Callable[[], Any]) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def restore(layout: Layout, run_dir: str, tensors: int, step_dir: str, reference_sizes: dict[str, int]) -> dict:
    """The real restore on rank 0, then on two other ranks replaying rank 0's broadcasts and
    scatters. Its index exchange (``CheckedMetadata.read_own``) is over this process's tiny
    state: timed apart and left out of rank 0's time, its answer left out of the bytes each
    rank receives (the reference layout's index figures are ``index_figures``')."""
    log = open_log()
    synth = Synthesizer(layout, run_dir)
    comm0 = SimComm(layout.ranks, synth)
    with log.watching(run_dir + os.sep) as opened0:
        t0 = build_trainer(layout, run_dir, comm0, tensors)
        exchange: list[float] = []
        with timing_own(t0.adapter._metadata, "read_own", comm0, exchange):
            started = time.perf_counter()
            t0.coord.restore()
            restore_s = time.perf_counter() - started - comm0.excluded_s
        t0.coord.close()
    reads = {0: list(opened0)}
    traffic = {}
    # No broadcast carries DCP's metadata any more (the index is scattered, each rank its own
    # entries): counted to show it.
    with open(os.path.join(step_dir, ".metadata"), "rb") as f:
        tiny = f.read()
    carried = sum(_carries(obj, tiny) for obj in comm0.record)
    others = sorted({1, layout.ranks - 1} - {0})
    for r in others:
        comm = SimComm(layout.ranks, synth, rank=r, replay=comm0.record)
        with log.watching(run_dir + os.sep) as opened:
            t = build_trainer(layout, run_dir, comm, tensors)
            t.coord.restore()
            t.coord.close()
        reads[r] = [_generic(p, r) for p in opened]
        answers = sum(size for share, size in comm.scattered if _is_index_answer(share))
        traffic[r] = comm.traffic.other_max - answers
    return readers_and_bytes(layout, step_dir, run_dir, reads, others, reference_sizes) | {
        "rank0_restore_s": restore_s - sum(exchange),
        "rank0_restore_index_sim_s": sum(exchange),
        "restore_control_bytes_received_per_rank": max(traffic.values(), default=0),
        "restore_broadcasts_of_metadata": carried,
    }


@contextlib.contextmanager
def timing_own(obj: Any, name: str, comm: SimComm, into: list[float]) -> Any:
    """``timing`` less the other ranks' work (``comm.excluded_s``) done inside each call: that
    is subtracted from the whole already."""
    original = getattr(obj, name)

    def timed(*args: Any, **kwargs: Any) -> Any:
        started, excluded = time.perf_counter(), comm.excluded_s
        try:
            return original(*args, **kwargs)
        finally:
            into.append(time.perf_counter() - started - (comm.excluded_s - excluded))
    setattr(obj, name, timed)
    try:
        yield
    finally:
        with contextlib.suppress(AttributeError):
            delattr(obj, name)


def _is_index_answer(share: Any) -> bool:
    """A scatter's share that is a rank's index answer (``("ok", sub-index bytes)``)."""
    return isinstance(share, tuple) and len(share) == 2 and share[0] == "ok" \
        and isinstance(share[1], bytes) and share[1].startswith(MAGIC)


def _carries(obj: Any, data: bytes) -> int:
    """1 for a broadcast that carries DCP's metadata: its bytes, or the object rank 0 parsed."""
    if isinstance(obj, bytes):
        return int(obj == data)
    if isinstance(obj, Metadata):
        return 1
    if isinstance(obj, tuple | list):
        return sum(_carries(o, data) for o in obj)
    return 0


def readers_and_bytes(layout: Layout, step_dir: str, run_dir: str, reads: dict[int, list[str]],
                      others: list[int], reference_sizes: dict[str, int]) -> dict:
    """Ranks reading each file at restore, and bytes read from shared storage (every open reads
    the whole file; shards apart: bulk I/O). ``reference_sizes``: the reference layout's size of
    the step's files named there (``.metadata``, the index), in place of this process's tiny ones."""
    readers: dict[str, int] = {}
    opens: dict[str, int] = {}

    def add(path: str, ranks: int, count: int) -> None:
        readers[path] = readers.get(path, 0) + ranks
        opens[path] = opens.get(path, 0) + ranks * count

    for p in set(reads.get(0, [])):
        add(p, 1, reads[0].count(p))
    if others:
        seen = [set(reads[r]) for r in others]
        common = set.intersection(*seen)
        for p in set.union(*seen):
            count = max(reads[r].count(p) for r in others)
            if "<r>" in p:  # each rank's own file: one reader each
                for r in range(1, layout.ranks):
                    add(p.replace("<r>", str(r) if "distcp" in p else f"{r:05d}"), 1, count)
            else:  # read by every other rank when both replayed ranks read it, else by one
                add(p, layout.ranks - 1 if p in common else 1, count)
    at_reference = {os.path.relpath(os.path.join(step_dir, name), run_dir): size
                    for name, size in reference_sizes.items()}

    def size(p: str) -> int:
        if p in at_reference:
            return at_reference[p]
        full = os.path.join(run_dir, p)
        return os.path.getsize(full) if os.path.exists(full) else 0

    control = [p for p in readers if not _SHARD.search(p)]
    bytes_by_file = {p: opens[p] * size(p) for p in control}
    busiest = max(bytes_by_file, key=bytes_by_file.get) if bytes_by_file else ""
    most_read = sorted(control, key=lambda p: (-readers[p], p))[:5]
    return {
        "restore_bytes_read": sum(bytes_by_file.values()),
        "busiest_file": _generic_name(busiest),
        "busiest_file_bytes": bytes_by_file.get(busiest, 0),
        "max_readers_per_file": max((readers[p] for p in control), default=0),
        "most_read_files": [{"file": _generic_name(p), "readers": readers[p], "opens": opens[p],
                             "bytes": bytes_by_file[p]} for p in most_read],
        "files_opened_by_rank0": len(reads.get(0, [])),
    }


def _generic_name(path: str) -> str:
    return re.sub(r"step-\d+", "step-N", path)


# -- DCP: global planning, .metadata and the index for the reference layout's shards -------------

KINDS = ("fp32_param", "exp_avg", "exp_avg_sq")
"""Each parameter's optimizer states (Megatron-Core's distributed optimizer: flat, sharded over DP)."""


def stage_names(pp: int, per_rank: int) -> list[str]:
    """The ``per_rank`` parameters of pipeline stage ``pp``, named like Megatron's."""
    layer0 = pp * (per_rank // len(LAYER_TENSORS) + 1)
    return [f"decoder.layers.{layer0 + j // len(LAYER_TENSORS)}.{LAYER_TENSORS[j % len(LAYER_TENSORS)]}"
            for j in range(per_rank)]


def local_plans(layout: Layout, tensors: int) -> list[SavePlan]:
    """Every rank's local save plan: model tensors TP-sharded (the same items on every DP
    replica, which DCP de-duplicates), optimizer states flat and sharded over TP x DP."""
    per_rank = max(1, tensors // 4)
    bf16, f32 = TensorProperties(dtype=torch.bfloat16), TensorProperties(dtype=torch.float32)
    model_size, model_chunk = torch.Size([layout.tp * ROWS, COLS]), torch.Size([ROWS, COLS])
    flat = ROWS * COLS
    if flat % layout.dp:
        raise ValueError(f"DP {layout.dp}: expected a divisor of {flat}")
    shard = flat // layout.dp
    opt_size, opt_chunk = torch.Size([layout.tp * flat]), torch.Size([shard])
    plans = [None] * layout.ranks
    for pp in range(layout.pp):
        names = stage_names(pp, per_rank)
        for tp in range(layout.tp):
            offset = torch.Size([tp * ROWS, 0])
            model = [WriteItem(index=MetadataIndex(f"model.{n}", offset), type=WriteItemType.SHARD,
                               tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(offset, model_chunk),
                                                           properties=bf16, size=model_size)) for n in names]
            for dp in range(layout.dp):
                items = list(model)  # replicated over DP: equal items on every replica
                offset = torch.Size([tp * flat + dp * shard])
                for n in names:
                    for kind in KINDS:  # an object each, as DCP's planner makes them
                        data = TensorWriteData(chunk=ChunkStorageMetadata(offset, opt_chunk), properties=f32,
                                               size=opt_size)
                        items.append(WriteItem(index=MetadataIndex(f"optimizer.state.{kind}.{n}", offset),
                                               type=WriteItemType.SHARD, tensor_data=data))
                rank = tp + layout.tp * (dp + layout.dp * pp)
                plans[rank] = SavePlan(items)
    return plans  # type: ignore[return-value]


def held(global_size: torch.Size, chunk: ChunkStorageMetadata) -> torch.Tensor:
    """A tensor a rank holds, as DCP's load planner asks of it: its global size (a CPU tensor
    of no memory, every stride 0) and its chunk (what a DTensor answers; its own computation of
    the chunk is left out, the same whichever Metadata the load plans from)."""
    tensor = torch.empty((), dtype=torch.bfloat16).expand(global_size)
    tensor.__create_chunk_list__ = lambda: [chunk]
    return tensor


class Holdings:
    """What each rank of the reference layout holds at a restore on the same layout: exactly the
    chunks it wrote (``local_plans``, in their order; model chunks on every DP replica).
    ``arrays(rank)`` is what ``requests_for`` makes of that state (``requests_agree`` checks
    it), built with numpy: every rank's at 5,120 ranks in a second or two."""

    def __init__(self, layout: Layout, tensors: int) -> None:
        self.layout = layout
        self.per_rank = p = max(1, tensors // 4)
        self.flat = ROWS * COLS
        self.shard = self.flat // layout.dp
        self.ndim = np.array([2] * p + [1] * (len(KINDS) * p), np.int64)
        self.coords_at = np.concatenate([np.arange(p) * 4, 4 * p + np.arange(len(KINDS) * p) * 2]).astype(np.int64)
        self._stages: dict[int, tuple[list[str], np.ndarray]] = {}

    def where(self, rank: int) -> tuple[int, int, int]:
        """(tp, dp, pp) of ``rank`` (TP fastest, then DP, then PP, as ``local_plans`` numbers them)."""
        lay = self.layout
        return rank % lay.tp, (rank // lay.tp) % lay.dp, rank // (lay.tp * lay.dp)

    def names(self, pp: int) -> tuple[list[str], np.ndarray]:
        """The keys a rank of stage ``pp`` holds, in its plan's order, and their hashes."""
        if pp not in self._stages:
            params = stage_names(pp, self.per_rank)
            names = [f"model.{n}" for n in params] + [f"optimizer.state.{k}.{n}" for n in params for k in KINDS]
            self._stages[pp] = (names, np.array([key_hash(n) for n in names], np.int64))
        return self._stages[pp]

    def arrays(self, rank: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(key hashes, ndims, coords starts, coords): ``Requests``' arrays."""
        tp, dp, pp = self.where(rank)
        p = self.per_rank
        model = np.tile(np.array([tp * ROWS, 0, ROWS, COLS], np.int64), p)
        optimizer = np.tile(np.array([tp * self.flat + dp * self.shard, self.shard], np.int64), len(KINDS) * p)
        return self.names(pp)[1], self.ndim, self.coords_at, np.concatenate([model, optimizer])

    def wire(self, rank: int) -> tuple[bytes, bytes, bytes, bytes]:
        return tuple(a.tobytes() for a in self.arrays(rank))  # type: ignore[return-value]

    def requests(self, rank: int) -> Requests:
        return Requests(list(self.names(self.where(rank)[2])[0]), *self.arrays(rank))

    def state(self, rank: int) -> dict[str, torch.Tensor]:
        """The rank's state dict as DCP's load planner sees it (``held``)."""
        tp, dp, pp = self.where(rank)
        model = held(torch.Size([self.layout.tp * ROWS, COLS]),
                     ChunkStorageMetadata(torch.Size([tp * ROWS, 0]), torch.Size([ROWS, COLS])))
        optimizer = held(torch.Size([self.layout.tp * self.flat]),
                         ChunkStorageMetadata(torch.Size([tp * self.flat + dp * self.shard]), torch.Size([self.shard])))
        return {name: model if i < self.per_rank else optimizer for i, name in enumerate(self.names(pp)[0])}


def requests_agree(holdings: Holdings, plans: list[SavePlan], ranks: list[int]) -> list[int]:
    """The ranks of ``ranks`` whose ``Holdings`` requests differ from what ``requests_for`` makes
    of a state holding exactly the chunks of their local plan (meta tensors that report their
    chunk as a DTensor does)."""
    wrong = []
    for rank in ranks:
        state = {}
        for item in plans[rank].items:
            tensor = torch.empty(item.tensor_data.size, device="meta")
            tensor.__create_chunk_list__ = lambda c=item.tensor_data.chunk: [c]
            state[item.index.fqn] = tensor
        real, ours = requests_for(state), holdings.requests(rank)
        if real.names != ours.names or real.wire() != ours.wire():
            wrong.append(rank)
    return wrong


def plan_load(state: dict[str, torch.Tensor], metadata: Metadata) -> tuple[float, int]:
    """(seconds, read items) of one rank's DCP load planning from ``metadata``, as
    ``dcp.load(no_dist=True)`` makes it with the adapter's planner: set up, local plan, the
    global plan of that one plan, the final plan (the reader's own steps are no-ops)."""
    planner = SafeLoadPlanner()
    started = time.perf_counter()
    planner.set_up_planner(dict(state), metadata, True)
    plan = planner.create_local_plan()
    final = planner.finish_plan(planner.create_global_plan([plan])[0])
    return time.perf_counter() - started, len(final.items)


def dcp_figures(layout: Layout, tensors: int, root: str) -> dict:
    started = time.perf_counter()
    plans = local_plans(layout, tensors)
    build_s = time.perf_counter() - started
    checked = sorted({0, 1, layout.ranks - 1} & set(range(layout.ranks)))
    wrong = requests_agree(Holdings(layout, tensors), plans, checked)
    if wrong:
        raise RuntimeError(f"index requests of ranks {wrong}: expected what requests_for makes of their state")
    local_bytes = len(pickle.dumps(plans[-1], protocol=pickle.HIGHEST_PROTOCOL))
    # What DCP's gather gives rank 0: each rank's plan unpickled, objects of its own.
    plans = [pickle.loads(pickle.dumps(p, protocol=pickle.HIGHEST_PROTOCOL)) for p in plans]
    # The planner NativeTorchAdapter saves with (adapters/dcp/plan_cache.py): DCP's caching,
    # reused only for plans equal in every field.
    key = f"scale-{layout.ranks}"
    forget(key)
    planner = CachingSavePlanner(key, flatten_state_dict=False)
    with quiet():
        started = time.perf_counter()
        global_plan, metadata = planner.create_global_plan(plans)
        plan_s = time.perf_counter() - started
        unchanged = [SavePlan([], usable=False)] * layout.ranks
        started = time.perf_counter()
        delta, _ = planner.create_global_plan(unchanged)
        cached_s = time.perf_counter() - started
    global_bytes = max(len(pickle.dumps(global_plan[r], protocol=pickle.HIGHEST_PROTOCOL))
                       for r in sorted({0, layout.ranks - 1}))
    cached_bytes = len(pickle.dumps(delta[-1], protocol=pickle.HIGHEST_PROTOCOL))
    items = sum(len(p.items) for p in global_plan)
    written = write_metadata(layout, root, global_plan, metadata)
    # DCP ends a save by broadcasting what the planner handed it (``_DistWrapper.all_reduce``):
    # a KeptMetadata, which pickles to a MetadataSummary.
    final = pickle.dumps(metadata, protocol=pickle.HIGHEST_PROTOCOL)
    if type(pickle.loads(final)) is not MetadataSummary:
        raise RuntimeError(f"the planner's Metadata pickles to {len(final)} bytes, not to a MetadataSummary: "
                           "DCP's end-of-save broadcast carries it whole")
    del plans, global_plan, delta, metadata, planner
    forget(key)
    gc.collect()
    return {
        "dcp_plans_build_s": build_s,
        "dcp_plan_s": plan_s,
        "dcp_plan_cached_s": cached_s,
        "dcp_items_written": items,
        "dcp_local_plan_bytes": local_bytes,
        "dcp_plan_bytes_per_rank": global_bytes,
        "dcp_plan_bytes_per_rank_cached": cached_bytes,
        "dcp_final_broadcast_bytes": len(final),
        **written,
    }


def write_metadata(layout: Layout, root: str, global_plan: list[SavePlan], metadata: Any) -> dict:
    """Rank 0's end of a save, as the adapter's writer does it: every rank's write results
    (one file per rank, items back to back) gathered to rank 0 as ``StepWriter.write_data``
    packs them, then ``StepWriter.finish`` writes ``.metadata`` and the index. Each part timed
    (and DCP's own gather of unpacked results beside it), at a process's first save and at a
    later save of the same plan; where the files are."""
    results, sizes = _write_results(global_plan)
    first = _write_step(root, results, metadata, f"dcp-{layout.ranks}-first")
    # The next saves of the same plan: the same items, their results gathered again (new
    # objects); each part's median of three (this machine is shared: one save can be unlucky).
    steps = [_write_step(root, results, metadata, f"dcp-{layout.ranks}") for _ in range(3)]
    later = steps[-1] | {key: statistics.median(step[key] for step in steps)
                         for key in ("metadata_write_s", "index_write_s", "results_gather_s", "finish_s")}
    # A later save where one rank's last item grew (an object entry of another size): nothing
    # of the last save's results can be kept, rank 0 lays out .metadata and the index anew.
    grown = list(results)
    grown[-1] = _write_results([global_plan[-1]], rank0=len(global_plan) - 1, grow_last=8)[0][0]
    changed = _write_step(root, grown, metadata, f"dcp-{layout.ranks}-changed")
    for step_dir in ("first", "changed"):
        shutil.rmtree(os.path.join(root, f"dcp-{layout.ranks}-{step_dir}"), ignore_errors=True)
    plain = [pickle.dumps(list(r), protocol=pickle.HIGHEST_PROTOCOL) for r in results]  # DCP's own writer's
    started = time.perf_counter()
    for blob in plain:
        pickle.loads(blob)
    dcp_gather_s = time.perf_counter() - started
    return later | {"metadata_write_first_s": first["metadata_write_s"], "index_write_first_s": first["index_write_s"],
                    "finish_first_s": first["finish_s"], "metadata_write_changed_s": changed["metadata_write_s"],
                    "index_write_changed_s": changed["index_write_s"], "finish_changed_s": changed["finish_s"],
                    "shard_sizes": sizes,
                    "dcp_results_gather_s": dcp_gather_s, "dcp_results_bytes_rank0": sum(map(len, plain))}


def _write_results(global_plan: list[SavePlan], rank0: int = 0,
                   grow_last: int = 0) -> tuple[list[Any], dict[str, int]]:
    """Each rank's write results, as ``StepWriter.write_data`` returns them (packed); the plans
    are those of ranks ``rank0`` on, and each rank's last item is ``grow_last`` bytes longer."""
    results, sizes = [], {}
    for rank, plan in enumerate(global_plan, start=rank0):
        name, offset, out = f"__{rank}_0.distcp", 0, PackedWrites()
        for number, item in enumerate(plan.items, start=1):
            length = (item.tensor_storage_size() or 1) + (grow_last if number == len(plan.items) else 0)
            out.append(WriteResult(index=item.index, size_in_bytes=length,
                                   storage_data=_StorageInfo(name, offset, length)))
            offset += length
        results.append(out)
        sizes[name] = offset
    return results, sizes


def _write_step(root: str, results: list[Any], metadata: Any, step_dir: str) -> dict:
    storage = open_storage(root)
    storage.makedirs(step_dir)
    sent = [pickle.dumps(r, protocol=pickle.HIGHEST_PROTOCOL) for r in results]  # each rank's own work
    writer = make_writer(storage, step_dir, durable=False)
    metadata_s: list[float] = []
    index_s: list[float] = []
    started = time.perf_counter()
    gathered = [pickle.loads(blob) for blob in sent]  # what torch's gather_object makes rank 0 do
    gather_s = time.perf_counter() - started
    with timing(writer, "_write_metadata", metadata_s), timing(writer, "_write_index", index_s):
        writer.finish(metadata, gathered)
    finish_s = time.perf_counter() - started
    index_path = os.path.join(root, step_dir, INDEX_FILE)
    if not (metadata_s and index_s and os.path.exists(index_path)):
        raise RuntimeError(f"{index_path}: expected the writer to write .metadata and the index")
    return {"metadata_write_s": metadata_s[0], "index_write_s": index_s[0], "index_bytes": os.path.getsize(index_path),
            "metadata_path": os.path.join(root, step_dir, ".metadata"), "index_path": index_path,
            "results_gather_s": gather_s, "results_bytes_rank0": sum(map(len, sent)), "finish_s": finish_s}


def index_figures(layout: Layout, tensors: int, path: str, file_sizes: dict[str, int]) -> tuple[dict, Callable]:
    """Rank 0's handling of the index at a restore (read, ``CheckpointIndex.parse``, ``select``
    for every rank's requests), one other rank's (``partial_metadata`` of its answer, the
    largest) and its DCP load planning; and a function timing that rank's load planning
    from another Metadata (the whole one: ``metadata_figures``)."""
    holdings = Holdings(layout, tensors)
    wires = [holdings.wire(r) for r in range(layout.ranks)]  # the other ranks' work: not timed
    hashed = {name for name in file_sizes if name.endswith(".distcp")}  # verify_while_loading's
    gc.collect()
    started = time.perf_counter()
    with open(path, "rb") as f:
        data = f.read()
    read_s = time.perf_counter() - started
    started = time.perf_counter()
    index = CheckpointIndex.parse(data, source=path, file_sizes=file_sizes, compression=None)
    parse_s = time.perf_counter() - started
    started = time.perf_counter()
    answers = select(index, wires, hashed)
    select_s = time.perf_counter() - started
    del index, data
    # What torch's gather_object and scatter_object_list make rank 0 do besides: unpickle every
    # rank's request, pickle every rank's answer.
    received = [pickle.dumps(("ok", w), protocol=pickle.HIGHEST_PROTOCOL) for w in wires]
    started = time.perf_counter()
    for blob in received:
        pickle.loads(blob)
    sent = [len(pickle.dumps(("ok", a), protocol=pickle.HIGHEST_PROTOCOL)) for a in answers]
    comm_s = time.perf_counter() - started
    rank = max(range(1, layout.ranks), key=lambda r: len(answers[r])) if layout.ranks > 1 else 0
    requests = holdings.requests(rank)
    started = time.perf_counter()
    metadata, _ = partial_metadata(answers[rank], requests, source=path)
    other_s = time.perf_counter() - started
    state = holdings.state(rank)
    plan_s, items = plan_load(state, metadata)
    if items != len(requests.names):  # same layout: one read item per chunk held
        raise RuntimeError(f"rank {rank}'s load plan from its own entries: expected {len(requests.names)} "
                           f"read items, actual {items}")

    def plan_full(full: Metadata) -> float:
        seconds, n = plan_load(state, full)
        if n != items:
            raise RuntimeError(f"rank {rank}'s load plan from the whole Metadata: expected {items} read items, "
                               f"actual {n}")
        return seconds

    return {
        "index_read_s": read_s,
        "index_parse_s": parse_s,
        "index_select_s": select_s,
        "index_rank0_s": read_s + parse_s + select_s,
        "index_rank0_comm_s": comm_s,
        "index_requests_bytes_rank0": sum(map(len, received[1:])),
        "index_other_rank": rank,
        "index_other_rank_s": other_s,
        "index_bytes_per_rank": len(answers[rank]),
        "index_bytes_per_rank_min": min(map(len, answers)),
        "index_scatter_bytes_per_rank": max(sent[1:], default=sent[0]),
        "load_plan_s": plan_s,
    }, plan_full


def metadata_figures(path: str, sizes: dict, cap_mb: float, rate: list[float],
                     plan_full: Callable[[Metadata], float]) -> dict:
    """``.metadata``: what a restore of a checkpoint written before the index costs (vetted by
    rank 0, pickled to be sent, unpickled by every other rank), and one rank's DCP load planning
    from the whole of it, as plain ``dcp.load`` plans on every rank."""
    with open(path, "rb") as f:
        data = f.read()
    loaded: list[Any] = []
    plain_s = _time(lambda: loaded.append(pickle.loads(data)))
    # What a restore's broadcast of the vetted object costs rank 0 (torch pickles it to send).
    pickle_s = _time(lambda: pickle.dumps(loaded[0]))
    out = {"metadata_bytes": len(data), "metadata_plain_unpickle_s": plain_s, "metadata_pickle_s": pickle_s,
           "load_plan_full_metadata_s": plan_full(loaded[0])}
    loaded.clear()
    gc.collect()
    if len(data) <= cap_mb * (1 << 20):
        out["metadata_unpickle_s"] = _time(lambda: restricted_load_metadata(
            data, source=path, file_sizes={**sizes, ".metadata": len(data)}))
        out["metadata_unpickle"] = "measured"
        rate.append(out["metadata_unpickle_s"] / len(data))
    else:
        # Seconds per byte of the largest size measured in this run (none yet: not measured).
        out["metadata_unpickle_s"] = rate[-1] * len(data) if rate else None
        out["metadata_unpickle"] = "extrapolated" if rate else "not measured (raise --unpickle-cap-mb)"
    os.unlink(path)
    return out


# -- main -----------------------------------------------------------------------------------------

def measure(ranks: int, root: str, args: argparse.Namespace, rate: list[float]) -> dict:
    layout = Layout.of(ranks)
    started = time.perf_counter()
    dcp = dcp_figures(layout, args.tensors_per_rank, root)
    paths = {name: dcp.pop(name) for name in ("metadata_path", "index_path")}
    file_sizes = {**dcp.pop("shard_sizes"), ".metadata": os.path.getsize(paths["metadata_path"]),
                  INDEX_FILE: dcp["index_bytes"]}
    index, plan_full = index_figures(layout, args.tensors_per_rank, paths["index_path"], file_sizes)
    gc.collect()
    meta = metadata_figures(paths["metadata_path"], file_sizes, args.unpickle_cap_mb, rate, plan_full)
    shutil.rmtree(os.path.dirname(paths["index_path"]), ignore_errors=True)
    gc.collect()
    figures = control_plane(layout, root, args.tensors_per_rank, args.saves,
                            {".metadata": meta["metadata_bytes"], INDEX_FILE: dcp["index_bytes"]})
    shutil.rmtree(os.path.join(root, f"run-{ranks}"), ignore_errors=True)
    figures.update(meta)
    figures.update(index)
    figures.update(dcp)
    # DCP's own save sends every rank its global plan (an empty one when cached) and, at the
    # end, what the planner's Metadata pickles to (``_DistWrapper.all_reduce``: gather, then
    # broadcast): a MetadataSummary, not the index.
    figures["dcp_bytes_per_rank_per_save"] = dcp["dcp_plan_bytes_per_rank"] + dcp["dcp_final_broadcast_bytes"]
    figures["dcp_bytes_per_rank_per_save_cached"] = (dcp["dcp_plan_bytes_per_rank_cached"]
                                                     + dcp["dcp_final_broadcast_bytes"])
    # A restore: the control plane's collectives and the rank's own index answer (a scatter);
    # DCP's load sends nothing (no_dist).
    figures["restore_bytes_received_per_rank"] = (figures["restore_control_bytes_received_per_rank"]
                                                  + index["index_scatter_bytes_per_rank"])
    figures["elapsed_s"] = time.perf_counter() - started
    return figures


GROWTH_KEYS = ("bytes_per_rank_per_save", "rank0_bytes_per_save", "rank0_save_s", "manifest_bytes",
               "manifest_parse_s", "metadata_bytes", "metadata_unpickle_s", "restore_bytes_read",
               "busiest_file_bytes", "max_readers_per_file", "dcp_plan_s", "dcp_plan_cached_s",
               "restore_bytes_received_per_rank", "dcp_bytes_per_rank_per_save",
               "dcp_bytes_per_rank_per_save_cached", "index_bytes", "index_write_s", "index_rank0_s",
               "index_other_rank_s", "index_bytes_per_rank", "load_plan_s", "load_plan_full_metadata_s")


def growth(results: dict[str, dict]) -> dict:
    keys = sorted(results, key=int)
    if len(keys) < 2:
        return {}
    a, b = results[keys[-2]], results[keys[-1]]
    ratio = {k: (b[k] / a[k] if a.get(k) and b.get(k) is not None else None) for k in GROWTH_KEYS}
    return {"from": int(keys[-2]), "to": int(keys[-1]), "ranks": int(keys[-1]) / int(keys[-2]), "ratio": ratio}


def _si(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


ROWS_PRINTED = [
    ("layout", "layout", str),
    ("bytes received per rank per save (busiest non-0 rank)", "bytes_per_rank_per_save", _si),
    ("bytes received by rank 0 per save", "rank0_bytes_per_save", _si),
    ("rank 0 control-plane time per save, mean once retention deletes (s)", "rank0_save_s", lambda v: f"{v:.3f}"),
    ("  of which manifest write (s)", ("rank0_save_parts_s", "manifest_write"), lambda v: f"{v:.3f}"),
    ("  of which retention (s)", ("rank0_save_parts_s", "retention"), lambda v: f"{v:.3f}"),
    ("Python's garbage collector during the save, any part (s)", ("rank0_save_parts_s", "garbage_collection"),
     lambda v: f"{v:.3f}"),
    ("  of which gather, commit and the rest (s)", ("rank0_save_parts_s", "gather_and_rest"), lambda v: f"{v:.3f}"),
    ("rank 0 control-plane time, slowest of those saves (s)", "rank0_save_max_s", lambda v: f"{v:.3f}"),
    ("manifest size", "manifest_bytes", _si),
    ("manifest parse (s)", "manifest_parse_s", lambda v: f"{v:.3f}"),
    ("discovery, Run.find_latest (s)", "find_latest_s", lambda v: f"{v:.3f}"),
    ("index size", "index_bytes", _si),
    ("index written by rank 0 at each save (s)", "index_write_s", lambda v: f"{v:.2f}"),
    ("  at a process's first save (s)", "index_write_first_s", lambda v: f"{v:.2f}"),
    (".metadata written by rank 0 at each save (s)", "metadata_write_s", lambda v: f"{v:.2f}"),
    ("write results gathered to rank 0, unpickled (s)", "results_gather_s", lambda v: f"{v:.2f}"),
    ("  as DCP's own writer sends them (s)", "dcp_results_gather_s", lambda v: f"{v:.2f}"),
    ("rank 0's end of a save: gather, .metadata, index (s)", "finish_s", lambda v: f"{v:.2f}"),
    ("  when one rank's entry changed size (s)", "finish_changed_s", lambda v: f"{v:.2f}"),
    ("  at a process's first save (s)", "finish_first_s", lambda v: f"{v:.2f}"),
    ("restore: rank 0 reads, parses, selects the index (s)", "index_rank0_s", lambda v: f"{v:.2f}"),
    ("  of which read / parse / select (s)", ("index_read_s", "index_parse_s", "index_select_s"),
     lambda v: " / ".join(f"{x:.2f}" for x in v)),
    ("restore: rank 0 unpickles requests, pickles answers (s)", "index_rank0_comm_s", lambda v: f"{v:.2f}"),
    ("restore: another rank builds its Metadata (s)", "index_other_rank_s", lambda v: f"{v:.3f}"),
    ("restore: index answer per rank, largest", "index_bytes_per_rank", _si),
    ("restore: requests rank 0 receives", "index_requests_bytes_rank0", _si),
    ("restore: DCP load planning, own entries (s)", "load_plan_s", lambda v: f"{v:.3f}"),
    ("restore: DCP load planning, whole Metadata (s)", "load_plan_full_metadata_s", lambda v: f"{v:.2f}"),
    (".metadata size", "metadata_bytes", _si),
    ("before the index: .metadata restricted unpickle (s)", "metadata_unpickle_s",
     lambda v: "n/a" if v is None else f"{v:.2f}"),
    ("  measured or extrapolated", "metadata_unpickle", str),
    ("before the index: .metadata plain pickle.loads (s)", "metadata_plain_unpickle_s", lambda v: f"{v:.2f}"),
    ("before the index: .metadata pickled again by rank 0 (s)", "metadata_pickle_s", lambda v: f"{v:.2f}"),
    ("restore: bytes read from shared storage (no shards)", "restore_bytes_read", _si),
    ("restore: busiest file", "busiest_file", str),
    ("restore: bytes read from the busiest file", "busiest_file_bytes", _si),
    ("restore: max readers per file", "max_readers_per_file", str),
    ("restore: bytes received per rank (collectives + index answer)", "restore_bytes_received_per_rank", _si),
    ("rank 0 restore time, no shard I/O, no index (s)", "rank0_restore_s", lambda v: f"{v:.2f}"),
    ("DCP global plan, no cache (s)", "dcp_plan_s", lambda v: f"{v:.2f}"),
    ("DCP global plan, cached (s)", "dcp_plan_cached_s", lambda v: f"{v:.4f}"),
    ("DCP items written (after de-dup)", "dcp_items_written", str),
    ("DCP bytes per rank per save (plan + final broadcast)", "dcp_bytes_per_rank_per_save", _si),
    ("DCP bytes per rank per save, cached plan", "dcp_bytes_per_rank_per_save_cached", _si),
]


def print_table(results: dict[str, dict]) -> None:
    keys = sorted(results, key=int)
    print("| N | " + " | ".join(keys) + " |")
    print("|---|" + "---:|" * len(keys))
    for label, key, fmt in ROWS_PRINTED:
        cells = []
        for k in keys:
            if isinstance(key, tuple) and key[0] in results[k] and isinstance(results[k][key[0]], dict):
                v = results[k][key[0]][key[1]]
            elif isinstance(key, tuple):
                v = tuple(results[k][part] for part in key)
            else:
                v = results[k].get(key)
            cells.append(fmt(v))
        print(f"| {label} | " + " | ".join(cells) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", default=",".join(map(str, DEFAULT_RANKS)),
                        help="comma-separated rank counts (default: 8,64,640,5120)")
    parser.add_argument("--tensors-per-rank", type=int, default=1000,
                        help="sharded tensors each rank writes (1/4 model, 3/4 optimizer state)")
    parser.add_argument("--saves", type=int, default=6,
                        help="saves per N; rank 0's figures are the mean of those from the 4th on "
                             "(retention deletes one at each)")
    parser.add_argument("--unpickle-cap-mb", type=float, default=64.0,
                        help="largest .metadata unpickled by the restricted unpickler; above, extrapolated")
    parser.add_argument("--dir", default=None, help="where the simulated runs live (default: a temp dir)")
    parser.add_argument("--json", action="store_true", help="also print one JSON object as the last line")
    args = parser.parse_args()
    try:
        ranks = sorted({int(x) for x in args.ranks.split(",") if x.strip()})
        for n in ranks:
            Layout.of(n)
    except ValueError as e:
        parser.error(f"--ranks: {e}")
    if args.saves < 1 or args.tensors_per_rank < 4:
        parser.error("--saves: expected >= 1; --tensors-per-rank: expected >= 4")
    logging.getLogger("resume").setLevel(logging.ERROR)
    logging.getLogger("torch.distributed.checkpoint").setLevel(logging.ERROR)
    torch.set_num_threads(1)
    started = time.perf_counter()
    root = tempfile.mkdtemp(prefix="resume-scale-", dir=args.dir)
    results: dict[str, dict] = {}
    rate: list[float] = []
    try:
        for n in ranks:
            results[str(n)] = measure(n, root, args, rate)
            print(f"N={n}: {results[str(n)]['elapsed_s']:.1f} s", file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    elapsed = time.perf_counter() - started
    print(f"{len(ranks)} sizes, {args.tensors_per_rank} tensors per rank, {os.cpu_count()} cores, "
          f"torch {torch.__version__}, {elapsed:.0f} s")
    print_table(results)
    g = growth(results)
    if g:
        print(f"\ngrowth {g['from']} -> {g['to']} ranks (x{g['ranks']:g}): " + ", ".join(
            f"{k} x{v:.2f}" for k, v in g["ratio"].items() if v is not None))
    if args.json:
        print(json.dumps({"ranks": results, "growth": g, "tensors_per_rank": args.tensors_per_rank,
                          "saves": args.saves, "elapsed_s": elapsed,
                          "machine": {"cores": os.cpu_count(), "torch": torch.__version__,
                                      "python": platform.python_version()}}))


if __name__ == "__main__":
    main()
