"""DCP's ``.metadata`` pickled in a fraction of the time ``pickle.dumps`` takes.

At every save rank 0 pickles DCP's ``Metadata``; at 5,120 ranks that takes 41-51 s, nearly
all of it in ``storage_data`` (one ``MetadataIndex -> _StorageInfo`` per chunk written): the
standard pickler walks millions of small objects one by one. ``dumps_metadata`` writes the
same objects with the same opcodes the standard pickler would (``__newobj__`` + ``BUILD`` of
the same state dicts, ``torch.Size`` by ``REDUCE``), only the bytes of ``storage_data`` are
laid out by numpy from a few record templates, one per shape of entry (ndim of the offset,
index or None, descriptors), all padded to one width by a longer LONG1 for the length::

    <the Metadata pickled with storage_data = an empty dict P, its STOP dropped>
    LONG_BINGET P  MARK <classes, field names, distinct strings, memoized> POP_MARK
    MARK (key record, value record) * n SETITEMS  POP  STOP

Any plain unpickler (``dcp.load``'s ``pickle.load``, our restricted one) reads it back to a
``Metadata`` equal in every field, ``storage_data`` in the same order. The entries' columns come
from the objects (C-level passes over them, most of the time left: about 1.5 us an entry) or,
where the save already holds them (``written.Written``), straight from those.

What must stay true: the bytes reproduce ``__reduce_ex__`` of these classes, so each call first
checks that a sample still reduces as reproduced and every entry is exactly of the shape
written, and anything else (a subclass, an extra attribute, an int past 64 bits) is pickled by
``pickle.dumps`` instead: slow, never different.
"""

from __future__ import annotations

import collections
import contextlib
import copyreg
import gc
import io
import itertools
import operator
import pickle
import struct
import sys
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)

from .index import PlanTables, plan_tables

if TYPE_CHECKING:
    from .written import Written

__all__ = ["dumps_metadata", "metadata_parts"]

_PROTOCOL = pickle.DEFAULT_PROTOCOL
"""What DCP's ``pickle.dump`` writes: the head is pickled with it."""
_CLASSES = (MetadataIndex, _StorageInfo, torch.Size, ChunkStorageMetadata)
_NAMES = ("fqn", "index", "offset", "relative_path", "length", "transform_descriptors", "offsets", "sizes")
"""The memo's first strings, after the classes: the state's field names."""
_BLOCK = 1 << 16
"""Entries laid out at a time: bounds the scratch table to a few tens of MiB."""
_INT32 = (-(1 << 31), (1 << 31) - 1)
_ABSENT, _NONE = -1, -2
"""Key offset codes besides an ndim: no ``offset`` in the state, ``offset: None`` in it."""


def dumps_metadata(metadata: Metadata, written: Written | None = None) -> bytes:
    """``pickle.dumps(metadata)``'s equal: bytes that ``pickle.loads`` turns into a ``Metadata``
    equal in every field (``storage_data`` in the same order, offsets ``torch.Size``), laid out
    by numpy for ``storage_data`` and the chunk lists of ``state_dict_metadata``. Falls back to
    ``pickle.dumps`` for anything not reproduced.

    ``written``: ``storage_data``'s entries as columns (``written.Written``), where the caller
    holds them: the records are laid out from them and no entry object is made or read. The
    bytes are then those of ``metadata`` with ``storage_data`` the plain dict of those entries
    (``StorageEntries.as_dict``); ``storage_data`` itself (any mapping of them) is read only by
    the fallback."""
    return b"".join(metadata_parts(metadata, written))


def metadata_parts(metadata: Metadata, written: Written | None = None) -> list[Any]:
    """``dumps_metadata``'s bytes as the buffers (bytes, one-dimensional uint8 arrays) that
    follow each other in it: written one after the other, no copy of them all is made (553 MiB
    at 5,120 ranks)."""
    fast = None
    if type(metadata) is Metadata and _reduces_as_written():
        with _gc_paused():
            fast = _dumps_fast(metadata, written)
    return fast if fast is not None else [pickle.dumps(_plain_storage(metadata, written))]


def _plain_storage(metadata: Metadata, written: Written | None) -> Metadata:
    """``metadata`` with ``storage_data`` a plain dict where the caller gave its columns and a
    mapping of them: what the bytes say either way."""
    storage = getattr(metadata, "storage_data", None)
    if written is not None and isinstance(storage, Mapping) and type(storage) is not dict:
        return _with_storage(metadata, dict(storage.items()))
    return metadata


def _with_storage(metadata: Metadata, storage: Any) -> Metadata:
    """A shallow copy of ``metadata`` (its fields in their order) with ``storage`` for ``storage_data``."""
    return _replaced(metadata, storage_data=storage)


