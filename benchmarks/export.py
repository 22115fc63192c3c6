"""``resume export`` beside reading the same bytes, and its peak memory beside the largest tensor.

    python benchmarks/export.py [--gib 2] [--runs 3] [--pause 1] [--dir DIR] [--mem-dir DIR] [--drop auto|proc|fadvise]
                                [--keep] [--profile N] [--json]

The checkpoint: save_path.py's state (``LAYERS`` fp32 ``nn.Linear(w, w)`` whose weights and AdamW
moments total ``--gib``), one real optimizer step, ``Coordinator.save()`` (``NativeTorchAdapter``,
one process, ``LocalComm``) and ``close()``: one committed step, whose data files (``*.distcp``)
hold ``checkpoint_bytes``; beside them the index the export reads (``index.resume``). The files
are then read once, not timed: on a virtual disk the first read after a write can come from the
device and later ones from the host's cache, which no drop in the guest reaches (here: 4.5 s,
then 1 s, for 2 GiB), so every timed side finds the same.
Each run times six sides, in the order read, export part=all, read+hash, export part=model, copy,
export to memory (reversed in odd runs), each after ``--pause`` seconds and ``sync``, with the page cache dropped
(all of it when ``/proc/sys/vm/drop_caches`` is writable, else the run's own pages with
``posix_fadvise(DONTNEED)``), then checked with ``mincore`` on the largest data file: ``cache``
is "dropped", or "warm" when a drop left more than a tenth of its pages in memory:

- ``read``: the files the export reads (the data files and the index) front to back into one reused
  16 MiB buffer (``readinto`` on an unbuffered file after ``POSIX_FADV_SEQUENTIAL``: ``cat > /dev/null``);
- ``read_hash``: the same, each block hashed with xxh3, every digest compared with the manifest's
  (what verification alone costs);
- ``copy``: the same read and hash, each block also written to one new file, fsync'd at the end
  (a verified ``cp``: the floor for anything that writes out the bytes it reads);
- ``export_model`` and ``export_all``: ``export_checkpoint(run, OUT)`` to a fresh OUT (safetensors,
  dtype kept) with ``Selection(part="model")`` (the default: the model's weights) and
  ``Selection(part="all")`` (every tensor: bytes written about the bytes read), each in a fresh
  Python process (``python -c``) timed around the call there. Its peak memory: the peak RSS
  (``VmHWM``; ``ru_maxrss`` without ``/proc``, though it survives ``execve`` and so starts at the
  parent's peak) after the call minus the same after the imports (the export's modules imported
  first), the peak first brought down to the RSS then where ``/proc/self/clear_refs`` permits
  (``peak_rss_reset``; otherwise a passing peak of the imports can hide a smaller export's);
- ``export_mem``: export part=all again, OUT on a memory file system (``--mem-dir``, default
  ``/dev/shm``): the export's own cost (read, verify, put together, write) apart from the output
  device, which on this disk writes at a quarter of the read speed. ``export_mem_vs_read`` =
  ``read_s / export_mem_s``.

After each export (not timed), its output is checked: every file its record lists is there with that
size and xxh3 checksum, the index maps every tensor to its shard, and every tensor (model weights,
and for part=all the AdamW moments and steps) equals the live state's bitwise.
Throughput is ``checkpoint_bytes`` (the export's ``bytes_read`` less the index: each data file read
once) over the median seconds; both sides also read the index. ``export_vs_read`` = export part=all throughput /
plain read throughput (= ``read_s / export_all_s``; goal >= 0.8), ``export_model_vs_read`` likewise,
``export_all_vs_copy`` = ``copy_s / export_all_s``. ``peak_rss_bytes``: the most any export grew
by (over both parts and every run); ``peak_vs_largest_tensor`` it over the largest tensor's bytes
(goal <= 3; ``model_bytes`` and ``state_bytes`` beside it: memory does not follow the model). The
last line with ``--json`` is one JSON object; ``per_run`` holds each run's figures and order.
Each side's CPU seconds (user, system) and minor page faults are reported beside its time (the
export's in its process, around the call). ``--profile N`` adds a cProfile (top N by own time) of
one more export part=all in this process.
"""

from __future__ import annotations

import argparse
import cProfile
import ctypes
import gc
import json
import mmap
import os
import platform
import resource
import shutil
import statistics
import struct
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass, field

import numpy as np
import torch
import xxhash
from bench_common import in_fresh_process, profile_text, settle, write_proc
from save_path import LAYERS, PageCache, Samples, Training, logging_quiet, state_bytes, width_for

