"""A process's first asynchronous save copies into host buffers made ahead, in the background,
from the first applied update on; what it stages and writes is the state at the save, bit for
bit, whatever the buffers held and however far their making got. Durable writes drop their
pages behind them and keep every byte."""

from __future__ import annotations

import itertools
import mmap
import os
import threading

import pytest
import torch
import xxhash
from resume.adapters.dcp import filesystem
from resume.adapters.torch import shards
from resume.adapters.torch_native import NativeTorchAdapter

from resume import Coordinator
from resume.background import Prepared
from resume.checksum import ALGORITHM

WIDTH = 64
SENTINEL = 7.0
"""What the buffers made ahead hold before a save copies into them: stale, to be overwritten."""


class Batches:
    """An endless stream of batches whose state is its position."""

    def __init__(self) -> None:
        self.pos = 0

    def state_dict(self) -> dict:
        return {"pos": self.pos}

    def load_state_dict(self, s: dict) -> None:
        self.pos = s["pos"]

    def __iter__(self):
        while True:
            g = torch.Generator().manual_seed(self.pos)
            self.pos += 1
            yield {"ids": torch.tensor([self.pos - 1]), "x": torch.randn(4, WIDTH, generator=g)}


def job(run: str, *, every: int = 5, async_save: bool = True, seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.GELU(), torch.nn.Linear(WIDTH, WIDTH))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    adapter = NativeTorchAdapter(model, opt, [], Batches())
    coord = Coordinator(run, adapter, global_batch=4, every=every, async_save=async_save, handle_signals=False)
    return coord, adapter, model, opt


def step(model: torch.nn.Module, opt: torch.optim.Optimizer, batch: dict) -> None:
    model(batch["x"]).square().mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def leaves(tree, path=()):
    """(path, tensor) of every tensor in a tree of dicts and lists."""
    if isinstance(tree, torch.Tensor):
        yield path, tree
    elif isinstance(tree, dict):
        for k, v in tree.items():
            yield from leaves(v, (*path, k))
    elif isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            yield from leaves(v, (*path, i))


def bits(t: torch.Tensor) -> bytes:
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def snapshot(tree) -> dict:
    return {path: (t.dtype, tuple(t.shape), bits(t)) for path, t in leaves(tree)}


def stale_buffers(monkeypatch) -> list:
    """Buffers made ahead recorded as made, each then filled with ``SENTINEL`` (stale values a
    save must overwrite everywhere)."""
    made: list = []
    real = shards.make_buffers
    depth = [0]

    def make(shapes, stop):  # make_buffers recurses through the module's name: only the whole tree
        depth[0] += 1
        try:
            tree = real(shapes, stop)
        finally:
            depth[0] -= 1
        if depth[0] == 0:
            for _, t in leaves(tree):
                t.fill_(SENTINEL)
            made.append(tree)
        return tree
    monkeypatch.setattr(shards, "make_buffers", make)
    return made


def record_staging(monkeypatch, adapter) -> list:
    """Each ``stage_shards``: the live state just before it, and what it staged."""
    calls: list = []
    real = adapter.stage_shards

    def stage():
        live = snapshot(adapter._sharded_state([o for o in adapter.optimizers if o.state]))
        staged = real()
        calls.append((live, staged))
        return staged
    monkeypatch.setattr(adapter, "stage_shards", stage)
    return calls


def test_the_first_async_save_copies_the_state_at_the_save_into_the_buffers_made_ahead(tmp_path, monkeypatch):
    run = str(tmp_path / "run")
    made = stale_buffers(monkeypatch)
    coord, adapter, model, opt = job(run, every=5)
    staging = record_staging(monkeypatch, adapter)
    coord.restore()
    at_save = None
    for batch in coord.batches():
        step(model, opt, batch)
        saved = coord.update(applied=True)
        if coord.iteration == 1:  # the first applied update started the buffers' making
            assert isinstance(adapter._staged_state, Prepared)
            adapter._staged_state._thread.join(30)  # all of them made (the next test takes them in part)
        if saved:
            at_save = {"params": snapshot(dict(model.named_parameters())), "iteration": coord.iteration}
        if coord.iteration == 8:  # training goes on (and changes the state) while the save is written
            break
    coord.close()

    assert len(made) == 1 and len(staging) == 1 and at_save is not None and at_save["iteration"] == 5
    live, staged = staging[0]
    assert snapshot(staged["state"]) == live, "the staged copy is not the state at the save"
    # Every tensor with a buffer made ahead was copied into that buffer (no fresh allocation).
    buffers = {path: t.data_ptr() for path, t in leaves(made[0])}
    used = {path: t.data_ptr() for path, t in leaves(staged["state"]) if path in buffers}
    assert buffers and used == buffers
    assert not any(torch.any(t == SENTINEL) for _, t in leaves(staged["state"]) if t.is_floating_point())

    # What committed is the state at the save: a restart loads it, bit for bit.
    fresh, fresh_adapter, fresh_model, _ = job(run, every=5, seed=1)
    fresh.restore()
    assert fresh.restored_from == 5
    assert snapshot(dict(fresh_model.named_parameters())) == at_save["params"]
    assert snapshot(fresh_adapter._sharded_state(fresh_adapter.optimizers)) == live
    fresh.close()