def _replaced(metadata: Metadata, **fields: Any) -> Metadata:
    """A shallow copy of ``metadata`` (its fields in their order) with ``fields`` in place."""
    other = Metadata.__new__(Metadata)
    vars(other).update(vars(metadata))
    vars(other).update(fields)
    return other


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    """No cyclic collection meanwhile: the columns are a few large objects, but the memo copy
    and the iterators allocate enough to start one, which walks every object of a heap that
    holds millions (a second, at 640 ranks)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _dumps_fast(metadata: Metadata, written: Written | None) -> list[Any] | None:
    """The stream, or None where neither part is as the records reproduce it: ``storage_data``'s
    entries, ``state_dict_metadata``'s chunk lists. A part not reproduced is in the head."""
    try:
        kept = _STORAGE[0] if _STORAGE and written is not None and _STORAGE[0].written is written else None
        entries = kept if kept is not None else _storage_entries(metadata, written)
        lists = _ChunkLists.of(vars(metadata).get("state_dict_metadata"))
        if entries is None and lists is None:
            return None
        fields: dict[str, Any] = {}
        placeholders: list[Any] = []
        if entries is not None:
            fields["storage_data"] = {}
            placeholders.append(fields["storage_data"])
        if lists is not None:
            fields["state_dict_metadata"] = lists.emptied
            placeholders += lists.lists
        top = _replaced(metadata if entries is not None else _plain_storage(metadata, written), **fields)
        head = _head(top, [vars(metadata).get(name) for name in fields], placeholders)
        if head is None:
            return None
        data, slots, base = head
        memo = _Memo(base, entries.strings if entries is not None else list(_string_table()))
        parts = [data, pickle.MARK, memo.definitions(), pickle.POP_MARK]
        if lists is not None:
            parts += lists.records(slots[entries is not None:], memo)
        if entries is not None:
            parts += [_ref(slots[0]), pickle.MARK, *_storage_records(entries, written, memo), pickle.SETITEMS,
                      pickle.POP]
    except (IndexError, OverflowError, TypeError, ValueError):  # an int past 64 bits, a field of another type
        return None
    return [*parts, pickle.STOP]


def _storage_entries(metadata: Metadata, written: Written | None) -> _Entries | None:
    """``storage_data``'s entries as columns, or None where there are none or they are not of a
    shape the records reproduce."""
    storage = vars(metadata).get("storage_data")
    try:
        if written is not None:
            return _Entries.of_written(written) if len(written) else None
        return _Entries.of(storage) if type(storage) is dict and storage else None
    except (OverflowError, TypeError, ValueError):  # an int past 64 bits, a field of another type
        return None


_STORAGE: list[Any] = []
"""The last save's storage records: ``(written, strings, base, parts)``. The columns of a later
save whose every rank wrote the same (``written.written_of`` hands back the same object) lay
out to the same records when the head leaves the same memo base: those are written again, not
laid out anew (at 5,120 ranks, a second and more, and a few hundred MiB of fresh memory)."""


def _storage_records(entries: Any, written: Written | None, memo: _Memo) -> list[Any]:
    """``storage_data``'s records: the last save's where they are the same (``_STORAGE``)."""
    if isinstance(entries, _Kept):
        if entries.base == memo.base:
            return entries.parts
        entries = _Entries.of_written(written)  # held together before: not None now
    _STORAGE.clear()  # the old records' memory free before the new ones are made
    parts = _records(entries, memo)
    if written is not None:
        _STORAGE[:] = [_Kept(written, entries.strings, memo.base, parts)]
    return parts


@dataclass
class _Kept:
    """Records laid out from ``written``'s columns, against a memo from ``base``."""

    written: Any
    strings: list[str]
    base: int
    parts: list[Any]


# -- guards ---------------------------------------------------------------------------------------

def _reduces_as_written() -> bool:
    """Whether the four classes still pickle as the records reproduce them: by
    ``copyreg.__newobj__`` with the instance's fields as state (``_StorageInfo`` without its
    None fields), ``torch.Size`` by its tuple, each found under its module and name."""
    if any(cls in copyreg.dispatch_table or getattr(sys.modules.get(cls.__module__), cls.__qualname__, None)
           is not cls for cls in _CLASSES):
        return False
    key, size = MetadataIndex("k", torch.Size([3, 4]), 2), torch.Size([3, 4])
    bare = MetadataIndex("k")
    info, zstd = _StorageInfo("f", 5, 6), _StorageInfo("f", 5, 6, ["t"])
    chunk = ChunkStorageMetadata(size, torch.Size([1, 2]))
    newobj = copyreg.__newobj__  # type: ignore[attr-defined]
    try:
        return (chunk.__reduce_ex__(_PROTOCOL) == (newobj, (ChunkStorageMetadata,),
                                                    {"offsets": size, "sizes": torch.Size([1, 2])}, None, None)
                and key.__reduce_ex__(_PROTOCOL) == (newobj, (MetadataIndex,), {"fqn": "k", "index": 2, "offset": size},
                                                 None, None)
                and bare.__reduce_ex__(_PROTOCOL) == (newobj, (MetadataIndex,), {"fqn": "k", "index": None}, None, None)
                and info.__reduce_ex__(_PROTOCOL) == (newobj, (_StorageInfo,),
                                                      {"relative_path": "f", "offset": 5, "length": 6}, None, None)
                and zstd.__reduce_ex__(_PROTOCOL)[2] == {"relative_path": "f", "offset": 5, "length": 6,
                                                         "transform_descriptors": ["t"]}
                and size.__reduce_ex__(_PROTOCOL) == (torch.Size, ((3, 4),)))
    except Exception:  # noqa: BLE001 - a class changed beyond recognition: the standard pickler decides
        return False


