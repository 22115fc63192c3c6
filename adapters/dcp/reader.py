"""Reading a DCP step's data items within bounds, without running their code.

DCP's default planner reads non-tensor items with ``torch.load(weights_only=False)``; here
every item is read with ``weights_only=True``, inside the byte range ``.metadata`` gives it
(``.metadata`` itself: ``unpickle``), and a plain stored tensor straight into its target.
"""

from __future__ import annotations

import io
import math
import os
import pickle
import struct
import zipfile
from collections import OrderedDict
from typing import Any, ClassVar

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint.default_planner import set_element
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from resume.errors import CorruptCheckpointError, OversizedFileError, UnsafeCheckpointError
from resume.text import clip, short

from .metadata_check import stored_bytes
from .unpickle import METADATA_CAP, ZSTD, pickle_refusal, restricted_load_metadata

__all__ = ["SafeFileSystemReader", "SafeLoadPlanner", "Window", "check_archive", "decode_chunk", "read_capped",
           "read_stored_tensor_into"]


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
    hash_files: ClassVar[dict[str, tuple[int, str]]] = {}
    """Files this rank reads whole and hashes while the load reads them (relative path -> the
    manifest's size and checksum): ``verify_hashed()`` after ``read_data``."""

    def read_data(self, plan, planner):
        from concurrent.futures import ThreadPoolExecutor

        from torch.distributed.checkpoint.planner import LoadItemType
        from torch.futures import Future

        # Only planners whose tensor hooks are plain look-ups may be called from threads.
        plain = (type(planner).resolve_tensor is DefaultLoadPlanner.resolve_tensor
                 and type(planner).commit_tensor is DefaultLoadPlanner.commit_tensor)
        self._segments: dict[str, list] = {rel: [] for rel in self.hash_files}
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

    def verify_hashed(self, url) -> list[str]:
        """Each of ``hash_files`` hashed from the bytes the load read (kept in ``_segments``, in
        file order), the bytes no item of this rank covers read now: one pass over each file.
        Problems in ``run.verify_checksums``'s words (``url(rel)`` names the file); an I/O error
        other than a missing file raises (storage trouble says nothing about the checkpoint)."""
        problems = []
        for rel, (size, checksum) in sorted(self.hash_files.items()):
            try:
                actual, digest = self._hash_file(rel, getattr(self, "_segments", {}).get(rel, []))
            except FileNotFoundError:
                problems.append(f"{url(rel)}: expected a file of {size} bytes, actual missing")
                continue
            if actual != size:
                problems.append(f"{url(rel)}: size: expected {size} bytes, actual {actual}")
            elif digest != checksum:
                problems.append(f"{url(rel)}: checksum: expected {checksum}, actual {digest}")
        self._segments = {}
        return problems

    def _hash_file(self, rel: str, segments: list) -> tuple[int, str]:
        import xxhash

        from resume.checksum import ALGORITHM

        h, cursor = xxhash.xxh3_64(), 0
        with self.fs.create_stream(self.fs.concat_path(self.path, rel), "rb") as stream:
            def fill(upto: int | None) -> int:  # bytes no segment holds, read now
                stream.seek(cursor)
                done = 0
                while upto is None or cursor + done < upto:
                    chunk = stream.read(16 << 20 if upto is None else min(16 << 20, upto - cursor - done))
                    if not chunk:
                        break
                    h.update(chunk)
                    done += len(chunk)
                return done
            for offset, buf in sorted(segments, key=lambda s: s[0]):
                view = memoryview(buf).cast("B")
                if offset > cursor:
                    cursor += fill(offset)
                    if cursor < offset:
                        break  # the file ends before this item: its size says so
                skip = cursor - offset
                if skip < len(view):
                    h.update(view[skip:])
                    cursor = offset + len(view)
            cursor += fill(None)
        return cursor, f"{ALGORITHM}:{h.hexdigest()}"

    def _by_file(self, reqs: list) -> dict[str, list]:
        by_file: dict[str, list] = {}
        for r in sorted(reqs, key=lambda r: self.storage_data[r.storage_index].offset):
            by_file.setdefault(self.storage_data[r.storage_index].relative_path, []).append(r)
        return by_file

    def _read_items(self, relative_path: str, reqs: list, planner) -> None:
        from torch.distributed.checkpoint.planner import LoadItemType

        path = self.fs.concat_path(self.path, relative_path)
        segments = getattr(self, "_segments", {}).get(relative_path)
        with self.fs.create_stream(path, "rb") as stream:
            for req in reqs:
                where = f"{relative_path}: {short(req.storage_index.fqn)}"
                if req.type == LoadItemType.BYTE_IO:
                    item = self._item(stream, req, BYTES_ITEM_CAP, where, segments)
                    data = io.BytesIO(item.read() if isinstance(item, Window) else item.getvalue())
                    check_archive(data, max(BYTES_ITEM_CAP, len(data.getbuffer())), where)
                    data.seek(0)
                    planner.load_bytes(req, data)
                else:
                    self._read_tensor(stream, req, planner, where, segments)
                    _drop_read(stream, self.storage_data[req.storage_index])

    def _expected_bytes(self, req) -> int:
        index = req.storage_index
        entry = self.preloaded_metadata.state_dict_metadata.get(index.fqn) if self.preloaded_metadata else None
        chunks_at = vars(self).setdefault("_chunks_at", {})  # each entry's chunks by offsets, kept
        stored = stored_bytes(entry, index, chunks_at) if entry is not None else None
        return BYTES_ITEM_CAP if stored is None else stored + ZIP_FRAMING

    def _item(self, stream, req, cap: int, where: str, segments: list | None = None) -> io.IOBase:
        """The item's torch.save archive, seekable: a window of the file, or its decompressed
        bytes, read no further than ``cap``. ``segments`` (a hashed file's): the item's bytes are
        read whole first and kept there for the file's hash."""
        info = self.storage_data[req.storage_index]
        window = Window(stream, info.offset, info.length)
        if segments is not None:
            raw = window.read()
            segments.append((info.offset, raw))
            window = Window(io.BytesIO(raw), 0, len(raw))
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

    def _read_tensor(self, stream, req, planner, where: str, segments: list | None = None) -> None:
        from torch.distributed._shard._utils import narrow_tensor_by_index as narrow

        info = self.storage_data[req.storage_index]
        target = planner.resolve_tensor(req).detach()
        whole = all(o == 0 for o in req.storage_offsets) and tuple(req.lengths) == tuple(target.shape)
        if (whole and not info.transform_descriptors
                and read_stored_tensor_into(stream, info.offset, info.length, target, segments)):
            planner.commit_tensor(req, target)
            return
        cap = self._expected_bytes(req)
        tensor = _load_tensor(self._item(stream, req, cap, where, segments), cap, where)
        tensor = narrow(tensor, req.storage_offsets, req.lengths)
        if target.size() != tensor.size():
            raise CorruptCheckpointError(f"{where}: size: expected {tuple(target.size())}, "
                                         f"actual {short(tuple(tensor.size()))}")
        target.copy_(tensor)
        planner.commit_tensor(req, target)


