"""The checkpoint's index in a form that cannot run code: typed arrays, read without unpickling.

DCP's ``.metadata`` is a pickle of one object per chunk: at 5,120 ranks, 613 MiB that take
minutes to vet and to send. Beside it (still written, for ``dcp.load`` and other tools) each
save writes ``INDEX_FILE``: a JSON header (the names: keys, files, dtypes) and five int64
arrays, checksummed in the manifest like any file::

    b"RESUMEIX" | u32 version | u32 header length | header JSON | arrays (8-byte aligned)

    keys    [K, 7]  kind (0 tensor, 1 bytes), dtype, ndim, dims start, chunk start, chunk count, flags
    dims    [D]     every tensor's global shape
    chunks  [C, 5]  coords start, file, offset, length, transform (0 none, 1 zstd)
    coords  [X]     each tensor chunk's offsets, then its sizes (ndim each)

At a restore rank 0 reads and bounds-checks it once (``CheckpointIndex.parse``); every rank
sends what it holds (``requests_for``: a 64-bit hash of each key and the box of each local
chunk), rank 0 answers each rank with the entries overlapping its boxes only (``select``, the
same format with the keys left out: they are the rank's own, in its order) and the files it
hashes while the load reads them (``hash_owners``), and each rank builds the DCP ``Metadata`` of
its own load from that (``partial_metadata``), after checking that the chunks it got cover each
of its boxes exactly once. Nothing here imports a pickle; a damaged or forged index is a
``CorruptCheckpointError`` naming the file and the field.
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint import filesystem as _fs
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from resume.errors import CorruptCheckpointError, ManifestError, UnsafeCheckpointError
from resume.manifest import check_relative_path
from resume.text import short

from .metadata_check import MAX_NAME
from .written import Written, columns_of

__all__ = ["INDEX_FILE", "CheckpointIndex", "PlanTables", "Requests", "SubIndex", "dtype_of", "encode_index",
           "partial_metadata",
           "plan_tables", "requests_for"]

INDEX_FILE = "index.resume"
MAGIC = b"RESUMEIX"
VERSION = 1
ZSTD = "stream.zstd"
_ARRAYS = (("keys", 7), ("dims", 1), ("chunks", 5), ("coords", 1))
_MAX_INT = 2**62
_MAX_DIMS = 64
_HEADER_CAP = 1 << 30
_DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
    torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128, torch.float8_e4m3fn,
    torch.float8_e5m2, torch.uint16, torch.uint32, torch.uint64)}
_FLAG_REQUIRES_GRAD, _FLAG_PIN = 1, 2


def dtype_of(name: str) -> torch.dtype:
    """The torch dtype of a name in ``header.dtypes`` (``CheckpointIndex.parse`` accepts only these)."""
    return _DTYPES[name]


def key_hash(name: str) -> int:
    """A key's 64-bit name hash (what a rank sends for it instead of the name)."""
    return int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little") >> 1


# -- writing ---------------------------------------------------------------------------------------

def encode_index(metadata: Metadata, written: Written | None = None) -> bytes:
    """``metadata`` (DCP's, after ``finish`` filled ``storage_data``; ``written``: its columns,
    when already read) as the index. ValueError for what the format cannot say (an unknown
    dtype, layout or memory format, an entry that is no chunk of the plan): the save then writes
    no index and a restore reads ``.metadata`` as before.

    What depends on the plan alone (names, shapes, chunks, each chunk's place on one line of
    every tensor's elements) is kept for the next save of the same plan (DCP's plan cache
    hands back the same objects); each save places its entries on that line, vectorized."""
    tables = plan_tables(metadata.state_dict_metadata)
    kept = _ENCODED[0] if _ENCODED else None
    if (written is not None and kept is not None and kept[0] is tables and kept[1] is written
            and kept[2] == metadata.version):
        return kept[3]  # a later save of the plan whose every rank wrote the same (written_of)
    _ENCODED.clear()
    given, written = written, columns_of(metadata.storage_data) if written is None else written
    data = _encoded(tables, written, metadata.version)
    if given is not None:
        _ENCODED[:] = [(tables, given, metadata.version, data)]
    return data


_ENCODED: list[tuple[PlanTables, Written, Any, bytes]] = []
"""The last index encoded: its plan's tables, the save's columns, DCP's version, the bytes."""


def _encoded(tables: PlanTables, written: Written, version: Any) -> bytes:
    rows = _entry_rows(tables, written)
    chunks = tables.chunks.copy()
    chunks[rows, 1] = written.file
    chunks[rows, 2] = written.offset
    chunks[rows, 3] = written.length
    if written.transforms is not None:
        chunks[rows, 4] = [_transform(named) for named in written.transforms]
    header = {"keys": tables.names, "files": written.files, "dtypes": tables.dtypes, "dcp_version": version}
    return _pack(header, {"keys": tables.keys, "dims": tables.dims, "chunks": chunks, "coords": tables.coords})


@dataclass
class PlanTables:
    """A plan's (``state_dict_metadata``'s) keys and chunks as arrays, in its order: each key's
    row (kind, dtype, ndim, dims start, first chunk row, chunk count, flags), each chunk's row
    (coords start, then the storage columns a save fills), every chunk's offsets then sizes."""

    plan: Any
    """The ``state_dict_metadata`` these were made from (held: its identity is the cache key)."""
    names: list[str]
    dtypes: list[str]
    keys: np.ndarray
    dims: np.ndarray
    chunks: np.ndarray
    """coords start, then placeholders for the storage columns."""
    coords: np.ndarray
    line: tuple | None = None
    """``_chunk_line`` of these tables (None: too many elements for one line)."""


_LAST_PLAN: list[PlanTables] = []


def plan_tables(plan: Mapping[str, Any]) -> PlanTables:
    """``plan``'s tables, kept for the next call with the same object (DCP's plan cache hands
    back the same ``state_dict_metadata`` at every save of a plan). ValueError where the index
    cannot say a key (``_dtype_name``)."""
    if _LAST_PLAN and _LAST_PLAN[0].plan is plan:
        return _LAST_PLAN[0]
    dtypes: dict[str, int] = {}
    key_rows, dims, chunk_rows, coords = [], [], [], []
    for entry in plan.values():
        if isinstance(entry, BytesStorageMetadata):
            key_rows.append((1, -1, 0, len(dims), len(chunk_rows), 1, 0))
            chunk_rows.append(-1)
            continue
        props = entry.properties
        dtype = dtypes.setdefault(_dtype_name(props), len(dtypes))
        flags = _FLAG_REQUIRES_GRAD * bool(props.requires_grad) + _FLAG_PIN * bool(props.pin_memory)
        key_rows.append((0, dtype, len(entry.size), len(dims), len(chunk_rows), len(entry.chunks), flags))
        dims.extend(entry.size)
        for chunk in entry.chunks:
            chunk_rows.append(len(coords))
            coords.extend(chunk.offsets)
            coords.extend(chunk.sizes)
    chunks = np.zeros((len(chunk_rows), 5), np.int64)
    chunks[:, 0] = chunk_rows
    tables = PlanTables(plan, list(plan), list(dtypes), np.array(key_rows, np.int64).reshape(-1, 7),
                         np.array(dims, np.int64), chunks, np.array(coords, np.int64))
    tables.line = _chunk_line(tables)
    _LAST_PLAN[:] = [tables]
    return tables


