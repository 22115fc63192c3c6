"""The path the user calls, beside plain DCP, in one run, on the same state.

    python benchmarks/save_path.py [--gib 2] [--runs 3] [--pause 3] [--dir DIR] [--json]

State: fp32 ``nn.Linear`` layers whose weights and AdamW moments total ``--gib``, a ``LambdaLR``
warm-up and the library's loader, in one process (``LocalComm``); the loop is the README's.
Each run times, ours and plain alternating first: ``save`` (``Coordinator.save()`` against
``get_state_dict`` + ``dcp.save`` + ``torch.save`` of the small state), ``async stall`` (the
``coord.update()`` that starts a scheduled async save against ``dcp.async_save`` returning),
``restore`` into fresh objects with the page cache dropped (``Coordinator.restore()`` against
``dcp.load`` + ``set_state_dict``), and ``update()`` without a save. After the runs, ``update()``
without a save again, with hang detection on (``HangBounds()``: the watchdog thread running) and
off (``HangBounds(enabled=False)``: no thread), a Coordinator each, alternating on, off, off, on;
then ``update()`` with the update journal on (the default; ``loss``, ``grad_norm`` and ``clipped``
passed as floats) and off (``journal=False``), the same way, each an applied update after a real
optimizer step (not timed) on a small model of the same shape: the record then holds the LR
applied and the batch's ids, as in training (``update()``'s cost does not grow with the model).
Then the first save of a process, ``--runs`` times, ours and plain alternating first: each side in a
fresh process (``python -c``) with fresh objects and three real iterations behind it, the pages of
the directory it writes to dropped, the same ``--pause`` before it: ``Coordinator.save()`` (the
first of the process) against ``plain_save`` (the first ``dcp.save`` of the process), and the
first ``update()`` that starts a scheduled async save against the first ``dcp.async_save``
returning (the plain side's process holds no Coordinator).
Figures are medians over the runs; the last line with ``--json`` is one JSON object:
``save_vs_dcp`` and ``restore_vs_dcp_load`` are plain / ours (higher is faster),
``async_stall_vs_dcp_async`` is ours / DCP's (lower is better), ``update_us`` in microseconds,
``update_us_hang_on`` and ``update_us_hang_off`` the same with hang detection on and off,
``update_hang_on_vs_off`` their ratio, ``update_us_journal_on``, ``update_us_journal_off`` and
``update_journal_on_vs_off`` likewise for the journal, ``per_run`` each run's ratios;
``first_save_vs_dcp`` (plain / ours) and ``first_async_stall_vs_dcp_async`` (ours / DCP's) the
same for a process's first save, from the medians ``seconds`` holds as ``ours_first_save``,
``dcp_first_save``, ``ours_first_async_stall`` and ``dcp_first_async_stall``, ``first_per_run``
each run's.
``--profile N`` adds a cProfile of one more of each. The method in full: docs/performance.md.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import json
import math
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
import warnings

import torch
import torch.distributed.checkpoint as dcp
from bench_common import drop_pages, in_fresh_process, profile_text, quiet, settle, timed, write_proc
from resume.adapters.data import GlobalPositionSampler, StatefulLoader
from resume.adapters.torch_native import NativeTorchAdapter
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from resume import Coordinator, HangBounds
from resume.run import step_dirname

warnings.filterwarnings("ignore", message="torch.distributed is disabled")
LAYERS = 16
GLOBAL_BATCH = 4
SAMPLES = 256
GOALS = {"save_vs_dcp": (">=", 0.95), "async_stall_vs_dcp_async": ("<=", 1.1),
         "restore_vs_dcp_load": (">=", 0.85), "update_us": ("<=", 50.0), "update_us_hang_on": ("<=", 50.0),
         "update_us_journal_on": ("<=", 50.0), "first_save_vs_dcp": (">=", 1.0),
         "first_async_stall_vs_dcp_async": ("<=", 0.5)}
HANG_MODES = {"on": HangBounds(), "off": HangBounds(enabled=False)}
"""Hang detection as ``update_us_hang_*`` times it: explicit both ways (a Coordinator given no
bounds would keep the process watchdog's, the last Coordinator's)."""
JOURNAL_WIDTH = 64
"""Layer width of the model ``update_us_journal_*`` trains: its real optimizer steps come between
the timed calls, and ``update()`` itself does not look at the weights."""


# -- the training state ----------------------------------------------------------------------

def width_for(gib: float) -> int:
    """Layer width whose LAYERS square layers (weight + bias) hold ``gib`` of state at 12 B/param."""
    params = gib * (1 << 30) / 12 / LAYERS
    return max(8, math.isqrt(int(params)))


class Samples:
    """A map dataset of dict samples (what ``StatefulLoader`` collates)."""

    def __init__(self, width: int) -> None:
        g = torch.Generator().manual_seed(7)
        self.x = torch.randn(SAMPLES, width, generator=g)

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int) -> dict:
        return {"x": self.x[i]}


def warmup(step: int) -> float:
    return min(1.0, (step + 1) / 100)


def build(width: int, dataset: Samples, *, seed: int):
    """Model, AdamW, LambdaLR and loader: the same construction for the live and fresh sides."""
    torch.manual_seed(seed)
    layers: list[torch.nn.Module] = []
    for i in range(LAYERS):
        layers.append(torch.nn.Linear(width, width))
        if i < LAYERS - 1:
            layers.append(torch.nn.GELU())
    model = torch.nn.Sequential(*layers)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(optim, warmup)
    loader = StatefulLoader(dataset, GlobalPositionSampler(len(dataset), GLOBAL_BATCH, seed=3))
    return model, optim, sched, loader


def state_bytes(model: torch.nn.Module, optim: torch.optim.Optimizer) -> int:
    n = sum(p.numel() * p.element_size() for p in model.parameters())
    for s in optim.state.values():
        n += sum(v.numel() * v.element_size() for k, v in s.items() if k != "step")
    return n


def probe(model: torch.nn.Module, optim: torch.optim.Optimizer) -> tuple[torch.Tensor, torch.Tensor]:
    """Copies of the first weight and the last layer's exp_avg_sq: a restore must reproduce them."""
    params = list(model.parameters())
    return params[0].detach().clone(), optim.state[params[-2]]["exp_avg_sq"].clone()


