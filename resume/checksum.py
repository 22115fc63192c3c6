"""Per-file checksums: xxh3-64, streamed, as ``xxh3:<16 hex digits>``."""

from __future__ import annotations

from collections.abc import Callable

import xxhash

from .storage import CHUNK, Storage

__all__ = ["ALGORITHM", "checksum_bytes", "checksum_file", "digest_parts"]

ALGORITHM = "xxh3"


def checksum_bytes(data: bytes) -> str:
    return f"{ALGORITHM}:{xxhash.xxh3_64_hexdigest(data)}"


def checksum_file(storage: Storage, path: str,
                  progress: Callable[[int], None] | None = None) -> tuple[int, str]:
    """(size, checksum) of one file, read in chunks."""
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


def digest_parts(parts) -> str:
    """A short digest of a sequence of str/bytes parts (order matters)."""
    h = xxhash.xxh3_64()
    for part in parts:
        if isinstance(part, str):
            part = part.encode()
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
    return h.hexdigest()
