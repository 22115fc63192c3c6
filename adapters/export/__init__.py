"""``resume export``: a committed checkpoint's tensors out, as consolidated (whole, global) tensors
in sharded safetensors or torch files, for evaluation and serving (imported as
``resume.adapters.export``).

- Only a committed checkpoint, and only once every file it reads verified: each data file is read
  once, front to back, hashed as it is read (``reading``); the index (ours or DCP's
  ``.metadata``) is checked against its checksum and parsed by the restore's own parsers.
- Native checkpoints (DTensor / FSDP2 shards put together into whole tensors) and Megatron-Core
  ``torch_dist`` saves (the model's sharded tensors as global tensors under their keys).
- Streaming: one tensor at a time (``writing``), read into two reused buffers in turn (the next
  tensor is read while one is written): peak memory is about twice the largest tensor's stored
  bytes plus the tensor being put together (or cast), not the model.
- The output is written under a temporary name beside ``out`` and moved into place at the end,
  with its record (``RECORD``: source, step, manifest checksum, selection, dtype, every output
  file's size and checksum); a failure leaves nothing under ``out``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from resume.checksum import checksum_bytes
from resume.errors import CorruptCheckpointError, UsageError
from resume.manifest import Manifest
from resume.run import Run, utc_now
from resume.storage import MANIFEST_CAP, fsync_dir

from .entries import PARTS, Selection, TensorEntry, entries_from_index, entries_from_metadata, select
from .reading import DataFiles, plan_reads
from .writing import FORMATS, ExportWriter, plan_shards

__all__ = ["DTYPES", "FORMATS", "PARTS", "RECORD", "ExportResult", "Selection", "export_checkpoint", "read_entries"]

RECORD = "resume-export.json"
DTYPES = {"keep": None, "bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass
class ExportResult:
    out: str
    step: int
    tensors: int
    bytes_read: int
    bytes_written: int
    seconds: float
    record: dict = field(repr=False)
    rereads: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"out": self.out, "step": self.step, "tensors": self.tensors, "bytes_read": self.bytes_read,
                "bytes_written": self.bytes_written, "seconds": round(self.seconds, 3), "rereads": self.rereads,
                "files": self.record["files"]}


@dataclass
class _Source:
    run: Run
    manifest: Manifest
    manifest_checksum: str
    step_dir: str
    entries: list[TensorEntry]
    megatron: bool
    index_bytes: int
    """The index's size (read and verified before the data files)."""


def _committed(run: Run, step: int | None) -> tuple[Manifest, str]:
    """The step's manifest (the newest committed one without ``step``), re-read as bytes for the
    checksum the record keeps; a step that fails the commit check is refused with its reason."""
    chosen = run.manifest_for(step)
    result = run.check(chosen.step)
    if not result.committed:
        raise CorruptCheckpointError(f"{run.storage.url(run.dirname(chosen.step))}: expected a committed "
                                     f"checkpoint, actual {result.reason} (nothing exported)")
    path = run.manifest_path(chosen.step)
    text = run.storage.read_bytes(path, limit=MANIFEST_CAP)
    manifest = Manifest.from_json(text, source=run.storage.url(path))
    return manifest, checksum_bytes(text)


def _verified_bytes(run: Run, manifest: Manifest, rel: str) -> bytes:
    path = run.step_path(manifest.step, rel)
    entry = manifest.files[rel]
    try:
        data = run.storage.read_bytes(path, limit=entry.size)
    except FileNotFoundError as e:
        raise CorruptCheckpointError(f"{run.storage.url(path)}: expected a file of {entry.size} bytes, "
                                     "actual missing") from e
    if len(data) != entry.size or checksum_bytes(data) != entry.checksum:
        raise CorruptCheckpointError(f"{run.storage.url(path)}: checksum: expected {entry.checksum} "
                                     f"({entry.size} bytes), actual {checksum_bytes(data)} ({len(data)} bytes)")
    return data


def read_entries(run_url: str, step: int | None = None) -> _Source:
    """The committed step's tensors (names, dtypes, shapes, chunks) from its verified index."""
    from ..dcp.index import INDEX_FILE, CheckpointIndex
    from ..dcp.unpickle import restricted_load_metadata
    from ..torch.metadata import recorded_for_shards

    run = Run.open(run_url)
    manifest, manifest_checksum = _committed(run, step)
    recorded = recorded_for_shards(manifest)
    source = run.storage.url(run.dirname(manifest.step))
    if INDEX_FILE in manifest.files:
        data = _verified_bytes(run, manifest, INDEX_FILE)
        index = CheckpointIndex.parse(data, source=run.storage.url(run.step_path(manifest.step, INDEX_FILE)),
                                      file_sizes=recorded["sizes"], compression=recorded["compression"])
        entries = entries_from_index(index)
    elif ".metadata" in manifest.files:
        data = _verified_bytes(run, manifest, ".metadata")
        metadata = restricted_load_metadata(data, source=run.storage.url(run.step_path(manifest.step, ".metadata")),
                                            file_sizes=recorded["sizes"], compression=recorded["compression"])
        entries = entries_from_metadata(metadata, source)
    else:
        raise CorruptCheckpointError(f"{source}: expected {INDEX_FILE} or .metadata among the manifest's files, "
                                     "actual neither (not a DCP checkpoint)")
    return _Source(run, manifest, manifest_checksum, run.dirname(manifest.step), entries,
                   manifest.adapter.startswith("megatron"), len(data))


def _target_dtype(entry: TensorEntry, dtype: str) -> torch.dtype:
    if dtype not in DTYPES:
        raise UsageError(f"dtype: expected one of {', '.join(DTYPES)}, actual {dtype!r}")
    to = DTYPES[dtype]
    return to if to is not None and entry.dtype.is_floating_point else entry.dtype