def same(a: tuple[torch.Tensor, torch.Tensor], b: tuple[torch.Tensor, torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b))


class Training:
    """The live loop: model, optimizer, scheduler, loader, adapter and Coordinator."""

    def __init__(self, width: int, dataset: Samples, run_dir: str, every: int, *,
                 hang: HangBounds | None = None, journal: bool = True) -> None:
        self.model, self.optim, self.sched, self.loader = build(width, dataset, seed=0)
        self.adapter = NativeTorchAdapter(self.model, [self.optim], [self.sched], self.loader)
        self.coord = Coordinator(run_dir, self.adapter, global_batch=GLOBAL_BATCH, every=every,
                                 keep=1000, async_save=True, handle_signals=False, hang=hang,
                                 journal=journal)
        self.coord.restore()  # a fresh start
        self.batches = self.coord.batches()
        self.every = every

    def step(self, *, clip: bool = False) -> tuple[float, float]:
        """One real iteration, up to (not including) update(): the loss and, with ``clip``
        (gradients clipped to norm 1, as the README's loop does), the norm before clipping."""
        batch = next(self.batches)
        loss = self.model(batch["x"]).pow(2).mean()
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0).item() if clip else 0.0
        self.optim.step()
        self.sched.step()
        self.optim.zero_grad(set_to_none=True)
        return loss.item(), grad_norm

    def train(self) -> None:
        """A real iteration with its update(), never one that saves."""
        if (self.coord.iteration + 1) % self.every == 0:
            next(self.batches)
            assert not self.coord.update(applied=False)
        self.step()
        assert not self.coord.update(applied=True), "an iteration meant not to save saved"

    def skip_to_due(self, sink: list[float]) -> None:
        """Skipped iterations up to the one before a scheduled save, each update() timed."""
        clock = time.perf_counter
        while (self.coord.iteration + 1) % self.every:
            next(self.batches)
            started = clock()
            saved = self.coord.update(applied=False)
            sink.append(clock() - started)
            assert not saved, "update() saved at an iteration that is not due"

    def train_to_due(self, sink: list[float]) -> None:
        """Applied iterations up to the one before a scheduled save, each update() timed with
        the loss, gradient norm and clipped passed (what the journal records)."""
        clock = time.perf_counter
        while (self.coord.iteration + 1) % self.every:
            loss, grad_norm = self.step(clip=True)
            started = clock()
            saved = self.coord.update(applied=True, loss=loss, grad_norm=grad_norm, clipped=grad_norm > 1.0)
            sink.append(clock() - started)
            assert not saved, "update() saved at an iteration that is not due"


