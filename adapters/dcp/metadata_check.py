"""The shape and bounds of DCP's ``.metadata``, checked before anything uses it.

The restricted unpickler (``unpickle``) guarantees that only the metadata classes were
made; this module guarantees they were put together as DCP puts them: a ``Metadata``
whose ``state_dict_metadata`` maps names to tensor or bytes entries with consistent
shapes and chunks, whose ``storage_data`` maps each item to a short path inside the
step directory and a byte range inside that file (``file_sizes``: the manifest's),
and nothing nested deeper or larger than a real checkpoint's. Anything else is a
``CorruptCheckpointError`` naming the file and the field (a path outside the step
directory: ``UnsafeCheckpointError``). Values are quoted with ``resume.text.short``.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import pathlib
from collections.abc import Collection, Mapping
from typing import Any

import torch
from torch.distributed.checkpoint import filesystem as _fs
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from resume.errors import CorruptCheckpointError, ManifestError, UnsafeCheckpointError
from resume.manifest import check_relative_path
from resume.text import short

__all__ = ["MAX_NAME", "check_metadata", "chunk_bytes", "stored_bytes"]

MAX_NAME = 4096
"""Longest state-dict key or file name accepted."""
_MAX_INT = 2**62
_MAX_DIMS = 64
_PLAIN_DEPTH = 32
_PLAIN_NODES = 10_000_000
"""Visits of a generic walk (``planner_data``): a shared graph is counted per path, so a
pickle of a few hundred bytes cannot make a walk of 2**64 steps."""
_EXTRA_FIELDS = {"all_local_plans"}
"""Attributes beyond DCP's own that a known saver adds (Megatron-Core's torch_dist)."""


def _refuse(source: str, field: str, expected: str, actual: Any) -> CorruptCheckpointError:
    return CorruptCheckpointError(f"{source}: {field}: expected {expected}, actual {short(actual)}")


def _check_int(value: Any, source: str, field: str, *, limit: int = _MAX_INT) -> int:
    if type(value) is not int or not 0 <= value <= limit:
        raise _refuse(source, field, f"an integer in [0, {limit}]", value)
    return value


def _check_str(value: Any, source: str, field: str, *, optional: bool = False) -> None:
    if value is None and optional:
        return
    if type(value) is not str or len(value) > MAX_NAME:
        raise _refuse(source, field, f"a string of at most {MAX_NAME} characters", value)


def check_metadata(metadata: Any, *, source: str, file_sizes: Mapping[str, int] | None = None,
                   transforms: Collection[str] | None = None) -> None:
    """Raise CorruptCheckpointError (or UnsafeCheckpointError) unless ``metadata`` is sound.
    ``file_sizes`` (the manifest's) bound every item; ``transforms``: the only transform
    descriptors an item may name (the compression the manifest records; None: not checked)."""
    if type(metadata) is not Metadata:
        raise _refuse(source, "metadata", "a DCP Metadata", type(metadata).__name__)
    extra = set(vars(metadata)) - {f for f in Metadata.__dataclass_fields__} - _EXTRA_FIELDS
    if extra:
        raise _refuse(source, "metadata", "DCP's fields only", sorted(extra))
    entries = metadata.state_dict_metadata
    if type(entries) is not dict:
        raise _refuse(source, "state_dict_metadata", "a dict", type(entries).__name__)
    for fqn, entry in entries.items():
        _check_str(fqn, source, "state_dict_metadata key")
        _check_entry(entry, source, f"state_dict_metadata[{short(fqn)}]")
    _check_storage_data(metadata.storage_data, entries, source, file_sizes, transforms)
    _check_plain(metadata.planner_data, source, "planner_data")
    _check_storage_meta(metadata.storage_meta, source)
    _check_str(metadata.version, source, "version", optional=True)
    if "all_local_plans" in vars(metadata):
        _check_plain(metadata.all_local_plans, source, "all_local_plans")


def _check_entry(entry: Any, source: str, field: str) -> None:
    if type(entry) is BytesStorageMetadata:
        return
    if type(entry) is not TensorStorageMetadata:
        raise _refuse(source, field, "a TensorStorageMetadata or BytesStorageMetadata", type(entry).__name__)
    props = entry.properties
    if type(props) is not TensorProperties or not isinstance(props.dtype, torch.dtype):
        raise _refuse(source, f"{field}.properties", "TensorProperties with a dtype", props)
    size = _check_shape(entry.size, source, f"{field}.size", None)
    if math.prod(size) * _itemsize(props.dtype) > _MAX_INT:
        raise _refuse(source, f"{field}.size", f"at most {_MAX_INT} bytes", size)
    chunks = entry.chunks
    if type(chunks) is not list:
        raise _refuse(source, f"{field}.chunks", "a list", type(chunks).__name__)
    for i, chunk in enumerate(chunks):
        where = f"{field}.chunks[{i}]"
        if type(chunk) is not ChunkStorageMetadata:
            raise _refuse(source, where, "a ChunkStorageMetadata", type(chunk).__name__)
        offsets = _check_shape(chunk.offsets, source, f"{where}.offsets", len(size))
        sizes = _check_shape(chunk.sizes, source, f"{where}.sizes", len(size))
        if any(o + n > d for o, n, d in zip(offsets, sizes, size)):
            raise _refuse(source, where, f"offsets + sizes within the tensor's size {tuple(size)}",
                          (tuple(offsets), tuple(sizes)))


def _check_shape(shape: Any, source: str, field: str, dims: int | None) -> tuple[int, ...]:
    if type(shape) is not torch.Size or len(shape) > _MAX_DIMS or (dims is not None and len(shape) != dims):
        expected = f"a torch.Size of {dims} dimensions" if dims is not None else "a torch.Size"
        raise _refuse(source, field, expected, shape)
    for i, n in enumerate(shape):
        _check_int(n, source, f"{field}[{i}]")
    return tuple(shape)


def _itemsize(dtype: torch.dtype) -> int:
    return dtype.itemsize


def chunk_bytes(chunk: ChunkStorageMetadata, dtype: torch.dtype) -> int:
    """The bytes of a stored chunk, uncompressed: what its item may decompress to (plus
    ``torch.save``'s small framing)."""
    return math.prod(chunk.sizes) * _itemsize(dtype)


def _check_storage_data(storage: Any, entries: dict, source: str, file_sizes: Mapping[str, int] | None,
                        transforms: Collection[str] | None) -> None:
    if type(storage) is not dict:
        raise _refuse(source, "storage_data", "a dict", type(storage).__name__)
    chunks_at: dict = {}
    for index, info in storage.items():
        if type(index) is not MetadataIndex or type(index.fqn) is not str or index.fqn not in entries:
            raise _refuse(source, "storage_data key", "a MetadataIndex naming a state_dict_metadata entry",
                          getattr(index, "fqn", index))
        field = f"storage_data[{short(index.fqn)}]"
        if index.offset is not None:
            _check_shape(index.offset, source, f"{field}.offset", None)
        _check_storage_info(info, source, field, file_sizes)
        named = list(info.transform_descriptors or ())
        if transforms is not None and any(t not in transforms for t in named):
            raise _refuse(source, f"{field}.transform_descriptors",
                          f"only {sorted(transforms)} (the compression the manifest records)" if transforms
                          else "none (the run's manifest records no compression)", named)
        stored = stored_bytes(entries[index.fqn], index, chunks_at)
        if stored is not None and not info.transform_descriptors and stored > info.length:
            # Stored raw, a chunk takes at least its bytes: a larger shape than the file holds.
            raise _refuse(source, f"{field}.length", f"at least the chunk's {stored} bytes", info.length)


def stored_bytes(entry: Any, index: MetadataIndex, chunks_at: dict | None = None) -> int | None:
    """The uncompressed bytes of the chunk ``index`` names (None: a bytes entry, or no such
    chunk): what its item may hold, and decompress to, besides torch.save's framing.
    ``chunks_at``: a dict kept by the caller over many calls, in which each entry's chunks are
    looked up by offsets (made once per entry: a tensor of thousands of chunks, each looked up
    in a loop over them, took minutes)."""
    if type(entry) is not TensorStorageMetadata or index.offset is None:
        return None
    if chunks_at is None:
        chunk = next((c for c in entry.chunks if tuple(c.offsets) == tuple(index.offset)), None)
    else:
        by_offsets = chunks_at.get(id(entry))
        if by_offsets is None or by_offsets[0] is not entry:
            by_offsets = chunks_at[id(entry)] = (entry, {})
            for c in reversed(entry.chunks):  # the first of equal offsets wins, as in the loop
                by_offsets[1][tuple(c.offsets)] = c
        chunk = by_offsets[1].get(tuple(index.offset))
    return None if chunk is None else chunk_bytes(chunk, entry.properties.dtype)


def _check_storage_info(info: Any, source: str, field: str, file_sizes: Mapping[str, int] | None) -> None:
    if type(info) is not _fs._StorageInfo:
        raise _refuse(source, field, "a _StorageInfo", type(info).__name__)
    path = info.relative_path
    _check_str(path, source, f"{field}.relative_path")
    try:
        check_relative_path(path, source=source)
    except ManifestError as e:
        raise UnsafeCheckpointError(f"{source}: storage_data.relative_path: expected a file inside the "
                                    f"step directory, actual {short(path)}") from e
    size = None if file_sizes is None else file_sizes.get(path)
    if file_sizes is not None and size is None:
        raise _refuse(source, f"{field}.relative_path", "a file of the step directory", path)
    offset = _check_int(info.offset, source, f"{field}.offset")
    length = _check_int(info.length, source, f"{field}.length")
    if size is not None and offset + length > size:
        raise _refuse(source, f"{field}.offset + length", f"at most {path}'s size {size}", offset + length)
    transforms = info.transform_descriptors
    if transforms is not None and (type(transforms) not in (list, tuple) or len(transforms) > 8
                                   or any(type(t) is not str or len(t) > 64 for t in transforms)):
        raise _refuse(source, f"{field}.transform_descriptors", "a short list of names", transforms)


def _check_storage_meta(meta: Any, source: str) -> None:
    if meta is None:
        return
    if type(meta) is not StorageMeta:
        raise _refuse(source, "storage_meta", "a StorageMeta", type(meta).__name__)
    if meta.checkpoint_id is not None and not isinstance(meta.checkpoint_id, (str, pathlib.PurePath)):
        raise _refuse(source, "storage_meta.checkpoint_id", "a path", meta.checkpoint_id)
    _check_str(meta.save_id, source, "storage_meta.save_id", optional=True)
    _check_str(meta.load_id, source, "storage_meta.load_id", optional=True)
    if type(meta.modules) is not list:
        raise _refuse(source, "storage_meta.modules", "a list", meta.modules)
    for i, name in enumerate(meta.modules):
        _check_str(name, source, f"storage_meta.modules[{i}]")


_LEAVES = (str, int, float, bool, type(None), torch.dtype, torch.layout, torch.memory_format,
           pathlib.PurePath, enum.Enum)


def _check_plain(value: Any, source: str, field: str) -> None:
    """Plain data (containers of leaves, or the metadata's own records) no deeper than
    ``_PLAIN_DEPTH`` and of at most ``_PLAIN_NODES`` visits: walked without recursion."""
    pending: list[tuple[Any, int]] = [(value, 0)]
    visits = 0
    while pending:
        item, depth = pending.pop()
        visits += 1
        if depth > _PLAIN_DEPTH or visits > _PLAIN_NODES:
            raise _refuse(source, field, f"plain data at most {_PLAIN_DEPTH} levels deep and "
                          f"{_PLAIN_NODES} items large", "more")
        if isinstance(item, _LEAVES) or type(item) is torch.Size:
            if type(item) is float and not math.isfinite(item):
                raise _refuse(source, field, "finite numbers", item)
            continue
        if type(item) in (list, tuple):
            pending.extend((v, depth + 1) for v in item)
        elif isinstance(item, dict):
            pending.extend((v, depth + 1) for pair in item.items() for v in pair)
        elif dataclasses.is_dataclass(item) and not isinstance(item, type):
            # A record the unpickler allowed: its fields.
            pending.extend((v, depth + 1) for v in vars(item).values())
        else:
            raise _refuse(source, field, "plain data", type(item).__name__)