def _types(values: Iterable[Any]) -> set[type]:
    return set(map(type, values))


def _int64(values: Iterable[Any], count: int) -> np.ndarray:
    """``values`` (Python ints only, checked) as int64; OverflowError past 64 bits."""
    values = list(values)
    if not _types(values) <= {int}:
        raise TypeError("expected ints")
    return np.fromiter(values, dtype=np.int64, count=count)


# -- the head: everything but storage_data ----------------------------------------------------------

_UNFRAMED = {pickle.BINUNICODE[0]: 4, pickle.BINBYTES[0]: 4, pickle.BINUNICODE8[0]: 8,
             pickle.BINBYTES8[0]: 8, pickle.BYTEARRAY8[0]: 8}
"""Opcodes (and the width of their length) that protocol 4 writes between frames, for a
payload of 64 KiB or more."""


def _head(top: Metadata, replaced: list[Any], placeholders: list[Any]) -> tuple[bytes, list[int], int] | None:
    """``top`` (the metadata with parts ``replaced`` by placeholders: an empty dict for
    ``storage_data``, empty chunk lists) pickled as ``pickle.dump`` would, its STOP dropped;
    each placeholder's memo index and the first memo index free. None where the stream is not
    one this module can extend (then the standard pickler writes it all)."""
    buffer = io.BytesIO()
    pickler = pickle.Pickler(buffer, protocol=_PROTOCOL)
    pickler.dump(top)
    memo = pickler.memo.copy()
    data = bytearray(buffer.getbuffer())
    # A part replaced and referred to from elsewhere too: the standard pickle keeps the sharing.
    if (any(id(part) in memo for part in replaced)
            or not all(id(p) in memo for p in placeholders) or not _drop_stop(data)):
        return None
    return bytes(data), [memo[id(p)][0] for p in placeholders], len(memo)


def _drop_stop(data: bytearray) -> bool:
    """Drops the STOP that ends a pickle in place. From protocol 4 on it sits at the end of the
    last frame, whose length is shortened by one: what follows is read unframed, as the
    unpicklers read a large payload between frames. False where the stream is not a chain
    of frames (and large payloads) ending in STOP."""
    if data[-1:] != pickle.STOP or data[:2] != pickle.PROTO + bytes([_PROTOCOL]):
        return False
    if _PROTOCOL < 4:
        del data[-1]
        return True
    position, last = 2, -1
    while position < len(data):
        op, width = data[position], _UNFRAMED.get(data[position], 8)
        size = int.from_bytes(data[position + 1:position + 1 + width], "little")
        if op != pickle.FRAME[0] and op not in _UNFRAMED:
            return False
        last = position if op == pickle.FRAME[0] else -1
        position += 1 + width + size
    if position != len(data) or last < 0:
        return False
    size = int.from_bytes(data[last + 1:last + 9], "little")
    data[last + 1:last + 9] = (size - 1).to_bytes(8, "little")
    del data[-1]
    return True


# -- storage_data as columns -----------------------------------------------------------------------

_KEY_FIELDS = ("fqn", "index", "offset")
"""A ``MetadataIndex``'s ``__dict__``, in order; built with no offset, it has none."""
_VALUE_FIELDS = ("relative_path", "offset", "length", "transform_descriptors")
"""A ``_StorageInfo``'s ``__dict__``, in order; unpickled (a rank's write result) without
its descriptors when they were None."""
_NoneType = type(None)
_DICT = operator.attrgetter("__dict__")
"""``vars``, twice as fast over a list (no builtin call per object)."""


def _string_table() -> dict[str, int]:
    """Each distinct string's code, in order of first appearance (a new one gets the next), the
    field names first: one pass over a column codes it."""
    table: dict[str, int] = collections.defaultdict(itertools.count().__next__)
    for name in _NAMES:
        table[name]
    return table


def _codes(strings: list[str], table: dict[str, int]) -> np.ndarray:
    """Each string's code in ``table`` (a defaultdict that gives a new string the next)."""
    return np.fromiter(map(table.__getitem__, strings), np.int64, len(strings))


