"""What a save wrote, as columns: every rank's write results, gathered to rank 0, as arrays.

At the end of a save DCP gathers every rank's ``WriteResult`` list to rank 0, which builds
``storage_data`` (one ``MetadataIndex -> _StorageInfo`` per chunk or object written) and
pickles it into ``.metadata``. At 5,120 ranks that is millions of small objects: unpickling the
gathered lists, building the dict and walking it again cost rank 0 tens of seconds inside the
synchronous save. Here each rank's results travel packed (``PackedWrites``: a few arrays), and
rank 0 reads them into ``Written`` columns without making an object per entry; the index and
``.metadata`` are laid out from these columns. ``StorageEntries`` is the ``storage_data`` handed
back: its length is known at once, the objects are made only if something asks for them.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from operator import attrgetter
from typing import Any

import numpy as np

__all__ = ["Packed", "PackedWrites", "StorageEntries", "Written", "as_write_results", "columns_of", "written_of"]


@dataclass
class Written:
    """The entries of a save's ``storage_data``, in its order, as columns."""

    names: list[str]
    """The distinct keys (``MetadataIndex.fqn``)."""
    key: np.ndarray
    """Each entry's key, into ``names``."""
    ndim: np.ndarray
    """Each entry's offset's number of dimensions; -1 for an object's (``offset`` None)."""
    offsets: np.ndarray
    """Every entry's offsets, end to end (``ndim`` each)."""
    index: np.ndarray
    """Each entry's ``MetadataIndex.index`` (-1: None)."""
    files: list[str]
    """The distinct ``relative_path`` values."""
    file: np.ndarray
    """Each entry's file, into ``files``."""
    offset: np.ndarray
    length: np.ndarray
    transforms: list[Any] | None
    """Each entry's ``transform_descriptors``; None where no entry has any."""

    def __len__(self) -> int:
        return len(self.key)

    @property
    def fqns(self) -> list[str]:
        return list(map(self.names.__getitem__, self.key.tolist()))


def columns_of(storage: Mapping[Any, Any]) -> Written:
    """``storage`` (DCP's ``storage_data``) as columns. ValueError for an offset, an index or
    a length that is not an int of at most 63 bits."""
    if isinstance(storage, StorageEntries):
        return storage.written
    try:
        return _columns(list(storage), list(storage.values()))
    except (TypeError, OverflowError) as e:
        raise ValueError(f"storage_data: expected int offsets and lengths of at most 63 bits: {e}") from e


def _columns(keys: list[Any], values: list[Any]) -> Written:
    offsets = list(map(attrgetter("offset"), keys))
    if None in offsets:
        ndim = np.fromiter((-1 if o is None else len(o) for o in offsets), np.int64, len(offsets))
        offsets = [o for o in offsets if o is not None]
    else:
        ndim = np.fromiter(map(len, offsets), np.int64, len(offsets))
    flat = np.fromiter(itertools.chain.from_iterable(offsets), np.int64, int(ndim[ndim > 0].sum()))
    names, key = _distinct(list(map(attrgetter("fqn"), keys)))
    files, file = _distinct(list(map(attrgetter("relative_path"), values)))
    index = np.fromiter((-1 if i is None else i for i in map(attrgetter("index"), keys)), np.int64, len(keys))
    transforms = list(map(attrgetter("transform_descriptors"), values))
    return Written(
        names=names, key=key, ndim=ndim, offsets=flat, index=index, files=files, file=file,
        offset=np.fromiter(map(attrgetter("offset"), values), np.int64, len(values)),
        length=np.fromiter(map(attrgetter("length"), values), np.int64, len(values)),
        transforms=transforms if any(transforms) else None)


