"""Loading torch.distributed.checkpoint directories without executing their code.

DCP keeps its ``.metadata`` as a pickle and its non-tensor entries as
``torch.save`` blobs that the default planner reads with
``torch.load(weights_only=False)``. Both would run whatever a malicious
checkpoint put there. Here ``.metadata`` goes through an unpickler that allows
the metadata classes and nothing else, and non-tensor entries are read with
``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import dataclasses
import io
import pathlib
import pickle
import struct
import types
import zipfile
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any, ClassVar

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint import filesystem as _fs
from torch.distributed.checkpoint import metadata as _md
from torch.distributed.checkpoint.default_planner import set_element
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from resume.errors import CorruptCheckpointError, OversizedFileError, UnsafeCheckpointError
from resume.storage import join
from resume.text import clip, short

from .dcp_metadata_check import check_metadata

__all__ = ["SafeFileSystemReader", "SafeLoadPlanner", "read_stored_tensor_into", "restricted_load_metadata"]

_ALLOWED: dict[tuple[str, str], Any] = {
    ("torch", "Size"): torch.Size,
    ("torch.serialization", "_get_layout"): torch.serialization._get_layout,
    ("collections", "OrderedDict"): OrderedDict,
    ("pathlib", "PosixPath"): pathlib.PosixPath,
    ("pathlib", "PurePosixPath"): pathlib.PurePosixPath,
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): _fs._StorageInfo,
}
# Megatron-Core's torch_dist saver keeps every rank's save plan in the
# metadata (``Metadata.all_local_plans``): plain records, no behaviour.
from torch.distributed.checkpoint import planner as _planner

for _name in ("SavePlan", "WriteItem", "WriteItemType", "TensorWriteData"):
    if hasattr(_planner, _name):
        _ALLOWED[("torch.distributed.checkpoint.planner", _name)] = getattr(_planner, _name)
for _name in ("Metadata", "MetadataIndex", "TensorStorageMetadata", "BytesStorageMetadata",
              "ChunkStorageMetadata", "TensorProperties", "StorageMeta", "_MEM_FORMAT_ENCODING"):
    if hasattr(_md, _name):
        _ALLOWED[("torch.distributed.checkpoint.metadata", _name)] = getattr(_md, _name)


class _DataOnlyUnpickler(pickle._Unpickler):  # type: ignore[name-defined]
    """The pure-Python unpickler, whose opcode table is ours to change (the C one's is not).

    BUILD (which also carries SETSTATE) sets attributes on the object below it: on a class
    that would change the class for the whole process, even if a later opcode makes the
    pickle refused. Here BUILD is allowed on an instance of ``buildable`` only, with a state
    of plain attribute names (or the state the class's own ``__setstate__`` takes), so a
    refused pickle leaves the process exactly as it was. Checking each BUILD's real target
    as it runs is exact, where a pre-scan of the opcodes would have to model the stack.
    The cost: about 0.4 s per MB of metadata, checks included (the C unpickler is ~10x
    faster); a restore reads it once, on rank 0.
    """

    buildable: frozenset[type] = frozenset()
    dispatch: ClassVar[dict] = dict(pickle._Unpickler.dispatch)  # type: ignore[attr-defined]

    def _load_build(self) -> None:
        stack = self.stack
        if len(stack) < 2:
            raise pickle.UnpicklingError("BUILD: expected an object and its state, actual an empty stack")
        state, target = stack[-1], stack[-2]
        if type(target) not in self.buildable:
            raise pickle.UnpicklingError(f"BUILD on {_kind(target)} (refused: state may be set on "
                                         "instances of the checkpoint's data classes only)")
        if "__setstate__" not in type(target).__dict__ and not _is_plain_state(state):
            raise pickle.UnpicklingError(f"BUILD on {type(target).__name__}: expected a dict of field "
                                         f"names, actual {short(state, 80)}")
        pickle._Unpickler.load_build(self)  # type: ignore[attr-defined]

    dispatch[pickle.BUILD[0]] = _load_build


def _printable(name: str) -> str:
    """A global's name as the pickle spells it, cut short and with no control characters."""
    return repr(name[:80])[1:-1] if isinstance(name, str) else short(name, 80)


def _kind(obj: Any) -> str:
    if isinstance(obj, type):
        return f"the class {obj.__module__}.{obj.__qualname__}"
    if isinstance(obj, types.ModuleType):
        return f"the module {obj.__name__}"
    return f"a {type(obj).__name__}"


def _is_plain_state(state: Any) -> bool:
    return type(state) is dict and all(type(k) is str and k.isidentifier() and not k.startswith("__")
                                       for k in state)


class _MetadataUnpickler(_DataOnlyUnpickler):
    buildable = frozenset(cls for cls in _ALLOWED.values()
                          if isinstance(cls, type) and dataclasses.is_dataclass(cls))

    def __init__(self, file, source: str) -> None:
        super().__init__(file)
        self.source = source

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED:
            return _ALLOWED[(module, name)]
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise UnsafeCheckpointError(f"{self.source}: pickle global: expected a checkpoint "
                                    f"metadata class, actual {_printable(module)}.{_printable(name)} (refused)")


def restricted_load_metadata(data: bytes, *, source: str, file_sizes: Mapping[str, int] | None = None,
                             compression: str | None | bool = False) -> Metadata:
    """DCP's ``.metadata`` unpickled with the metadata classes only, then checked in shape and
    bounds (``dcp_metadata_check``; ``file_sizes``: the manifest's, which bound every item;
    ``compression``: what the manifest records, the only transform an item may name; False:
    not known, not checked).
    UnsafeCheckpointError for a forbidden global, CorruptCheckpointError for anything else
    wrong, each naming ``source`` and the field; no other exception leaves."""
    try:
        metadata = _MetadataUnpickler(io.BytesIO(data), source).load()
    except UnsafeCheckpointError:
        raise
    except (Exception, RecursionError) as e:
        raise CorruptCheckpointError(f"{source}: expected DCP metadata, actual unreadable "
                                     f"({type(e).__name__}: {clip(str(e), 200)})") from e
    try:
        transforms = None if compression is False else [ZSTD] if compression == "zstd" else []
        check_metadata(metadata, source=source, file_sizes=file_sizes, transforms=transforms)
    except RecursionError as e:
        raise CorruptCheckpointError(f"{source}: expected DCP metadata, actual nested too deep") from e
    except (AttributeError, TypeError, ValueError) as e:  # a record built without its fields
        raise CorruptCheckpointError(f"{source}: expected DCP metadata, actual "
                                     f"{type(e).__name__}: {clip(str(e), 200)}") from e
    return metadata


METADATA_CAP = 1 << 30
"""Bytes: the largest ``.metadata`` read where no manifest records its size (a framework's own
save). The reference layout's (5,120 ranks, about 1,000 sharded tensors each) is tens of MB."""


def read_step_metadata(storage: Any, step_dir: str) -> Metadata:
    """DCP's ``.metadata`` of a step directory that no manifest of ours describes (a framework's
    own save), checked as ``restricted_load_metadata`` checks it: read capped at ``METADATA_CAP``,
    and every item bounded by the size of the ``.distcp`` file it names, as the directory holds
    it now (a link or special file there is refused)."""
    sizes = {name: storage.size(join(step_dir, name)) for name in storage.listdir(step_dir)
             if name.endswith(".distcp")}
    path = join(step_dir, ".metadata")
    return restricted_load_metadata(storage.read_bytes(path, limit=METADATA_CAP),
                                    source=storage.url(path), file_sizes=sizes)


class _SafeMetadataMixin:
    preloaded_metadata: Metadata | None = None
    """Metadata already read (and vetted) by the caller: not read again."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if self.preloaded_metadata is not None:
            metadata = self.preloaded_metadata
        else:
            path = self._get_metadata_path(kwargs.get("rank"))  # type: ignore[attr-defined]
            with self.fs.create_stream(path, "rb") as f:  # type: ignore[attr-defined]
                data = f.read(METADATA_CAP + 1)
            if len(data) > METADATA_CAP:
                raise OversizedFileError(f"{path}: size: expected at most {METADATA_CAP} bytes, "
                                         "actual more (not read)")
            metadata = restricted_load_metadata(data, source=str(path))
        self.preloaded_metadata = metadata  # the item sizes read_data bounds decompression by
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id  # type: ignore[attr-defined]
        return metadata


ZSTD = "stream.zstd/1"
"""The one transform honoured (what ``dcp_io.make_writer(compression="zstd")`` records), and
only when the run's manifest records the compression (``compressed``)."""
ZIP_FRAMING = 64 << 10
"""What torch.save adds around a chunk's bytes (zip headers, alignment, its small pickle)."""
BYTES_ITEM_CAP = 256 << 20
"""The most a non-tensor item (a torch.save'd value, not a tensor) may decompress to."""


class SafeFileSystemReader(_SafeMetadataMixin, FileSystemReader):
    """DCP's reader with the restricted metadata unpickler; tensors are read by ``threads``
    workers (each with its own file handle), so reading, deserialising and copying overlap.

    Every item is read within bounds: a transform other than zstd, or zstd on a run whose
    manifest does not record it, is refused; decompression stops at the item's expected
    size (its chunk's bytes plus torch.save's framing); a torch.save archive is opened only
    when its records are stored uncompressed and no larger than that."""

    threads = 2
    compressed = False
    """The run's manifest records zstd compression: only then is ``stream.zstd`` honoured."""

    def read_data(self, plan, planner):
        from concurrent.futures import ThreadPoolExecutor

        from torch.distributed.checkpoint.planner import LoadItemType
        from torch.futures import Future

        # Only planners whose tensor hooks are plain look-ups may be called from threads.
        plain = (type(planner).resolve_tensor is DefaultLoadPlanner.resolve_tensor
                 and type(planner).commit_tensor is DefaultLoadPlanner.commit_tensor)
        tensor_reqs, rest = [], []
        for r in plan.items:
            simple = r.type != LoadItemType.BYTE_IO and not self.storage_data[r.storage_index].transform_descriptors
            (tensor_reqs if simple else rest).append(r)
        if self.threads < 2 or len(tensor_reqs) < 2 or not plain:
            rest, tensor_reqs = list(plan.items), []
        for path, reqs in self._by_file(rest).items():
            self._read_items(path, reqs, planner)
        work = []
        for path, reqs in self._by_file(tensor_reqs).items():
            # Contiguous runs of the file per thread: each reads sequentially.
            half = (len(reqs) + self.threads - 1) // self.threads
            work += [(path, reqs[i:i + half]) for i in range(0, len(reqs), half)]
        if work:
            with ThreadPoolExecutor(self.threads) as pool:
                for f in [pool.submit(self._read_items, path, reqs, planner) for path, reqs in work if reqs]:
                    f.result()
        fut: Future = Future()
        fut.set_result(None)
        return fut

    def _by_file(self, reqs: list) -> dict[str, list]:
        by_file: dict[str, list] = {}
        for r in sorted(reqs, key=lambda r: self.storage_data[r.storage_index].offset):
            by_file.setdefault(self.storage_data[r.storage_index].relative_path, []).append(r)
        return by_file

    def _read_items(self, relative_path: str, reqs: list, planner) -> None:
        from torch.distributed.checkpoint.planner import LoadItemType

        path = self.fs.concat_path(self.path, relative_path)
        with self.fs.create_stream(path, "rb") as stream:
            for req in reqs:
                where = f"{relative_path}: {short(req.storage_index.fqn)}"
                if req.type == LoadItemType.BYTE_IO:
                    item = self._item(stream, req, BYTES_ITEM_CAP, where)
                    data = io.BytesIO(item.read() if isinstance(item, _Window) else item.getvalue())
                    check_archive(data, max(BYTES_ITEM_CAP, len(data.getbuffer())), where)
                    data.seek(0)
                    planner.load_bytes(req, data)
                else:
                    self._read_tensor(stream, req, planner, where)

    def _expected_bytes(self, req) -> int:
        from .dcp_metadata_check import stored_bytes

        index = req.storage_index
        entry = self.preloaded_metadata.state_dict_metadata.get(index.fqn) if self.preloaded_metadata else None
        stored = stored_bytes(entry, index) if entry is not None else None
        return BYTES_ITEM_CAP if stored is None else stored + ZIP_FRAMING

    def _item(self, stream, req, cap: int, where: str) -> io.IOBase:
        """The item's torch.save archive, seekable: a window of the file, or its decompressed
        bytes, read no further than ``cap``."""
        info = self.storage_data[req.storage_index]
        window = _Window(stream, info.offset, info.length)
        transforms = list(info.transform_descriptors or ())
        if not transforms:
            return window
        if transforms != [ZSTD] or not self.compressed:
            raise CorruptCheckpointError(
                f"{where}: transform_descriptors: expected {'[' + ZSTD + ']' if self.compressed else 'none'} "
                f"(the run's manifest {'records zstd' if self.compressed else 'records no compression'}), "
                f"actual {short(transforms)}")
        from torch.distributed.checkpoint._extension import ZStandard

        return io.BytesIO(read_capped(ZStandard().transform_from(window), cap, where))

    def _read_tensor(self, stream, req, planner, where: str) -> None:
        from torch.distributed._shard._utils import narrow_tensor_by_index as narrow

        info = self.storage_data[req.storage_index]
        target = planner.resolve_tensor(req).detach()
        whole = all(o == 0 for o in req.storage_offsets) and tuple(req.lengths) == tuple(target.shape)
        if (whole and not info.transform_descriptors
                and read_stored_tensor_into(stream, info.offset, info.length, target)):
            planner.commit_tensor(req, target)
            return
        cap = self._expected_bytes(req)
        item = self._item(stream, req, cap, where)
        check_archive(item, cap, where)
        item.seek(0)
        try:
            tensor = torch.load(item, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as e:
            raise UnsafeCheckpointError(
                f"{where}: pickle: expected tensor data only, actual {pickle_refusal(e)} (refused, nothing run)") from e
        if not isinstance(tensor, torch.Tensor):
            raise CorruptCheckpointError(f"{where}: expected a tensor, actual {type(tensor).__name__}")
        tensor = narrow(tensor, req.storage_offsets, req.lengths)
        if target.size() != tensor.size():
            raise CorruptCheckpointError(f"{where}: size: expected {tuple(target.size())}, "
                                         f"actual {short(tuple(tensor.size()))}")
        target.copy_(tensor)
        planner.commit_tensor(req, target)


def read_capped(stream, cap: int, where: str) -> bytes:
    """All of ``stream`` (a decompressor), refused as soon as it passes ``cap`` bytes."""
    out = bytearray()
    while True:
        chunk = stream.read(min(4 << 20, cap + 1 - len(out)))
        if not chunk:
            return bytes(out)
        out += chunk
        if len(out) > cap:
            raise CorruptCheckpointError(f"{where}: decompressed size: expected at most {cap} bytes "
                                         "(the item's chunk and its framing), actual more (refused, "
                                         "decompression stopped there)")


def check_archive(item, cap: int, where: str) -> None:
    """A torch.save archive is opened only when every record is stored (torch.save never
    compresses), inside the item, and the records together hold at most ``cap`` bytes:
    checked from the zip's directory, before any record is inflated."""
    try:
        with zipfile.ZipFile(item) as z:
            infos = z.infolist()
    except (zipfile.BadZipFile, ValueError, OSError, EOFError, struct.error) as e:
        raise CorruptCheckpointError(f"{where}: expected a torch.save archive, actual "
                                     f"{type(e).__name__}: {clip(str(e))}") from e
    item.seek(0, io.SEEK_END)
    size = item.tell()
    total = 0
    for info in infos:
        if info.compress_type != zipfile.ZIP_STORED or info.file_size != info.compress_size \
                or info.header_offset + info.file_size > size:
            raise CorruptCheckpointError(
                f"{where}: {short(info.filename)}: expected a stored record inside the item, actual "
                f"compress_type {info.compress_type}, {info.compress_size} bytes declaring {info.file_size}")
        total += info.file_size
    if total > cap:
        raise CorruptCheckpointError(f"{where}: records: expected at most {cap} bytes (the item's chunk "
                                     f"and its framing), actual {total}")


class SafeLoadPlanner(DefaultLoadPlanner):
    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        try:
            obj = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as e:
            raise UnsafeCheckpointError(
                f"{read_item.storage_index.fqn}: pickle: expected plain data only, actual "
                f"{pickle_refusal(e)} (refused, nothing run)") from e
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


# -- reading a stored tensor straight into its target -------------------------------------------

_STORAGE_DTYPES = {
    "FloatStorage": torch.float32, "DoubleStorage": torch.float64, "HalfStorage": torch.float16,
    "BFloat16Storage": torch.bfloat16, "LongStorage": torch.int64, "IntStorage": torch.int32,
    "ShortStorage": torch.int16, "CharStorage": torch.int8, "ByteStorage": torch.uint8,
    "BoolStorage": torch.bool,
}


class _Window(io.RawIOBase):
    """A seekable window [offset, offset + length) of a file (SEEK_END relative to the window)."""

    def __init__(self, f, offset: int, length: int) -> None:
        self.f, self.start, self.length, self.pos = f, offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = 0) -> int:
        base = {0: 0, 1: self.pos, 2: self.length}[whence]
        self.pos = max(0, min(self.length, base + offset))
        return self.pos

    def tell(self) -> int:
        return self.pos

    def readinto(self, b) -> int:
        view = memoryview(b)[: max(0, self.length - self.pos)]
        if not len(view):
            return 0
        self.f.seek(self.start + self.pos)
        n = self.f.readinto(view) or 0
        self.pos += n
        return n


class _RecordUnpickler(pickle.Unpickler):
    """Reads a torch.save'd tensor's pickle as a description; nothing in it is called."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return lambda *args: ("tensor", args)
        if module == "torch" and name in _STORAGE_DTYPES:
            return name
        if (module, name) == ("collections", "OrderedDict"):
            return OrderedDict
        raise pickle.UnpicklingError(f"{module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        return ("storage", pid)


def read_stored_tensor_into(f, offset: int, length: int, target: torch.Tensor) -> bool:
    """Copy a DCP item (a torch.save'd tensor at [offset, offset+length) of ``f``) straight into
    ``target``, when it is exactly a contiguous tensor of target's dtype and shape, stored raw.

    One read into the target's own memory instead of torch.load + copy. False (nothing
    written) whenever anything is not as expected: the caller then takes the general path.
    """
    if target.device.type != "cpu" or not target.is_contiguous() or target.numel() == 0:
        return False
    found = _stored_record(_Window(f, offset, length))
    if found is None or not _matches(found[0], found[2], target):
        return False
    f.seek(offset + found[1])
    view = memoryview(target.reshape(-1).view(torch.uint8).numpy()).cast("B")
    filled = 0
    while filled < len(view):
        n = f.readinto(view[filled:])
        if not n:
            raise EOFError(f"stored tensor ends after {filled} of {len(view)} bytes")
        filled += n
    return True


def _local_start(window: _Window, info: zipfile.ZipInfo) -> int:
    """Where a stored record's bytes begin (its local header's name and extra vary)."""
    window.seek(info.header_offset)
    header = window.read(30)
    if len(header) != 30 or header[:4] != b"PK\x03\x04":
        raise ValueError("not a local file header")
    name_len, extra_len = struct.unpack("<HH", header[26:30])
    return info.header_offset + 30 + name_len + extra_len


def _raw(window: _Window, info: zipfile.ZipInfo) -> bytes:
    # Read as stored: our shards are written without torch's per-record CRC
    # (the file's xxh3 covers them), which zipfile's reader would reject.
    window.seek(_local_start(window, info))
    return window.read(info.file_size)


def _stored_record(window: _Window) -> tuple[tuple, int, zipfile.ZipInfo] | None:
    """(the tensor record's arguments, where its one data record starts, that record) of a
    torch.save zip whose records are all stored uncompressed and little-endian; else None."""
    try:
        with zipfile.ZipFile(window) as z:
            infos = {i.filename.split("/", 1)[-1]: i for i in z.infolist()}
        data, pkl = infos.get("data/0"), infos.get("data.pkl")
        if data is None or pkl is None or "data/1" in infos or data.compress_type != zipfile.ZIP_STORED \
                or pkl.compress_type != zipfile.ZIP_STORED:
            return None
        if "byteorder" in infos and _raw(window, infos["byteorder"]) != b"little":
            return None
        kind, args = _RecordUnpickler(io.BytesIO(_raw(window, pkl))).load()
        data_start = _local_start(window, data)
    except (zipfile.BadZipFile, pickle.UnpicklingError, ValueError, TypeError, KeyError, EOFError):
        return None
    return (args, data_start, data) if kind == "tensor" and len(args) >= 4 else None


def _matches(args: tuple, data: zipfile.ZipInfo, target: torch.Tensor) -> bool:
    """The record is a whole, contiguous tensor of the target's dtype and shape."""
    (tag, pid), storage_offset, size, stride = args[0], args[1], tuple(args[2]), tuple(args[3])
    if tag != "storage" or not isinstance(pid, tuple) or len(pid) < 5:
        return False
    dtype = _STORAGE_DTYPES.get(pid[1])
    expected_stride = tuple(torch.empty(0).new_empty(size).stride()) if size else ()
    return (dtype == target.dtype and storage_offset == 0 and size == tuple(target.shape)
            and stride == expected_stride and data.file_size == target.numel() * target.element_size())


def pickle_refusal(error: BaseException) -> str:
    """torch's weights-only refusal names the global on its first lines; the rest is advice."""
    lines = [line.strip() for line in str(error).splitlines() if "GLOBAL" in line or "global" in line]
    return (lines[0] if lines else str(error).splitlines()[0] if str(error) else type(error).__name__)[:300]