warnings.filterwarnings("ignore", message="torch.distributed is disabled")
BLOCK = 16 << 20
"""What the plain read reads at a time (and the export skips with)."""
SIDES = ("read", "export_all", "read_hash", "export_model", "copy", "export_mem")
"""One run's order (odd runs: reversed)."""
GOALS = {"export_vs_read": (">=", 0.8), "peak_vs_largest_tensor": ("<=", 3.0)}
WARM = 0.1
"""A drop that leaves more than this share of the largest data file's pages in memory: "warm"."""


# -- the checkpoint ----------------------------------------------------------------------------

@dataclass
class Checkpoint:
    run_dir: str
    width: int
    model_bytes: int
    state_bytes: int
    largest_tensor_bytes: int
    checkpoint_bytes: int
    """The data files (``*.distcp``): what an export counts as ``bytes_read``."""
    index_bytes: int
    files: dict[str, str]
    """What the export reads, path -> the manifest's checksum: the data files and the index."""
    expected: dict[str, dict[str, str]] = field(repr=False)
    """Part -> exported name -> xxh3 of the live tensor's bytes."""


def digest(t: torch.Tensor) -> str:
    return xxhash.xxh3_64_hexdigest(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy())


def live_digests(model: torch.nn.Module, optim: torch.optim.Optimizer) -> dict[str, dict[str, str]]:
    """The names each part exports under, with their tensors' digests (native keys: ``model.``,
    ``optim.state.<param>.<moment>``; part=model strips ``model.``)."""
    weights = {name: digest(p) for name, p in model.named_parameters()}
    everything = {f"model.{name}": d for name, d in weights.items()}
    for name, p in model.named_parameters():
        for key, value in optim.state[p].items():
            everything[f"optim.state.{name}.{key}"] = digest(value)
    return {"model": weights, "all": everything}


def build_checkpoint(gib: float, run_dir: str) -> Checkpoint:
    """The state, one real optimizer step, ``Coordinator.save()``, ``close()``: one committed step."""
    from resume.run import Run

    width = width_for(gib)
    t = Training(width, Samples(width), run_dir, every=1000)
    t.train()
    t.coord.save()
    t.coord.close()
    step = t.coord.last_committed_step
    tensors = [p for p in t.model.parameters()] + [v for s in t.optim.state.values() for v in s.values()]
    largest = max(v.numel() * v.element_size() for v in tensors)
    model_bytes = sum(p.numel() * p.element_size() for p in t.model.parameters())
    expected = live_digests(t.model, t.optim)
    size = state_bytes(t.model, t.optim)
    del t, tensors
    gc.collect()
    run = Run.open(run_dir)
    manifest = run.manifest_for(step)
    index = "index.resume" if "index.resume" in manifest.files else ".metadata"
    read = sorted(rel for rel in manifest.files if rel.endswith(".distcp")) + [index]
    files = {os.path.join(run_dir, run.step_path(step, rel)): manifest.files[rel].checksum for rel in read}
    data = sum(manifest.files[rel].size for rel in read[:-1])
    return Checkpoint(run_dir, width, model_bytes, size, largest, data, manifest.files[index].size, files, expected)


# -- the page cache ----------------------------------------------------------------------------