def _entry_rows(tables: PlanTables, written: Written) -> np.ndarray:
    """Each written entry's chunk row: an object's key's one row; a tensor chunk's found by its
    key and first element on the line, its offsets then compared. ValueError unless the entries
    are the plan's chunks, each once."""
    number = {name: i for i, name in enumerate(tables.names)}
    try:
        key = np.array([number[name] for name in written.names] or [0], np.int64)[written.key]
    except KeyError as e:
        raise ValueError(f"index: storage_data: an entry of no key of the plan: {short(e.args[0])}") from e
    keys = tables.keys
    rows = np.full(len(written), -1, np.int64)
    objects = keys[key, 0] == 1
    rows[objects & (written.ndim == -1)] = keys[key[objects & (written.ndim == -1)], 4]
    tensor = np.flatnonzero(~objects & (written.ndim == keys[key, 2]))
    at = _exclusive(np.maximum(written.ndim, 0))[:-1]
    if tables.line is not None and len(tensor):
        found, chunk = _exact_pairs(tables, tables.line, key, at, written.offsets, tensor, keys[key, 2],
                                    offsets_only=True)
        rows[tensor[found]] = chunk
    rows = _rows_left(tables, written, key, at, rows)
    if len(rows) != len(tables.chunks) or (np.bincount(rows, minlength=len(tables.chunks)) != 1).any():
        raise ValueError(f"index: storage_data: expected the plan's {len(tables.chunks)} chunks once each, "
                         f"actual {len(rows)} entries")
    return rows


def _rows_left(tables: PlanTables, written: Written, key: np.ndarray, at: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """The rows of entries the line did not place (an empty chunk, a plan too large for one
    line), key by key in Python: a few in a real plan."""
    keys = tables.keys
    for e in np.flatnonzero(rows < 0):
        k, nd = int(key[e]), int(written.ndim[e])
        if nd < 0 or keys[k, 0] != 0 or nd != keys[k, 2]:
            raise ValueError(f"index: storage_data: {short(tables.names[k])}: expected an entry of the plan's kind")
        offsets = written.offsets[at[e]:at[e] + nd]
        for c in range(int(keys[k, 4]), int(keys[k, 4] + keys[k, 5])):
            c_at = int(tables.chunks[c, 0])
            if (tables.coords[c_at:c_at + nd] == offsets).all():
                rows[e] = c
                break
        else:
            raise ValueError(f"index: storage_data: {short(tables.names[k])}: an offset of no chunk of the plan")
    return rows


def _dtype_name(props: TensorProperties) -> str:
    name = str(props.dtype).removeprefix("torch.")
    if name not in _DTYPES or props.layout != torch.strided or props.memory_format != torch.contiguous_format:
        raise ValueError(f"index: tensor properties: expected a strided contiguous tensor of a known dtype, "
                         f"actual {props.dtype}, {props.layout}, {props.memory_format}")
    return name


def _transform(descriptors: Any) -> int:
    named = list(descriptors or ())
    if not named:
        return 0
    if named == [ZSTD]:
        return 1
    raise ValueError(f"index: transform_descriptors: expected none or [{ZSTD}], actual {named}")


def _pack(header: dict, arrays: Mapping[str, Any]) -> bytes:
    blobs, layout, at = [], {}, 0
    for name, width in _ARRAYS:
        array = np.ascontiguousarray(arrays[name], dtype="<i8").reshape(-1)
        if width > 1 and array.size % width:
            raise ValueError(f"index: {name}: expected rows of {width}")
        layout[name] = [at, int(array.size)]
        blobs.append(array)  # joined from the array's own memory: one copy, not two
        at += array.nbytes
    head = json.dumps({**header, "arrays": layout}, separators=(",", ":")).encode()
    head += b" " * (-(len(MAGIC) + 8 + len(head)) % 8)
    return b"".join([MAGIC, struct.pack("<II", VERSION, len(head)), head, *blobs])


# -- reading and checking ----------------------------------------------------------------------------

@dataclass
class _Parsed:
    header: dict
    keys: np.ndarray
    dims: np.ndarray
    chunks: np.ndarray
    coords: np.ndarray


def _unpack(data: bytes, source: str) -> _Parsed:
    def refuse(field: str, expected: str, actual: Any) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"{source}: {field}: expected {expected}, actual {short(actual)}")
    if len(data) < len(MAGIC) + 8 or data[:len(MAGIC)] != MAGIC:
        raise refuse("magic", f"{MAGIC!r}", data[:len(MAGIC)])
    version, head_len = struct.unpack_from("<II", data, len(MAGIC))
    if version != VERSION:
        raise refuse("version", str(VERSION), version)
    start = len(MAGIC) + 8
    if head_len > min(_HEADER_CAP, len(data) - start):
        raise refuse("header length", f"at most the {len(data) - start} bytes left", head_len)
    try:
        header = json.loads(data[start:start + head_len])
    except (ValueError, RecursionError) as e:
        raise refuse("header", "JSON", f"{type(e).__name__}: {e}") from e
    if not isinstance(header, dict) or not isinstance(header.get("arrays"), dict):
        raise refuse("header", "an object with 'arrays'", header if not isinstance(header, dict) else sorted(header))
    body, arrays = memoryview(data)[start + head_len:], {}
    for name, width in _ARRAYS:
        at = header["arrays"].get(name)
        if (not isinstance(at, list) or len(at) != 2 or any(type(v) is not int or v < 0 for v in at)
                or at[0] % 8 or at[0] + 8 * at[1] > len(body) or at[1] % width):
            raise refuse(f"arrays.{name}", f"[offset, count] of {width}-wide rows inside the file", at)
        arrays[name] = np.frombuffer(body, dtype="<i8", count=at[1], offset=at[0]).reshape(-1, width) \
            if width > 1 else np.frombuffer(body, dtype="<i8", count=at[1], offset=at[0])
    return _Parsed(header, arrays["keys"], arrays["dims"], arrays["chunks"], arrays["coords"])


def _names(header: dict, field: str, source: str, *, optional: bool = False) -> list[str] | None:
    names = header.get(field)
    if names is None and optional:
        return None
    if not isinstance(names, list) or not all(type(n) is str and 0 < len(n) <= MAX_NAME for n in names):
        raise CorruptCheckpointError(f"{source}: header.{field}: expected a list of names of at most "
                                     f"{MAX_NAME} characters, actual {short(names)}")
    return names