# -- helpers ---------------------------------------------------------------------------------

class PageCache:
    """Drops the page cache before a restore: all of it when permitted, else one directory's."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        if mode == "auto":
            self.mode = "proc" if self._proc() else "fadvise"
            if self.mode == "fadvise":
                print("note: /proc/sys/vm/drop_caches not writable; dropping the checkpoint's own pages "
                      "with posix_fadvise(DONTNEED) instead", file=sys.stderr)

    @staticmethod
    def _proc() -> bool:
        os.sync()
        return write_proc("/proc/sys/vm/drop_caches", "3\n")

    def drop(self, directory: str) -> None:
        if self.mode == "proc" and self._proc():
            return
        drop_pages(directory)


def fresh_dir(root: str, name: str) -> str:
    path = os.path.join(root, name)
    shutil.rmtree(path, ignore_errors=True)
    os.makedirs(path)
    return path


# -- the plain tool, as a user would call it ---------------------------------------------------

def plain_save(t: Training | PlainLoop, directory: str) -> None:
    model_sd, optim_sd = get_state_dict(t.model, t.optim)
    with quiet():
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=directory)
    torch.save({"scheduler": t.sched.state_dict(), "loader": t.loader.state_dict()},
               os.path.join(directory, "extra.pt"))


def plain_async_save(t: Training | PlainLoop, directory: str):
    model_sd, optim_sd = get_state_dict(t.model, t.optim)
    with quiet():
        future = dcp.async_save({"model": model_sd, "optim": optim_sd}, checkpoint_id=directory)
    torch.save({"scheduler": t.sched.state_dict(), "loader": t.loader.state_dict()},
               os.path.join(directory, "extra.pt"))
    return future


def plain_load(model, optim, sched, loader, directory: str) -> None:
    model_sd, optim_sd = get_state_dict(model, optim)  # creates AdamW's state to load into
    state = {"model": model_sd, "optim": optim_sd}
    with quiet():
        dcp.load(state, checkpoint_id=directory)
    set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
    extra = torch.load(os.path.join(directory, "extra.pt"), weights_only=True)
    sched.load_state_dict(extra["scheduler"])
    loader.load_state_dict(extra["loader"])


# -- one run -----------------------------------------------------------------------------------

def run_once(t: Training, width: int, dataset: Samples, root: str, run_dir: str, cache: PageCache, *,
             index: int, pause: float, update_s: list[float]) -> dict[str, float]:
    out: dict[str, float] = {}
    order = ("ours", "plain") if index % 2 == 0 else ("plain", "ours")

    # Synchronous save.
    for side in order:
        settle(pause)
        if side == "ours":
            t.train()
            out["ours_save"] = timed(t.coord.save)
            assert t.coord.last_committed_step == t.coord.iteration
        else:
            d = fresh_dir(root, "dcp_sync")
            out["dcp_save"] = timed(lambda d=d: plain_save(t, d))
            shutil.rmtree(d)

    # Asynchronous save: what the loop is blocked for; the write is waited for outside.
    expected: dict[str, tuple] = {}
    plain_dir = fresh_dir(root, "dcp_async")
    for side in order:
        settle(pause)
        if side == "ours":
            t.skip_to_due(update_s)
            t.step()
            started = time.perf_counter()
            saved = t.coord.update(applied=True)
            out["ours_async_stall"] = time.perf_counter() - started
            assert saved and t.coord.iteration % t.every == 0
            t.coord.maybe_wait_for_save()
            out["ours_async_total"] = time.perf_counter() - started
            assert t.coord.last_committed_step == t.coord.iteration
            expected["ours"] = probe(t.model, t.optim)
            ours_iteration = t.coord.iteration
        else:
            t.train()  # the state moves on, as between two saves of a real loop
            shutil.rmtree(plain_dir)
            os.makedirs(plain_dir)
            started = time.perf_counter()
            future = plain_async_save(t, plain_dir)
            out["dcp_async_stall"] = time.perf_counter() - started
            future.result()
            out["dcp_async_total"] = time.perf_counter() - started
            expected["plain"] = probe(t.model, t.optim)
            del future
    gc.collect()

    # Restore into fresh objects, pages dropped first; construction is not timed.
    for side in order:
        model, optim, sched, loader = build(width, dataset, seed=1 + index)
        if side == "ours":
            adapter = NativeTorchAdapter(model, [optim], [sched], loader)
            # No lease: the live Coordinator of this process holds it (a second one of the same
            # job would take it over); the lease is taken at construction, not in restore().
            started = time.perf_counter()
            coord = Coordinator(run_dir, adapter, global_batch=GLOBAL_BATCH, every=t.every, keep=1000,
                                handle_signals=False, lease_ttl_s=None)
            out["ours_coordinator_init"] = time.perf_counter() - started
            cache.drop(run_dir)
            out["ours_restore"] = timed(coord.restore)
            assert coord.restored_from == ours_iteration, (coord.restored_from, ours_iteration)
            assert same(probe(model, optim), expected["ours"]), "our restore did not reproduce the state"
            coord.close()
            del coord, adapter
        else:
            cache.drop(plain_dir)
            out["dcp_load"] = timed(lambda objs=(model, optim, sched, loader): plain_load(*objs, plain_dir))
            assert same(probe(model, optim), expected["plain"]), "the plain load did not reproduce the state"
        del model, optim, sched, loader
        gc.collect()
    shutil.rmtree(plain_dir)

    # Keep the newest checkpoint only (outside every timed region; retention never runs here).
    committed = t.coord.last_committed_step
    for name in os.listdir(run_dir):
        if name.startswith("step-") and name != step_dirname(committed):
            shutil.rmtree(os.path.join(run_dir, name), ignore_errors=True)
    return out


def profile(t: Training, width: int, dataset: Samples, run_dir: str, cache: PageCache, top: int,
            pause: float) -> None:
    """cProfile of one more save(), async stall and restore(): top functions by cumulative time."""
    def show(title: str, prof: cProfile.Profile) -> None:
        roots = [os.path.dirname(os.path.dirname(torch.__file__)), os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]
        print(f"--- profile: {title} (top {top} by cumulative time)\n{profile_text(prof, top, 'cumulative', roots)}\n")

    settle(pause)
    t.train()
    prof = cProfile.Profile()
    prof.runcall(t.coord.save)
    show("Coordinator.save()", prof)

    settle(pause)
    t.skip_to_due([])
    t.step()
    prof = cProfile.Profile()
    assert prof.runcall(t.coord.update, applied=True)
    t.coord.maybe_wait_for_save()
    show("update() that starts an async save (the stall)", prof)

    model, optim, sched, loader = build(width, dataset, seed=99)
    coord = Coordinator(run_dir, NativeTorchAdapter(model, [optim], [sched], loader), global_batch=GLOBAL_BATCH,
                        every=t.every, keep=1000, handle_signals=False, lease_ttl_s=None)
    cache.drop(run_dir)
    prof = cProfile.Profile()
    prof.runcall(coord.restore)
    coord.close()
    show("Coordinator.restore() (verify_on_restore=True, pages dropped)", prof)


def time_update_by_hang_mode(width: int, dataset: Samples, root: str, every: int, pairs: int) -> dict[str, list[float]]:
    """``update()`` without a save, each call timed, with hang detection on and off: a fresh
    Coordinator (its own run) for each, ``pairs`` times in the order on, off, off, on."""
    times: dict[str, list[float]] = {mode: [] for mode in HANG_MODES}
    for i, mode in enumerate(["on", "off", "off", "on"] * pairs):
        t = Training(width, dataset, fresh_dir(root, f"hang-{mode}-{i}"), every, hang=HANG_MODES[mode])
        watched = t.coord.watchdog._thread is not None
        assert watched == (mode == "on"), f"hang detection {mode}: watchdog thread running: {watched}"
        t.skip_to_due(times[mode])
        t.coord.close()
        del t
        gc.collect()
    return times


def hang_figures(times: dict[str, list[float]]) -> dict[str, float]:
    on, off = statistics.fmean(times["on"]) * 1e6, statistics.fmean(times["off"]) * 1e6
    return {"update_us_hang_on": on, "update_us_hang_off": off, "update_hang_on_vs_off": on / off,
            "update_us_hang_on_median": statistics.median(times["on"]) * 1e6,
            "update_us_hang_off_median": statistics.median(times["off"]) * 1e6}


def time_update_by_journal(root: str, every: int, pairs: int) -> dict[str, list[float]]:
    """``update()`` without a save, each call timed, with the update journal on (the default)
    and off (``journal=False``): a fresh Coordinator (its own run) for each, ``pairs`` times in
    the order on, off, off, on; applied updates after real steps of a ``JOURNAL_WIDTH`` model."""
    dataset = Samples(JOURNAL_WIDTH)
    times: dict[str, list[float]] = {"on": [], "off": []}
    # One thread: a model this small gains nothing from more, and their spin-waits after each step
    # would land in the timed calls (on a loaded 2-core machine, most of them).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for i, mode in enumerate(["on", "off", "off", "on"] * pairs):
            t = Training(JOURNAL_WIDTH, dataset, fresh_dir(root, f"journal-{mode}-{i}"), every,
                         journal=mode == "on")
            kept = t.coord.journal is not None
            assert kept == (mode == "on"), f"journal {mode}: journal kept: {kept}"
            t.train_to_due(times[mode])
            t.coord.close()
            del t
            gc.collect()
    finally:
        torch.set_num_threads(threads)
    return times


def journal_figures(times: dict[str, list[float]]) -> dict[str, float]:
    on, off = statistics.fmean(times["on"]) * 1e6, statistics.fmean(times["off"]) * 1e6
    return {"update_us_journal_on": on, "update_us_journal_off": off, "update_journal_on_vs_off": on / off,
            "update_us_journal_on_median": statistics.median(times["on"]) * 1e6,
            "update_us_journal_off_median": statistics.median(times["off"]) * 1e6}


# -- the first save of a process ---------------------------------------------------------------

FIRST_KINDS = {"save": "first_save", "async": "first_async_stall"}
"""The first-save measurements, each side in a process of its own: kind -> its key's stem."""
FIRST_STEPS = 3
"""Real iterations before a first save, on both sides: AdamW's moments exist and have moved."""


