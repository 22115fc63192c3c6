"""Reading a checkpoint's data files for an export: every byte once, hashed as it is read.

Each data file is read front to back: the chunks an export needs are taken in the order the
tensors are exported (which is the order a save wrote them, so each file moves forward only),
the bytes between them (what the export leaves out) are hashed and dropped. When the last
tensor is done, the rest of each file is hashed and every file's size and checksum compared
with the manifest: an export is published only after every file verified. A file whose chunks
the export would need out of order is verified whole first (``Run.verify_checksums``) and then
read where needed (its bytes are read twice; ``Plan.rereads`` names such files).

Memory: two buffers the chunks are read into, used in turn (one tensor read while the one before
it is written; each as large as the largest tensor's stored bytes), the tensor being put together
from several chunks, and a 16 MiB buffer for the bytes skipped.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import IO

import torch

from resume.checksum import ALGORITHM
from resume.errors import CorruptCheckpointError, StorageError
from resume.manifest import Manifest
from resume.storage import Storage, join
from resume.text import clip, short

from .entries import TensorEntry

__all__ = ["DataFiles", "Plan", "plan_reads"]

_SKIP_BLOCK = 16 << 20
_OPEN_CAP = 64
"""Files held open at once; the others are reopened at their position when needed again."""


_SCRATCH = threading.local()


def _scratch() -> bytearray:
    """This thread's block for the bytes an export skips (hashed, not kept)."""
    block = getattr(_SCRATCH, "block", None)
    if block is None:
        block = _SCRATCH.block = bytearray(_SKIP_BLOCK)
    return block


@dataclass
class Plan:
    entries: list[TensorEntry]
    rereads: list[str]
    """Files whose chunks are needed out of order: hashed whole first, then read where needed."""


def plan_reads(entries: list[TensorEntry]) -> Plan:
    """The export order (each tensor at its first chunk's file and offset) and the files it would
    read backwards."""
    for entry in entries:  # every later step takes the chunks in this order
        entry.chunks.sort(key=lambda c: (c.file, c.offset))
    ordered = sorted(entries, key=lambda e: (e.chunks[0].file, e.chunks[0].offset) if e.chunks else ("", 0))
    position: dict[str, int] = {}
    rereads = set()
    for entry in ordered:
        for chunk in entry.chunks:
            if chunk.offset < position.get(chunk.file, 0):
                rereads.add(chunk.file)
            position[chunk.file] = max(position.get(chunk.file, 0), chunk.offset + chunk.length)
    return Plan(ordered, sorted(rereads))


class _File:
    """One data file read forward, hashed."""

    def __init__(self, storage: Storage, path: str, size: int, checksum: str, *, hashed: bool = True) -> None:
        import xxhash

        self.storage, self.path, self.size, self.checksum = storage, path, size, checksum
        self.url = storage.url(path)
        self.hash = xxhash.xxh3_64() if hashed else None
        self.pos = 0
        self.stream: IO[bytes] | None = None

    def open(self) -> IO[bytes]:
        if self.stream is None:
            try:
                self.stream = self.storage.open_read(self.path)
            except FileNotFoundError as e:
                raise CorruptCheckpointError(f"{self.url}: expected a file of {self.size} bytes, actual missing") from e
            if self.pos:
                self.stream.seek(self.pos)
        return self.stream

    def close(self) -> None:
        if self.stream is not None:
            self.stream.close()
            self.stream = None

    def read(self, offset: int, length: int, buf: memoryview) -> memoryview:
        """``length`` bytes at ``offset`` (not before the position, unless the file was verified
        whole first), read into ``buf`` (at least that long; buffers reused from tensor to tensor:
        no fresh memory to fault in); the bytes skipped on the way hashed."""
        stream = self.open()
        if self.hash is None:
            stream.seek(offset)
            self.pos = offset
        elif offset < self.pos:
            raise AssertionError(f"{self.url}: read at {offset} behind {self.pos}")  # plan_reads prevents it
        self._skip_to(offset)
        view, filled = buf[:length], 0
        while filled < length:
            n = stream.readinto(view[filled:])
            if not n:
                raise CorruptCheckpointError(f"{self.url}: size: expected at least {offset + length} bytes "
                                             f"(an item ends there), actual {offset + filled}")
            filled += n
        if self.hash is not None:
            self.hash.update(view)
        self.pos = offset + length
        return view

    def _skip_to(self, offset: int | None) -> None:
        """Hash the bytes up to ``offset`` (None: the file's end), read into one reused block."""
        stream = self.stream
        block = memoryview(_scratch())
        while offset is None or self.pos < offset:
            n = stream.readinto(block[:_SKIP_BLOCK if offset is None else min(_SKIP_BLOCK, offset - self.pos)])
            if not n:
                if offset is None:
                    return
                raise CorruptCheckpointError(f"{self.url}: size: expected at least {offset} bytes, actual {self.pos}")
            if self.hash is not None:
                self.hash.update(block[:n])
            self.pos += n

    def finish(self) -> str | None:
        """The rest hashed; a problem in ``verify``'s words, or None."""
        if self.hash is None:
            return None
        self.open()
        self._skip_to(None)
        self.close()
        if self.pos != self.size:
            return f"{self.url}: size: expected {self.size} bytes, actual {self.pos}"
        digest = f"{ALGORITHM}:{self.hash.hexdigest()}"
        return None if digest == self.checksum else f"{self.url}: checksum: expected {self.checksum}, actual {digest}"