def _states(objects: list[Any], names: tuple[str, ...]) -> tuple[list[list[Any]], np.ndarray] | None:
    """Each object's ``__dict__`` as columns (field i of every object, None where its dict
    stops short) and each dict's length; None unless every dict holds ``names``, the last
    one possibly left out, in that order. One pass over the dicts for the names, one for the
    values: the objects are scattered in memory, each pass costs a cache miss an entry."""
    n, full = len(objects), len(names)
    dicts = list(map(_DICT, objects))
    found = list(itertools.chain.from_iterable(dicts))
    values = list(itertools.chain.from_iterable(map(dict.values, dicts)))
    for width in (full, full - 1):  # one width for all: a dict's names repeat no name, so equal
        if len(found) == n * width:  # to names * n means each dict holds exactly those
            if found != list(names[:width]) * n:
                return None
            return [values[i::width] for i in range(width)] + [[None] * n] * (full - width), np.full(n, width)
    lengths = np.fromiter(map(len, dicts), np.int64, n)
    if lengths.min() < full - 1 or lengths.max() > full:
        return None
    columns, expected = _short_and_full(values, np.flatnonzero(lengths < full).tolist(), n, names)
    return (columns, lengths) if found == expected else None


def _short_and_full(values: list[Any], short: list[int], n: int,
                    names: tuple[str, ...]) -> tuple[list[list[Any]], list[str]]:
    """The columns of dicts that hold ``names`` but those at ``short``, which lack the last,
    and the names they must hold: runs of full dicts sliced, the short ones one by one (a
    checkpoint has few: its bytes entries)."""
    full = len(names)
    columns: list[list[Any]] = [[] for _ in names]
    expected: list[str] = []
    position = previous = 0
    for stop in [*short, n]:
        end = position + (stop - previous) * full
        expected += names * (stop - previous)
        for i, column in enumerate(columns):
            column += values[position + i:end:full]
        if stop < n:
            expected += names[:-1]
            for i, column in enumerate(columns[:-1]):
                column.append(values[end + i])
            columns[-1].append(None)
        position, previous = end + full - 1, stop + 1
    return columns, expected


@dataclass
class _Entries:
    """``storage_data``'s entries as columns, in its order. ``shape`` (per entry, into
    ``shapes``) picks the record template; strings are codes into ``strings``."""

    shapes: list[tuple[int, bool, tuple[str, ...] | None]]
    """Key offset (ndim, ``_ABSENT`` or ``_NONE``), whether the index is an int, descriptors."""
    shape: np.ndarray
    columns: dict[str, np.ndarray]
    """Per entry: fqn, index, path (codes), offset, length; ``flat``: the key offsets back to
    back, ``start``: where each entry's begin in it."""
    strings: list[str]
    """Distinct strings, the field names first."""

    @classmethod
    def of(cls, storage: dict) -> _Entries | None:
        """The columns, or None where an entry is not of a shape the records reproduce
        (TypeError, OverflowError: a field of another type, an int past 64 bits)."""
        keys, values = list(storage), list(storage.values())
        if _types(keys) != {MetadataIndex} or _types(values) != {_StorageInfo}:
            return None
        key_states, value_states = _states(keys, _KEY_FIELDS), _states(values, _VALUE_FIELDS)
        if key_states is None or value_states is None:
            return None
        table = _string_table()
        columns, offset_code = _key_columns(*key_states, table)
        descriptors, descriptor_code = _value_columns(value_states[0], table, columns)
        return cls.shaped(columns, offset_code, descriptors, descriptor_code, table)

    @classmethod
    def of_written(cls, written: Written) -> _Entries | None:
        """From the columns the write results arrive as: the entries ``StorageEntries.as_dict``
        makes of them (a negative ndim: no offset; a negative index: None). None where the
        columns do not hold together."""
        key, ndim, index, file, offset, length = (np.asarray(getattr(written, name), np.int64) for name in
                                                  ("key", "ndim", "index", "file", "offset", "length"))
        flat, dims, n = np.asarray(written.offsets, np.int64), np.maximum(ndim, 0), len(key)
        names, files, transforms = list(written.names), list(written.files), written.transforms
        if (not _types(names) | _types(files) <= {str} or n == 0 or len(flat) != dims.sum()
                or any(len(column) != n for column in (ndim, index, file, offset, length))
                or (transforms is not None and len(transforms) != n)
                or min(key.min(), file.min()) < 0 or key.max() >= len(names) or file.max() >= len(files)):
            return None
        table = _string_table()
        has_index = index >= 0
        columns = {"fqn": _codes(names, table)[key], "path": _codes(files, table)[file],
                   "index": np.where(has_index, index, 0), "has_index": has_index.astype(np.int64),
                   "flat": flat, "start": np.cumsum(dims) - dims, "value_offset": offset, "length": length}
        descriptors, descriptor_code = _descriptors(list(transforms or [None] * n), table)
        return cls.shaped(columns, np.where(ndim < 0, _ABSENT, ndim), descriptors, descriptor_code, table)

    @classmethod
    def shaped(cls, columns: dict[str, Any], offset_code: np.ndarray, descriptors: list[tuple[str, ...]],
               descriptor_code: np.ndarray, table: dict[str, int]) -> _Entries:
        """The entries, each given the shape (the template) its key offset, index and
        descriptors make."""
        combined = ((offset_code + 2) * 2 + columns["has_index"]) * (len(descriptors) + 1) + descriptor_code
        present = np.flatnonzero(np.bincount(combined))  # a few small codes: no sort of n entries
        number = np.zeros(len(present) and int(present[-1]) + 1, np.int64)
        number[present] = np.arange(len(present))
        first = [int(np.argmax(combined == code)) for code in present]
        shapes = [(int(offset_code[i]), bool(columns["has_index"][i]),
                   descriptors[descriptor_code[i] - 1] if descriptor_code[i] else None) for i in first]
        return cls(shapes, number[combined], columns, list(table))

    def column(self, name: str | int, rows: np.ndarray) -> np.ndarray:
        """One field of ``rows``; an int: that dimension of the key offset."""
        if isinstance(name, int):
            return self.columns["flat"][self.columns["start"][rows] + name]
        return self.columns[name][rows]