class PlainLoop:
    """The plain side's objects and loop, without a Coordinator (what ``plain_save`` reads)."""

    def __init__(self, width: int, dataset: Samples) -> None:
        self.model, self.optim, self.sched, self.loader = build(width, dataset, seed=0)
        self.batches = iter(self.loader)

    def step(self) -> None:
        batch = next(self.batches)
        self.model(batch["x"]).pow(2).mean().backward()
        self.optim.step()
        self.sched.step()
        self.optim.zero_grad(set_to_none=True)


def first_save(side: str, kind: str, gib: float, directory: str, drop: str, pause: float, every: int) -> float:
    """In a fresh process: build the objects, take ``FIRST_STEPS`` real iterations, drop the pages
    of ``directory`` and time this process's first save (``kind`` "save") or the first async save's
    stall (``kind`` "async") of ``side`` ("ours", "plain"). The write is waited for outside."""
    logging_quiet()
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    width = width_for(gib)
    dataset = Samples(width)
    cache = PageCache(drop)
    if side == "plain":
        loop = PlainLoop(width, dataset)
        for _ in range(FIRST_STEPS):
            loop.step()
        target = fresh_dir(directory, "dcp")
        cache.drop(directory)
        settle(pause)
        if kind == "save":
            return timed(lambda: plain_save(loop, target))
        started = time.perf_counter()
        future = plain_async_save(loop, target)
        stall = time.perf_counter() - started
        future.result()
        return stall
    t = Training(width, dataset, os.path.join(directory, "run"), every)
    for _ in range(FIRST_STEPS - 1):
        t.train()
    if kind == "save":
        t.train()
        cache.drop(directory)
        settle(pause)
        seconds = timed(t.coord.save)
    else:
        t.skip_to_due([])
        cache.drop(directory)
        settle(pause)
        t.step()
        started = time.perf_counter()
        assert t.coord.update(applied=True), "the first async save was not started"
        seconds = time.perf_counter() - started
    t.coord.close()
    assert t.coord.last_committed_step == t.coord.iteration
    return seconds


