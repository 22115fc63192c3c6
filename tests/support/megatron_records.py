"""Where things are inside a Megatron torch_dist save: the records .metadata lists, and the
bytes of a tensor inside one of them (to damage data, not a zip header)."""

from __future__ import annotations

import os
import struct
import zipfile

from resume.adapters.dcp.unpickle import read_step_metadata

from resume.storage import open_storage


def records(step_dir: str) -> list[tuple[str, str, int, int]]:
    """(fqn, file, offset, length) of every record, in file order."""
    parent, name = os.path.split(step_dir.rstrip("/"))
    metadata = read_step_metadata(open_storage(parent), name)
    out = [(index.fqn, info.relative_path, info.offset, info.length)
           for index, info in metadata.storage_data.items()]
    return sorted(out, key=lambda r: (r[1], r[2]))


def tensor_data_offset(step_dir: str) -> int:
    """An offset in ``__0_0.distcp`` in the middle of the largest record's tensor bytes."""
    _, rel, offset, length = max((r for r in records(step_dir) if r[1] == "__0_0.distcp"), key=lambda r: r[3])
    with open(os.path.join(step_dir, rel), "rb") as f:
        f.seek(offset)
        raw = f.read(length)
    import io

    with zipfile.ZipFile(io.BytesIO(raw)) as z:
        data = max(z.infolist(), key=lambda i: i.file_size)
    name_len, extra_len = struct.unpack("<HH", raw[data.header_offset + 26:data.header_offset + 30])
    start = data.header_offset + 30 + name_len + extra_len
    return offset + start + data.file_size // 2