def _key_columns(fields: list[list[Any]], lengths: np.ndarray,
                 table: dict[str, int]) -> tuple[dict[str, Any], np.ndarray]:
    """The keys' columns (fqns as codes into ``table``) and each key's offset code."""
    fqns, indexes, offsets = fields
    n = len(fqns)
    index_types, offset_types = _types(indexes), _types(offsets)
    if (_types(fqns) != {str} or not index_types <= {int, _NoneType}
            or not offset_types <= {torch.Size, _NoneType}):
        raise TypeError("a key field of another type")
    has_index, present = _not_none(indexes, index_types)
    index = np.zeros(n, np.int64)
    index[has_index] = np.fromiter(present, np.int64, len(present))
    has_offset, present = _not_none(offsets, offset_types)
    ndim = np.fromiter(map(len, present), np.int64, len(present))
    flat = _int64(itertools.chain.from_iterable(present), int(ndim.sum()))
    code = np.full(n, _NONE, np.int64)
    code[has_offset] = ndim
    code[lengths < len(_KEY_FIELDS)] = _ABSENT
    start = np.zeros(n, np.int64)
    start[has_offset] = np.cumsum(ndim) - ndim
    columns = {"fqn": _codes(fqns, table), "index": index, "has_index": has_index.astype(np.int64),
               "flat": flat, "start": start}
    return columns, code


def _not_none(values: list[Any], types: set[type]) -> tuple[np.ndarray, list[Any]]:
    """Which of ``values`` are not None, and those (``values`` itself where none is)."""
    if _NoneType not in types:
        return np.ones(len(values), bool), values
    mask = list(map(operator.is_not, values, itertools.repeat(None)))
    return np.array(mask, bool), list(itertools.compress(values, mask))


def _value_columns(fields: list[list[Any]], table: dict[str, int],
                   columns: dict[str, Any]) -> tuple[list[tuple[str, ...]], np.ndarray]:
    """The values' columns into ``columns`` (paths as codes into ``table``), and their
    transform descriptors (``_descriptors``)."""
    paths, offsets, lengths, found = fields
    n = len(paths)
    if _types(paths) != {str}:
        raise TypeError("a relative_path of another type")
    columns.update(path=_codes(paths, table), value_offset=_int64(offsets, n), length=_int64(lengths, n))
    return _descriptors(found, table)


def _descriptors(found: list[Any], table: dict[str, int]) -> tuple[list[tuple[str, ...]], np.ndarray]:
    """The distinct transform descriptors of ``found`` (each entry's: a list of strings, or
    None), their strings added to ``table``, and each entry's code (0: none, i:
    ``descriptors[i - 1]``)."""
    n = len(found)
    if found.count(None) == n:
        return [], np.zeros(n, np.int64)
    if not _types(found) <= {list, _NoneType}:
        raise TypeError("transform descriptors of another type")
    kinds: dict[tuple[str, ...] | None, int] = {None: 0}
    codes = [kinds.setdefault(None if d is None else tuple(d), len(kinds)) for d in found]
    descriptors = [kind for kind in kinds if kind is not None]
    if not _types(itertools.chain.from_iterable(descriptors)) <= {str}:
        raise TypeError("a transform descriptor of another type")
    for text in itertools.chain.from_iterable(descriptors):
        table[text]
    return descriptors, np.array(codes, np.int64)


# -- state_dict_metadata's chunk lists --------------------------------------------------------------

_CHUNK_FIELDS = ["offsets", "sizes"]
"""A ``ChunkStorageMetadata``'s ``__dict__``, in order."""
_KEPT: list[tuple[PlanTables, np.ndarray, list[Any]]] = []
"""The last plan's tables, which of their keys the records reproduce and each key's chunk list
as it was then."""
_RECORDS: list[tuple[PlanTables, tuple, list[Any]]] = []
"""The last chunk records laid out: the tables, the head's slots and base they refer to, the parts."""


