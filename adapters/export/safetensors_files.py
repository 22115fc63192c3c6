"""Reading the safetensors files of an export (a warm start's source), without the safetensors
package: the 8-byte header length, the JSON header, each tensor's bytes at its offsets. The
header is untrusted: every dtype, shape and byte range is checked against the file before
anything is allocated (``CorruptCheckpointError`` naming the file and the field)."""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from typing import IO

import torch

from resume.errors import CorruptCheckpointError
from resume.text import short

from .writing import SAFETENSORS_DTYPES

__all__ = ["HEADER_CAP", "StoredTensor", "read_header", "read_tensor"]

HEADER_CAP = 100 << 20
_BY_NAME = {v: k for k, v in SAFETENSORS_DTYPES.items()}


@dataclass(frozen=True)
class StoredTensor:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    """Byte offset in the file."""
    length: int


def read_header(f: IO[bytes], size: int, where: str) -> dict[str, StoredTensor]:
    """The tensors a safetensors file of ``size`` bytes declares."""
    head = f.read(8)
    if len(head) != 8:
        raise CorruptCheckpointError(f"{where}: header length: expected 8 bytes, actual {len(head)}")
    (n,) = struct.unpack("<Q", head)
    if n > min(HEADER_CAP, size - 8):
        raise CorruptCheckpointError(f"{where}: header length: expected at most {min(HEADER_CAP, size - 8)}, actual {n}")
    try:
        header = json.loads(f.read(n))
    except (ValueError, RecursionError) as e:
        raise CorruptCheckpointError(f"{where}: header: expected JSON, actual unparsable ({short(str(e))})") from e
    if not isinstance(header, dict):
        raise CorruptCheckpointError(f"{where}: header: expected an object, actual {short(header)}")
    base, out = 8 + n, {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        out[name] = _entry(name, entry, base, size, where)
    return out


def _entry(name: str, entry: object, base: int, size: int, where: str) -> StoredTensor:
    field = f"{where}: {short(name, 120)}"
    if not isinstance(entry, dict) or entry.get("dtype") not in _BY_NAME:
        raise CorruptCheckpointError(f"{field}: dtype: expected one of {sorted(_BY_NAME)}, actual "
                                     f"{short(entry.get('dtype') if isinstance(entry, dict) else entry)}")
    shape, offsets = entry.get("shape"), entry.get("data_offsets")
    if not isinstance(shape, list) or len(shape) > 64 or any(type(d) is not int or d < 0 for d in shape):
        raise CorruptCheckpointError(f"{field}: shape: expected a list of non-negative integers, actual {short(shape)}")
    if (not isinstance(offsets, list) or len(offsets) != 2 or any(type(o) is not int for o in offsets)
            or not 0 <= offsets[0] <= offsets[1] <= size - base):
        raise CorruptCheckpointError(f"{field}: data_offsets: expected [begin, end] inside the file's "
                                     f"{size - base} data bytes, actual {short(offsets)}")
    dtype = _BY_NAME[entry["dtype"]]
    nbytes = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
    if offsets[1] - offsets[0] != nbytes:
        raise CorruptCheckpointError(f"{field}: data_offsets: expected {nbytes} bytes ({entry['dtype']} {shape}), "
                                     f"actual {offsets[1] - offsets[0]}")
    return StoredTensor(name, dtype, tuple(shape), base + offsets[0], nbytes)


def read_tensor(f: IO[bytes], stored: StoredTensor, where: str) -> torch.Tensor:
    """The tensor's bytes, read into a tensor of its own (the header checked them against the file)."""
    out = torch.empty(stored.shape, dtype=stored.dtype)
    if not stored.length:
        return out
    f.seek(stored.start)
    view = memoryview(out.reshape(-1).view(torch.uint8).numpy()).cast("B")
    filled = 0
    while filled < stored.length:
        n = f.readinto(view[filled:])
        if not n:
            raise CorruptCheckpointError(f"{where}: {short(stored.name, 120)}: expected {stored.length} bytes, "
                                         f"actual {filled} (the file ends)")
        filled += n
    return out