def first_save_in_child(side: str, kind: str, gib: float, directory: str, drop: str, pause: float,
                        every: int) -> float:
    """``first_save`` in a fresh Python process (nothing imported, allocated or planned before)."""
    call = f"print(save_path.first_save({side!r}, {kind!r}, {gib!r}, {directory!r}, {drop!r}, {pause!r}, {every!r}))"
    return float(in_fresh_process("save_path", call, f"first {kind} of {side}"))


def time_first_saves(gib: float, root: str, runs: int, drop: str, pause: float, every: int) -> list[dict[str, float]]:
    """Each run: the first save, then the first async stall, ours and plain alternating first
    (ours first in even runs), each in a fresh process writing to a fresh directory."""
    out = []
    for i in range(runs):
        order = ("ours", "plain") if i % 2 == 0 else ("plain", "ours")
        run: dict[str, float] = {}
        for kind, stem in FIRST_KINDS.items():
            for side in order:
                directory = fresh_dir(root, "first")
                run[f"{'ours' if side == 'ours' else 'dcp'}_{stem}"] = first_save_in_child(
                    side, kind, gib, directory, drop, pause, every)
                shutil.rmtree(directory)
        out.append(run)
    return out


def first_ratios(t: dict[str, float]) -> dict[str, float]:
    """Plain / ours for the first save (higher: ours faster); ours / DCP for the first stall."""
    return {"first_save_vs_dcp": t["dcp_first_save"] / t["ours_first_save"],
            "first_async_stall_vs_dcp_async": t["ours_first_async_stall"] / t["dcp_first_async_stall"]}