class _ChunkLists:
    """The tensors' chunk lists of a plan (``state_dict_metadata``), laid out from its tables
    (``index.plan_tables``, kept across the saves of a plan, as are the checks here): the
    plan's copy with those lists emptied goes in the head, then each list's chunks are
    appended to it (``LONG_BINGET list MARK <chunk records> APPENDS POP``). A key whose entry
    or chunks are not exactly as the records reproduce keeps its own list, in the head."""

    def __init__(self, tables: PlanTables, plain: np.ndarray, seen: list[Any]) -> None:
        self.tables, self.keys = tables, np.flatnonzero(plain & (tables.keys[:, 5] > 0))
        self.emptied: dict[str, Any] = dict(tables.plan)
        self.lists: list[list] = []
        for k in self.keys.tolist():
            name, count = tables.names[k], int(tables.keys[k, 5])
            entry = self.emptied[name]
            chunks = vars(entry).get("chunks")
            if chunks is not seen[k] or len(chunks) != count:  # changed since: the tables no longer say it
                raise ValueError(f"{name}: a chunk list changed since the plan's tables were made")
            copy = TensorStorageMetadata.__new__(TensorStorageMetadata)
            vars(copy).update(vars(entry))
            vars(copy)["chunks"] = []
            self.emptied[name] = copy
            self.lists.append(vars(copy)["chunks"])

    @classmethod
    def of(cls, plan: Any) -> _ChunkLists | None:
        """The lists to lay out, or None where there are none (or the plan is no plain dict, or
        one the tables do not say)."""
        if type(plan) is not dict or not plan:
            return None
        try:
            tables = plan_tables(plan)
            if not _KEPT or _KEPT[0][0] is not tables:
                _KEPT[:] = [(tables, *_plain_keys(tables))]
            lists = cls(*_KEPT[0])
        except (OverflowError, TypeError, ValueError):  # a dtype the index cannot say, an int past 64 bits
            return None
        return lists if lists.lists else None

    def records(self, slots: list[int], memo: _Memo) -> list[Any]:
        """Each list's chunks appended to it. The same plan pickled to the same head (its lists
        at the same memo indices, the records' definitions at the same base) gives the same
        bytes: those of the save before are written again (a few hundred MiB at 5,120 ranks
        not laid out, nor their memory touched anew, at every save)."""
        key = (tuple(slots), memo.base)
        if _RECORDS and _RECORDS[0][0] is self.tables and _RECORDS[0][1] == key:
            return _RECORDS[0][2]
        _RECORDS.clear()  # the memory of the old ones free before the new ones are made
        out = self._laid_out(slots, memo)
        _RECORDS[:] = [(self.tables, key, out)]
        return out

    def _laid_out(self, slots: list[int], memo: _Memo) -> list[Any]:
        """Each list's chunks appended to it, the records of a dimensionality laid out at once."""
        keys, tables = self.tables.keys, self.tables
        kind = "int32" if not len(tables.coords) or (tables.coords.min() >= _INT32[0]
                                                      and tables.coords.max() <= _INT32[1]) else "int64"
        ndims, first, count = keys[self.keys, 2], keys[self.keys, 4], keys[self.keys, 5]
        rows_of: dict[int, tuple[np.ndarray, int]] = {}  # each list's table and where its rows end
        for nd in np.unique(ndims).tolist():
            mine = np.flatnonzero(ndims == nd)
            ends = np.cumsum(count[mine])
            rows = np.repeat(first[mine] - (ends - count[mine]), count[mine]) + np.arange(int(ends[-1]))
            table = _chunk_template(nd, memo, kind).fill(_ChunkColumns(tables), rows, memo.first_string)
            for i, end in zip(mine.tolist(), ends.tolist(), strict=True):
                rows_of[i] = (table, end)
        out: list[Any] = []
        for i, slot in enumerate(slots):
            table, end = rows_of[i]
            out += [_ref(slot) + pickle.MARK, table[end - int(count[i]):end].reshape(-1), pickle.APPENDS + pickle.POP]
        return out


def _plain_keys(tables: PlanTables) -> tuple[np.ndarray, list[Any]]:
    """Which keys' chunk lists the records reproduce (the entry exactly a
    ``TensorStorageMetadata`` holding a list of the tables' chunks, each exactly a
    ``ChunkStorageMetadata`` whose ``__dict__`` is its offsets and sizes, both ``torch.Size``),
    and each key's list (held: a later save checks it is still the one seen)."""
    plain, seen = np.zeros(len(tables.names), bool), []
    for k, entry in enumerate(tables.plan.values()):
        chunks = vars(entry).get("chunks") if type(entry) is TensorStorageMetadata else None
        seen.append(chunks)
        if type(chunks) is not list or len(chunks) != tables.keys[k, 5]:
            continue
        dicts = list(map(_DICT, chunks))
        plain[k] = not chunks or (_types(chunks) == {ChunkStorageMetadata}
                                  and list(itertools.chain.from_iterable(dicts)) == _CHUNK_FIELDS * len(chunks)
                                  and _types(itertools.chain.from_iterable(map(dict.values, dicts))) == {torch.Size})
    return plain, seen


