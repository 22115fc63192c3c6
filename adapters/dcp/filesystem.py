"""How our DCP shards reach storage: checksummed while written, durable at disk speed.

torch.distributed.checkpoint's ``FileSystemWriter`` writes each rank's file
through ``FileSystem.create_stream``. Ours:

- hashes every byte on its way out (xxh3-64), so the manifest's
  checksums cost no second read;
- on local/parallel file systems, starts the kernel's writeback every 32 MiB
  (``sync_file_range(SYNC_FILE_RANGE_WRITE)``), so the disk works while the
  next tensors are serialised, and ends with ``fdatasync`` of the file and an
  ``fsync`` of its directory: when the save returns, the bytes are on disk
  (DCP's own ``sync_files`` fsyncs before flushing its write buffer, and at
  the end only, so the disk idles while it serialises);
- on object stores, spools the file locally and uploads it in one request
  with bounded, jittered retries (``resume.storage``): a 503 SlowDown or a
  reset connection costs one file's upload, not the save.

``written`` maps each file this rank wrote to (size, checksum).

``StepWriter`` (DCP's ``FileSystemWriter``) writes ``.metadata`` from a plain ``Metadata``:
our planners hand DCP a ``KeptMetadata`` that pickles small for DCP's end-of-save broadcast
(``plan_cache``), while the file holds the bytes DCP itself writes.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import io
import logging
import os
import stat
import tempfile
import threading
from collections.abc import Generator
from pathlib import Path
from typing import Any

import xxhash
from torch.distributed.checkpoint import filesystem as _fs
from torch.futures import Future

from resume import faults
from resume.checksum import ALGORITHM

from .plan_cache import plain_metadata

__all__ = ["ChecksummingFileSystem", "HashingSink", "RetryingFsspecFileSystem", "StepWriter", "make_reader",
           "make_writer", "without_torch_crc32", "writeback_supported"]

log = logging.getLogger("resume")

WRITEBACK_EVERY = 32 << 20
BUFFER = 8 << 20
_SYNC_FILE_RANGE_WRITE = 2
_SYNC_FILE_RANGE_WAIT = 1 | 2 | 4  # WAIT_BEFORE | WRITE | WAIT_AFTER: the range is on disk when it returns


def _load_sync_file_range() -> Any:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        fn = libc.sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_sync_file_range = _load_sync_file_range()


def writeback_supported() -> bool:
    return _sync_file_range is not None


class _HashingSink(io.RawIOBase):
    """The raw end of the stream DCP writes to: hashes, writes, starts writeback."""

    def __init__(self, raw: Any, *, writeback: bool, hashing: bool = True) -> None:
        self.raw = raw
        self.hash = xxhash.xxh3_64() if hashing else None
        self.size = 0
        self._flushed_to = 0
        self._dropped_to = 0
        self._writeback = writeback and _sync_file_range is not None and hasattr(raw, "fileno")

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        view = memoryview(b)
        if self.hash is not None:
            self.hash.update(view)
        written = 0
        while written < len(view):  # a raw write may be partial
            n = self.raw.write(view[written:])
            written += n
        first = self.size == 0
        self.size += written
        if first:
            faults.point("save.mid_shards")  # the file's first block is out, the rest not yet
        if self._writeback and self.size - self._flushed_to >= WRITEBACK_EVERY:
            self._drop_behind()
            _sync_file_range(self.raw.fileno(), self._flushed_to, self.size - self._flushed_to,
                             _SYNC_FILE_RANGE_WRITE)
            self._flushed_to = self.size
        return written

    def _drop_behind(self) -> None:
        """The range whose writeback the last call started, once on disk, out of the page cache:
        a save's file pages stay a few ranges, the same ones over again, instead of new memory
        the kernel must find for every byte (which a process's first save, with no pages freed
        lately to reuse, paid for page by page: docs/performance.md). The wait costs nothing
        the final fdatasync would not; nobody reads a shard back soon after writing it."""
        start, end = self._dropped_to, self._flushed_to
        if end > start:
            fd = self.raw.fileno()
            _sync_file_range(fd, start, end - start, _SYNC_FILE_RANGE_WAIT)
            with contextlib.suppress(OSError):  # a file system without it keeps the pages
                os.posix_fadvise(fd, start, end - start, os.POSIX_FADV_DONTNEED)
            self._dropped_to = end

    def tell(self) -> int:
        return self.size

    def seekable(self) -> bool:
        return False

    def fileno(self) -> int:
        return self.raw.fileno()

    def close(self) -> None:  # the file is closed by create_stream, after its sync
        pass

    @property
    def checksum(self) -> str | None:
        return f"{ALGORITHM}:{self.hash.hexdigest()}" if self.hash is not None else None


HashingSink = _HashingSink
"""For other writers of large files (``resume export``): hashed while written, written back and
dropped from the page cache behind the writer."""


class ChecksummingFileSystem(_fs.FileSystem):
    """DCP's local FileSystem, with checksums while writing and a durable close."""

    def __init__(self, *, durable: bool = True) -> None:
        self.durable = durable
        self.checksum = True
        """False only to measure what the checksums cost (benchmarks/storage.py)."""
        self.written: dict[str, tuple[int, str]] = {}
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Generator[io.IOBase, None, None]:
        if "w" not in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        path = Path(path)
        with open(path, "wb", buffering=0) as raw:
            sink = _HashingSink(raw, writeback=self.durable, hashing=self.checksum)
            stream = io.BufferedWriter(sink, buffer_size=BUFFER)
            yield stream  # type: ignore[misc]
            with contextlib.suppress(ValueError):  # DCP may have closed it (and so flushed)
                stream.flush()
            if self.durable:
                os.fdatasync(raw.fileno())
        # The directory entry is made durable once, by the commit (Storage.sync_dir), not per file.
        with self._lock:
            self.written[path.name] = (sink.size, sink.checksum)

    def rename(self, path: str | os.PathLike, new_path: str | os.PathLike) -> None:
        super().rename(path, new_path)
        old, new = Path(path).name, Path(new_path).name
        with self._lock:
            if old in self.written:  # DCP writes .metadata as a temp file, then renames it
                self.written[new] = self.written.pop(old)
        if self.durable:
            _fsync_dir(str(Path(new_path).parent))