class CheckpointIndex:
    """The index of one checkpoint, checked in shape and bounds (``parse``)."""

    def __init__(self, parsed: _Parsed, source: str) -> None:
        self.source = source
        self.keys = parsed.keys
        self.dims = parsed.dims
        self.chunks = parsed.chunks
        self.coords = parsed.coords
        self.names: list[str] = parsed.header["keys"]
        self.files: list[str] = parsed.header["files"]
        self.dtypes: list[str] = parsed.header["dtypes"]
        self.dcp_version = parsed.header.get("dcp_version")
        self._hashes: tuple[np.ndarray, np.ndarray] | None = None
        self._line: tuple | None = None

    @classmethod
    def parse(cls, data: bytes, *, source: str, file_sizes: Mapping[str, int] | None,
              compression: str | None = None) -> CheckpointIndex:
        """CorruptCheckpointError (UnsafeCheckpointError for a path leading out of the step
        directory) unless every entry is within bounds: rows, shapes, chunks inside their
        tensor, items inside the files ``file_sizes`` (the manifest's) lists, 1-D chunks disjoint."""
        parsed = _unpack(data, source)
        names = _names(parsed.header, "keys", source)
        if len(set(names)) != len(names):
            raise CorruptCheckpointError(f"{source}: header.keys: expected distinct names, actual duplicates")
        index = cls(parsed, source)
        _check_header(parsed.header, source, file_sizes, len(names), len(parsed.keys))
        check_arrays(index, source, file_sizes, compression)
        return index

    def line_chunks(self, built: _LineBuilder | None = None) -> tuple | None:
        """Every tensor key's elements on one line, row-major, each key after the previous one:
        (each key's base on it, every non-empty chunk's first element there, sorted, where it
        ends (a one-dimensional chunk: its last element + 1; any other: its first + 1), their
        rows, each dimension's stride in ``dims``, each chunk's key). None where the keys'
        elements together pass 2**62 (each key is then searched on its own). ``built``: the
        boxes ``parse``'s checks gathered (``_chunk_line``)."""
        if self._line is None:
            self._line = _chunk_line(self, built) or (None,)
        return self._line if self._line[0] is not None else None

    def key_hashes(self) -> tuple[np.ndarray, np.ndarray]:
        """(sorted 64-bit hashes of the keys, the key each belongs to)."""
        if self._hashes is None:
            hashes = np.fromiter((key_hash(n) for n in self.names), dtype=np.int64, count=len(self.names))
            order = np.argsort(hashes, kind="stable")
            if len(hashes) > 1 and (np.diff(hashes[order]) == 0).any():
                raise CorruptCheckpointError(f"{self.source}: header.keys: expected names with distinct "
                                             "64-bit hashes, actual a collision")
            self._hashes = (hashes[order], order)
        return self._hashes


def _chunk_line(index: Any, built: _LineBuilder | None = None) -> tuple | None:
    """``CheckpointIndex.line_chunks`` of ``index`` (or of a save's ``PlanTables``). ``built``:
    every box already added (``parse`` gathers them to check them)."""
    if built is None:
        frame = _line_frame(index, _chunk_keys(index.keys))
        if frame is None:
            return None
        built = _LineBuilder(index, frame)
        for n, mine, box in _chunk_boxes(index, frame[2]):
            built.add(n, mine, box)
    return built.line()


class _LineBuilder:
    """The line's chunks, added a block of boxes at a time into arrays as long as the chunks
    (filled in place: no list of pieces to join, half the memory at its peak), then sorted."""

    def __init__(self, index: Any, frame: tuple) -> None:
        self.dims_at = index.keys[:, 3]
        self.base, self.stride, self.chunk_key = frame
        self.start, self.end, self.row = (np.empty(len(index.chunks), np.int64) for _ in range(3))
        self.count = 0

    def add(self, n: int, mine: np.ndarray, box: np.ndarray) -> None:
        """The non-empty ones of chunks ``mine`` (boxes ``box``, ``n`` dimensions)."""
        k = self.chunk_key[mine]
        keep = (box[:, n:] > 0).all(axis=1)
        start = self.base[k] + (box[:, :n] * self.stride[self.dims_at[k][:, None] + np.arange(n)]).sum(axis=1)
        at, count = self.count, int(keep.sum())
        self.start[at:at + count] = start[keep]
        self.end[at:at + count] = (start + (box[:, 1] if n == 1 else 1))[keep]
        self.row[at:at + count] = mine[keep]
        self.count += count

    def line(self) -> tuple:
        order = np.argsort(self.start[:self.count], kind="stable")
        start, end, row = (a[:self.count][order] for a in (self.start, self.end, self.row))
        return self.base, start, end, row, self.stride, self.chunk_key


def _chunk_keys(keys: np.ndarray) -> np.ndarray:
    """Each chunk row's key (the keys' rows checked: their chunks in order, counts >= 0)."""
    return np.repeat(np.arange(len(keys)), keys[:, 5]) if len(keys) else np.zeros(0, np.int64)


def _line_frame(index: Any, chunk_key: np.ndarray) -> tuple | None:
    """(each key's base on the line, each dimension's stride in ``dims``, ``chunk_key``); None
    where the keys' elements together pass 2**62."""
    keys, dims = index.keys, index.dims
    nd = np.where(keys[:, 0] == 0, keys[:, 2], 0) if len(keys) else np.zeros(0, np.int64)
    stride = np.zeros(len(dims), np.int64)
    numel = np.where(keys[:, 0] == 0, 1, 0) if len(keys) else np.zeros(0, np.int64)
    for n in np.unique(nd[nd > 0]):
        n, mine = int(n), np.flatnonzero(nd == n)
        shape = dims[keys[mine, 3][:, None] + np.arange(n)]
        if np.prod(shape.astype(np.float64), axis=1).sum() > _MAX_INT:
            return None
        tail = np.cumprod(shape[:, ::-1], axis=1)[:, ::-1]
        stride[keys[mine, 3][:, None] + np.arange(n)] = np.concatenate([tail[:, 1:], np.ones((len(mine), 1), np.int64)], 1)
        numel[mine] = tail[:, 0]
    if float(numel.astype(np.float64).sum()) > _MAX_INT:
        return None
    return np.concatenate([[0], np.cumsum(numel)[:-1]]).astype(np.int64), stride, chunk_key


_BLOCK_CHUNKS = 1 << 18


def _chunk_boxes(index: Any, chunk_key: np.ndarray, refuse: Any = None) -> Iterable[tuple[int, np.ndarray, np.ndarray]]:
    """(ndim, rows, offsets then sizes) of the tensor chunks, ``_BLOCK_CHUNKS`` rows at a time
    split by number of dimensions (small arrays: at 5,120 ranks, gathering every box at once
    took 0.3 GB more, which this machine maps and faults in anew). ``refuse``:
    CorruptCheckpointError, before any gather, for coords out of range (None: a save's own
    tables, not checked)."""
    keys, chunks = index.keys, index.chunks
    key_nd = np.where(keys[:, 0] == 0, keys[:, 2], -1) if len(keys) else chunk_key
    for b in range(0, len(chunk_key), _BLOCK_CHUNKS):
        nd = key_nd[chunk_key[b:b + _BLOCK_CHUNKS]]
        for n in (np.flatnonzero(np.bincount(nd + 1)) - 1).tolist():
            if n < 0:
                continue
            mine = b + np.flatnonzero(nd == n)
            at = chunks[mine, 0]
            if refuse is not None and ((at < 0) | (at > len(index.coords) - 2 * n)).any():
                outside = mine[(at < 0) | (at > len(index.coords) - 2 * n)]
                raise refuse("chunks", "coords inside coords", np.isin(np.arange(len(chunks)), outside))
            yield n, mine, index.coords[at[:, None] + np.arange(2 * n)]