class _ChunkColumns:
    """The tables' chunks as the template's columns: column j of a chunk row is its j-th
    coordinate (its offsets, then its sizes)."""

    def __init__(self, tables: PlanTables) -> None:
        self.tables = tables

    def column(self, j: int, rows: np.ndarray) -> np.ndarray:
        return self.tables.coords[self.tables.chunks[rows, 0] + j]


def _chunk_template(nd: int, memo: _Memo, kind: str) -> _Template:
    """A ``ChunkStorageMetadata`` of ``nd`` dimensions as the standard pickler writes it:
    ``__newobj__``, then BUILD of its ``__dict__`` (offsets, sizes: each ``torch.Size``'s reduce)."""
    template = _Template()
    template.add(memo.cls(ChunkStorageMetadata), pickle.EMPTY_TUPLE, pickle.NEWOBJ, pickle.EMPTY_DICT, pickle.MARK)
    for name, first in (("offsets", 0), ("sizes", nd)):
        template.add(memo.string(name), memo.cls(torch.Size), pickle.MARK)
        for dim in range(nd):
            template.field(first + dim, kind)
        template.add(pickle.TUPLE, pickle.TUPLE1, pickle.REDUCE)
    template.add(pickle.SETITEMS, pickle.BUILD)
    return template


# -- the records -----------------------------------------------------------------------------------

def _ref(index: int) -> bytes:
    return pickle.LONG_BINGET + struct.pack("<I", index)


class _Memo:
    """The memo entries the records refer to, from ``base`` (the first index the head left
    free): the three classes, then every distinct string."""

    def __init__(self, base: int, strings: list[str]) -> None:
        self.base, self.strings = base, strings
        self.first_string = base + len(_CLASSES)
        self.codes = {text: code for code, text in enumerate(strings)}
        if self.first_string + len(strings) >= 1 << 32:
            raise ValueError("past the 4-byte memo indices")

    def definitions(self) -> bytes:
        """The classes and strings pushed and memoized at their indices (inside a MARK that
        POP_MARK then drops)."""
        out = [pickle.GLOBAL + f"{cls.__module__}\n{cls.__qualname__}\n".encode()
               + pickle.LONG_BINPUT + struct.pack("<I", self.base + i) for i, cls in enumerate(_CLASSES)]
        for code, text in enumerate(self.strings):
            encoded = text.encode("utf-8", "surrogatepass")
            out.append(pickle.BINUNICODE + struct.pack("<I", len(encoded)) + encoded
                       + pickle.LONG_BINPUT + struct.pack("<I", self.first_string + code))
        return b"".join(out)

    def cls(self, cls: type) -> bytes:
        return _ref(self.base + _CLASSES.index(cls))

    def string(self, text: str) -> bytes:
        return _ref(self.first_string + self.codes[text])


_OPCODES = {"ref": pickle.LONG_BINGET, "int32": pickle.BININT, "int64": pickle.LONG1 + b"\x08"}
"""A field's opcode: a memo reference (a string), an int; an int n: LONG1 of n bytes."""


def _encoded(values: np.ndarray, kind: str | int) -> np.ndarray:
    """``values`` as the bytes that follow a field's opcode, one row each. LONG1 of n bytes is
    the value in two's complement, sign-extended past 8 bytes (any n at least its width)."""
    if kind in ("ref", "int32"):
        return values.astype("<u4" if kind == "ref" else "<i4").view(np.uint8).reshape(-1, 4)
    wide = values.astype("<i8").view(np.uint8).reshape(-1, 8)
    size = 8 if kind == "int64" else int(kind)
    if size <= 8:
        return wide[:, :size]
    sign = np.where(values < 0, 255, 0).astype(np.uint8)
    return np.concatenate([wide, np.repeat(sign[:, None], size - 8, axis=1)], axis=1)


class _Template:
    """One shape of entry: its record's constant bytes, and the fields filled per entry."""

    def __init__(self) -> None:
        self.bytes = bytearray()
        self.fields: list[tuple[int, str | int, str | int]] = []

    def add(self, *parts: bytes) -> None:
        for part in parts:
            self.bytes += part

    def field(self, column: str | int, kind: str | int) -> None:
        self.bytes += _OPCODES[kind] if isinstance(kind, str) else pickle.LONG1 + bytes([kind])
        self.fields.append((len(self.bytes), column, kind))
        self.bytes += bytes(4 if kind in ("ref", "int32") else 8 if kind == "int64" else int(kind))

    def fill(self, entries: _Entries, rows: np.ndarray, first_string: int) -> np.ndarray:
        """The records of ``rows``, one a row."""
        out = np.empty((len(rows), len(self.bytes)), np.uint8)
        out[:] = np.frombuffer(bytes(self.bytes), np.uint8)
        for position, column, kind in self.fields:
            values = entries.column(column, rows)
            encoded = _encoded(values + first_string if kind == "ref" else values, kind)
            out[:, position:position + encoded.shape[1]] = encoded
        return out


