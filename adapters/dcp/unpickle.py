"""DCP's ``.metadata`` unpickled without running its code.

DCP keeps ``.metadata`` as a pickle, which would run whatever a malicious checkpoint put
there. Here it goes through an unpickler that allows the metadata classes and nothing else,
then through ``metadata_check`` (shape and bounds). The data items are read by ``reader``.
"""

from __future__ import annotations

import dataclasses
import io
import pathlib
import pickle
import types
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any, ClassVar

import torch
from torch.distributed.checkpoint import filesystem as _fs
from torch.distributed.checkpoint import metadata as _md
from torch.distributed.checkpoint.metadata import Metadata

from resume.errors import CorruptCheckpointError, UnsafeCheckpointError
from resume.storage import join
from resume.text import clip, short

from .metadata_check import check_metadata

__all__ = ["METADATA_CAP", "ZSTD", "pickle_refusal", "read_step_metadata", "restricted_load_metadata"]

ZSTD = "stream.zstd/1"
"""The one transform honoured (what ``filesystem.make_writer(compression="zstd")`` records), and
only when the run's manifest records the compression."""

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
    Slower than the C unpickler: a restore runs it once, on rank 0.
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
    bounds (``metadata_check``; ``file_sizes``: the manifest's, which bound every item;
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
save)."""


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


def pickle_refusal(error: BaseException) -> str:
    """torch's weights-only refusal names the global on its first lines; the rest is advice."""
    lines = [line.strip() for line in str(error).splitlines() if "GLOBAL" in line or "global" in line]
    return (lines[0] if lines else str(error).splitlines()[0] if str(error) else type(error).__name__)[:300]
