"""The end of a save sends every rank a message of bounded size, and ``.metadata`` stays DCP's.

DCP ends ``dcp.save`` with ``all_reduce("write")``: rank 0 writes ``.metadata`` and broadcasts
the ``Metadata`` its planner returned to every rank (613 MiB pickled at 5,120 ranks). Our
planners (adapters/dcp/plan_cache.py) return a ``KeptMetadata``, which pickles to a
``MetadataSummary``; ``StepWriter`` (adapters/dcp/filesystem.py) writes ``.metadata`` from a
plain ``Metadata``. What each rank sends or receives in that step is recorded by wrapping
``torch.distributed.broadcast_object_list`` (``recorded_broadcasts``); plain DCP, recorded the
same way, broadcasts the whole ``Metadata`` (the control that shows the measure sees it).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import pickle
import warnings
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from resume.adapters.dcp.plan_cache import KeptMetadata, plain_metadata
from resume.adapters.dcp.unpickle import restricted_load_metadata
from resume.adapters.torch_native import NativeTorchAdapter
from resume.drill.worker import tensor_digest
from support.ranks import run_ranks
from support.workloads import Setup, build, param_digests, train
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlanner
from torch.distributed.checkpoint.utils import _DistWrapper

from resume.storage import LocalStorage

SMALL = 4 << 10
"""Bytes: the most a rank may receive at the end of a save."""
WORLD = 3
SIZES = (10, 400)
"""Tensors in the model: the message must not grow with them."""

# -- helpers ------------------------------------------------------------------------------------


@contextlib.contextmanager
def recorded_broadcasts() -> Iterator[list]:
    """Every object broadcast in DCP's end-of-save step (``all_reduce("write")``), as this rank
    holds it after the broadcast (rank 0: what it sent; the others: what they received):
    ``{"type": class name, "bytes": pickled size}``; on rank 0 also ``"sha256"`` of a plain
    ``Metadata`` pickled from it (what ``.metadata`` must hold)."""
    seen: list = []
    steps: list = []
    all_reduce, broadcast = _DistWrapper.all_reduce, dist.broadcast_object_list

    def all_reduce_(self, step, map_fun, reduce_fun):
        steps.append(step)
        try:
            return all_reduce(self, step, map_fun, reduce_fun)
        finally:
            steps.pop()

    def broadcast_(*args, **kwargs):
        result = broadcast(*args, **kwargs)
        if steps and steps[-1] == "write":
            obj = (args[0] if args else kwargs["object_list"])[0]
            record = {"type": type(obj).__name__, "bytes": len(pickle.dumps(obj))}
            if isinstance(obj, Metadata):
                plain = plain_metadata(obj)
                plain.storage_data = dict(plain.storage_data.items())  # the entries, made objects
                record["sha256"] = hashlib.sha256(pickle.dumps(plain)).hexdigest()
            seen.append(record)
        return result

    _DistWrapper.all_reduce, dist.broadcast_object_list = all_reduce_, broadcast_
    try:
        yield seen
    finally:
        _DistWrapper.all_reduce, dist.broadcast_object_list = all_reduce, broadcast


class Many(torch.nn.Module):
    """``n`` small parameters, the same on every rank (seeded by ``n``)."""

    def __init__(self, n: int) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(n)
        self.ps = torch.nn.ParameterList(torch.nn.Parameter(torch.randn(3, generator=gen)) for _ in range(n))


def stepped_adapter(n: int, caching: bool) -> tuple[NativeTorchAdapter, Many]:
    model = Many(n)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sum(p.sum() for p in model.parameters()).backward()
    opt.step()
    return NativeTorchAdapter(model, opt, plan_caching=caching), model


def cached_metadata(adapter: NativeTorchAdapter) -> object:
    """Rank 0: the Metadata DCP caches under the adapter's live key (None without caching)."""
    return SavePlanner._cached_metadata.get(adapter._plan_cache.key("live"))