def _check_header(header: dict, source: str, file_sizes: Mapping[str, int] | None, names: int, rows: int) -> None:
    if names != rows:
        raise CorruptCheckpointError(f"{source}: arrays.keys: expected {names} rows (one per key), actual {rows}")
    for path in _names(header, "files", source) or ():
        try:
            check_relative_path(path, source=source)
        except ManifestError as e:
            raise UnsafeCheckpointError(f"{source}: header.files: expected files inside the step directory, "
                                        f"actual {short(path)}") from e
        if file_sizes is not None and path not in file_sizes:
            raise CorruptCheckpointError(f"{source}: header.files: expected files the manifest lists, "
                                         f"actual {short(path)}")
    dtypes = _names(header, "dtypes", source) or []
    unknown = [d for d in dtypes if d not in _DTYPES]
    if unknown:
        raise CorruptCheckpointError(f"{source}: header.dtypes: expected names of {sorted(_DTYPES)}, "
                                     f"actual {short(unknown)}")


def check_arrays(index: CheckpointIndex | SubIndex, source: str, file_sizes: Mapping[str, int] | None,
                 compression: str | None) -> None:
    """The arrays' bounds, vectorized: every row points inside its table, every chunk inside its
    tensor, every item inside its file."""
    def refuse(field: str, expected: str, rows: np.ndarray) -> CorruptCheckpointError:
        bad = int(np.flatnonzero(rows)[0])
        return CorruptCheckpointError(f"{source}: {field}[{bad}]: expected {expected}, actual "
                                      f"{short(_row(index, field, bad))}")
    keys, chunks = index.keys, index.chunks
    kind, dtype, ndim, dims_at, first, count, flags = keys.T if len(keys) else [np.zeros(0, np.int64)] * 7
    tensor = kind == 0
    checks = [
        ("keys", "kind 0 (tensor) or 1 (bytes)", (kind != 0) & (kind != 1)),
        ("keys", f"a dtype among the {len(index.dtypes)} named", tensor & ((dtype < 0) | (dtype >= len(index.dtypes)))),
        ("keys", f"at most {_MAX_DIMS} dimensions inside dims", (ndim < 0) | (ndim > _MAX_DIMS) | (dims_at < 0)
         | (dims_at + ndim > len(index.dims)) | (~tensor & (ndim != 0))),
        ("keys", "chunks in order, inside chunks", (first != np.concatenate([[0], np.cumsum(count)[:-1]]))
         | (count < 0) | (~tensor & (count != 1)) | (flags < 0) | (flags > 3)),
    ]
    for field, expected, bad in checks:
        if bad.any():
            raise refuse(field, expected, bad)
    if len(keys) and int(count.sum()) != len(chunks):
        raise CorruptCheckpointError(f"{source}: arrays.chunks: expected {int(count.sum())} rows (the keys' "
                                     f"chunks), actual {len(chunks)}")
    if (index.dims < 0).any() or (index.dims > _MAX_INT).any():
        raise refuse("dims", f"sizes in [0, {_MAX_INT}]", (index.dims < 0) | (index.dims > _MAX_INT))
    _check_items(index, source, file_sizes, compression, refuse)
    _check_chunk_boxes(index, source, refuse)


def _row(index: Any, field: str, i: int) -> Any:
    table = getattr(index, field)
    return table[i].tolist()


def _check_items(index: Any, source: str, file_sizes: Mapping[str, int] | None, compression: str | None,
                 refuse: Any) -> None:
    chunks = index.chunks
    if not len(chunks):
        return
    # Read as unsigned, a negative value is past 2**63: one comparison checks both ends.
    _, file, offset, length, transform = chunks.view("<u8").T
    bad = (file >= len(index.files)) | (offset > _MAX_INT) | (length > _MAX_INT) \
        | (transform > (1 if compression == "zstd" else 0))
    if bad.any():
        raise refuse("chunks", f"a listed file, a byte range and transform {'0 or 1' if compression == 'zstd' else '0'}"
                     " (the compression the manifest records)", bad)
    if file_sizes is not None:
        sizes = np.array([file_sizes[f] for f in index.files], dtype=np.int64)
        for b in range(0, len(chunks), _BLOCK_CHUNKS):
            part = chunks[b:b + _BLOCK_CHUNKS]
            over = part[:, 2] + part[:, 3] > sizes[part[:, 1]]
            if over.any():
                raise refuse("chunks", "offset + length within the file's size", np.concatenate([np.zeros(b, bool), over]))


def _check_chunk_boxes(index: Any, source: str, refuse: Any) -> None:
    """Each tensor chunk's offsets and sizes inside the tensor; stored raw, an item at least its
    chunk's bytes; in one dimension, chunks disjoint (on the line, built from the boxes
    gathered here, when the index has one; else key by key). A block of chunks at a time: the
    first block with a fault names it."""
    if not len(index.keys):
        return
    chunk_key = _chunk_keys(index.keys)
    frame = _line_frame(index, chunk_key) if isinstance(index, CheckpointIndex) else None
    built, one_d = _LineBuilder(index, frame) if frame is not None else None, []
    for n, mine, box in _chunk_boxes(index, chunk_key, refuse):
        _check_boxes(index, refuse, n, mine, chunk_key[mine], box)
        if built is not None:
            built.add(n, mine, box)
        elif n == 1:
            one_d.append((chunk_key[mine], box[:, 0], box[:, 1]))
    if built is None:
        if one_d:
            _check_disjoint_1d(*(np.concatenate(c) for c in zip(*one_d)), source)
        return
    _, starts, ends = index.line_chunks(built)[:3]
    overlap = starts[1:] < ends[:-1]
    if overlap.any():
        raise CorruptCheckpointError(f"{source}: chunks: expected the chunks of a tensor disjoint, actual "
                                     f"two overlapping at line position {int(starts[1:][overlap][0])}")


def _check_boxes(index: Any, refuse: Any, n: int, mine: np.ndarray, k: np.ndarray, box: np.ndarray) -> None:
    """The chunks ``mine`` (keys ``k``, boxes ``box``) inside their tensor, and each stored raw
    in an item of at least its bytes."""
    chunks, keys = index.chunks, index.keys
    # Unsigned (a negative value past 2**63), an offset in [0, dim] and a size in [0, dim - offset]:
    # no sum to overflow.
    off, size = box[:, :n].view("<u8"), box[:, n:].view("<u8")
    dim = index.dims[keys[k, 3][:, None] + np.arange(n)].view("<u8") if n else off
    bad = (off > dim).any(1) | (size > dim - off).any(1)
    if bad.any():
        where = np.zeros(len(chunks), bool)
        where[mine[bad]] = True
        raise refuse("chunks", "offsets + sizes within the tensor's shape", where)
    itemsize = np.array([_DTYPES[d].itemsize for d in index.dtypes] or [1], np.int64)[keys[k, 1]]
    rows = np.take(chunks, mine, axis=0)
    too_small = (rows[:, 4] == 0) & (rows[:, 3] < np.prod(box[:, n:], axis=1, dtype=np.float64) * itemsize)
    if too_small.any():
        where = np.zeros(len(chunks), bool)
        where[mine[too_small]] = True
        raise refuse("chunks", "at least the chunk's bytes (stored raw)", where)