def _distinct(strings: list[str]) -> tuple[list[str], np.ndarray]:
    """(the distinct strings, in order of first use; each one's place among them). Strings
    that are one object (entries of one rank, unpickled together) are told apart by ``id``
    first, so only the distinct objects are hashed and compared."""
    if not strings:
        return [], np.zeros(0, np.int64)
    ids = np.fromiter(map(id, strings), np.int64, len(strings))
    object_ids, first, inverse = np.unique(ids, return_index=True, return_inverse=True)
    numbers: dict[str, int] = {}
    by_object = np.empty(len(object_ids), np.int64)
    for o in np.argsort(first, kind="stable"):
        by_object[o] = numbers.setdefault(strings[int(first[o])], len(numbers))
    return list(numbers), by_object[inverse.reshape(-1)]


# -- each rank's write results, packed for the gather to rank 0 --------------------------------------

_PACKED = ("key", "ndim", "offsets", "index", "file", "offset", "length")


class PackedWrites(list):
    """A rank's write results (``WriteResult`` objects, as DCP's writer returns them) that pickle
    as a ``Packed``: its columns as arrays and the few distinct names."""

    def __reduce__(self) -> tuple:
        try:
            written = _columns([w.index for w in self], [w.storage_data for w in self])
        except (TypeError, OverflowError, AttributeError):  # not DCP's usual entries: as DCP sends them
            return list, (list(self),)
        return Packed, (_names_blob(written.names), tuple(getattr(written, f).tobytes() for f in _PACKED),
                        written.files, written.transforms)


def _names_blob(names: list[str]) -> bytes | list[str]:
    """``names`` as one UTF-8 string, NUL between them: one object to unpickle, not one per name,
    and the ranks that write the same keys send the same bytes, which rank 0 splits once. A name
    holding a NUL (or none at all) goes as the list."""
    joined = "\0".join(names)
    if not names or joined.count("\0") != len(names) - 1:
        return names
    return joined.encode("utf-8", "surrogatepass")


@dataclass
class Packed:
    """A rank's write results as they arrive on rank 0 (a ``PackedWrites``, pickled)."""

    names: bytes | list[str]
    """The distinct keys: a list, or ``_names_blob``'s bytes."""
    arrays: tuple[bytes, ...]
    files: list[str]
    transforms: list[Any] | None


_LAST: list[tuple[list[Packed], Written]] = []
"""The last save's gathered results and their columns: a save whose every rank sent the same
(a later save of the same plan, every item the same size) gets the same ``Written`` object
back, and what is laid out from it (``.metadata``'s records, the index) is reused by identity."""


def written_of(results: list[Any]) -> Written:
    """The columns of every rank's results: a gathered ``Packed``, or a ``WriteResult`` list (a
    writer that does not pack, a rank whose results would not pack). ValueError as
    ``columns_of``. Results equal to the last call's (every rank's, compared byte for byte)
    give the same object back: nothing is read again."""
    last = _LAST[0] if _LAST else None
    if last is not None and last[0] == results:
        return last[1]
    _LAST.clear()  # its memory free before the new columns are made
    written = _written_of(results)
    if results and all(type(r) is Packed for r in results):
        _LAST[:] = [(list(results), written)]
    return written


def _written_of(results: list[Any]) -> Written:
    parts = []
    split: dict[bytes, list[str]] = {}  # each distinct blob of names split once, into one list
    for rank_results in results:
        if isinstance(rank_results, Packed):
            arrays = (np.frombuffer(b, np.int64) for b in rank_results.arrays)
            names = rank_results.names
            if isinstance(names, bytes):
                names = split.get(names) or split.setdefault(names, names.decode("utf-8", "surrogatepass").split("\0"))
            parts.append(Written(names=names, files=rank_results.files,
                                 transforms=rank_results.transforms, **dict(zip(_PACKED, arrays, strict=True))))
        else:
            parts.append(columns_of({w.index: w.storage_data for w in rank_results}))
    return _joined(parts)


