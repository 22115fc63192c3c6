"""Per-file checksums: xxh3-64, streamed, as ``xxh3:<16 hex digits>``."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import xxhash

from .storage import Storage

__all__ = ["ALGORITHM", "checksum_bytes", "checksum_file", "digest_parts"]

ALGORITHM = "xxh3"
CHUNK_READ = 16 << 20


def checksum_bytes(data: bytes) -> str:
    return f"{ALGORITHM}:{xxhash.xxh3_64_hexdigest(data)}"


def checksum_file(storage: Storage, path: str,
                  progress: Callable[[int], None] | None = None) -> tuple[int, str]:
    """(size, checksum) of one file at the storage's read speed.

    Through the storage's own reader (so every storage, and every fault a test
    injects there, is covered), in 16 MiB chunks into two reused buffers: hashing
    one chunk overlaps reading the next (both release the GIL).
    """
    h = xxhash.xxh3_64()
    size = 0
    buffers = [bytearray(CHUNK_READ), bytearray(CHUNK_READ)]
    with storage.open_read(path) as f, ThreadPoolExecutor(1) as hasher:
        pending = None
        i = 0
        while True:
            buf = buffers[i % 2]
            n = _readinto(f, buf)
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


def _readinto(f, buf: bytearray) -> int:
    readinto = getattr(f, "readinto", None)
    if readinto is not None:
        return readinto(buf) or 0
    chunk = f.read(len(buf))
    buf[: len(chunk)] = chunk
    return len(chunk)


def digest_parts(parts) -> str:
    """A short digest of a sequence of str/bytes parts (order matters)."""
    h = xxhash.xxh3_64()
    for part in parts:
        if isinstance(part, str):
            part = part.encode()
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
    return h.hexdigest()