def resident_fraction(path: str) -> float:
    """The share of a file's pages in the page cache (``mincore``); NaN where it cannot be told."""
    size = os.path.getsize(path)
    if not size:
        return 0.0
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    pages = -(-size // mmap.PAGESIZE)
    vec = np.zeros(pages, dtype=np.uint8)
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr is None or addr == ctypes.c_void_p(-1).value:
            return float("nan")
        try:
            if libc.mincore(addr, size, vec.ctypes.data) != 0:
                return float("nan")
        finally:
            libc.munmap(addr, size)
    finally:
        os.close(fd)
    return float((vec & 1).mean())


class Cache:
    """save_path.py's ``PageCache`` (all pages when permitted, else the run's own), each drop
    checked on the largest data file."""

    def __init__(self, mode: str, probe: str) -> None:
        self.pages = PageCache(mode)
        self.probe = probe
        self.resident: list[float] = []

    def drop(self, directory: str) -> float:
        try:
            self.pages.drop(directory)
        except OSError as e:
            print(f"note: page cache not dropped ({e}): reads may be warm", file=sys.stderr)
        fraction = resident_fraction(self.probe)
        self.resident.append(fraction)
        return fraction

    @property
    def state(self) -> str:
        return "warm" if any(f > WARM for f in self.resident) else "dropped"


# -- the baselines -----------------------------------------------------------------------------

def read_files(files: dict[str, str], *, hashed: bool, copy_to: str | None = None) -> int:
    """Each file front to back into one reused buffer (hashed and compared with the manifest's
    checksum when ``hashed``; written to ``copy_to``, fsync'd, when given); the bytes read."""
    buf = bytearray(BLOCK)
    view = memoryview(buf)
    total = 0
    out = open(copy_to, "xb", buffering=0) if copy_to else None  # noqa: SIM115 - closed below
    try:
        for path, checksum in files.items():
            h = xxhash.xxh3_64() if hashed else None
            with open(path, "rb", buffering=0) as f:
                os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
                while n := f.readinto(buf):
                    if h is not None:
                        h.update(view[:n])
                    if out is not None:
                        out.write(view[:n])
                    total += n
            if h is not None and f"xxh3:{h.hexdigest()}" != checksum:
                raise AssertionError(f"{path}: expected {checksum}, actual xxh3:{h.hexdigest()}")
        if out is not None:
            os.fsync(out.fileno())
    finally:
        if out is not None:
            out.close()
    return total


# -- the export, in a fresh process ------------------------------------------------------------

def child(run_dir: str, out: str, part: str) -> None:
    """In a fresh process: the export's modules imported, the peak RSS noted, the export timed;
    one JSON line: its result, the seconds and the peak RSS before and after."""
    # What the export imports lazily, imported before the baseline: its memory is not the export's.
    import resume.adapters.dcp.index
    import resume.adapters.dcp.reader
    import resume.adapters.dcp.unpickle
    import resume.adapters.torch.metadata  # noqa: F401
    from resume.adapters.export import Selection, export_checkpoint

    logging_quiet()
    gc.collect()
    reset = reset_peak_rss()
    before, cpu = peak_rss_now(), cpu_now()
    started = time.perf_counter()
    result = export_checkpoint(run_dir, out, selection=Selection(part=part))
    seconds = time.perf_counter() - started
    cpu_used, after = cpu_since(cpu), peak_rss_now()
    print(json.dumps({**result.to_dict(), "seconds": seconds, "cpu": cpu_used, "rss_after_imports": before,
                      "rss_peak": after, "rss_peak_reset": reset}))


def reset_peak_rss() -> bool:
    """The peak RSS brought down to the RSS now (``/proc/self/clear_refs``: 5), so that it no
    longer holds the imports' passing peak; False where not permitted."""
    return write_proc("/proc/self/clear_refs", "5")


def peak_rss_now() -> int:
    """This process's peak RSS in bytes: ``VmHWM`` (its own address space's), else ``ru_maxrss``.
    ``ru_maxrss`` survives ``execve``: a child's starts at its parent's peak (here: the whole
    training state) and would hide the export's."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def export_in_child(run_dir: str, out: str, part: str) -> dict:
    return json.loads(in_fresh_process("export", f"export.child({run_dir!r}, {out!r}, {part!r})",
                                       f"export part={part}"))


def safetensors_digests(path: str) -> dict[str, str]:
    """Each tensor of a safetensors file, by its header: name -> xxh3 of its bytes."""
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
        header.pop("__metadata__", None)
        out = {}
        for name, info in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
            start, end = info["data_offsets"]
            f.seek(8 + length + start)
            out[name] = xxhash.xxh3_64_hexdigest(f.read(end - start))
    return out


def verify_export(result: dict, part: str, ck: Checkpoint) -> None:
    """What the record lists is there, whole; the index maps every tensor; every tensor is the
    live state's (AssertionError otherwise)."""
    out = result["out"]
    for name, info in result["files"].items():
        size, checksum = os.path.getsize(os.path.join(out, name)), "xxh3:"
        with open(os.path.join(out, name), "rb") as f:
            checksum += xxhash.xxh3_64_hexdigest(f.read())
        assert (size, checksum) == (info["size"], info["checksum"]), (name, size, checksum, info)
    with open(os.path.join(out, "model.safetensors.index.json")) as f:
        weight_map = json.load(f)["weight_map"]
    found: dict[str, str] = {}
    for shard in sorted(set(weight_map.values())):
        digests = safetensors_digests(os.path.join(out, shard))
        assert all(weight_map[name] == shard for name in digests), shard
        found.update(digests)
    assert found == ck.expected[part], f"part={part}: the exported tensors differ from the live state's"
    assert result["bytes_read"] == ck.checkpoint_bytes + ck.index_bytes, (result["bytes_read"], ck.checkpoint_bytes)
    assert result["tensors"] == len(ck.expected[part]) and not result["rereads"], result


# -- one run -----------------------------------------------------------------------------------

def run_once(ck: Checkpoint, root: str, cache: Cache, *, index: int, pause: float, mem_root: str | None = None) -> dict:
    """The sides, pages dropped before each; the seconds, each export's result and peak RSS.
    ``export_mem``: part=all with OUT under ``mem_root`` (a memory file system; else ``root``)."""
    order = SIDES if index % 2 == 0 else tuple(reversed(SIDES))
    seconds: dict[str, float] = {}
    cpu: dict[str, dict[str, float]] = {}
    exports: dict[str, dict] = {}
    resident = []
    for side in order:
        settle(pause)
        if side.startswith("export_"):
            key = side[len("export_"):]
            part = "all" if key == "mem" else key
            out = os.path.join(mem_root or root, f"out-{key}-{os.getpid()}" if key == "mem" else f"out-{key}")
            shutil.rmtree(out, ignore_errors=True)
            resident.append(cache.drop(ck.run_dir))
            result = export_in_child(ck.run_dir, out, part)
            seconds[side], cpu[side] = result["seconds"], result["cpu"]
            verify_export(result, part, ck)
            exports[key] = result
            if key == "mem":
                shutil.rmtree(out, ignore_errors=True)  # memory: not kept
            continue
        target = os.path.join(root, "copy") if side == "copy" else None
        resident.append(cache.drop(ck.run_dir))
        before, started = cpu_now(), time.perf_counter()
        n = read_files(ck.files, hashed=side != "read", copy_to=target)
        seconds[side], cpu[side] = time.perf_counter() - started, cpu_since(before)
        assert n == ck.checkpoint_bytes + ck.index_bytes, (side, n)
        if target:
            os.remove(target)
    return {"order": list(order), "seconds": seconds, "cpu": cpu, "exports": exports,
            "resident_after_drop": max(resident)}


def cpu_now() -> resource.struct_rusage:
    return resource.getrusage(resource.RUSAGE_SELF)


def cpu_since(before: resource.struct_rusage) -> dict[str, float]:
    """This process's CPU seconds (user, system) and minor page faults since ``before``."""
    now = cpu_now()
    return {"user_s": round(now.ru_utime - before.ru_utime, 3), "sys_s": round(now.ru_stime - before.ru_stime, 3),
            "minor_faults": now.ru_minflt - before.ru_minflt}


def profile(ck: Checkpoint, root: str, cache: Cache, top: int) -> None:
    """One more export part=all in this process, pages dropped, under cProfile: top by own time."""
    from resume.adapters.export import Selection, export_checkpoint

    out = os.path.join(root, "out-profile")
    shutil.rmtree(out, ignore_errors=True)
    cache.drop(ck.run_dir)
    prof = cProfile.Profile()
    result = prof.runcall(export_checkpoint, ck.run_dir, out, selection=Selection(part="all"))
    roots = [os.path.dirname(os.path.dirname(torch.__file__)), os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]
    print(f"--- profile: export_checkpoint(part=all), {result.seconds:.3f} s, pages dropped "
          f"(top {top} by own time)\n{profile_text(prof, top, 'tottime', roots)}\n")
    shutil.rmtree(out, ignore_errors=True)


# -- the figures -------------------------------------------------------------------------------

def run_figures(run: dict, ck: Checkpoint) -> dict:
    s = run["seconds"]
    return {"order": run["order"], **{f"{k}_s": round(v, 4) for k, v in s.items()}, "cpu": run["cpu"],
            "export_vs_read": round(s["read"] / s["export_all"], 3),
            "export_model_vs_read": round(s["read"] / s["export_model"], 3),
            "export_mem_vs_read": round(s["read"] / s["export_mem"], 3),
            "peak_rss_model_bytes": peak_rss(run["exports"]["model"]),
            "peak_rss_all_bytes": peak_rss(run["exports"]["all"]),
            "resident_after_drop": round(run["resident_after_drop"], 4)}


def peak_rss(result: dict) -> int:
    return result["rss_peak"] - result["rss_after_imports"]


def summarize(runs: list[dict], ck: Checkpoint, cache: Cache, mem_dir: str | None = None) -> dict:
    med = {side: statistics.median(r["seconds"][side] for r in runs) for side in SIDES}
    mib_s = {side: ck.checkpoint_bytes / med[side] / (1 << 20) for side in SIDES}
    cpu = {side: {k: statistics.median(r["cpu"][side][k] for r in runs) for k in runs[0]["cpu"][side]}
           for side in SIDES}
    peaks = {part: max(peak_rss(r["exports"][part]) for r in runs) for part in ("model", "all")}
    peak = max(peaks.values())
    last = runs[-1]["exports"]
    figures = {
        "gib": ck.state_bytes / (1 << 30), "runs": len(runs), "width": ck.width, "layers": LAYERS,
        "model_bytes": ck.model_bytes, "state_bytes": ck.state_bytes,
        "largest_tensor_bytes": ck.largest_tensor_bytes, "checkpoint_bytes": ck.checkpoint_bytes,
        "index_bytes": ck.index_bytes, **{f"{side}_s": med[side] for side in SIDES},
        "mib_s": mib_s, "cpu": cpu, "export_vs_read": med["read"] / med["export_all"],
        "export_model_vs_read": med["read"] / med["export_model"],
        "export_mem_vs_read": med["read"] / med["export_mem"],
        "read_hash_vs_read": med["read"] / med["read_hash"], "export_all_vs_copy": med["copy"] / med["export_all"],
        "peak_rss_bytes": peak, "peak_rss_model_bytes": peaks["model"], "peak_rss_all_bytes": peaks["all"],
        "peak_vs_largest_tensor": peak / ck.largest_tensor_bytes,
        "rss_after_imports_bytes": max(r["exports"][p]["rss_after_imports"] for r in runs for p in last),
        "peak_rss_reset": all(r["exports"][p]["rss_peak_reset"] for r in runs for p in last),
        "cache": cache.state, "cache_drop": cache.pages.mode, "mem_dir": mem_dir,
        "resident_after_drop_max": max(cache.resident),
        "exports": {part: {k: last[part][k] for k in ("out", "step", "tensors", "bytes_read", "bytes_written",
                                                      "rereads", "files")} | {"verified": True}
                    for part in ("model", "all")},
        "per_run": [run_figures(r, ck) for r in runs]}
    figures["goals_met"] = {k: figures[k] >= goal if op == ">=" else figures[k] <= goal
                            for k, (op, goal) in GOALS.items()}
    return figures


def print_tables(f: dict) -> None:
    mib = 1 << 20
    print(f"| {f['runs']} runs, medians, page cache {f['cache']} ({f['cache_drop']}) | seconds | MiB/s | "
          "vs read | CPU user s | CPU sys s | minor faults |\n|---|---:|---:|---:|---:|---:|---:|")
    rows = [("read (cat > /dev/null: readinto 16 MiB)", "read"), ("read + xxh3 (verification alone)", "read_hash"),
            ("read + xxh3 + write + fsync (a verified cp)", "copy"),
            (f"export part=model (writes {f['exports']['model']['bytes_written'] / mib:.0f} MiB)", "export_model"),
            (f"export part=all (writes {f['exports']['all']['bytes_written'] / mib:.0f} MiB)", "export_all"),
            (f"export part=all, OUT in memory ({f['mem_dir'] or 'no memory file system: on disk'})", "export_mem")]
    for label, side in rows:
        c = f["cpu"][side]
        print(f"| {label} | {f[side + '_s']:.3f} | {f['mib_s'][side]:.0f} | {f['read_s'] / f[side + '_s']:.2f} | "
              f"{c['user_s']:.2f} | {c['sys_s']:.2f} | {c['minor_faults']:.0f} |")
    print(f"\n| memory | MiB |\n|---|---:|\n| largest tensor | {f['largest_tensor_bytes'] / mib:.1f} |\n"
          f"| model (weights) | {f['model_bytes'] / mib:.1f} |\n| state (weights + AdamW moments) | "
          f"{f['state_bytes'] / mib:.1f} |\n| export part=model: peak RSS growth | {f['peak_rss_model_bytes'] / mib:.1f} |\n"
          f"| export part=all: peak RSS growth | {f['peak_rss_all_bytes'] / mib:.1f} |\n"
          f"| (RSS after imports, not counted) | {f['rss_after_imports_bytes'] / mib:.1f} |")
    if not f["peak_rss_reset"]:
        print("note: the peak RSS could not be reset after the imports: a smaller export peak may hide under theirs")
    print("\n| ratio | value | goal |\n|---|---:|---|")
    for k, (op, goal) in GOALS.items():
        print(f"| `{k}` | {f[k]:.2f} | {'≥' if op == '>=' else '≤'} {goal:g} "
              f"{'(met)' if f['goals_met'][k] else '(NOT met)'} |")
    print(f"| `export_model_vs_read` | {f['export_model_vs_read']:.2f} | |\n"
          f"| `export_mem_vs_read` (the export apart from the output device) | {f['export_mem_vs_read']:.2f} | |\n"
          f"| `read_hash_vs_read` | {f['read_hash_vs_read']:.2f} | |\n"
          f"| `export_all_vs_copy` | {f['export_all_vs_copy']:.2f} | |")
    print("\n| run | first | read | export all | read+hash | export model | copy | export_vs_read | peak all MiB |"
          "\n|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for i, r in enumerate(f["per_run"]):
        print(f"| {i + 1} | {r['order'][0]} | {r['read_s']:.3f} | {r['export_all_s']:.3f} | {r['read_hash_s']:.3f} | "
              f"{r['export_model_s']:.3f} | {r['copy_s']:.3f} | {r['export_vs_read']:.2f} | "
              f"{r['peak_rss_all_bytes'] / mib:.1f} |")


# -- main --------------------------------------------------------------------------------------

def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gib", type=float, default=2.0, help="state size in GiB (default 2)")
    parser.add_argument("--runs", type=int, default=3, help="runs; medians are reported (default 3)")
    parser.add_argument("--dir", default=None, help="where to write (default: a temp dir under /tmp, removed)")
    parser.add_argument("--mem-dir", default="/dev/shm" if os.path.isdir("/dev/shm") else None,
                        help="a memory file system for the export_mem side's OUT (default /dev/shm)")
    parser.add_argument("--json", action="store_true", help="end with one JSON line of the results")
    parser.add_argument("--pause", type=float, default=1.0,
                        help="seconds to let the disk drain before each side (default 1)")
    parser.add_argument("--drop", choices=("auto", "proc", "fadvise"), default="auto",
                        help="how the page cache is dropped (default: proc when permitted)")
    parser.add_argument("--keep", action="store_true",
                        help="keep the checkpoint and the last run's exports (the JSON names them)")
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="also cProfile one export part=all in this process: top N functions")
    args = parser.parse_args()
    if args.runs < 1:
        parser.error("--runs: expected >= 1")
    return args


def main() -> None:
    args = parse_args()
    logging_quiet()
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    root = tempfile.mkdtemp(prefix="resume-export-", dir=args.dir)
    started, load_start = time.perf_counter(), os.getloadavg()
    try:
        ck = build_checkpoint(args.gib, os.path.join(root, "run"))
        cache = Cache(args.drop, max(ck.files, key=os.path.getsize))
        print(f"checkpoint {ck.checkpoint_bytes / (1 << 30):.3f} GiB: {LAYERS} x Linear({ck.width}, {ck.width}) "
              f"fp32 + AdamW moments; page cache dropped by {cache.pages.mode}", file=sys.stderr, flush=True)
        read_files(ck.files, hashed=False)  # not timed: every side reads what the host's cache holds then
        runs = []
        for i in range(args.runs):
            runs.append(run_once(ck, root, cache, index=i, pause=args.pause, mem_root=args.mem_dir))
            print(f"run {i + 1}/{args.runs}: " + ", ".join(f"{k} {v:.3f}s" for k, v in runs[-1]["seconds"].items()),
                  file=sys.stderr, flush=True)
        if args.profile:
            profile(ck, root, cache, args.profile)
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    figures = summarize(runs, ck, cache, args.mem_dir)
    figures["kept"] = root if args.keep else None
    figures["elapsed_s"] = time.perf_counter() - started
    figures["machine"] = {"cores": os.cpu_count(), "torch": torch.__version__, "python": platform.python_version(),
                          "platform": platform.platform(), "loadavg_start": load_start, "loadavg_end": os.getloadavg()}
    print(f"checkpoint {ck.checkpoint_bytes / (1 << 30):.3f} GiB ({LAYERS} x Linear({ck.width}, {ck.width}) + AdamW), "
          f"{os.cpu_count()} cores, torch {torch.__version__}, {figures['elapsed_s']:.0f} s, load average "
          f"{load_start[0]:.2f} at the start, {figures['machine']['loadavg_end'][0]:.2f} at the end")
    print_tables(figures)
    if args.runs % 2:
        print(f"note: {args.runs} runs: the read went first in {(args.runs + 1) // 2} of them; an even --runs "
              "balances the order")
    if args.json:
        print(json.dumps(figures))


if __name__ == "__main__":
    main()