def _joined(parts: list[Written]) -> Written:
    """``parts`` end to end, names and files numbered anew."""
    names, name_codes = _numbered([part.names for part in parts])
    files, file_codes = _numbered([part.files for part in parts])
    columns: dict[str, list[np.ndarray]] = {f: [] for f in _PACKED}
    for part, own_names, own_files in zip(parts, name_codes, file_codes, strict=True):
        for field in _PACKED:
            columns[field].append(getattr(part, field))
        columns["key"][-1], columns["file"][-1] = own_names[part.key], own_files[part.file]
    transforms = None  # each entry's, where any part has some
    if any(p.transforms is not None for p in parts):
        transforms = list(itertools.chain.from_iterable(p.transforms or [None] * len(p) for p in parts))
    joined = {f: np.concatenate(columns[f]) if columns[f] else np.zeros(0, np.int64) for f in _PACKED}
    return Written(names=names, files=files, transforms=transforms, **joined)


def _numbered(lists: list[list[str]]) -> tuple[list[str], list[np.ndarray]]:
    """The distinct strings of ``lists``, in order of first appearance, and each list's codes
    into them (``[0]`` for an empty one, so that indexing it by an empty column works). A list
    that is one object with an earlier one (ranks that sent the same names) is coded once; the
    rest in C-level passes: millions of names at thousands of ranks."""
    distinct_lists = list({id(one): one for one in lists}.values())
    every = list(itertools.chain.from_iterable(distinct_lists))
    distinct = list(dict.fromkeys(every))
    number = {text: i for i, text in enumerate(distinct)}
    codes = np.fromiter(map(number.__getitem__, every), np.int64, len(every))
    ends = np.cumsum([len(one) for one in distinct_lists], dtype=np.int64).tolist()
    by_list = {id(one): codes[end - len(one):end] if len(one) else np.zeros(1, np.int64)
               for one, end in zip(distinct_lists, ends, strict=True)}
    return distinct, [by_list[id(one)] for one in lists]


def as_write_results(rank_results: Any) -> list[Any]:
    """A rank's results as ``WriteResult`` objects (a ``Packed`` made objects again)."""
    if not isinstance(rank_results, Packed):
        return list(rank_results)
    from torch.distributed.checkpoint.storage import WriteResult

    entries = StorageEntries(_written_of([rank_results])).as_dict()
    return [WriteResult(index=k, size_in_bytes=v.length, storage_data=v) for k, v in entries.items()]


class StorageEntries(Mapping):
    """``storage_data`` of a save, from its columns: ``len`` at once; the ``MetadataIndex`` and
    ``_StorageInfo`` objects made, once, only when something reads an entry."""

    def __init__(self, written: Written) -> None:
        self.written = written
        self._dict: dict | None = None

    def __len__(self) -> int:
        return len(self.written)

    def __iter__(self) -> Iterator[Any]:
        return iter(self.as_dict())

    def __getitem__(self, key: Any) -> Any:
        return self.as_dict()[key]

    def as_dict(self) -> dict:
        """The plain dict DCP would have built (what ``.metadata`` pickles)."""
        if self._dict is None:
            import torch
            from torch.distributed.checkpoint.filesystem import _StorageInfo
            from torch.distributed.checkpoint.metadata import MetadataIndex

            w = self.written
            at = np.concatenate([[0], np.cumsum(np.maximum(w.ndim, 0))]).tolist()
            flat, names, files = w.offsets.tolist(), w.names, w.files
            transforms = w.transforms or itertools.repeat(None)
            self._dict = {
                MetadataIndex(names[k], None if nd < 0 else torch.Size(flat[at[e]:at[e + 1]]), None if i < 0 else i):
                _StorageInfo(files[f], o, n, t)
                for e, (k, nd, i, f, o, n, t) in enumerate(zip(w.key.tolist(), w.ndim.tolist(), w.index.tolist(),
                                                              w.file.tolist(), w.offset.tolist(), w.length.tolist(),
                                                              transforms))}
        return self._dict
