"""Loading torch.distributed.checkpoint directories without executing their code.

DCP keeps its ``.metadata`` as a pickle and its non-tensor entries as
``torch.save`` blobs that the default planner reads with
``torch.load(weights_only=False)``. Both would run whatever a malicious
checkpoint put there. Here ``.metadata`` goes through an unpickler that allows
the metadata classes and nothing else, and non-tensor entries are read with
``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import io
import pathlib
import pickle
import struct
import zipfile
from collections import OrderedDict
from typing import Any

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint import filesystem as _fs
from torch.distributed.checkpoint import metadata as _md
from torch.distributed.checkpoint.default_planner import set_element
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from resume.errors import ManifestError, UnsafeCheckpointError
from resume.manifest import check_relative_path

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


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, file, source: str) -> None:
        super().__init__(file)
        self.source = source

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED:
            return _ALLOWED[(module, name)]
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise UnsafeCheckpointError(f"{self.source}: pickle global: expected a checkpoint "
                                    f"metadata class, actual {module}.{name} (refused)")


def restricted_load_metadata(data: bytes, *, source: str) -> Metadata:
    try:
        metadata = _MetadataUnpickler(io.BytesIO(data), source).load()
    except UnsafeCheckpointError:
        raise
    except Exception as e:
        raise UnsafeCheckpointError(f"{source}: expected DCP metadata, actual unreadable "
                                    f"({type(e).__name__}: {e})") from e
    if not isinstance(metadata, Metadata):
        raise UnsafeCheckpointError(f"{source}: expected DCP Metadata, actual {type(metadata).__name__}")
    # Every data file must lie inside the step directory.
    for info in (metadata.storage_data or {}).values():
        path = getattr(info, "relative_path", None)
        try:
            check_relative_path(path, source=source)
        except ManifestError as e:
            raise UnsafeCheckpointError(f"{source}: storage_data.relative_path: expected a file "
                                        f"inside the step directory, actual {path!r}") from e
    return metadata


class _SafeMetadataMixin:
    preloaded_metadata: Metadata | None = None
    """Metadata already read (and vetted) by the caller: not read again."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if self.preloaded_metadata is not None:
            metadata = self.preloaded_metadata
        else:
            path = self._get_metadata_path(kwargs.get("rank"))  # type: ignore[attr-defined]
            with self.fs.create_stream(path, "rb") as f:  # type: ignore[attr-defined]
                metadata = restricted_load_metadata(f.read(), source=str(path))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id  # type: ignore[attr-defined]
        return metadata


class SafeFileSystemReader(_SafeMetadataMixin, FileSystemReader):
    """DCP's reader with the restricted metadata unpickler; tensors are read by ``threads``
    workers (each with its own file handle), so reading, deserialising and copying overlap."""

    threads = 2

    def read_data(self, plan, planner):
        from concurrent.futures import ThreadPoolExecutor

        from torch.distributed.checkpoint import DefaultLoadPlanner
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
            return super().read_data(plan, planner)
        if rest:
            super().read_data(type(plan)(rest, plan.storage_data, plan.planner_data), planner)
        by_file: dict[str, list] = {}
        for r in tensor_reqs:
            by_file.setdefault(self.storage_data[r.storage_index].relative_path, []).append(r)
        work = []
        for path, reqs in by_file.items():
            # Contiguous runs of the file per thread: each reads sequentially.
            reqs.sort(key=lambda r: self.storage_data[r.storage_index].offset)
            half = (len(reqs) + self.threads - 1) // self.threads
            work += [(path, reqs[i:i + half]) for i in range(0, len(reqs), half)]
        with ThreadPoolExecutor(self.threads) as pool:
            for f in [pool.submit(self._read_tensors, path, reqs, planner) for path, reqs in work if reqs]:
                f.result()
        fut: Future = Future()
        fut.set_result(None)
        return fut

    def _read_tensors(self, relative_path: str, reqs: list, planner) -> None:
        from torch.distributed._shard._utils import narrow_tensor_by_index as narrow
        from torch.distributed.checkpoint.utils import _create_file_view

        path = self.fs.concat_path(self.path, relative_path)
        with self.fs.create_stream(path, "rb") as stream:
            for req in reqs:
                info = self.storage_data[req.storage_index]
                target = planner.resolve_tensor(req).detach()
                whole = all(o == 0 for o in req.storage_offsets) and tuple(req.lengths) == tuple(target.shape)
                if whole and read_stored_tensor_into(stream, info.offset, info.length, target):
                    planner.commit_tensor(req, target)
                    continue
                stream.seek(info.offset)
                view = _create_file_view(stream, info.offset, info.length)
                try:
                    tensor = torch.load(view, map_location="cpu", weights_only=True)
                except pickle.UnpicklingError as e:
                    raise UnsafeCheckpointError(
                        f"{relative_path}: {req.storage_index.fqn}: pickle: expected tensor data only, "
                        f"actual {pickle_refusal(e)} (refused, nothing run)") from e
                tensor = narrow(tensor, req.storage_offsets, req.lengths)
                if target.size() != tensor.size():
                    raise ValueError(f"{relative_path}: {req.storage_index.fqn}: size: expected "
                                     f"{tuple(target.size())}, actual {tuple(tensor.size())}")
                target.copy_(tensor)
                planner.commit_tensor(req, target)


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