def _check_disjoint_1d(keys: np.ndarray, starts: np.ndarray, sizes: np.ndarray, source: str) -> None:
    order = np.lexsort((starts, keys))
    k, s, e = keys[order], starts[order], starts[order] + sizes[order]
    overlap = (k[1:] == k[:-1]) & (s[1:] < e[:-1]) & (sizes[order][1:] > 0)
    if overlap.any():
        raise CorruptCheckpointError(f"{source}: chunks: expected the chunks of a tensor disjoint, actual two "
                                     f"overlapping at offset {int(s[1:][overlap][0])}")


# -- what a rank holds, and what it gets --------------------------------------------------------------

@dataclass(frozen=True)
class Requests:
    """What a rank's flattened state dict holds: per box, its key's hash, the box's number of
    dimensions and where its offsets and sizes start in ``coords``. ``names``: the keys, in
    order (kept on the rank: only the arrays travel)."""

    names: list[str]
    hashes: np.ndarray
    ndim: np.ndarray
    coords_at: np.ndarray
    coords: np.ndarray

    def wire(self) -> tuple[bytes, bytes, bytes, bytes]:
        return (self.hashes.tobytes(), self.ndim.tobytes(), self.coords_at.tobytes(), self.coords.tobytes())


def requests_for(flat_state: Mapping[str, Any]) -> Requests:
    """The boxes of a flattened state dict (``flatten_state_dict(_flatten_sharded_tensors(...))``):
    a DTensor's or ShardedTensor's local chunks, a tensor whole, anything else a bytes entry
    (ndim -1); a DTensor of a mesh this rank is not part of, nothing."""
    from torch.distributed.checkpoint.planner_helpers import _create_chunk_list
    from torch.distributed.tensor import DTensor

    names, hashes, ndims, at, coords = [], [], [], [], []
    for name, value in flat_state.items():
        if isinstance(value, DTensor) and value.device_mesh.get_coordinate() is None:
            continue
        if isinstance(value, torch.Tensor):
            boxes = [(tuple(c.offsets), tuple(c.sizes)) for c in _create_chunk_list(value)]
        else:
            boxes = [None]
        h = key_hash(name)
        for box in boxes:
            names.append(name)
            hashes.append(h)
            at.append(len(coords))
            if box is None:
                ndims.append(-1)
            else:
                ndims.append(len(box[0]))
                coords.extend(box[0])
                coords.extend(box[1])
    return Requests(names, np.array(hashes, np.int64), np.array(ndims, np.int64), np.array(at, np.int64),
                    np.array(coords, np.int64))


def _from_wire(wire: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    if not (isinstance(wire, tuple) and len(wire) == 4 and all(type(b) is bytes for b in wire)):
        raise ValueError("index request: expected four byte strings")
    hashes, ndim, at, coords = (np.frombuffer(b, dtype=np.int64) for b in wire)
    if not len(hashes) == len(ndim) == len(at):
        raise ValueError("index request: expected as many hashes, ranks and starts")
    return hashes, ndim, at, coords


# -- rank 0: each rank's entries ------------------------------------------------------------------------

ABSENT = 2
"""A sub-index row's kind for a key the checkpoint does not hold (DCP's plan then names it)."""
_BLOCK_REQUESTS = 1 << 18


def select(index: CheckpointIndex, wires: list[Any], hashed: Iterable[str]) -> list[bytes]:
    """Each rank's sub-index: for each of its boxes, in its order, the key's shape and the chunks
    overlapping the box; and the files of ``hashed`` it reads whole and hashes (each file one
    rank's: the one that reads most of it, else dealt out).

    Ranks a block at a time (``_BLOCK_REQUESTS`` boxes), twice: the pairs, then (once every
    rank's reads are known) the answers. Each block's arrays stay small enough for the caches
    and for the allocator to reuse: at 5,120 ranks, whole-request arrays of 40 MB were mapped
    and faulted in afresh by every temporary."""
    parts = [_from_wire(w) for w in wires]
    counts = np.array([len(p[0]) for p in parts], np.int64)
    per_block = max(1, _BLOCK_REQUESTS * len(parts) // max(1, int(counts.sum())))
    blocks = [(r0, min(len(parts), r0 + per_block)) for r0 in range(0, len(parts), per_block)]
    found = [_block_pairs(index, parts[r0:r1], r0) for r0, r1 in blocks]
    owners = hash_owners(index, [(f.runs, f.run_bytes) for f in found], list(hashed), len(parts))
    answers: list[bytes] = []
    for (r0, r1), f in zip(blocks, found):
        answers.extend(_block_answers(index, f, [owners.get(r, []) for r in range(r0, r1)]))
    return answers


@dataclass
class _Pairs:
    """A block of ranks' requests and the chunks answering them (``select``'s first pass)."""

    key: np.ndarray
    """Each request's key (-1: none of that name)."""
    req: np.ndarray
    chunk: np.ndarray
    """(request, chunk) pairs, sorted by request (numbered inside the block)."""
    bounds: np.ndarray
    """Each rank's first request, then the block's count."""
    pair_bounds: np.ndarray
    """Each rank's first pair, then the block's count."""
    r0: int
    """The block's first rank."""
    runs: np.ndarray
    run_starts: np.ndarray
    run_bytes: np.ndarray
    """``_reads`` of the pairs (ranks numbered among all)."""


def _block_pairs(index: CheckpointIndex, parts: list[tuple], r0: int) -> _Pairs:
    """The pairs of the ranks ``r0``, ``r0 + 1``, ... whose requests are ``parts``. ValueError
    for a box outside its own rank's coordinates."""
    counts = np.array([len(p[0]) for p in parts], np.int64)
    lens = np.array([len(p[3]) for p in parts], np.int64)
    hashes, ndim = np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])
    at = np.concatenate([p[2] for p in parts])
    coords = np.concatenate([p[3] for p in parts])
    own = np.repeat(lens, counts)
    if ((ndim < -1) | (ndim > _MAX_DIMS) | (at < 0) | (at > own - 2 * np.maximum(ndim, 0))).any():
        raise ValueError("index request: a box outside its coordinates")
    at += np.repeat(_exclusive(lens)[:-1], counts)
    key = _key_of(index, hashes)
    req, chunk = _overlaps(index, key, ndim, at, coords)
    bounds = _exclusive(counts)
    pair_bounds = np.searchsorted(req, bounds)
    rank = np.repeat(np.arange(r0, r0 + len(parts)), np.diff(pair_bounds))
    return _Pairs(key, req, chunk, bounds, pair_bounds, r0, *_reads(index, rank, chunk))


def _key_of(index: CheckpointIndex, hashes: np.ndarray) -> np.ndarray:
    """Each request's key (-1: the checkpoint has none of that name)."""
    sorted_hashes, order = index.key_hashes()
    if not len(sorted_hashes):
        return np.full(len(hashes), -1, np.int64)
    pos = np.minimum(np.searchsorted(sorted_hashes, hashes), len(sorted_hashes) - 1)
    return np.where(sorted_hashes[pos] == hashes, order[pos], -1)