class ReadaheadFileSystem(_fs.FileSystem):
    """DCP's local FileSystem for loads: the kernel reads the whole file ahead while DCP
    deserialises the first tensors (DCP itself reads one item after the other)."""

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Generator[io.IOBase, None, None]:
        with super().create_stream(path, mode) as stream:
            if "r" not in mode:
                yield stream
                return
            # A thread asks the kernel for the file chunk by chunk (fadvise releases the GIL),
            # staying ahead of DCP, which deserialises and copies what has arrived.
            stop = threading.Event()
            fd = stream.fileno()
            prefetcher = threading.Thread(target=_prefetch, args=(fd, stop), daemon=True)
            with contextlib.suppress(AttributeError, OSError, io.UnsupportedOperation):
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
                prefetcher.start()
            try:
                yield stream
            finally:
                stop.set()
                if prefetcher.is_alive():
                    prefetcher.join()


PREFETCH_CHUNK = 64 << 20


def _prefetch(fd: int, stop: threading.Event) -> None:
    with contextlib.suppress(OSError):
        size = os.fstat(fd).st_size
        offset = 0
        while offset < size and not stop.is_set():
            os.posix_fadvise(fd, offset, PREFETCH_CHUNK, os.POSIX_FADV_WILLNEED)
            offset += PREFETCH_CHUNK


def prefetch_files(paths: list[str]) -> threading.Event:
    """The kernel asked to read ``paths`` into the page cache, by a daemon thread, while the
    restore does other work (a fresh optimizer's state made, the index exchanged): the load
    then reads from memory. Regular files only, no link followed; set the event to stop."""
    stop = threading.Event()

    def run() -> None:
        for path in paths:
            if stop.is_set():
                return
            try:
                fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
            except OSError:
                continue
            try:
                if stat.S_ISREG(os.fstat(fd).st_mode):
                    _prefetch(fd, stop)
            finally:
                os.close(fd)
    threading.Thread(target=run, name="resume-prefetch", daemon=True).start()
    return stop


