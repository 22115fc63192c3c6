"""Checking a Megatron save that has no resume manifest, from Megatron's own metadata.

``.metadata`` lists every record (file, offset, length); each record is a stored
``torch.save`` archive whose members carry a CRC-32. So without checksums of ours: every
file named must exist and hold its records, nothing may follow the last record, and
``deep`` reads every record and checks every member's CRC-32.

Not caught (``UNCAUGHT``, also in the README): a record replaced whole by another valid
archive, and a change to ``.metadata``, ``metadata.json`` or the common state that still
reads. Nothing here unpickles a record (``.metadata``: ``resume.adapters.dcp.unpickle``'s allow-list; the
common state: ``common``'s inert reader).
"""


from __future__ import annotations

import io
import struct
import zipfile
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from resume.errors import ResumeError, UnsafePathError
from resume.storage import SMALL_FILE_CAP, Storage, join
from resume.text import clip, parse_json, short

from .common import SAMPLE_COUNTERS, CommonState, read_common_state
from .savedir import iteration_dirname

__all__ = ["UNCAUGHT", "Counters", "SaveCheck", "check_save", "derived_counters"]

UNCAUGHT = ("without a resume manifest there are no checksums: a record replaced whole by another "
            "valid archive, or a change to .metadata, metadata.json or the common state that still "
            "reads, is not caught (`resume megatron adopt` records checksums)")

NO_SCHEDULER = ("Megatron saves its scheduler only with the optimizer and this save has none "
                "(--no-save-optim?): successful and skipped updates cannot be derived")


@dataclass
class Counters:
    """The counters of a Megatron save as its own state gives them; None where it cannot."""

    iteration: int
    samples_read: int | None
    updates_successful: int | None
    updates_skipped: int | None
    unknown: str | None = None
    """Why a counter is None."""
    megatron: dict[str, Any] = field(default_factory=dict)
    """Megatron's own sample counters (``consumed_train_samples``, ``skipped_train_samples``)."""

    def to_dict(self) -> dict:
        return {"iteration": self.iteration, "samples_read": self.samples_read,
                "updates_successful": self.updates_successful, "updates_skipped": self.updates_skipped,
                "unknown": self.unknown}


def derived_counters(common: CommonState) -> Counters:
    """Counters from the common state: samples read is ``consumed_train_samples``; successful
    updates the scheduler position over the global batch; skipped the rest of the iterations.
    Without the scheduler's state the updates are unknown, never a guess."""
    args = common.args
    megatron = {k: args.get(k) if isinstance(args.get(k), int) else None for k in SAMPLE_COUNTERS}
    consumed = args.get("consumed_train_samples")
    samples = consumed if isinstance(consumed, int) else None
    if common.scheduler is None:
        return Counters(common.iteration, samples, None, None, NO_SCHEDULER, megatron)
    try:
        state = common.counters()
    except ResumeError as e:
        return Counters(common.iteration, samples, None, None, str(e), megatron)
    return Counters(state.iteration, state.samples_read, state.updates_successful, state.updates_skipped,
                    None, megatron)


@dataclass
class SaveCheck:
    """What the check of one Megatron save found."""

    step: int
    problems: list[str] = field(default_factory=list)
    counters: Counters | None = None
    common: CommonState | None = None
    records: int = 0
    files: dict[str, int] = field(default_factory=dict)
    """Every file of the save: name -> size (``.metadata``, ``metadata.json`` and the data files)."""
    deep: bool = False

    @property
    def ok(self) -> bool:
        return not self.problems

    def summary(self) -> str:
        data = [n for n in self.files if n.endswith(".distcp")]
        how = "and the CRC-32 of every record" if self.deep else "(--deep: the CRC-32 of every record)"
        return f"{self.records} records in {len(data)} files match .metadata {how}"


def check_save(storage: Storage, iteration: int, *, deep: bool = False,
               progress: Callable[[int], None] | None = None) -> SaveCheck:
    """Check ``iter_<iteration>/`` from Megatron's own metadata. Never raises for a bad save:
    each problem names the file it is about (and the record, for a record)."""
    d = iteration_dirname(iteration)
    check = SaveCheck(step=iteration, deep=deep)
    try:
        names = storage.listdir(d)
    except (OSError, ValueError) as e:
        check.problems.append(f"{storage.url(d)}: expected a listable directory, actual "
                              f"{type(e).__name__}: {clip(str(e), 200)}")
        return check
    if any(n.startswith("mp_rank_") for n in names) and ".metadata" not in names:
        check.problems.append(f"{storage.url(d)}: format: expected torch_dist (.metadata, *.distcp), actual "
                              "the legacy torch format (mp_rank_*/model_optim_rng.pt); save with "
                              "--ckpt-format torch_dist")
        return check
    check.problems += _metadata_json_problems(storage, d, check)
    metadata = _read_metadata(storage, d, names, check)
    if metadata is None:
        return check
    by_file: dict[str, list[tuple[int, int, str]]] = {}
    for index, info in metadata.storage_data.items():
        by_file.setdefault(info.relative_path, []).append((info.offset, info.length, index.fqn))
    check.records = len(metadata.storage_data)
    sound = []
    for name, records in sorted(by_file.items()):
        records.sort()
        problem = _file_problem(storage, join(d, name), records, check)
        if problem:
            check.problems.append(problem)
        else:
            sound.append(name)
    try:
        check.common = read_common_state(storage, iteration)
        check.counters = derived_counters(check.common)
    except (OSError, ValueError, RuntimeError) as e:  # ResumeError is a RuntimeError
        if not check.problems:  # a missing or cut file already says why
            check.problems.append(str(e))
    if deep:
        for name in sound:
            problem = _record_problem(storage, join(d, name), by_file[name], progress)
            if problem:
                check.problems.append(problem)
    return check


