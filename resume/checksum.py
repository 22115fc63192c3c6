"""Per-file checksums: xxh3-64, streamed, as ``xxh3:<16 hex digits>``."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import xxhash

from .storage import CHUNK, Storage

__all__ = ["ALGORITHM", "checksum_bytes", "checksum_file", "checksum_local_file", "digest_parts"]

ALGORITHM = "xxh3"


def checksum_bytes(data: bytes) -> str:
    return f"{ALGORITHM}:{xxhash.xxh3_64_hexdigest(data)}"


def checksum_file(storage: Storage, path: str,
                  progress: Callable[[int], None] | None = None) -> tuple[int, str]:
    """(size, checksum) of one file, read in chunks."""
    local = storage.local_path(path)
    if local is not None:
        return checksum_local_file(local, progress)
    h = xxhash.xxh3_64()
    size = 0
    with storage.open_read(path) as f:
        while True:
            chunk = f.read(CHUNK)
            if not chunk:
                break
            h.update(chunk)
            size += len(chunk)
            if progress is not None:
                progress(len(chunk))
    return size, f"{ALGORITHM}:{h.hexdigest()}"


LOCAL_CHUNK = 16 << 20


def checksum_local_file(path: str, progress: Callable[[int], None] | None = None) -> tuple[int, str]:
    """(size, checksum) of a local file at the disk's read speed.

    The kernel is told the file is read sequentially (a wider read-ahead), and
    hashing one chunk overlaps reading the next (both release the GIL), into two
    reused buffers.
    """
    h = xxhash.xxh3_64()
    size = 0
    buffers = [bytearray(LOCAL_CHUNK), bytearray(LOCAL_CHUNK)]
    with open(path, "rb", buffering=0) as f, ThreadPoolExecutor(1) as hasher:
        with contextlib.suppress(AttributeError, OSError):
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
        pending = None
        i = 0
        while True:
            buf = buffers[i % 2]
            n = f.readinto(buf)
            if pending is not None:
                pending.result()  # the other buffer is free again
            if not n:
                break
            pending = hasher.submit(h.update, memoryview(buf)[:n])
            size += n
            i += 1
            if progress is not None:
                progress(n)
    return size, f"{ALGORITHM}:{h.hexdigest()}"


def digest_parts(parts) -> str:
    """A short digest of a sequence of str/bytes parts (order matters)."""
    h = xxhash.xxh3_64()
    for part in parts:
        if isinstance(part, str):
            part = part.encode()
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
    return h.hexdigest()