def _load_tensor(item, cap: int, where: str) -> torch.Tensor:
    """A torch.save'd tensor, its archive checked first (``check_archive``), loaded weights-only."""
    check_archive(item, cap, where)
    item.seek(0)
    try:
        tensor = torch.load(item, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise UnsafeCheckpointError(
            f"{where}: pickle: expected tensor data only, actual {pickle_refusal(e)} (refused, nothing run)") from e
    if not isinstance(tensor, torch.Tensor):
        raise CorruptCheckpointError(f"{where}: expected a tensor, actual {type(tensor).__name__}")
    return tensor


def _drop_read(stream, info) -> None:
    """The pages of a tensor just read (into its target) out of the page cache: a restore reads
    each byte once, and the memory it fills next (its targets, a fresh optimizer's state) then
    reuses pages the process has just touched instead of fresh ones, which this kind of host
    makes slow to fault in (docs/performance.md). Local files only; nothing else changes."""
    try:
        os.posix_fadvise(stream.fileno(), info.offset, info.length, os.POSIX_FADV_DONTNEED)
    except (AttributeError, OSError, ValueError, io.UnsupportedOperation):
        pass


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


class Window(io.RawIOBase):
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


def read_stored_tensor_into(f, offset: int, length: int, target: torch.Tensor,
                            segments: list | None = None) -> bool:
    """Copy a DCP item (a torch.save'd tensor at [offset, offset+length) of ``f``) straight into
    ``target``, when it is exactly a contiguous tensor of target's dtype and shape, stored raw.

    One read into the target's own memory instead of torch.load + copy. False (nothing
    written) whenever anything is not as expected: the caller then takes the general path.
    ``segments`` (a hashed file's): the item's bytes, as (file offset, buffer), in three parts:
    the framing before the data, the target's memory, the framing after.
    """
    if target.device.type != "cpu" or not target.is_contiguous() or target.numel() == 0:
        return False
    found = _stored_record(Window(f, offset, length))
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
    if segments is not None:
        f.seek(offset)
        head = f.read(found[1])
        end = found[1] + len(view)
        f.seek(offset + end)
        tail = f.read(length - end)
        segments.extend([(offset, head), (offset + found[1], view), (offset + end, tail)])
    return True


def _local_start(window: Window, info: zipfile.ZipInfo) -> int:
    """Where a stored record's bytes begin (its local header's name and extra vary)."""
    window.seek(info.header_offset)
    header = window.read(30)
    if len(header) != 30 or header[:4] != b"PK\x03\x04":
        raise ValueError("not a local file header")
    name_len, extra_len = struct.unpack("<HH", header[26:30])
    return info.header_offset + 30 + name_len + extra_len


def _raw(window: Window, info: zipfile.ZipInfo) -> bytes:
    # Read as stored: our shards are written without torch's per-record CRC
    # (the file's xxh3 covers them), which zipfile's reader would reject.
    window.seek(_local_start(window, info))
    return window.read(info.file_size)


def _stored_record(window: Window) -> tuple[tuple, int, zipfile.ZipInfo] | None:
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


def decode_chunk(item: bytes | bytearray | memoryview, dtype: torch.dtype, sizes: tuple[int, ...], where: str, *,
                 zstd: bool = False) -> torch.Tensor:
    """One stored chunk (a DCP item's bytes: a torch.save'd tensor, zstd-compressed when ``zstd``)
    as a tensor of ``dtype`` and ``sizes``, without running code: a whole contiguous record is
    viewed in place (no copy); anything else goes through ``torch.load(weights_only=True)`` after
    ``check_archive``. CorruptCheckpointError names ``where`` when it is not that tensor."""
    expected = math.prod(sizes) * torch.empty(0, dtype=dtype).element_size()
    if zstd:
        from torch.distributed.checkpoint._extension import ZStandard

        item = read_capped(ZStandard().transform_from(io.BytesIO(item)), expected + ZIP_FRAMING, where)
    window = Window(_BytesView(item), 0, len(item))  # not io.BytesIO: that would copy the chunk
    if not expected:
        return torch.empty(sizes, dtype=dtype)
    found = _stored_record(window)
    if found is not None and _matches_shape(found[0], found[2], dtype, sizes):
        start = found[1]
        return torch.frombuffer(memoryview(item)[start:start + expected], dtype=torch.uint8).view(dtype).reshape(sizes)
    try:
        tensor = _load_tensor(window, expected + ZIP_FRAMING, where)
    except (RuntimeError, EOFError, ValueError, zipfile.BadZipFile) as e:
        raise CorruptCheckpointError(f"{where}: expected a stored tensor, actual {type(e).__name__}: "
                                     f"{clip(str(e))}") from e
    if tensor.dtype != dtype or tuple(tensor.shape) != tuple(sizes):
        raise CorruptCheckpointError(f"{where}: expected a tensor {dtype} {tuple(sizes)}, actual "
                                     f"{tensor.dtype} {short(tuple(tensor.shape))}")
    return tensor


def _matches_shape(args: tuple, data: zipfile.ZipInfo, dtype: torch.dtype, sizes: tuple[int, ...]) -> bool:
    return _matches(args, data, _Shape(dtype, tuple(sizes)))


class _BytesView(io.RawIOBase):
    """A seekable, read-only file over a buffer, without copying it."""

    def __init__(self, data: bytes | bytearray | memoryview) -> None:
        self.view, self.pos = memoryview(data).cast("B"), 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = 0) -> int:
        self.pos = max(0, {0: 0, 1: self.pos, 2: len(self.view)}[whence] + offset)
        return self.pos

    def tell(self) -> int:
        return self.pos

    def readinto(self, b) -> int:
        n = max(0, min(len(b), len(self.view) - self.pos))
        memoryview(b).cast("B")[:n] = self.view[self.pos:self.pos + n]
        self.pos += n
        return n


class _Shape:
    """What ``_matches`` reads of a target: its dtype, shape and byte size."""

    def __init__(self, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
        self.dtype, self.shape = dtype, shape

    def numel(self) -> int:
        return math.prod(self.shape)

    def element_size(self) -> int:
        return torch.empty(0, dtype=self.dtype).element_size()