def _metadata_json_problems(storage: Storage, d: str, check: SaveCheck) -> list[str]:
    path = join(d, "metadata.json")
    source = storage.url(path)
    try:
        raw = storage.read_bytes(path, limit=SMALL_FILE_CAP)
    except FileNotFoundError:
        return [(f"{source}: expected Megatron's metadata.json ({{\"sharded_backend\": \"torch_dist\"}}), "
                 "actual missing")]
    except (OSError, ValueError) as e:
        return [str(e) if isinstance(e, UnsafePathError) else
                f"{source}: expected a readable file, actual {type(e).__name__}: {clip(str(e), 200)}"]
    check.files["metadata.json"] = len(raw)
    try:
        meta = parse_json(raw)
    except ValueError as e:
        return [f"{source}: {e}"]
    backend = meta.get("sharded_backend") if isinstance(meta, dict) else None
    if backend != "torch_dist":
        return [f"{source}: sharded_backend: expected 'torch_dist', actual {short(backend)}"]
    return []


def _read_metadata(storage: Storage, d: str, names: list[str], check: SaveCheck) -> Any:
    """DCP's ``.metadata`` through the allow-list unpickler (shape checked, bounds not: they
    are checked per file here, to name the file); None after adding the problem."""
    from ..dcp.unpickle import METADATA_CAP, restricted_load_metadata

    path = join(d, ".metadata")
    source = storage.url(path)
    if ".metadata" not in names:
        check.problems.append(f"{source}: expected DCP's .metadata (written last; it lists every record's "
                              "file, offset and length), actual missing")
        return None
    try:
        raw = storage.read_bytes(path, limit=METADATA_CAP)
        check.files[".metadata"] = len(raw)
        return restricted_load_metadata(raw, source=source)
    except (OSError, ValueError, RuntimeError) as e:
        check.problems.append(str(e) if isinstance(e, (ResumeError, UnsafePathError)) else
                              f"{source}: expected a readable file, actual {type(e).__name__}: {clip(str(e), 200)}")
        return None


def _file_problem(storage: Storage, path: str, records: list[tuple[int, int, str]],
                  check: SaveCheck) -> str | None:
    """A data file against the records .metadata puts in it: present, every record inside it,
    nothing after the last one."""
    source = storage.url(path)
    try:
        size = storage.size(path)
    except FileNotFoundError:
        return (f"{source}: expected the file .metadata names for {len(records)} records (first "
                f"{short(records[0][2])}), actual missing")
    except (OSError, ValueError) as e:
        return str(e) if isinstance(e, UnsafePathError) else (
            f"{source}: expected a readable regular file, actual {type(e).__name__}: {clip(str(e), 200)}")
    check.files[path.rsplit("/", 1)[-1]] = size
    outside = [r for r in records if r[0] + r[1] > size]
    if outside:
        offset, length, fqn = outside[0]
        return (f"{source}: record {short(fqn)} at offset {offset}, length {length}: expected inside the "
                f"file's {size} bytes, actual ending at {offset + length} (truncated: {len(outside)} of "
                f"{len(records)} records past the end)")
    end = max(o + n for o, n, _ in records)
    if size > end:
        return (f"{source}: size: expected {end} bytes (the end of its last record), actual {size} "
                "(bytes .metadata does not describe)")
    return None


def _record_problem(storage: Storage, path: str, records: list[tuple[int, int, str]],
                    progress: Callable[[int], None] | None) -> str | None:
    """Every record of a data file read: a stored torch.save archive inside the record whose
    members' CRC-32 match. The first bad record is named, with how many are bad."""
    from ..dcp.reader import Window, check_archive

    source = storage.url(path)
    bad: list[str] = []
    with storage.open_read(path) as f:
        for offset, length, fqn in records:
            where = f"{source}: record {short(fqn)} at offset {offset}, length {length}"
            window = io.BufferedReader(Window(f, offset, length), buffer_size=1 << 20)
            try:
                check_archive(window, length, where)
                with zipfile.ZipFile(window) as z:
                    broken = z.testzip()
                if broken is not None:
                    bad.append(f"{where}: CRC-32 of {short(broken)}: expected the one the archive records, "
                               "actual another (bytes changed since Megatron wrote them)")
            except ResumeError as e:
                bad.append(str(e))
            except (zipfile.BadZipFile, OSError, ValueError, EOFError, struct.error) as e:
                bad.append(f"{where}: expected a torch.save archive, actual {type(e).__name__}: "
                           f"{clip(str(e), 120)}")
            if progress is not None:
                progress(length)
    if not bad:
        return None
    return bad[0] + (f" ({len(bad)} of {len(records)} records bad)" if len(bad) > 1 else "")