class RetryingFsspecFileSystem(_fs.FileSystemBase):
    """DCP's file system over our ``FsspecStorage``: every file spooled locally, then uploaded
    in one request with retries; reads fetched with retries. Paths are relative to the step."""

    def __init__(self, storage: Any, step_dir: str, *, spool_dir: str | None = None) -> None:
        self.storage = storage
        self.step_dir = step_dir
        # Local room for one shard at a time; RESUME_SPOOL_DIR points it at a local disk
        # where /tmp is memory.
        self.spool_dir = spool_dir or os.environ.get("RESUME_SPOOL_DIR") or None
        self.written: dict[str, tuple[int, str]] = {}
        self._lock = threading.Lock()

    def _rel(self, path: str | os.PathLike) -> str:
        return os.fspath(path).lstrip("/")

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Generator[io.IOBase, None, None]:
        rel = self._rel(path)
        target = f"{self.step_dir}/{rel}"
        if "r" in mode:
            # One GET per file, retried as a whole; DCP then seeks in the local copy.
            with tempfile.NamedTemporaryFile(dir=self.spool_dir, prefix="resume-fetch-") as spool:
                self.storage.get_file(target, spool.name)
                with open(spool.name, "rb") as f:
                    yield f  # type: ignore[misc]
            return
        with tempfile.NamedTemporaryFile(dir=self.spool_dir, prefix="resume-spool-") as spool:
            sink = _HashingSink(spool, writeback=False)
            stream = io.BufferedWriter(sink, buffer_size=BUFFER)
            yield stream  # type: ignore[misc]
            with contextlib.suppress(ValueError):
                stream.flush()
            spool.flush()
            self.storage.put_file(spool.name, target)
        with self._lock:
            self.written[rel] = (sink.size, sink.checksum)

    def concat_path(self, path: str | os.PathLike, suffix: str) -> str:
        base = self._rel(path)
        return f"{base}/{suffix}" if base else suffix

    def init_path(self, path: str | os.PathLike) -> str:
        return ""

    def rename(self, path: str | os.PathLike, new_path: str | os.PathLike) -> None:
        old, new = self._rel(path), self._rel(new_path)
        try:
            self.storage.rename(f"{self.step_dir}/{old}", f"{self.step_dir}/{new}")
        except FileNotFoundError:
            # A retried copy+delete whose first answer was lost: the source is gone
            # because the move happened. Done, if the destination is there.
            if not self.storage.exists(f"{self.step_dir}/{new}"):
                raise
        with self._lock:
            if old in self.written:
                self.written[new] = self.written.pop(old)

    def mkdir(self, path: str | os.PathLike) -> None:
        self.storage.makedirs(self.step_dir)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return False

    def exists(self, path: str | os.PathLike) -> bool:
        return self.storage.exists(f"{self.step_dir}/{self._rel(path)}")

    def rm_file(self, path: str | os.PathLike) -> None:
        self.storage.delete(f"{self.step_dir}/{self._rel(path)}")

    def ls(self, path: str | os.PathLike) -> list[str]:
        return self.storage.listdir(self.step_dir)


def _fsync_dir(directory: str) -> None:
    from resume.storage import fsync_dir

    fsync_dir(directory)