def _padded(kind: str, pad: int) -> str | int:
    """An int field's kind made ``pad`` bytes longer: LONG1 of more bytes, which reads back
    the same int (BININT's 5 bytes are LONG1's 2 and at least 3 more)."""
    if pad == 0:
        return kind
    size = (3 if kind == "int32" else 8) + pad
    if size > 255:
        raise ValueError("records too unlike to pad")
    return size


def _int_kinds(entries: _Entries) -> dict[str, str]:
    """Per int column: BININT where every value fits 32 bits, else LONG1 of 8 bytes."""
    def kind(values: np.ndarray) -> str:
        fits = values.size == 0 or (values.min() >= _INT32[0] and values.max() <= _INT32[1])
        return "int32" if fits else "int64"
    return {name: kind(entries.columns[name]) for name in ("index", "value_offset", "length", "flat")}


def _key_template(template: _Template, shape: tuple[int, bool, Any], memo: _Memo, kinds: dict[str, str]) -> None:
    """A ``MetadataIndex`` as the standard pickler writes it: ``__newobj__``, then BUILD of
    its ``__dict__`` (fqn, index, offset, in that order; no offset where the dict has none)."""
    offset_code, has_index, _ = shape
    template.add(memo.cls(MetadataIndex), pickle.EMPTY_TUPLE, pickle.NEWOBJ, pickle.EMPTY_DICT, pickle.MARK,
                 memo.string("fqn"))
    template.field("fqn", "ref")
    template.add(memo.string("index"))
    if has_index:
        template.field("index", kinds["index"])
    else:
        template.add(pickle.NONE)
    if offset_code == _NONE:
        template.add(memo.string("offset"), pickle.NONE)
    elif offset_code != _ABSENT:  # torch.Size's reduce: (torch.Size, (tuple,))
        template.add(memo.string("offset"), memo.cls(torch.Size), pickle.MARK)
        for dim in range(offset_code):
            template.field(dim, kinds["flat"])
        template.add(pickle.TUPLE, pickle.TUPLE1, pickle.REDUCE)
    template.add(pickle.SETITEMS, pickle.BUILD)


def _value_template(template: _Template, shape: tuple[int, bool, Any], memo: _Memo, kinds: dict[str, str],
                    pad: int) -> None:
    """A ``_StorageInfo`` as the standard pickler writes it: ``__newobj__``, then BUILD of
    its ``__getstate__`` (the fields not None; the descriptors a list); its length ``pad``
    bytes longer (``_padded``)."""
    descriptors = shape[2]
    template.add(memo.cls(_StorageInfo), pickle.EMPTY_TUPLE, pickle.NEWOBJ, pickle.EMPTY_DICT, pickle.MARK,
                 memo.string("relative_path"))
    template.field("path", "ref")
    template.add(memo.string("offset"))
    template.field("value_offset", kinds["value_offset"])
    template.add(memo.string("length"))
    template.field("length", _padded(kinds["length"], pad))
    if descriptors is not None:
        template.add(memo.string("transform_descriptors"), pickle.EMPTY_LIST, pickle.MARK,
                     *map(memo.string, descriptors), pickle.APPENDS)
    template.add(pickle.SETITEMS, pickle.BUILD)


def _records(entries: _Entries, memo: _Memo) -> list[Any]:
    """Every entry's key and value records, in ``storage_data``'s order. Each shape's records
    are padded to one width (the longest; ``_padded``), so a block of entries is a table whose
    rows are the records: each shape's records are written into its rows."""
    kinds = _int_kinds(entries)
    templates = [_template(shape, memo, kinds, 0) for shape in entries.shapes]
    width = max(len(template.bytes) for template in templates)
    templates = [_template(shape, memo, kinds, width - len(template.bytes))
                 for shape, template in zip(entries.shapes, templates, strict=True)]
    out: list[Any] = []
    for first in range(0, len(entries.shape), _BLOCK):
        shape = entries.shape[first:first + _BLOCK]
        codes = np.flatnonzero(np.bincount(shape, minlength=len(templates)))
        if len(codes) == 1:  # one shape: its records are the block
            out.append(templates[codes[0]].fill(entries, np.arange(first, first + len(shape)),
                                                memo.first_string).reshape(-1))
            continue
        table = np.empty((len(shape), width), np.uint8)
        for code in codes:
            rows = np.flatnonzero(shape == code)
            table[rows] = templates[code].fill(entries, rows + first, memo.first_string)
        out.append(table.reshape(-1))
    return out


def _template(shape: tuple[int, bool, Any], memo: _Memo, kinds: dict[str, str], pad: int) -> _Template:
    template = _Template()
    _key_template(template, shape, memo, kinds)
    _value_template(template, shape, memo, kinds, pad)
    return template