# -- the adapter's saves, 10 and 400 tensors, caching on and off --------------------------------


def saves(rank: int, world: int, tmp: str, caching: bool) -> dict:
    storage = LocalStorage(tmp)
    out: dict = {}
    for n in SIZES:
        adapter, model = stepped_adapter(n, caching)
        with recorded_broadcasts() as seen:
            first = adapter.save_shards(storage, f"n{n}-s1")
            cached_first = cached_metadata(adapter)
            second = adapter.save_shards(storage, f"n{n}-s2")  # unchanged: the cached plan
            cached_second = cached_metadata(adapter)
        out[str(n)] = {
            "seen": seen, "files": [sorted(first), sorted(second)],
            "sizes": {name: list(v) for files in (first, second) for name, v in files.items()},
            "params": {k: tensor_digest(v) for k, v in model.state_dict().items()},
            "cached": type(cached_second).__name__, "reused": cached_first is not None
            and cached_first is cached_second}
        with recorded_broadcasts() as plain:  # the control: DCP's own planner and writer
            dcp.save({"model": model.state_dict()}, checkpoint_id=f"{tmp}/n{n}-plain",
                     planner=DefaultSavePlanner())
        out[str(n)]["plain"] = plain
    return out


@pytest.fixture(scope="module", params=[True, False], ids=["caching", "no-caching"])
def saved(request, tmp_path_factory) -> dict:
    tmp = str(tmp_path_factory.mktemp("broadcast"))
    return {"tmp": tmp, "caching": request.param, "outs": run_ranks(saves, WORLD, tmp, request.param)}


@pytest.mark.multiprocess
def test_every_rank_receives_a_small_summary_at_the_end_of_each_save(saved):
    for rank, out in enumerate(saved["outs"]):
        for n in SIZES:
            seen = out[str(n)]["seen"]
            assert len(seen) == 2, (rank, n, seen)  # one end-of-save broadcast per save
            expected = "KeptMetadata" if rank == 0 else "MetadataSummary"
            assert [s["type"] for s in seen] == [expected] * 2, (rank, n)
            assert all(s["bytes"] < SMALL for s in seen), (rank, n, seen)
        # Not growing with the tensors: 40 times the tensors, the same few bytes.
        small, large = ([s["bytes"] for s in out[str(n)]["seen"]] for n in SIZES)
        assert max(large) <= min(small) + 16, (rank, small, large)


@pytest.mark.multiprocess
def test_plain_dcp_broadcasts_the_whole_metadata_which_the_measure_sees(saved):
    for rank, out in enumerate(saved["outs"]):
        [record] = out["400"]["plain"]
        assert record["type"] == "Metadata" and record["bytes"] > 16 * SMALL, (rank, record)


@pytest.mark.multiprocess
def test_second_save_reuses_the_cached_plan_with_caching_on(saved):
    rank0 = saved["outs"][0]
    for n in SIZES:
        if saved["caching"]:
            assert rank0[str(n)]["reused"] and rank0[str(n)]["cached"] == "KeptMetadata"
        else:
            assert not rank0[str(n)]["reused"] and rank0[str(n)]["cached"] == "NoneType"


@pytest.mark.multiprocess
def test_each_rank_lists_the_files_it_wrote_and_rank_0_the_metadata(saved):
    tmp, outs = saved["tmp"], saved["outs"]
    for n in SIZES:
        for save in (0, 1):
            step = f"{tmp}/n{n}-s{save + 1}"
            listed = [out[str(n)]["files"][save] for out in outs]
            assert ".metadata" in listed[0] and not any(".metadata" in f for f in listed[1:])
            for rank, files in enumerate(listed[1:], start=1):
                assert all(f.startswith(f"__{rank}_") for f in files), (rank, files)
            names = [f for files in listed for f in files]
            assert sorted(names) == sorted(os.listdir(step)), step  # each file once, all listed
            for rank, out in enumerate(outs):
                for name in listed[rank]:
                    size, checksum = out[str(n)]["sizes"][name]
                    assert size == os.path.getsize(f"{step}/{name}") and checksum, (rank, name)