def test_a_save_while_the_buffers_are_made_takes_those_made_so_far_and_copies_exactly(tmp_path, monkeypatch):
    coord, adapter, model, opt = job(str(tmp_path / "run"), every=100)
    coord.restore()
    batches = coord.batches()
    step(model, opt, next(batches))
    coord.update(applied=True)
    adapter._staged_state.take()  # the buffers made at the first update: replaced below
    shapes = shards.buffer_shapes(adapter._sharded_state(adapter.optimizers))
    started, made = threading.Event(), []

    def slow(stop: threading.Event):
        # The first half of the buffers is made at once, the rest only once stop is seen: a
        # save that comes while they are made gets half of them (as many as were begun).
        partial = {"model": shards.make_buffers(shapes["model"], threading.Event()), "optim": None}
        for _, t in leaves(partial):
            t.fill_(SENTINEL)
        started.set()
        stop.wait()
        made.append(partial)
        return partial
    adapter._staged_state = Prepared.start(slow, name="test-staging")
    assert started.wait(10)
    for _ in range(3):  # the state moves on
        step(model, opt, next(batches))
        coord.update(applied=True)

    live = snapshot(adapter._sharded_state(adapter.optimizers))
    staged = adapter.stage_shards()  # stops the making, waits for it, uses what was made
    assert snapshot(staged["state"]) == live
    assert [t.data_ptr() for _, t in leaves(staged["state"]["model"])] == \
        [t.data_ptr() for _, t in leaves(made[0]["model"])]
    assert not isinstance(adapter._staged_state, Prepared)
    coord.close()


def test_buffers_are_made_once_from_the_first_applied_update_and_only_for_async_saves(tmp_path):
    sync, sync_adapter, model, opt = job(str(tmp_path / "sync"), async_save=False)
    sync.restore()
    for batch in sync.batches():
        step(model, opt, batch)
        sync.update(applied=True)
        if sync.iteration == 3:
            break
    assert sync_adapter._staged_state is None
    sync.close()

    coord, adapter, model, opt = job(str(tmp_path / "async"), every=100)
    coord.restore()
    batches = coord.batches()
    next(batches)
    coord.update(applied=False)  # a skipped update: no optimizer state to shape buffers after yet
    assert adapter._staged_state is None
    step(model, opt, next(batches))
    coord.update(applied=True)
    prepared = adapter._staged_state
    assert isinstance(prepared, Prepared)
    step(model, opt, next(batches))
    coord.update(applied=True)
    assert adapter._staged_state is prepared
    prepared._thread.join(30)  # all of them made before they are taken
    made = prepared.take()
    # One buffer per tensor of the state (model and AdamW's moments and steps), shaped as it.
    state = adapter._sharded_state(adapter.optimizers)
    assert [(p, tuple(t.shape), t.dtype) for p, t in leaves(made)] == \
        [(p, tuple(t.shape), t.dtype) for p, t in leaves(state)]
    coord.close()


def test_making_buffers_stops_between_tensors_and_pages_when_asked():
    shapes = shards.buffer_shapes({"a": torch.ones(3, 5), "b": [torch.ones(0), torch.ones(2, dtype=torch.int64)],
                                   "c": 1.5, "d": torch.ones(4, 4).t()})
    assert shapes["a"] == shards.BufferShape(torch.Size([3, 5]), (5, 1), torch.float32)
    assert shapes["b"][0] is None and shapes["c"] is None and shapes["d"] is None  # empty, scalar, not contiguous
    stopped = threading.Event()
    stopped.set()
    assert shards.make_buffers(shapes, stopped) == {"a": None, "b": [None, None], "c": None, "d": None}
    made = shards.make_buffers(shapes, threading.Event())
    assert made["a"].shape == (3, 5) and made["a"].stride() == (5, 1) and made["b"][1].dtype == torch.int64
    # A buffer of many pages: every page written (here: zeroed) before it is handed over.
    big = torch.full((5 * shards.TOUCH_PAGES * 1024 + 3,), 1, dtype=torch.uint8)
    shards.touch_pages(big, threading.Event())
    assert big[::mmap.PAGESIZE].eq(0).all() and big[-1] == 0


def test_prepared_hands_over_what_was_made_once_and_nothing_after_a_failure():
    prepared = Prepared.start(lambda stop: "made", name="test")
    assert prepared.take() == "made"
    assert prepared.take() is None

    def fail(stop):
        raise MemoryError("no memory for the buffers")
    assert Prepared.start(fail, name="test").take() is None


@pytest.mark.skipif(not filesystem.writeback_supported(), reason="sync_file_range not available")
def test_durable_writes_drop_their_pages_behind_them_and_keep_every_byte(tmp_path, monkeypatch):
    monkeypatch.setattr(filesystem, "WRITEBACK_EVERY", 64 << 10)
    monkeypatch.setattr(filesystem, "BUFFER", 16 << 10)
    dropped: list = []
    real = os.posix_fadvise

    def advise(fd, offset, length, advice):
        if advice == os.POSIX_FADV_DONTNEED:
            dropped.append((offset, length))
        return real(fd, offset, length, advice)
    monkeypatch.setattr(filesystem.os, "posix_fadvise", advise)
    data = os.urandom(1 << 20) + b"tail"
    fs = filesystem.ChecksummingFileSystem(durable=True)
    path = tmp_path / "__0_0.distcp"
    with fs.create_stream(path, "wb") as stream:
        for i in range(0, len(data), 10_000):
            stream.write(data[i:i + 10_000])
    assert path.read_bytes() == data
    assert fs.written[path.name] == (len(data), f"{ALGORITHM}:{xxhash.xxh3_64(data).hexdigest()}")
    # Contiguous ranges from the start, each on disk before its pages were dropped.
    assert dropped and dropped[0][0] == 0
    assert all(a + n == b for (a, n), (b, _) in itertools.pairwise(dropped))
    assert sum(n for _, n in dropped) >= len(data) - 4 * (64 << 10)
