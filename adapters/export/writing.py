"""Writing an export: sharded safetensors with their index, or sharded torch files with theirs.

safetensors (``model-00001-of-0000N.safetensors`` + ``model.safetensors.index.json``): every
shard's header is known before its first tensor (names, dtypes, shapes and so offsets come from
the checkpoint's index), so each tensor is written as soon as it is read and dropped: memory
does not grow with the model. torch (``pytorch_model-00001-of-0000N.bin`` +
``pytorch_model.bin.index.json``): each shard is a ``torch.save`` of its tensors, held until the
shard is written (memory up to ``max_shard_size`` plus one tensor). Shards are filled in export
order up to ``max_shard_size`` (a tensor larger than that gets a shard of its own). Every file is
hashed as written, synced, and listed with its size and checksum in the export's record.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import IO

import torch

__all__ = ["FORMATS", "SAFETENSORS_DTYPES", "ExportWriter", "Shard", "plan_shards"]

FORMATS = ("safetensors", "torch")
SAFETENSORS_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
    torch.uint16: "U16", torch.uint32: "U32", torch.uint64: "U64",
}


@dataclass
class Shard:
    file: str
    names: list[str] = field(default_factory=list)
    dtypes: list[torch.dtype] = field(default_factory=list)
    shapes: list[tuple[int, ...]] = field(default_factory=list)
    nbytes: int = 0


def _nbytes(dtype: torch.dtype, shape: Sequence[int]) -> int:
    return math.prod(shape) * torch.empty(0, dtype=dtype).element_size()


def plan_shards(items: Sequence[tuple[str, torch.dtype, tuple[int, ...]]], fmt: str, max_shard_size: int) -> list[Shard]:
    """The shards, in export order, each up to ``max_shard_size`` bytes of tensor data."""
    shards: list[Shard] = []
    for name, dtype, shape in items:
        n = _nbytes(dtype, shape)
        if not shards or (shards[-1].names and shards[-1].nbytes + n > max_shard_size):
            shards.append(Shard(""))
        shard = shards[-1]
        shard.names.append(name)
        shard.dtypes.append(dtype)
        shard.shapes.append(tuple(shape))
        shard.nbytes += n
    stem, ext = ("model", "safetensors") if fmt == "safetensors" else ("pytorch_model", "bin")
    for i, shard in enumerate(shards):
        shard.file = f"{stem}-{i + 1:05d}-of-{len(shards):05d}.{ext}"
    return shards


def index_name(fmt: str) -> str:
    return "model.safetensors.index.json" if fmt == "safetensors" else "pytorch_model.bin.index.json"


def _safetensors_header(shard: Shard, metadata: dict[str, str]) -> bytes:
    header: dict = {"__metadata__": metadata}
    at = 0
    for name, dtype, shape in zip(shard.names, shard.dtypes, shard.shapes):
        n = _nbytes(dtype, shape)
        header[name] = {"dtype": SAFETENSORS_DTYPES[dtype], "shape": list(shape), "data_offsets": [at, at + n]}
        at += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
    return struct.pack("<Q", len(raw)) + raw


class _HashingFile:
    """A new output file, hashed while written, its writeback started behind the writer and its
    pages dropped once on disk (``HashingSink``, as a save's shards are written)."""

    def __init__(self, path: str) -> None:
        from ..dcp.filesystem import HashingSink

        self.raw: IO[bytes] = open(path, "xb", buffering=0)  # noqa: SIM115 - closed by close()
        self.sink = HashingSink(self.raw, writeback=True)

    def write(self, data) -> None:
        self.sink.write(memoryview(data).cast("B"))

    def flush(self) -> None:
        pass

    def close(self) -> dict:
        os.fdatasync(self.raw.fileno())
        self.raw.close()
        return {"size": self.sink.size, "checksum": self.sink.checksum}


class ExportWriter:
    """Takes the tensors in the planned order (``add``) and writes the shards into ``directory``."""

    def __init__(self, directory: str, fmt: str, shards: list[Shard], metadata: dict[str, str]) -> None:
        if fmt not in FORMATS:
            raise ValueError(f"format {fmt!r}")
        self.directory, self.fmt, self.shards, self.metadata = directory, fmt, shards, metadata
        self.files: dict[str, dict] = {}
        self._shard = -1
        self._at = 0
        self._out: _HashingFile | None = None
        self._held: dict[str, torch.Tensor] = {}

    def add(self, name: str, tensor: torch.Tensor) -> None:
        shard = self._current()
        expected = shard.names[self._at]
        if name != expected or tensor.dtype != shard.dtypes[self._at] or tuple(tensor.shape) != shard.shapes[self._at]:
            raise AssertionError(f"export order: expected {expected}, actual {name}")
        if self.fmt == "safetensors":
            if tensor.numel():
                self._out.write(tensor.contiguous().reshape(-1).view(torch.uint8).numpy())
        else:
            self._held[name] = tensor.clone(memory_format=torch.contiguous_format)  # the read buffer is reused
        self._at += 1
        if self._at == len(shard.names):
            self._close_shard()

    def _current(self) -> Shard:
        if self._out is None and not self._held and (self._shard < 0 or self._at == len(self.shards[self._shard].names)):
            self._shard += 1
            self._at = 0
            shard = self.shards[self._shard]
            if self.fmt == "safetensors":
                self._out = _HashingFile(os.path.join(self.directory, shard.file))
                self._out.write(_safetensors_header(shard, self.metadata))
        return self.shards[self._shard]

    def _close_shard(self) -> None:
        shard = self.shards[self._shard]
        if self.fmt == "torch":
            out = _HashingFile(os.path.join(self.directory, shard.file))
            torch.save(self._held, out)  # type: ignore[arg-type]
            self._held = {}
            self.files[shard.file] = out.close()
        else:
            self.files[shard.file] = self._out.close()
            self._out = None

    def finish(self) -> None:
        """The index file (every tensor's shard), after the last shard."""
        if self._shard != len(self.shards) - 1 or self._out is not None or self._held:
            raise AssertionError("export: not every tensor was written")
        total = sum(s.nbytes for s in self.shards)
        index = {"metadata": {"total_size": total, **self.metadata},
                 "weight_map": {name: s.file for s in self.shards for name in s.names}}
        name = index_name(self.fmt)
        out = _HashingFile(os.path.join(self.directory, name))
        out.write(json.dumps(index, indent=2, sort_keys=True).encode() + b"\n")
        self.files[name] = out.close()

    def abort(self) -> None:
        if self._out is not None:
            self._out.raw.close()
            self._out = None
        self._held = {}
