"""Checkpoint storage speed against the disk's own limits and plain DCP, in one run.

    python benchmarks/storage.py [--gib 2] [--runs 3] [--dir DIR] [--json]

State: bf16 weights plus fp32 AdamW moments after real AdamW steps (10 bytes per
parameter), in 64 tensors. Each run measures, in this order:

- ``dd``: ``dd conv=fdatasync`` writing the same number of bytes (the disk's write limit);
- ``read``: a cold ``dd`` read of the files of our checkpoint (pages dropped first): the read
  limit for exactly those bytes; reads, cold loads and verifies alternate twice and each
  keeps its faster time, so a host caching the virtual disk favours none of them;
- ``torch.save``: one file, then fsync;
- ``dcp``: torch.distributed.checkpoint's FileSystemWriter with ``sync_files=True``;
- ``durable``: ours (adapters/dcp/filesystem.py: checksums while writing, early writeback, fdatasync,
  directory fsync), as the native adapter saves;
- ``durable_nosum``: the same without the checksums (for the checksum overhead);
- ``durable_zstd``: ours with zstandard on every item (and the bytes it wrote);
- ``stall``: what an asynchronous save blocks the loop for (the staging copy);
- ``hash``: xxh3 over the same bytes in memory (what checksumming adds to the writer);
- ``cold_load`` / ``warm_load``: our safe reader into preallocated tensors, pages dropped / cached;
- ``verify``: ``resume verify --deep``'s checksum pass over the files, pages dropped.

Figures are medians over the runs; ratios compare medians of the same run. The last
line with ``--json`` is one JSON object with the ratios (``*_vs_*``: higher is faster for
throughputs; ``async_stall_vs_durable`` and ``checksum_overhead``: lower is better).
Keep the machine otherwise idle: on a virtual disk whose host caches writes, a save
that follows another pays for its flush (``--pause`` lets it drain).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import warnings

import torch
import torch.distributed.checkpoint as dcp
import xxhash
from bench_common import drop_pages, quiet, settle, timed
from resume.adapters.dcp import filesystem as dcp_io
from resume.adapters.dcp.reader import SafeLoadPlanner
from resume.adapters.torch.shards import copy_tree

from resume.checksum import checksum_file
from resume.storage import LocalStorage

warnings.filterwarnings("ignore", message="torch.distributed is disabled")
TENSORS = 64


def realistic_state(gib: float) -> dict[str, torch.Tensor]:
    """bf16 weights and fp32 exp_avg/exp_avg_sq after two real AdamW steps."""
    per_param = 2 + 4 + 4
    total = int(gib * (1 << 30) / per_param)
    sizes = [total // TENSORS] * TENSORS
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(n) * 0.02) for n in sizes]
    opt = torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1)
    for _ in range(2):
        for p in params:
            p.grad = torch.randn_like(p) * 1e-3
        opt.step()
    state: dict[str, torch.Tensor] = {}
    for i, p in enumerate(params):
        state[f"model.layer{i}.weight"] = p.detach().to(torch.bfloat16)
        state[f"optim.state.layer{i}.exp_avg"] = opt.state[p]["exp_avg"]
        state[f"optim.state.layer{i}.exp_avg_sq"] = opt.state[p]["exp_avg_sq"]
    return state


def nbytes(state: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def run_once(state: dict[str, torch.Tensor], size: int, root: str, *, index: int, pause: float) -> dict[str, float]:
    t: dict[str, float] = {}
    fresh = lambda name: (shutil.rmtree(os.path.join(root, name), ignore_errors=True),
                          os.makedirs(os.path.join(root, name)))[1] or os.path.join(root, name)

    # The disk's limits.
    settle(pause)
    d = fresh("dd")
    block = 16 << 20
    t["dd"] = timed(lambda: subprocess.run(
        ["dd", "if=/dev/zero", f"of={d}/file", f"bs={block}", f"count={size // block}", "conv=fdatasync"],
        check=True, capture_output=True))
    shutil.rmtree(d)
    settle(pause)

    d = fresh("torchsave")

    def torch_save() -> None:
        with open(f"{d}/state.pt", "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
    t["torch.save"] = timed(torch_save)
    shutil.rmtree(d)
    settle(pause)

    d = fresh("dcp")
    with quiet():
        t["dcp"] = timed(lambda: dcp.save(state, storage_writer=dcp.FileSystemWriter(d, sync_files=True),
                                          no_dist=True))
    shutil.rmtree(d)
    settle(pause)

    storage = LocalStorage(root)
    variants = [("durable_nosum", False), ("durable", True)]
    for name, checksum in variants if index % 2 else reversed(variants):  # neither always goes first
        fresh(name)

        def ours(name: str = name, checksum: bool = checksum) -> None:
            writer = dcp_io.make_writer(storage, name, durable=True)
            writer.fs.checksum = checksum
            with quiet(), dcp_io.without_torch_crc32():
                dcp.save(state, storage_writer=writer, no_dist=True)
            storage.sync_dir(name)  # what the commit does before the manifest
        t[name] = timed(ours)
        settle(pause)
    shutil.rmtree(os.path.join(root, "durable_nosum"))

    fresh("zstd")

    def compressed() -> None:
        writer = dcp_io.make_writer(storage, "zstd", durable=True, compression="zstd")
        with quiet(), dcp_io.without_torch_crc32():
            dcp.save(state, storage_writer=writer, no_dist=True)
        storage.sync_dir("zstd")
    t["durable_zstd"] = timed(compressed)
    zdir = os.path.join(root, "zstd")
    t["zstd_bytes"] = sum(os.path.getsize(os.path.join(zdir, f)) for f in os.listdir(zdir))
    shutil.rmtree(zdir)
    settle(pause)

    t["stall"] = timed(lambda: copy_tree(state))
    # What checksumming adds to a save: the xxh3 pass over the same bytes, inline in the writer.
    hasher = xxhash.xxh3_64()
    t["hash"] = timed(lambda: [hasher.update(memoryview(v.view(torch.uint8).reshape(-1).numpy()))
                               for v in state.values()])

    target = {k: torch.empty_like(v) for k, v in state.items()}

    def load() -> None:
        with quiet():
            dcp.load(target, storage_reader=dcp_io.make_reader(storage, "durable"), planner=SafeLoadPlanner(),
                     no_dist=True)
    durable_dir = os.path.join(root, "durable")

    def read_files() -> None:  # the read limit, on the very files the load reads
        for f in sorted(os.listdir(durable_dir)):
            subprocess.run(["dd", f"if={durable_dir}/{f}", "of=/dev/null", f"bs={block}"], check=True,
                           capture_output=True)
    # Reads, loads and verifies alternate, twice each, pages dropped before every one, and
    # each keeps its faster time: a host that caches the virtual disk favours none of them.
    files = sorted(os.listdir(durable_dir))
    reads, loads, verifies = [], [], []
    for _ in range(2):
        for sink, fn in ((reads, read_files), (loads, load),
                         (verifies, lambda: [checksum_file(storage, f"durable/{f}") for f in files])):
            drop_pages(durable_dir)
            sink.append(timed(fn))
    assert all(torch.equal(target[k], state[k]) for k in state), "loaded state differs"
    t["read"], t["cold_load"], t["verify"] = min(reads), min(loads), min(verifies)
    t["warm_load"] = timed(load)
    shutil.rmtree(os.path.join(root, "durable"))
    return t


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gib", type=float, default=2.0, help="state size in GiB (default 2)")
    parser.add_argument("--runs", type=int, default=3, help="runs; medians are reported (default 3)")
    parser.add_argument("--dir", default=None, help="where to write (default: a temp dir under /tmp)")
    parser.add_argument("--json", action="store_true", help="end with one JSON line of the ratios")
    parser.add_argument("--pause", type=float, default=3.0,
                        help="seconds to let the disk drain between write measurements (default 3)")
    args = parser.parse_args()
    if args.runs < 1:
        parser.error("--runs: expected >= 1")
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    state = realistic_state(args.gib)
    size = nbytes(state)
    root = tempfile.mkdtemp(prefix="resume-bench-", dir=args.dir)
    try:
        runs = []
        for i in range(args.runs):
            runs.append(run_once(state, size, root, index=i, pause=args.pause))
            print(f"run {i + 1}/{args.runs}: " + ", ".join(f"{k} {v:.2f}s" for k, v in runs[-1].items()),
                  file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    zstd_bytes = med.pop("zstd_bytes")
    mib_s = {k: size / v / (1 << 20) for k, v in med.items()}
    ratios = {
        "durable_save_vs_dd": med["dd"] / med["durable"],
        "durable_save_vs_dcp": med["dcp"] / med["durable"],
        "durable_save_vs_torch_save": med["torch.save"] / med["durable"],
        "async_stall_vs_durable": med["stall"] / med["durable"],
        "cold_load_vs_read": med["read"] / med["cold_load"],
        "warm_load_vs_read": med["read"] / med["warm_load"],
        "verify_vs_read": med["read"] / med["verify"],
        # The hash runs inline in the writer thread: its time is what a save pays for it. The
        # A/B of two durable saves is printed too; on a shared virtual disk its noise exceeds 5%.
        "checksum_overhead": med["hash"] / med["durable"],
        "checksum_ab": med["durable"] / med["durable_nosum"] - 1.0,
        "zstd_save_vs_durable": med["durable"] / med["durable_zstd"],
        "zstd_size_vs_raw": zstd_bytes / size,
    }
    print(f"state {size / (1 << 30):.2f} GiB, {len(runs)} runs, medians; writeback "
          f"{'sync_file_range' if dcp_io.writeback_supported() else 'at close'}")
    for k, seconds in med.items():
        print(f"  {k:<14} {seconds:7.2f} s  {mib_s[k]:8.0f} MiB/s")
    for k, v in ratios.items():
        print(f"  {k:<28} {v:6.2f}")
    if args.json:
        print(json.dumps({"gib": size / (1 << 30), "runs": len(runs), "seconds": med,
                          "mib_per_s": mib_s, **ratios}))


if __name__ == "__main__":
    main()