class StepWriter(_fs.FileSystemWriter):
    """DCP's ``FileSystemWriter`` for one step directory. Each rank's write results travel to
    the coordinator packed (``written.PackedWrites``); ``finish`` (the coordinator, last) reads
    them into columns once and writes from them ``.metadata`` (what DCP writes, pickled from a
    plain ``Metadata`` whatever the planner handed it: a ``KeptMetadata`` pickles to a
    ``MetadataSummary``) and the index."""

    def write_data(self, plan: Any, planner: Any) -> Future:
        from .written import PackedWrites

        results = super().write_data(plan, planner).wait()
        packed: Future = Future()
        packed.set_result(PackedWrites(results))
        return packed

    def finish(self, metadata: Any, results: list) -> None:
        from .written import StorageEntries, as_write_results, written_of

        try:
            written = written_of(results)
        except ValueError as e:  # entries the columns cannot hold: DCP's own finish, no index
            log.warning("resume: no index for this step (its restores read .metadata): %s", e)
            plain = plain_metadata(metadata)
            super().finish(metadata=plain, results=[as_write_results(r) for r in results])
            vars(metadata).update(vars(plain))
            return
        plain = plain_metadata(metadata)
        plain.version = _fs.CURRENT_DCP_VERSION
        plain.storage_data = StorageEntries(written)
        plain.storage_meta = self.storage_meta()
        self._write_metadata(plain, written)
        vars(metadata).update(vars(plain))  # what DCP fills in: storage_data, storage_meta, version
        self._write_index(plain, written)

    def _write_index(self, plain: Any, written: Any) -> None:
        """The index (``index.INDEX_FILE``) beside ``.metadata``: what a restore reads instead of
        it. A state the index cannot describe writes none: its restores read ``.metadata``."""
        from .index import INDEX_FILE, encode_index

        try:
            data = encode_index(plain, written)
        except (ValueError, KeyError) as e:
            log.warning("resume: no index for this step (its restores read .metadata): %s", e)
            return
        with self.fs.create_stream(self.fs.concat_path(self.path, INDEX_FILE), "wb") as f:
            f.write(data)

    def _write_metadata(self, plain: Any, written: Any) -> None:
        """``.metadata`` as DCP writes it (a temporary file renamed over any old one), its
        ``storage_data`` a plain dict."""
        from .metadata_pickle import metadata_parts

        parts = metadata_parts(plain, written)
        tmp = self.fs.concat_path(self.path, f"{_fs._metadata_fn}.tmp")
        with self.fs.create_stream(tmp, "wb") as f:
            for part in parts:
                f.write(part)
        final = self.fs.concat_path(self.path, _fs._metadata_fn)
        if self.fs.exists(final):
            self.fs.rm_file(final)
        self.fs.rename(tmp, final)


COMPRESSIONS = (None, "zstd")


def make_writer(storage: Any, step_dir: str, *, durable: bool = True, thread_count: int = 1,
                compression: str | None = None, copy_ahead: bool = True) -> Any:
    """A DCP writer into ``step_dir`` of ``storage``; ``writer.fs.written`` after the save.

    ``compression="zstd"``: every item through zstandard (DCP's stream extension, recorded
    in the metadata, so any reader decompresses it). Off by default: see the README's
    storage figures for what it costs and saves here. ``copy_ahead=False`` for tensors
    already on the CPU (a staged copy): DCP's overlapping loader would touch CUDA streams
    from a background thread.
    """
    extensions = []
    if compression == "zstd":
        from torch.distributed.checkpoint._extension import ZStandard

        extensions.append(ZStandard())
    elif compression is not None:
        raise ValueError(f"compression: expected one of {COMPRESSIONS}, actual {compression!r}")
    local = storage.local_path(step_dir)
    fs: Any
    ahead = {} if copy_ahead else {"per_thread_copy_ahead": 0}
    if local is not None:
        writer = StepWriter(local, sync_files=False, thread_count=thread_count, _extensions=extensions,
                            **ahead)
        fs = ChecksummingFileSystem(durable=durable)
        writer.fs = fs
        writer.path = fs.init_path(local)
    else:
        writer = StepWriter("resume-remote", sync_files=False, thread_count=thread_count,
                            _extensions=extensions, **ahead)
        fs = RetryingFsspecFileSystem(storage, step_dir)
        writer.fs = fs
        writer.path = fs.init_path("")
    return writer


def make_reader(storage: Any, step_dir: str) -> Any:
    """A DCP reader of ``step_dir`` that never unpickles code (``reader``) and retries remote reads."""
    from .reader import SafeFileSystemReader

    local = storage.local_path(step_dir)
    if local is not None:
        reader = SafeFileSystemReader(local)
        reader.fs = ReadaheadFileSystem()
        return reader
    reader = SafeFileSystemReader("resume-remote")
    reader.threads = 1  # each reader thread would fetch the whole object again
    reader.fs = RetryingFsspecFileSystem(storage, step_dir)
    reader.path = reader.fs.init_path("")
    return reader


_crc_lock = threading.Lock()


@contextlib.contextmanager
def without_torch_crc32() -> Generator[None, None, None]:
    """torch.save's per-record CRC32 while our shards are written: it is the slowest part of
    DCP's write path on a CPU, and our xxh3 of the whole file covers the same bytes."""
    import torch

    set_crc = getattr(torch.serialization, "set_crc32_options", None)
    if set_crc is None:
        yield
        return
    with _crc_lock:
        set_crc(False)
        try:
            yield
        finally:
            set_crc(True)