class DataFiles:
    """The step's data files, each checked against the manifest (``finish``)."""

    def __init__(self, storage: Storage, step_dir: str, manifest: Manifest, plan: Plan,
                 progress: Callable[[int], None] | None = None) -> None:
        self.storage, self.step_dir, self.manifest = storage, step_dir, manifest
        self.progress = progress
        self.files: dict[str, _File] = {}
        self._bufs, self._slot = [bytearray(), bytearray()], 0
        self._open: list[str] = []
        self._rereads = set(plan.rereads)
        for rel in sorted({c.file for e in plan.entries for c in e.chunks} | self._data_files()):
            entry = manifest.files.get(rel)
            if entry is None:
                raise CorruptCheckpointError(f"{storage.url(join(step_dir, rel))}: expected a file the manifest "
                                             f"lists (the index names it), actual unlisted")
            self.files[rel] = _File(storage, join(step_dir, rel), entry.size, entry.checksum,
                                    hashed=rel not in self._rereads)

    def _data_files(self) -> set[str]:
        return {rel for rel in self.manifest.files if rel.endswith(".distcp")}

    def read_chunks(self, entry: TensorEntry) -> list[memoryview]:
        """The stored bytes of each of the tensor's chunks (file and offset order), read into the
        next of two buffers used in turn: valid until the call after next, so that one tensor is
        read while the one before it is written (``assemble``)."""
        chunks = entry.chunks  # in file and offset order (plan_reads)
        slot = self._slot = 1 - self._slot
        need = sum(c.length for c in chunks)
        if len(self._bufs[slot]) < need:
            self._bufs[slot] = bytearray(need)
        view, at, out = memoryview(self._bufs[slot]), 0, []
        for c in chunks:
            out.append(self._read(c.file, c.offset, c.length, view[at:at + c.length]))
            at += c.length
        return out

    def assemble(self, entry: TensorEntry, raws: list[memoryview]) -> torch.Tensor:
        """The whole tensor from its chunks' bytes (one chunk: a view of them)."""
        from ..dcp.reader import decode_chunk

        full = None
        for chunk, raw in zip(entry.chunks, raws):
            where = f"{self.files[chunk.file].url}: {short(entry.key, 120)}"
            try:
                part = decode_chunk(raw, entry.dtype, chunk.sizes, where, zstd=chunk.zstd)
            except (CorruptCheckpointError, StorageError):
                raise
            except Exception as e:
                raise CorruptCheckpointError(f"{where}: expected a stored tensor, actual {type(e).__name__}: "
                                             f"{clip(str(e))}") from e
            if len(entry.chunks) == 1 and tuple(chunk.sizes) == entry.shape:
                return part
            if full is None:
                full = torch.empty(entry.shape, dtype=entry.dtype)
            box = full
            for dim, (at, n) in enumerate(zip(chunk.offsets, chunk.sizes)):
                box = box.narrow(dim, at, n)
            box.copy_(part)
        return full if full is not None else torch.empty(entry.shape, dtype=entry.dtype)

    def _read(self, rel: str, offset: int, length: int, into: memoryview) -> memoryview:
        f = self.files[rel]
        if rel not in self._open:
            self._open.append(rel)
            if len(self._open) > _OPEN_CAP:
                self.files[self._open.pop(0)].close()
        before = f.pos
        buf = f.read(offset, length, into)
        if self.progress is not None:
            self.progress(max(0, f.pos - before) if f.hash is not None else length)
        return buf

    def finish(self) -> list[str]:
        """Every data file's rest hashed and compared; the problems (none: all verified)."""
        problems = []
        for rel, f in sorted(self.files.items()):
            before = f.pos
            try:
                problem = f.finish()
            except FileNotFoundError:
                problem = f"{f.url}: expected a file of {f.size} bytes, actual missing"
            if self.progress is not None and f.hash is not None:
                self.progress(max(0, f.pos - before))
            if problem:
                problems.append(problem)
        return problems

    def close(self) -> None:
        for f in self.files.values():
            f.close()

    def total_bytes(self) -> int:
        return sum(f.size for f in self.files.values())