def _overlaps(index: CheckpointIndex, key: np.ndarray, ndim: np.ndarray, at: np.ndarray,
              coords: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(request, chunk) pairs, sorted by request: every chunk of the request's key overlapping its
    box (a bytes key: its one item)."""
    keys = index.keys
    known = key >= 0
    kind = np.where(known, keys[np.maximum(key, 0), 0], ABSENT)
    knd = np.where(known, keys[np.maximum(key, 0), 2], -2)
    pairs_r, pairs_c = [], []
    plain = np.flatnonzero((kind == 1) & (ndim == -1))
    pairs_r.append(plain)
    pairs_c.append(keys[key[plain], 4])
    boxed = np.flatnonzero((kind == 0) & (ndim == knd))
    line = index.line_chunks()
    if line is not None:  # a box that is a saved chunk (a restart on the layout it was saved on)
        hit, hit_chunk = _exact_pairs(index, line, key, at, coords, boxed, knd)
        pairs_r.append(boxed[hit])
        pairs_c.append(hit_chunk)
        boxed = boxed[~hit]
    if line is not None:  # the one-dimensional keys (flat optimizer buffers) at once
        one = boxed[knd[boxed] == 1]
        # A box past the saved tensor's end (another shape: DCP's plan names it) overlaps nothing.
        one = one[coords[at[one]] + coords[at[one] + 1] <= index.dims[keys[key[one], 3]]]
        r, c = _line_pairs(line, key[one], coords[at[one]], coords[at[one] + 1])
        pairs_r.append(one[r])
        pairs_c.append(c)
        boxed = boxed[knd[boxed] != 1]
    few = boxed[(knd[boxed] >= 2) & (keys[key[boxed], 5] <= _FEW_CHUNKS)] if len(index.coords) else boxed[:0]
    for nd in np.unique(knd[few]):  # keys of a few chunks each (TP shards): all their requests at once
        r, c = _padded_pairs(index, key, at, coords, few[knd[few] == nd], int(nd))
        pairs_r.append(r)
        pairs_c.append(c)
    boxed = np.setdiff1d(boxed, few, assume_unique=True)
    r, c = _key_pairs(index, key, at, coords, boxed)
    pairs_r.append(r)
    pairs_c.append(c)
    req, chunk = np.concatenate(pairs_r).astype(np.int64, copy=False), np.concatenate(pairs_c).astype(np.int64, copy=False)
    if not (req[1:] < req[:-1]).any():  # the exact path's pairs alone (a restart on the saved layout)
        return req, chunk
    order = np.argsort(req, kind="stable")
    return req[order], chunk[order]


def _exact_pairs(index: Any, line: tuple, key: np.ndarray, at: np.ndarray, coords: np.ndarray,
                 boxed: np.ndarray, knd: np.ndarray, *, offsets_only: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """(which of ``boxed`` are exactly a saved chunk of their key, those chunks): the chunk whose
    first element is the box's, found on the line, then compared. The chunks of a key are
    disjoint (checked), so such a box overlaps no other. An empty box is left to the others.
    ``offsets_only``: ``coords`` holds offsets only (a save's entries), compared as such;
    else the sizes only (``_line_position``). Column by column: each a gather of one value per box."""
    _, starts, ends, rows, _, chunk_key = line
    hit, chunk = np.zeros(len(boxed), bool), np.zeros(len(boxed), np.int64)
    if not len(starts):
        return hit, chunk[:0]
    dims_at = np.ascontiguousarray(index.keys[:, 3])
    nds = knd[boxed]
    groups = np.flatnonzero(np.bincount(nds)).tolist() if len(nds) else []
    for nd in groups:
        mine = np.flatnonzero(nds == nd) if len(groups) > 1 else np.arange(len(boxed))
        r = boxed[mine]
        k, first = key[r], at[r]
        position, ok = _line_position(index, line, dims_at, k, first, coords, nd, offsets_only)
        i = np.minimum(np.searchsorted(starts, position), len(starts) - 1)
        c = rows[i]
        same = np.flatnonzero(ok & (starts[i] == position) & (chunk_key[c] == k))
        r_first, equal = first[same], np.ones(len(same), bool)
        if offsets_only:
            c_first = index.chunks[c[same], 0]
            for j in range(nd):
                equal &= index.coords[c_first + j] == coords[r_first + j]
        elif nd == 1:  # a 1-D chunk's end on the line is its first element + its size
            equal &= ends[i[same]] - starts[i[same]] == coords[r_first + 1]
        else:
            c_first = index.chunks[c[same], 0]
            for j in range(nd, 2 * nd):
                equal &= index.coords[c_first + j] == coords[r_first + j]
        hit[mine[same[equal]]] = True
        chunk[mine] = c
    return hit, chunk[hit]


def _line_position(index: Any, line: tuple, dims_at: np.ndarray, k: np.ndarray, first: np.ndarray,
                   coords: np.ndarray, nd: int, offsets_only: bool) -> tuple[np.ndarray, np.ndarray]:
    """(each box's first element on the line, whether the box lies inside its tensor: each
    offset in [0, dim), each size in (0, dim - offset], so that no sum overflows). Offsets
    inside the tensor give distinct positions, so a box inside whose position and key are a
    chunk's has that chunk's offsets: only the sizes are left to compare. ``offsets_only``:
    no sizes, every box "inside" (the offsets are compared)."""
    base, stride = line[0], line[4]
    ok, position = np.ones(len(k), bool), base[k]
    for j in range(nd):
        offset, d = coords[first + j], dims_at[k] + j
        if not offsets_only:
            size, dim = coords[first + nd + j], index.dims[d]
            ok &= (offset >= 0) & (offset < dim) & (size > 0) & (size <= dim - offset)
        position = position + offset * stride[d]
    return position, ok


def _key_pairs(index: CheckpointIndex, key: np.ndarray, at: np.ndarray, coords: np.ndarray,
               boxed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(request, chunk) of the requests left, key by key."""
    keys = index.keys
    pairs_r, pairs_c = [np.zeros(0, np.int64)], [np.zeros(0, np.int64)]
    order = boxed[np.argsort(key[boxed], kind="stable")]
    splits = np.flatnonzero(np.diff(key[order])) + 1
    for group in np.split(order, splits) if len(order) else []:
        k = int(key[group[0]])
        nd, first, count = int(keys[k, 2]), int(keys[k, 4]), int(keys[k, 5])
        cs = index.chunks[first:first + count, 0]
        c_box = index.coords[cs[:, None] + np.arange(2 * nd)] if nd else np.zeros((count, 0), np.int64)
        r_box = coords[at[group][:, None] + np.arange(2 * nd)] if nd else np.zeros((len(group), 0), np.int64)
        inside = (r_box[:, :nd] + r_box[:, nd:] <= index.dims[keys[k, 3]:keys[k, 3] + nd]).all(axis=1)
        group, r_box = group[inside], r_box[inside]
        if not len(group):
            continue
        r, c = _box_pairs(r_box, c_box, nd)
        pairs_r.append(group[r])
        pairs_c.append(first + c)
    return np.concatenate(pairs_r), np.concatenate(pairs_c)


_FEW_CHUNKS = 64
_BLOCK = 1 << 16


def _padded_pairs(index: CheckpointIndex, key: np.ndarray, at: np.ndarray, coords: np.ndarray, reqs: np.ndarray,
                  nd: int) -> tuple[np.ndarray, np.ndarray]:
    """(request, chunk) of requests on ``nd``-dimensional keys of at most ``_FEW_CHUNKS`` chunks:
    each request's box against every chunk of its key, blocks of requests at a time."""
    keys = index.keys
    rs, cs = [np.zeros(0, np.int64)], [np.zeros(0, np.int64)]
    for i in range(0, len(reqs), _BLOCK):
        r = reqs[i:i + _BLOCK]
        k = key[r]
        rbox = coords[at[r][:, None] + np.arange(2 * nd)]
        inside = (rbox[:, :nd] + rbox[:, nd:] <= index.dims[keys[k, 3][:, None] + np.arange(nd)]).all(axis=1)
        r, k, rbox = r[inside], k[inside], rbox[inside]
        if not len(r):
            continue
        first, count = keys[k, 4], keys[k, 5]
        width = int(count.max())
        valid = np.arange(width) < count[:, None]
        cid = np.where(valid, first[:, None] + np.arange(width), first[:, None])
        cbox = index.coords[index.chunks[cid, 0][..., None] + np.arange(2 * nd)]
        lo = np.maximum(rbox[:, None, :nd], cbox[..., :nd])
        hi = np.minimum(rbox[:, None, :nd] + rbox[:, None, nd:], cbox[..., :nd] + cbox[..., nd:])
        ri, ci = np.nonzero((lo < hi).all(axis=2) & valid)
        rs.append(r[ri])
        cs.append(cid[ri, ci])
    return np.concatenate(rs), np.concatenate(cs)


def _line_pairs(line: tuple, keys: np.ndarray, offsets: np.ndarray, sizes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(request, chunk) of requests on one-dimensional keys: the chunks of every such key on one
    line (each key's elements after the previous key's), so one ``searchsorted`` finds each run."""
    base, starts, ends, chunk_ids = line[:4]
    a, b = base[keys] + offsets, base[keys] + offsets + sizes
    lo, hi = np.searchsorted(ends, a, side="right"), np.searchsorted(starts, b, side="left")
    hi = np.where(sizes > 0, np.maximum(hi, lo), lo)
    n = hi - lo
    r = np.repeat(np.arange(len(keys)), n)
    c = chunk_ids[np.repeat(lo - np.concatenate([[0], np.cumsum(n)[:-1]]), n) + np.arange(int(n.sum()))]
    return r, c


def _box_pairs(r_box: np.ndarray, c_box: np.ndarray, nd: int) -> tuple[np.ndarray, np.ndarray]:
    """Indices (request, chunk) of the boxes that overlap (a zero-size box overlaps nothing; a
    0-d tensor's one chunk everything)."""
    if nd == 0:
        r, c = np.meshgrid(np.arange(len(r_box)), np.arange(len(c_box)), indexing="ij")
        return r.ravel(), c.ravel()
    if nd == 1:  # disjoint (checked): the overlapping chunks are one run of the sorted ones
        order = np.argsort(c_box[:, 0], kind="stable")
        starts, ends = c_box[order, 0], c_box[order, 0] + c_box[order, 1]
        a, b = r_box[:, 0], r_box[:, 0] + r_box[:, 1]
        lo, hi = np.searchsorted(ends, a, side="right"), np.searchsorted(starts, b, side="left")
        hi = np.where(b > a, np.maximum(hi, lo), lo)
        n = hi - lo
        r = np.repeat(np.arange(len(r_box)), n)
        c = order[np.repeat(lo - np.concatenate([[0], np.cumsum(n)[:-1]]), n) + np.arange(int(n.sum()))]
        keep = c_box[c, 1] > 0
        return r[keep], c[keep]
    rs, cs = [], []
    block = max(1, (1 << 22) // max(1, len(c_box) * nd))
    for i in range(0, len(r_box), block):
        rb = r_box[i:i + block]
        lo = np.maximum(rb[:, None, :nd], c_box[None, :, :nd])
        hi = np.minimum(rb[:, None, :nd] + rb[:, None, nd:], c_box[None, :, :nd] + c_box[None, :, nd:])
        r, c = np.nonzero((lo < hi).all(axis=2))
        rs.append(r + i)
        cs.append(c)
    return np.concatenate(rs), np.concatenate(cs)


def _reads(index: CheckpointIndex, rank: np.ndarray, chunk: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(``rank * files + file`` of each run of pairs reading one file, its first pair, the bytes
    it reads). Pairs come in rank order and mostly in runs of one file (5,120 ranks: 5M pairs,
    1.3M runs); a block of ranks ends no run, so the blocks' runs are the whole's."""
    if not len(chunk):
        return np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.float64)
    pair = rank * len(index.files) + index.chunks[chunk, 1]
    starts = np.flatnonzero(np.concatenate([[True], pair[1:] != pair[:-1]]))
    return pair[starts], starts, np.add.reduceat(index.chunks[chunk, 3].astype(np.float64), starts)


def hash_owners(index: CheckpointIndex, reads: list[tuple[np.ndarray, np.ndarray]], hashed: list[str],
                ranks: int) -> dict[int, list[str]]:
    """The files each rank reads whole and hashes: each of ``hashed`` by the rank that reads most
    of its bytes (``reads``: ``_reads`` of every block, in rank order; a file nobody reads:
    dealt out in turn)."""
    position = {name: i for i, name in enumerate(index.files)}
    owners: dict[int, list[str]] = {}
    best: dict[int, int] = {}
    runs = np.concatenate([r[0] for r in reads] or [np.zeros(0, np.int64)])
    if len(runs):
        uniq, inverse = np.unique(runs, return_inverse=True)
        read = np.bincount(inverse.reshape(-1), weights=np.concatenate([r[1] for r in reads]))
        by_file = uniq % len(index.files)
        order = np.lexsort((uniq // len(index.files), -read, by_file))
        first = np.concatenate([[True], by_file[order][1:] != by_file[order][:-1]])
        for u in order[first]:
            best[int(by_file[u])] = int(uniq[u] // len(index.files))
    for turn, name in enumerate(sorted(hashed)):
        f = position.get(name)
        owner = best.get(f, turn % ranks) if f is not None else turn % ranks
        owners.setdefault(owner, []).append(name)
    return owners


def _exclusive(counts: np.ndarray) -> np.ndarray:
    """Each position's start when ``counts`` are laid end to end, and the total last (len + 1)."""
    out = np.zeros(len(counts) + 1, np.int64)
    np.cumsum(counts, out=out[1:])
    return out


def _block_answers(index: CheckpointIndex, pairs: _Pairs, hashed: list[list[str]]) -> list[bytes]:
    """The answers (``SubIndex``) of a block of ranks, its tables built at once, then cut per
    rank: a row per request, in its order. Rows are gathered with ``np.take`` (a third of
    fancy indexing's time on rows of a 2-D table)."""
    key, req, chunk, bounds, pair_bounds = pairs.key, pairs.req, pairs.chunk, pairs.bounds, pairs.pair_bounds
    known = key >= 0
    rows = np.take(index.keys, np.maximum(key, 0), axis=0) if len(index.keys) else np.zeros((len(key), 7), np.int64)
    if not known.all():
        rows[~known] = 0
        rows[~known, 0] = ABSENT
    rows[:, 5] = np.bincount(req, minlength=len(key))
    rank_of = np.repeat(np.arange(len(bounds) - 1), np.diff(bounds))
    rows[:, 4] = _exclusive(rows[:, 5])[:-1] - pair_bounds[rank_of]
    nd = np.where(rows[:, 0] == 0, rows[:, 2], 0)
    dims_at = _exclusive(nd)
    dims = index.dims[np.repeat(rows[:, 3] - dims_at[:-1], nd) + np.arange(dims_at[-1])]
    rows[:, 3] = dims_at[:-1] - dims_at[bounds][rank_of]
    rows[rows[:, 0] != 0, 2] = 0
    chunks = np.take(index.chunks, chunk, axis=0)
    c_nd = rows[req, 2]
    coords_at = _exclusive(2 * c_nd)
    at = np.repeat(chunks[:, 0] - coords_at[:-1], 2 * c_nd)
    at += np.arange(coords_at[-1])
    coords = index.coords[at]
    chunks[:, 0] = np.where((c_nd == 0) & (chunks[:, 0] < 0), -1,
                            coords_at[:-1] - np.repeat(coords_at[pair_bounds[:-1]], np.diff(pair_bounds)))
    used, local = _files_used(pairs, len(index.files))
    chunks[:, 1] = local
    files = max(1, len(index.files))
    names = [index.files[f] for f in (used % files).tolist()]
    file_bounds = np.searchsorted(used // files, np.arange(pairs.r0, pairs.r0 + len(bounds))).tolist()
    dims_cut, coords_cut = dims_at[bounds].tolist(), coords_at[pair_bounds].tolist()
    bounds, pair_bounds = bounds.tolist(), pair_bounds.tolist()
    out = []
    for r in range(len(bounds) - 1):
        header = {"keys": None, "files": names[file_bounds[r]:file_bounds[r + 1]], "dtypes": index.dtypes,
                  "hash": hashed[r], "dcp_version": index.dcp_version}
        out.append(_pack(header, {"keys": rows[bounds[r]:bounds[r + 1]], "dims": dims[dims_cut[r]:dims_cut[r + 1]],
                                  "chunks": chunks[pair_bounds[r]:pair_bounds[r + 1]],
                                  "coords": coords[coords_cut[r]:coords_cut[r + 1]]}))
    return out


def _files_used(pairs: _Pairs, files: int) -> tuple[np.ndarray, np.ndarray]:
    """(the distinct (rank, file) pairs of a block as ``rank * files + file``, sorted; each
    pair's file numbered among its rank's files), from the runs ``_reads`` found."""
    if not len(pairs.runs):
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    used, inverse = np.unique(pairs.runs, return_inverse=True)
    first = np.searchsorted(used // files, used // files, side="left")
    local = (np.arange(len(used)) - first)[inverse.reshape(-1)]
    return used, np.repeat(local, np.diff(np.append(pairs.run_starts, len(pairs.chunk))))


# -- every rank: its own load's Metadata -----------------------------------------------------------------

@dataclass
class SubIndex:
    keys: np.ndarray
    dims: np.ndarray
    chunks: np.ndarray
    coords: np.ndarray
    files: list[str]
    dtypes: list[str]
    hashed: list[str]
    dcp_version: Any


def partial_metadata(data: bytes, requests: Requests, *, source: str) -> tuple[Metadata, list[str]]:
    """(DCP's Metadata of this rank's load, the files it hashes whole) from rank 0's answer.
    CorruptCheckpointError when the chunks do not cover one of its boxes exactly once (a gap
    would leave memory unread, an overlap read twice)."""
    parsed = _unpack(data, source)
    files = _names(parsed.header, "files", source) or []
    sub = SubIndex(parsed.keys, parsed.dims, parsed.chunks, parsed.coords, files,
                   _names(parsed.header, "dtypes", source) or [], _names(parsed.header, "hash", source) or [],
                   parsed.header.get("dcp_version"))
    if len(sub.keys) != len(requests.names):
        raise CorruptCheckpointError(f"{source}: keys: expected {len(requests.names)} rows (one per box), "
                                     f"actual {len(sub.keys)}")
    entries: dict[str, Any] = {}
    storage: dict[MetadataIndex, Any] = {}
    for row, name in enumerate(requests.names):
        kind, dtype, nd, dims_at, first, count, flags = (int(v) for v in sub.keys[row])
        if kind == ABSENT:
            continue
        if kind == 1:
            entries[name] = BytesStorageMetadata()
            storage[MetadataIndex(name)] = _info(sub, first)
            continue
        size = torch.Size(int(v) for v in sub.dims[dims_at:dims_at + nd])
        entry = entries.get(name)
        if entry is None:
            props = TensorProperties(dtype=_DTYPES[sub.dtypes[dtype]], requires_grad=bool(flags & _FLAG_REQUIRES_GRAD),
                                     pin_memory=bool(flags & _FLAG_PIN))
            entry = entries[name] = TensorStorageMetadata(properties=props, size=size, chunks=[])
        own_off, own_size = _box(requests, row)
        if len(own_off) != nd or any(o + n > d for o, n, d in zip(own_off, own_size, size)):
            continue  # another shape than saved: DCP's plan refuses it, naming both sizes
        covered = 0
        for c in range(first, first + count):
            at = int(sub.chunks[c, 0])
            offsets = torch.Size(int(v) for v in sub.coords[at:at + nd])
            sizes = torch.Size(int(v) for v in sub.coords[at + nd:at + 2 * nd])
            index = MetadataIndex(name, offsets)
            if index not in storage:
                entry.chunks.append(ChunkStorageMetadata(offsets, sizes))
                storage[index] = _info(sub, c)
            covered += _intersection(requests, row, offsets, sizes)
        _check_covered(requests, row, covered, source)
    metadata = Metadata(state_dict_metadata=entries, storage_data=storage)
    metadata.version = sub.dcp_version if isinstance(sub.dcp_version, str) else None
    return metadata, sub.hashed


def _info(sub: SubIndex, c: int) -> Any:
    _, file, offset, length, transform = (int(v) for v in sub.chunks[c])
    return _fs._StorageInfo(sub.files[file], offset, length, [ZSTD] if transform else None)


def _box(requests: Requests, row: int) -> tuple[list[int], list[int]]:
    nd, at = int(requests.ndim[row]), int(requests.coords_at[row])
    return requests.coords[at:at + nd].tolist(), requests.coords[at + nd:at + 2 * nd].tolist()


def _intersection(requests: Requests, row: int, offsets: torch.Size, sizes: torch.Size) -> int:
    own_off, own_size = _box(requests, row)
    volume = 1
    for a, n, o, s in zip(own_off, own_size, offsets, sizes, strict=True):
        volume *= max(0, min(a + n, o + s) - max(a, o))
    return volume


def _check_covered(requests: Requests, row: int, covered: int, source: str) -> None:
    _, own_size = _box(requests, row)
    volume = math.prod(own_size)
    if covered != volume:
        raise CorruptCheckpointError(
            f"{source}: {short(requests.names[row])}: chunks: expected the saved chunks to cover this rank's "
            f"{volume} elements exactly once, actual {covered} (the index is damaged)")
