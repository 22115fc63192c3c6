"""What a checkpoint holds, as export reads it: each tensor's name, dtype, global shape and the
stored chunks that cover it (file, byte range, box), from our index (``index.resume``) or DCP's
``.metadata`` (checked by their own parsers first), and the names an export gives them.

Native checkpoints keep the model under ``model.`` and the optimizer under ``optim.``;
Megatron-Core's ``torch_dist`` keeps the model's sharded tensors under their own keys and the
optimizer under ``optimizer.``. ``select`` picks a part, strips the native ``model.`` prefix (the
names are the model's own), applies the user's prefix filters and a rename hook, and refuses two
tensors given one name.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from resume.errors import CorruptCheckpointError, UsageError
from resume.text import short

__all__ = ["PARTS", "Chunk", "Selection", "TensorEntry", "entries_from_index", "entries_from_metadata", "select"]

PARTS = ("model", "optimizer", "all")


@dataclass(frozen=True)
class Chunk:
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    file: str
    offset: int
    length: int
    zstd: bool = False


@dataclass
class TensorEntry:
    key: str
    """The checkpoint's key."""
    dtype: torch.dtype
    shape: tuple[int, ...]
    chunks: list[Chunk]
    name: str = ""
    """The exported name (``select``)."""

    def check_cover(self, source: str) -> None:
        """The chunks cover the tensor exactly once (inside it, disjoint, volumes adding up):
        an export never writes memory nothing was read into."""
        where = f"{source}: {short(self.key, 120)}"
        total = math.prod(self.shape)
        if sum(math.prod(c.sizes) for c in self.chunks) != total:
            raise CorruptCheckpointError(f"{where}: chunks: expected {total} elements in all, actual "
                                         f"{sum(math.prod(c.sizes) for c in self.chunks)}")
        if len(self.chunks) < 2:
            return
        lo = np.array([c.offsets for c in self.chunks], dtype=np.int64)
        hi = lo + np.array([c.sizes for c in self.chunks], dtype=np.int64)
        if (lo < 0).any() or (hi > np.array(self.shape, dtype=np.int64)).any():
            raise CorruptCheckpointError(f"{where}: chunks: expected boxes inside {self.shape}, actual one outside")
        empty = (hi <= lo).any(axis=1)
        for i in range(len(self.chunks) - 1):
            overlap = ((lo[i] < hi[i + 1:]) & (lo[i + 1:] < hi[i])).all(axis=1) & ~empty[i + 1:] & ~empty[i]
            if overlap.any():
                j = i + 1 + int(np.argmax(overlap))
                raise CorruptCheckpointError(f"{where}: chunks: expected disjoint boxes, actual {i} and {j} overlap")


def entries_from_index(index: Any) -> list[TensorEntry]:
    """From a parsed ``CheckpointIndex`` (bounds already checked): the tensor keys in index order."""
    from ..dcp.index import dtype_of

    out = []
    for name, row in zip(index.names, index.keys.tolist()):
        kind, dtype, ndim, dims_at, chunk_at, n_chunks, _flags = row
        if kind != 0:
            continue
        shape = tuple(int(d) for d in index.dims[dims_at:dims_at + ndim])
        chunks = []
        for c_at, file, offset, length, transform in index.chunks[chunk_at:chunk_at + n_chunks].tolist():
            coords = index.coords[c_at:c_at + 2 * ndim].tolist()
            chunks.append(Chunk(tuple(coords[:ndim]), tuple(coords[ndim:]), index.files[file], offset, length,
                                transform == 1))
        out.append(TensorEntry(name, dtype_of(index.dtypes[dtype]), shape, chunks))
    return out


def entries_from_metadata(metadata: Any, source: str) -> list[TensorEntry]:
    """From DCP's checked ``Metadata``: the tensor keys in its order."""
    from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata

    out = []
    for key, md in metadata.state_dict_metadata.items():
        if not isinstance(md, TensorStorageMetadata):
            continue
        chunks = []
        for i, chunk in enumerate(md.chunks):
            info = metadata.storage_data.get(MetadataIndex(key, chunk.offsets, i))
            if info is None:
                raise CorruptCheckpointError(f"{source}: storage_data: expected an item for {short(key, 120)} "
                                             f"chunk {i} at {tuple(chunk.offsets)}, actual none")
            transforms = list(getattr(info, "transform_descriptors", None) or ())
            chunks.append(Chunk(tuple(chunk.offsets), tuple(chunk.sizes), str(info.relative_path), int(info.offset),
                                int(info.length), bool(transforms)))
        out.append(TensorEntry(key, md.properties.dtype, tuple(md.size), chunks))
    return out


@dataclass
class Selection:
    """Which tensors an export writes, and under which names."""

    part: str = "model"
    include: Sequence[str] = ()
    """Exported names must start with one of these (none: all)."""
    exclude: Sequence[str] = ()
    strip_prefix: str = ""
    rename: Callable[[str], str | None] | None = None
    """A hook after the prefix filters: the name to write, or None to leave the tensor out."""
    megatron: bool = field(default=False, repr=False)

    def to_dict(self) -> dict:
        return {"part": self.part, "include": list(self.include), "exclude": list(self.exclude),
                "strip_prefix": self.strip_prefix, "rename": getattr(self.rename, "__qualname__", None)}


def _part_name(key: str, part: str, megatron: bool) -> str | None:
    """The name a key has within ``part``, or None when it is not in it."""
    if megatron:
        is_optimizer = key.startswith("optimizer.")
        if part == "model":
            return None if is_optimizer else key
        return key if part == "all" or is_optimizer else None
    if part == "model":
        return key[len("model."):] if key.startswith("model.") else None
    if part == "optimizer":
        return key if key.startswith("optim.") else None
    return key


def select(entries: list[TensorEntry], selection: Selection) -> list[TensorEntry]:
    """The entries to export, named (``TensorEntry.name``); UsageError when nothing is left or two
    tensors would share a name."""
    if selection.part not in PARTS:
        raise UsageError(f"what: expected one of {', '.join(PARTS)}, actual {selection.part!r}")
    chosen, seen = [], {}
    for entry in entries:
        name = _part_name(entry.key, selection.part, selection.megatron)
        if name is None or (selection.include and not name.startswith(tuple(selection.include))):
            continue
        if selection.exclude and name.startswith(tuple(selection.exclude)):
            continue
        if selection.strip_prefix and name.startswith(selection.strip_prefix):
            name = name[len(selection.strip_prefix):]
        if selection.rename is not None:
            name = selection.rename(name)
            if name is None:
                continue
        if not name:
            raise UsageError(f"{entry.key}: exported name: expected a non-empty name, actual '' (after the filters)")
        if name in seen:
            raise UsageError(f"exported name {name!r}: expected one tensor, actual two ({seen[name]} and {entry.key})")
        seen[name] = entry.key
        entry.name = name
        chosen.append(entry)
    if not chosen:
        raise UsageError(f"selection: expected at least one tensor, actual none ({short(selection.to_dict())})")
    return chosen