@pytest.mark.multiprocess
def test_metadata_on_disk_is_dcps_plain_metadata_with_rank_0s_fields(saved):
    tmp, rank0 = saved["tmp"], saved["outs"][0]
    for n in SIZES:
        for save, record in enumerate(rank0[str(n)]["seen"], start=1):
            step = f"{tmp}/n{n}-s{save}"
            with open(f"{step}/.metadata", "rb") as f:
                data = f.read()
            sizes = {name: os.path.getsize(f"{step}/{name}") for name in os.listdir(step)}
            checked = restricted_load_metadata(data, source=step, file_sizes=sizes)
            assert type(checked) is Metadata
            loaded = pickle.loads(data)
            assert type(loaded) is Metadata and type(loaded.storage_data) is dict
            assert len(loaded.state_dict_metadata) >= 3 * n  # each parameter, its two moments
            # Exactly the plain Metadata with the fields rank 0 kept: pickled again by the
            # standard pickler, the same bytes (the file itself is laid out by dumps_metadata).
            assert hashlib.sha256(pickle.dumps(loaded)).hexdigest() == record["sha256"], step


@pytest.mark.multiprocess
def test_plain_dcp_load_restores_the_tensors_bitwise(saved):
    tmp, rank0 = saved["tmp"], saved["outs"][0]
    for n in SIZES:
        for save in (1, 2):
            model = Many(n)
            for p in model.parameters():
                p.data.zero_()
            state = {"model": model.state_dict()}
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)  # "assuming a single process"
                dcp.load(state, checkpoint_id=f"{tmp}/n{n}-s{save}")
            loaded = {k: tensor_digest(v) for k, v in state["model"].items()}
            assert loaded == rank0[str(n)]["params"], (n, save)


def test_kept_metadata_pickles_small_and_copies_whole():
    import copy

    metadata = KeptMetadata(state_dict_metadata={f"w{i}": None for i in range(1000)}, version="1.0.0")
    summary = pickle.loads(pickle.dumps(metadata))
    assert (type(summary).__name__, summary.items, summary.chunks, summary.version) == (
        "MetadataSummary", 1000, 0, "1.0.0")
    for other in (copy.copy(metadata), copy.deepcopy(metadata)):
        assert type(other) is KeptMetadata and other.state_dict_metadata == metadata.state_dict_metadata
    assert type(plain_metadata(metadata)) is Metadata


# -- through the Coordinator: saves, then a restore ---------------------------------------------


def coordinator_saves_and_restore(rank: int, world: int, tmp: str) -> dict:
    run = f"{tmp}/run"
    with recorded_broadcasts() as seen:
        coord, parts = build(rank, world, run, Setup(every=3))
        coord.restore()
        train(coord, parts, until=6)  # saves 3 and 6 (the second from the cached plan)
        saved = param_digests(parts["model"])
        coord.close()
    coord, parts = build(rank, world, run, Setup(every=3))
    coord.restore()
    coord.close()
    return {"seen": seen, "saved": saved, "restored": coord.restored_from,
            "loaded": param_digests(parts["model"])}


@pytest.mark.multiprocess
def test_coordinator_restore_after_saves_with_small_end_of_save_messages(tmp_path):
    outs = run_ranks(coordinator_saves_and_restore, 2, str(tmp_path))
    for rank, out in enumerate(outs):
        expected = "KeptMetadata" if rank == 0 else "MetadataSummary"
        assert [s["type"] for s in out["seen"]] == [expected] * 2, (rank, out["seen"])
        assert all(s["bytes"] < SMALL for s in out["seen"]), (rank, out["seen"])
        assert out["restored"] == 6 and out["loaded"] == out["saved"], rank