# -- main --------------------------------------------------------------------------------------

def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gib", type=float, default=2.0, help="state size in GiB (default 2)")
    parser.add_argument("--runs", type=int, default=3, help="runs; medians are reported (default 3)")
    parser.add_argument("--dir", default=None, help="where to write (default: a temp dir under /tmp)")
    parser.add_argument("--json", action="store_true", help="end with one JSON line of the results")
    parser.add_argument("--pause", type=float, default=3.0,
                        help="seconds to let the disk drain before each write (default 3)")
    parser.add_argument("--every", type=int, default=1000,
                        help="the async Coordinator's save interval: every-1 timed update() calls per run")
    parser.add_argument("--drop", choices=("auto", "proc", "fadvise"), default="auto",
                        help="how the page cache is dropped before a restore (default: proc when permitted)")
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="also cProfile one save, async stall and restore of ours: top N functions")
    args = parser.parse_args()
    if args.runs < 1:
        parser.error("--runs: expected >= 1")
    if args.every < 2:
        parser.error("--every: expected >= 2")
    logging_quiet()
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    cache = PageCache(args.drop)
    width = width_for(args.gib)
    dataset = Samples(width)
    root = tempfile.mkdtemp(prefix="resume-savepath-", dir=args.dir)
    run_dir = os.path.join(root, "run")
    started = time.perf_counter()
    load_start = os.getloadavg()
    update_s: list[float] = []
    try:
        t = Training(width, dataset, run_dir, args.every)
        for _ in range(2):  # real AdamW steps: the moments exist and have moved
            t.train()
        size = state_bytes(t.model, t.optim)
        print(f"state {size / (1 << 30):.3f} GiB: {LAYERS} x Linear({width}, {width}) fp32 + AdamW moments; "
              f"page cache dropped by {cache.mode}", file=sys.stderr, flush=True)
        runs = []
        for i in range(args.runs):
            runs.append(run_once(t, width, dataset, root, run_dir, cache, index=i, pause=args.pause,
                                 update_s=update_s))
            print(f"run {i + 1}/{args.runs}: " + ", ".join(f"{k} {v:.3f}s" for k, v in runs[-1].items()),
                  file=sys.stderr, flush=True)
        if args.profile:
            profile(t, width, dataset, run_dir, cache, args.profile, args.pause)
        t.coord.close()
        del t
        gc.collect()
        by_hang = time_update_by_hang_mode(width, dataset, root, args.every, pairs=max(1, args.runs // 2))
        by_journal = time_update_by_journal(root, args.every, pairs=max(1, args.runs // 2))
        firsts = time_first_saves(args.gib, root, args.runs, cache.mode, args.pause, args.every)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    elapsed = time.perf_counter() - started

    med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    first_med = {k: statistics.median(r[k] for r in firsts) for k in firsts[0]}
    med.update(first_med)
    update_us = statistics.fmean(update_s) * 1e6
    hang = hang_figures(by_hang)
    journal = journal_figures(by_journal)
    ratios = {**pair_ratios(med), "update_us": update_us, "update_us_hang_on": hang["update_us_hang_on"],
              **first_ratios(first_med)}
    # Per run, with which side went first: on a virtual disk the position in a pair can matter
    # as much as the tool, and only an even number of runs gives each side each position equally.
    per_run = [{"ours_first": i % 2 == 0, **{k: round(v, 3) for k, v in pair_ratios(r).items()}}
               for i, r in enumerate(runs)]
    first_per_run = [{"ours_first": i % 2 == 0, **{k: round(v, 3) for k, v in first_ratios(r).items()}}
                     for i, r in enumerate(firsts)]
    met = {k: (v >= GOALS[k][1] if GOALS[k][0] == ">=" else v <= GOALS[k][1]) for k, v in ratios.items()}
    machine = {"cores": os.cpu_count(), "torch": torch.__version__, "python": platform.python_version(),
               "platform": platform.platform(), "page_cache_drop": cache.mode,
               "loadavg_start": load_start, "loadavg_end": os.getloadavg()}

    print(f"state {size / (1 << 30):.3f} GiB, {len(runs)} runs (medians), {os.cpu_count()} cores, "
          f"torch {torch.__version__}, {elapsed:.0f} s, load average {load_start[0]:.2f} at the start, "
          f"{machine['loadavg_end'][0]:.2f} at the end")
    rows = [("Coordinator.save()", "ours_save"), ("plain dcp.save (sync_files=True)", "dcp_save"),
            ("update() starting an async save (stall)", "ours_async_stall"),
            ("dcp.async_save blocking", "dcp_async_stall"),
            ("  ours: stall + background write + commit", "ours_async_total"),
            ("  dcp: blocking + .result()", "dcp_async_total"),
            ("Coordinator.restore() (verify on)", "ours_restore"),
            ("plain get_state_dict + dcp.load + set_state_dict", "dcp_load"),
            ("  ours: Coordinator() built before restore (not in its time)", "ours_coordinator_init")]
    print("| measurement | seconds |\n|---|---:|")
    for label, key in rows:
        print(f"| {label} | {med[key]:.3f} |")
    print(f"\nupdate() without a save: {update_us:.1f} µs mean, {statistics.median(update_s) * 1e6:.1f} µs median "
          f"over {len(update_s)} calls")
    print_hang_table(hang, len(by_hang["on"]))
    print_journal_table(journal, len(by_journal["on"]))
    print_first_table(first_med, first_per_run)
    print("\n| ratio | value | goal |\n|---|---:|---|")
    for k, v in ratios.items():
        op, goal = GOALS[k]
        print(f"| `{k}` | {v:.2f} | {'≥' if op == '>=' else '≤'} {goal:g} {'(met)' if met[k] else '(NOT met)'} |")
    print("\n| run | first | save_vs_dcp | async_stall_vs_dcp_async | restore_vs_dcp_load |\n|---|---|---:|---:|---:|")
    for i, r in enumerate(per_run):
        print(f"| {i + 1} | {'ours' if r['ours_first'] else 'plain'} | {r['save_vs_dcp']:.2f} | "
              f"{r['async_stall_vs_dcp_async']:.2f} | {r['restore_vs_dcp_load']:.2f} |")
    if len(runs) % 2:
        print(f"note: {len(runs)} runs: ours went first in {(len(runs) + 1) // 2} of them; an even --runs "
              "balances the order")
    if args.json:
        print(json.dumps({**ratios, "gib": size / (1 << 30), "runs": len(runs), "seconds": med,
                          "update_us_median": statistics.median(update_s) * 1e6,
                          "update_calls": len(update_s), **{k: v for k, v in hang.items() if k not in ratios},
                          "update_hang_calls": len(by_hang["on"]), **journal,
                          "update_journal_calls": len(by_journal["on"]), "goals_met": met, "machine": machine,
                          "per_run": per_run, "first_per_run": first_per_run, "pause_s": args.pause,
                          "elapsed_s": elapsed}))


def print_hang_table(hang: dict[str, float], calls: int) -> None:
    """``update()`` without a save, hang detection on and off, beside the budget."""
    budget = GOALS["update_us_hang_on"][1]
    met = "met" if hang["update_us_hang_on"] <= budget else "NOT met"
    print(f"\n| update() without a save, {calls} calls each | hang detection on (default) | off | on / off | budget |"
          "\n|---|---:|---:|---:|---|")
    print(f"| mean | {hang['update_us_hang_on']:.1f} µs | {hang['update_us_hang_off']:.1f} µs | "
          f"{hang['update_hang_on_vs_off']:.2f} | ≤ {budget:g} µs ({met}) |")
    print(f"| median | {hang['update_us_hang_on_median']:.1f} µs | {hang['update_us_hang_off_median']:.1f} µs | "
          f"{hang['update_us_hang_on_median'] / hang['update_us_hang_off_median']:.2f} | |")


def print_journal_table(journal: dict[str, float], calls: int) -> None:
    """``update()`` without a save (applied, loss, gradient norm and clipped passed), the update
    journal on and off, beside the budget."""
    budget = GOALS["update_us_journal_on"][1]
    met = "met" if journal["update_us_journal_on"] <= budget else "NOT met"
    print(f"\n| update() without a save, {calls} calls each | journal on (default) | off | on / off | budget |"
          "\n|---|---:|---:|---:|---|")
    print(f"| mean | {journal['update_us_journal_on']:.1f} µs | {journal['update_us_journal_off']:.1f} µs | "
          f"{journal['update_journal_on_vs_off']:.2f} | ≤ {budget:g} µs ({met}) |")
    print(f"| median | {journal['update_us_journal_on_median']:.1f} µs | "
          f"{journal['update_us_journal_off_median']:.1f} µs | "
          f"{journal['update_us_journal_on_median'] / journal['update_us_journal_off_median']:.2f} | |")


def print_first_table(med: dict[str, float], per_run: list[dict]) -> None:
    """A process's first save and first async stall, ours and plain, each in a fresh process."""
    print(f"\n| first of a process, fresh process each, median of {len(per_run)} | ours | plain DCP |"
          "\n|---|---:|---:|")
    print(f"| save (Coordinator.save() / plain_save) | {med['ours_first_save']:.3f} s | {med['dcp_first_save']:.3f} s |")
    print(f"| async stall (update() / dcp.async_save returning) | {med['ours_first_async_stall']:.3f} s | "
          f"{med['dcp_first_async_stall']:.3f} s |")
    print("\n| run | first | first_save_vs_dcp | first_async_stall_vs_dcp_async |\n|---|---|---:|---:|")
    for i, r in enumerate(per_run):
        print(f"| {i + 1} | {'ours' if r['ours_first'] else 'plain'} | {r['first_save_vs_dcp']:.2f} | "
              f"{r['first_async_stall_vs_dcp_async']:.2f} |")


def pair_ratios(t: dict[str, float]) -> dict[str, float]:
    """Plain / ours for the save and the restore (higher: ours faster); ours / DCP for the stall."""
    return {"save_vs_dcp": t["dcp_save"] / t["ours_save"],
            "async_stall_vs_dcp_async": t["ours_async_stall"] / t["dcp_async_stall"],
            "restore_vs_dcp_load": t["dcp_load"] / t["ours_restore"]}


def logging_quiet() -> None:
    """The library logs each commit and restore at INFO; a benchmark prints its own lines."""
    import logging

    logging.getLogger("resume").setLevel(logging.WARNING)


if __name__ == "__main__":
    main()