def _prepare_out(out: str) -> str:
    """The temporary directory beside ``out``; ``out`` must be new or an empty directory."""
    if "://" in out:
        raise UsageError(f"{out}: OUT: expected a local directory, actual a URL")
    out = os.path.abspath(out)
    if os.path.lexists(out):
        if not os.path.isdir(out) or os.path.islink(out):
            raise UsageError(f"{out}: OUT: expected a new or empty directory, actual a file (nothing written)")
        if os.listdir(out):
            raise UsageError(f"{out}: OUT: expected a new or empty directory, actual {len(os.listdir(out))} "
                             "entries (nothing written, nothing replaced)")
    parent = os.path.dirname(out)
    os.makedirs(parent, exist_ok=True)
    tmp = os.path.join(parent, f".{os.path.basename(out)}.partial-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    os.mkdir(tmp)
    return tmp


def export_checkpoint(run_url: str, out: str, *, step: int | None = None, fmt: str = "safetensors",
                      dtype: str = "keep", selection: Selection | None = None, max_shard_size: int = 5 << 30,
                      progress: Callable[[int, int], None] | None = None) -> ExportResult:
    """Export a committed checkpoint of ``run_url`` (ours or a Megatron save directory with our
    manifests) to ``out``. ``progress(done, total)``: bytes of the checkpoint read so far."""
    if fmt not in FORMATS:
        raise UsageError(f"format: expected one of {', '.join(FORMATS)}, actual {fmt!r}")
    if max_shard_size < 1:
        raise UsageError(f"max_shard_size: expected a positive number of bytes, actual {max_shard_size}")
    started = time.perf_counter()
    src = read_entries(run_url, step)
    selection = dataclasses.replace(selection or Selection(), megatron=src.megatron)  # the caller's kept as given
    chosen = select(src.entries, selection)
    where = src.run.storage.url(src.step_dir)
    for entry in chosen:
        entry.check_cover(where)
        _target_dtype(entry, dtype)
    plan = plan_reads(chosen)
    targets = [(e.name, _target_dtype(e, dtype), e.shape) for e in plan.entries]
    shards = plan_shards(targets, fmt, max_shard_size)
    metadata = {"format": "pt", "resume.source": src.run.url, "resume.step": str(src.manifest.step)}
    tmp = _prepare_out(out)
    try:
        record = _write(src, plan, shards, fmt, dtype, selection, metadata, tmp, progress)
        final = os.path.abspath(out)
        os.rename(tmp, final)
        fsync_dir(os.path.dirname(final))
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return ExportResult(final, src.manifest.step, len(plan.entries), record["bytes_read"],
                        sum(f["size"] for f in record["files"].values()), time.perf_counter() - started, record,
                        plan.rereads)


def _pipeline(entries: list[TensorEntry], files: DataFiles, writer: ExportWriter, dtype: str) -> list[str]:
    """Each tensor read (one thread) while the one before it is put together and written (this
    one): the export takes about the longer of reading and writing, not their sum. The problems
    ``files.finish()`` found (every file hashed to its end and compared)."""
    from concurrent.futures import ThreadPoolExecutor

    if not entries:
        return files.finish()
    with ThreadPoolExecutor(1, thread_name_prefix="resume-export-read") as pool:
        ahead = pool.submit(files.read_chunks, entries[0])
        for i, entry in enumerate(entries):
            raws = ahead.result()
            # After the last tensor, the rest of every file is hashed while the last one is written.
            ahead = pool.submit(files.read_chunks, entries[i + 1]) if i + 1 < len(entries) else \
                pool.submit(files.finish)
            tensor = files.assemble(entry, raws)
            to = _target_dtype(entry, dtype)
            writer.add(entry.name, tensor if tensor.dtype == to else tensor.to(to))
            del tensor, raws
        return ahead.result()


def _write(src: _Source, plan: Any, shards: list, fmt: str, dtype: str, selection: Selection,
           metadata: dict, tmp: str, progress: Callable[[int, int], None] | None) -> dict:
    done = [src.index_bytes]
    files = DataFiles(src.run.storage, src.step_dir, src.manifest, plan)
    total = src.index_bytes + files.total_bytes() + sum(files.files[r].size for r in plan.rereads)

    def advance(n: int) -> None:
        done[0] += n
        if progress is not None:
            progress(done[0], total)
    files.progress = advance
    writer = ExportWriter(tmp, fmt, shards, metadata)
    try:
        reread = src.run.verify_checksums(src.manifest, plan.rereads)  # whole, before they are read out of order
        if reread:
            raise CorruptCheckpointError(f"{reread[0]} (nothing exported)")
        advance(sum(files.files[r].size for r in plan.rereads))
        problems = _pipeline(plan.entries, files, writer, dtype)
        if problems:
            more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
            raise CorruptCheckpointError(f"{problems[0]}{more} (nothing exported)")
        writer.finish()
    except BaseException:
        writer.abort()
        raise
    finally:
        files.close()
    record = {"schema": "resume.export", "schema_version": 1, "created_at": utc_now(),
              "source": {"run": src.run.url, "step": src.manifest.step, "adapter": src.manifest.adapter,
                         "manifest_checksum": src.manifest_checksum,
                         "train_state": src.manifest.train_state.to_dict()},
              "format": fmt, "dtype": dtype, "selection": selection.to_dict(), "tensors": len(plan.entries),
              "bytes_read": done[0], "files": writer.files}
    data = (json.dumps(record, indent=1, sort_keys=False) + "\n").encode()
    with open(os.path.join(tmp, RECORD), "xb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    fsync_dir(tmp)
    return record
