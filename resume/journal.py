"""The update journal: one small record per update, sealed by each checkpoint's commit.

A record (one JSON line, at most ``RECORD_CAP`` bytes)::

    {"it": 1201, "ok": true, "at": 2304000, "n": 1920, "lr": [8e-05, 8e-05],
     "loss": 2.31, "grad_norm": 0.84, "clipped": false, "ids": [...], "ids_n": 24}

``it`` is the iteration the update completed (1 for the first), ``ok`` whether it was applied
(false: skipped), ``at``/``n`` the batch's first sample position and sample count in the run's
own numbering (``resume.skips``), ``skipped`` the samples a declared skip passed over before it,
``lr`` the LR each param group applied (null: its optimizer did not step), ``loss``,
``grad_norm`` (before clipping) and ``clipped`` as the program passed them (non-finite numbers
as the strings ``"nan"``, ``"inf"``, ``"-inf"``), ``ids`` the first ``RECORD_IDS`` sample ids
of rank 0's share of the batch (``ids_n`` its size) or, for a batch that carries no ids,
``digest``, a digest of its content.

Files, under the run::

    journal/open-<stamp>-<pid>.jsonl     the records since the last seal, as they happen (rank 0,
                                         appended, never fsynced; a new file after each seal): what
                                         a crash leaves behind
    journal/sealed-<step>.jsonl          the records up to a checkpoint, written by its commit;
                                         its first line names the previous segment and checksum,
                                         the manifest's ``journal`` names this one: a chain
    journal/lost-after-<step>-<stamp>.jsonl
                                         records of updates a crash lost (beyond the checkpoint
                                         the next launch restored): the abandoned branch
    abandoned/rewind-<n>/journal/...     a rewind's abandoned branch (``resume.rewind``)

Reading (``read_journal``) follows the chain from a manifest and checks every segment's size
and checksum; the journal of a restored run never claims updates its state does not contain.
"""

from __future__ import annotations

import atexit
import datetime as _dt
import json
import logging
import math
import os
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .checksum import checksum_bytes
from .errors import ManifestError
from .storage import Storage, join
from .text import clip, parse_json, short

__all__ = ["JOURNAL_DIR", "RECORD_CAP", "RECORD_IDS", "WRITE_EVERY", "WRITE_S", "Branch", "Journal", "JournalView", "UpdateRecorder",
           "number_or_text", "read_journal", "read_segment_chain"]

log = logging.getLogger("resume")

JOURNAL_DIR = "journal"
RECORD_IDS = 32
"""Sample ids kept per record (rank 0's first ones)."""
RECORD_CAP = 2048
"""Bytes per record at most (a record past it keeps its counters and drops ids and extras)."""
SEGMENT_CAP = 256 << 20
OPEN_CAP = 64 << 20
SCHEMA = "resume.journal"
_REMOTE_FLUSH_S = 30.0
WRITE_S = 1.0
WRITE_EVERY = 64
"""The open file gets the kept records once this many are kept, or at the first record more than
``WRITE_S`` after the last write, and at each seal, flush and close (and at the interpreter's
exit). Encoding right after an optimizer step costs several times what it costs in a warm loop
(cold caches): encoded 64 at a time, most of that is paid once. A run whose updates take longer
than ``WRITE_S`` writes each record at its own update; a faster one killed with SIGKILL loses at
most the last ``WRITE_S`` of records (never sealed ones: the checkpoints hold those updates)."""


def number_or_text(value: Any) -> float | str | None:
    """A float for JSON: non-finite ones as text ("nan", "inf", "-inf"); None stays None."""
    if value is None:
        return None
    x = float(value)
    if math.isfinite(x):
        return x
    return "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")


def _stamp() -> str:
    return _dt.datetime.now(_dt.UTC).strftime("%Y%m%dT%H%M%S%f")


def _finite(record: dict) -> dict:
    """Non-finite numbers as text (JSON has none)."""
    for key in ("loss", "grad_norm"):
        v = record.get(key)
        if type(v) is float and not math.isfinite(v):
            record[key] = number_or_text(v)
    lrs = record.get("lr")
    if lrs is not None and not all(type(x) is float and math.isfinite(x) for x in lrs):
        record["lr"] = [number_or_text(x) for x in lrs]
    return record


def _read_ids(record: dict) -> dict:
    """A record's batch ids, kept as the adapter gave them (``_ids``), as its first ``RECORD_IDS``."""
    raw = record.pop("_ids", None)
    if raw is None:
        return record
    try:
        if hasattr(raw, "reshape") and hasattr(raw, "tolist"):
            flat = raw.reshape(-1)
            ids, total = flat[:RECORD_IDS].tolist(), int(flat.shape[0])
        else:
            ids, total = list(raw[:RECORD_IDS]), len(raw)
        record["ids"], record["ids_n"] = [int(i) for i in ids], total
    except Exception as e:  # noqa: BLE001 - ids the writer cannot read: the record says so
        record["batch"] = f"ids not readable: {type(e).__name__}"
    return record


def _line(record: dict) -> bytes:
    record = _finite(_read_ids(record))
    line = json.dumps(record, separators=(",", ":"), allow_nan=False).encode() + b"\n"
    if len(line) > RECORD_CAP:
        kept = {k: record[k] for k in ("it", "ok", "at", "n", "skipped", "loss", "grad_norm", "clipped")
                if k in record}
        kept["cut"] = True
        line = json.dumps(kept, separators=(",", ":"), allow_nan=False).encode() + b"\n"
    return line


class Journal:
    """Rank 0's writer. ``record`` keeps the record; they are encoded and appended with one ``write``
    (no fsync) on a local run (``WRITE_EVERY``, ``WRITE_S``); on an object store the open records
    go up every 30 s and at each save and close."""

    def __init__(self, storage: Storage, *, clock: Callable[[], float] | None = None) -> None:
        self.storage = storage
        self._pending: list[list] = []
        """[iteration, the record (None once encoded), its line (None until then)] not sealed yet."""
        self._queued = 0
        self._written_at = 0.0
        self._prev: dict | None = None
        self._lock = threading.Lock()
        self._open_name = join(JOURNAL_DIR, f"open-{_stamp()}-{os.getpid()}.jsonl")
        self._fd: int | None = None
        self._unflushed: list[bytes] = []
        self._clock = clock
        self._flushed_at = 0.0
        self._broken = False
        self._made = False
        atexit.register(_write_at_exit, weakref.ref(self))

    # -- the launch ----------------------------------------------------------------------

    def start(self, restored: dict | None, step: int | None) -> list[str]:
        """At the restore (``step``; None: a fresh start): the chain continues from the restored
        manifest's segment; records a crash left beyond ``step`` are kept as lost. The lost files
        written."""
        self._prev = restored
        try:
            return _keep_lost(self.storage, -1 if step is None else step)
        except OSError as e:  # the journal never stops training: the files stay for the next look
            log.warning("resume: %s: cannot look at the journal a launch left: %s", self.storage.url(JOURNAL_DIR), e)
            return []

    def record(self, record: dict) -> None:
        """Keep ``record``; it is encoded and written with the others every ``WRITE_S`` seconds or
        ``WRITE_EVERY`` records (one ``write``), at each seal, flush and close."""
        with self._lock:
            self._pending.append([record["it"], record, None])
            self._queued += 1
            due = self._queued >= WRITE_EVERY or (self._clock is not None and
                                                  self._clock() - self._written_at > WRITE_S)
            if due:
                self._drain()

    def _drain(self) -> None:
        """Encode the records kept since the last write and append them to the open file (under the lock)."""
        if not self._queued:
            return
        fresh = self._pending[len(self._pending) - self._queued:]
        self._queued = 0
        for entry in fresh:
            entry[2] = _line(entry[1])
            entry[1] = None
        self._write_open(b"".join(entry[2] for entry in fresh))
        if self._clock is not None:
            self._written_at = self._clock()

    def _write_open(self, data: bytes) -> None:
        if self._broken or not data:
            return
        try:
            if self._fd is None and not self._open_file():
                self._unflushed.append(data)
                if self._clock is not None and self._clock() - self._flushed_at > _REMOTE_FLUSH_S:
                    self._flush_remote()
                return
            os.write(self._fd, data)
        except OSError as e:
            self._broken = True  # the journal never stops training; the seal still writes
            log.warning("resume: %s: cannot append the update journal (%s); the sealed journal is "
                        "still written at each save", self.storage.url(self._open_name), e)

    def _open_file(self) -> bool:
        local = self.storage.local_path(self._open_name)
        if local is None:
            return False
        self.storage.append_bytes(self._open_name, b"", limit=OPEN_CAP)  # made safely (no link followed)
        self._fd = os.open(local, os.O_WRONLY | os.O_APPEND | getattr(os, "O_NOFOLLOW", 0))
        return True

    def flush(self) -> None:
        """Every record kept so far written to the open file (and, on an object store, sent)."""
        with self._lock:
            self._drain()
            self._flush_remote()

    def _flush_remote(self) -> None:
        if self._unflushed and not self._broken:
            data, self._unflushed = b"".join(self._unflushed), []
            try:
                if not self._made:
                    self.storage.makedirs(JOURNAL_DIR)
                    self._made = True
                self.storage.append_bytes(self._open_name, data, limit=OPEN_CAP)
            except OSError as e:
                log.warning("resume: %s: cannot append the update journal: %s", self.storage.url(self._open_name), e)
        if self._clock is not None:
            self._flushed_at = self._clock()

    def close(self) -> None:
        """The launch ends: the open file goes once every record in it is sealed."""
        with self._lock:
            self._drain()
            self._flush_remote()
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None
            sealed = not self._pending
        if sealed:
            try:
                if self.storage.exists(self._open_name):
                    self.storage.delete(self._open_name)
            except OSError as e:
                log.warning("resume: cannot remove %s: %s", self.storage.url(self._open_name), e)

    # -- sealing ---------------------------------------------------------------------------

    def snapshot(self, step: int) -> list[bytes]:
        """The records up to ``step`` not sealed yet (taken when a save captures its state)."""
        with self._lock:
            self._drain()
            return [line for it, _, line in self._pending if it <= step]

    def seal(self, step: int, lines: list[bytes]) -> dict:
        """Write the segment of ``lines`` (records up to ``step``) and return the manifest's
        ``journal`` entry; called by the commit, before the manifest is written."""
        with self._lock:
            prev = self._prev
        header = {"schema": SCHEMA, "step": step, "records": len(lines), "prev": prev}
        data = json.dumps(header, separators=(",", ":")).encode() + b"\n" + b"".join(lines)
        name = join(JOURNAL_DIR, f"sealed-{step:09d}.jsonl")
        if not self._made:  # a file system behind fsspec wants the directory made first
            self.storage.makedirs(JOURNAL_DIR)
            self._made = True
        self.storage.write_bytes_atomic(name, data)
        first = json.loads(lines[0])["it"] if lines else None
        entry = {"segment": name, "size": len(data), "checksum": checksum_bytes(data), "step": step,
                 "records": len(lines), "first": first}
        with self._lock:
            self._prev = entry
            self._drain()
            self._pending = [entry for entry in self._pending if entry[0] > step]
            self._rotate()
        return entry

    def _rotate(self) -> None:
        """After a seal (under the lock): a new open file holding only the records not sealed, and
        the old one gone, so that an open file never holds more than one save interval."""
        old, fd = self._open_name, self._fd
        self._open_name = join(JOURNAL_DIR, f"open-{_stamp()}-{os.getpid()}.jsonl")
        self._fd, self._unflushed = None, []
        if fd is not None:
            os.close(fd)
        self._write_open(b"".join(line for _, _, line in self._pending))
        self._flush_remote()
        try:
            if self.storage.exists(old):
                self.storage.delete(old)
        except OSError as e:
            log.warning("resume: cannot remove %s: %s", self.storage.url(old), e)


class UpdateRecorder:
    """What the coordinator hands the journal at each update (rank 0): the batch it gave the loop
    and what the program passes to ``update()``."""

    __slots__ = ("_batch", "adapter", "journal")

    def __init__(self, journal: Journal, adapter: Any) -> None:
        self.journal = journal
        self.adapter = adapter
        self._batch: Any = None

    def batch(self, batch: Any) -> None:
        self._batch = batch

    def update(self, state: Any, *, first: int, n: int, passed_over: int, applied: bool,
               extra: dict) -> None:
        record: dict[str, Any] = {"it": state.iteration, "ok": applied, "at": first, "n": n}
        if passed_over:
            record["skipped"] = passed_over
        if applied:
            lrs = self.adapter.applied_lrs()
            record["lr"] = self.adapter.current_lrs() if lrs is None else lrs
        for key, value in extra.items():
            if value is not None:
                record[key] = bool(value) if key == "clipped" else (
                    int(value) if key == "tokens" else float(value))
        batch, self._batch = self._batch, None
        if batch is not None:
            self._describe(record, batch)
        self.journal.record(record)

    def _describe(self, record: dict, batch: Any) -> None:
        try:
            ids = self.adapter.batch_ids(batch)
            if ids is not None:
                record["_ids"] = ids  # read when the record is encoded, off the update's path
            else:
                described = self.adapter.describe_batch(batch)
                record["digest"] = checksum_bytes(json.dumps(described).encode())
        except Exception as e:  # noqa: BLE001 - a batch the adapter cannot describe is recorded without
            record["batch"] = f"not described: {type(e).__name__}"


def _write_at_exit(ref: weakref.ref) -> None:
    """The records kept and not written yet, at the interpreter's exit (a program that raised)."""
    journal = ref()
    if journal is not None:
        try:
            journal.flush()
        except Exception:  # noqa: BLE001,S110 - an exit must not fail for the journal
            pass


def _keep_lost(storage: Storage, step: int) -> list[str]:
    """Every open file a launch left: its records beyond ``step`` go to a lost file (the updates
    a crash lost: the abandoned branch); then it goes."""
    try:
        names = [n for n in storage.listdir(JOURNAL_DIR) if n.startswith("open-") and n.endswith(".jsonl")]
    except (FileNotFoundError, NotADirectoryError):
        return []
    written = []
    for name in sorted(names):
        path = join(JOURNAL_DIR, name)
        try:
            records, problems = _parse_records(storage.read_bytes(path, limit=OPEN_CAP), storage.url(path))
        except (OSError, ValueError) as e:
            log.warning("resume: %s: left in place, unreadable: %s", storage.url(path), e)
            continue
        beyond = [r for r in records if r["it"] > step]
        if beyond:
            lost = join(JOURNAL_DIR, f"lost-after-{max(step, 0):09d}-{_stamp()}.jsonl")
            header = {"schema": SCHEMA, "lost_after": step, "from": name, "records": len(beyond),
                      "problems": problems[:5]}
            storage.write_bytes_atomic(lost, b"".join(_line(r) for r in [header, *beyond]))
            written.append(lost)
            log.warning("resume: %d update records after %d were lost with their launch; kept as %s",
                        len(beyond), step, storage.url(lost))
        storage.delete(path)
    return written


# -- reading -----------------------------------------------------------------------------------


def _check_record(r: Any) -> bool:
    return (isinstance(r, dict) and type(r.get("it")) is int and r["it"] > 0 and isinstance(r.get("ok"), bool)
            and type(r.get("at", 0)) is int and type(r.get("n", 0)) is int)


def _parse_records(data: bytes, source: str) -> tuple[list[dict], list[str]]:
    """Records of a journal file; a line that is no record (torn by a crash, planted) is named
    in the problems and left out."""
    records, problems = [], []
    for i, raw in enumerate(data.split(b"\n")):
        if not raw.strip():
            continue
        try:
            r = parse_json(raw) if len(raw) <= RECORD_CAP else None
        except ValueError:
            r = None
        if isinstance(r, dict) and r.get("schema") == SCHEMA:
            continue
        if not _check_record(r):
            problems.append(f"{source}: line {i + 1}: expected an update record, actual {short(raw[:80])}")
            continue
        records.append(r)
    return records, problems


def _parse_header(data: bytes, source: str) -> dict:
    first = data.split(b"\n", 1)[0]
    try:
        header = parse_json(first)
    except ValueError as e:
        raise ManifestError(f"{source}: line 1: expected the journal header, actual {clip(str(e), 80)}") from e
    if not isinstance(header, dict) or header.get("schema") != SCHEMA:
        raise ManifestError(f"{source}: schema: expected {SCHEMA!r}, actual {short(header)}")
    return header


def _check_entry(entry: Any, source: str) -> dict:
    if not (isinstance(entry, dict) and isinstance(entry.get("segment"), str)
            and type(entry.get("size")) is int and isinstance(entry.get("checksum"), str)
            and type(entry.get("step")) is int):
        raise ManifestError(f"{source}: journal: expected {{segment, size, checksum, step}}, actual {short(entry)}")
    segment = entry["segment"]
    if not (segment.startswith(JOURNAL_DIR + "/sealed-") and segment.count("/") == 1 and ".." not in segment):
        raise ManifestError(f"{source}: journal.segment: expected journal/sealed-<step>.jsonl, actual {short(segment)}")
    return entry


def read_segment_chain(storage: Storage, entry: dict | None, *, source: str,
                       base: str = "") -> tuple[list[dict], list[str]]:
    """The sealed records from the first segment to ``entry``'s (oldest first) and the problems
    met: a segment missing or with another size or checksum than its successor names ends the
    chain there (the records after it are still the sealed, checked ones)."""
    segments: list[list[dict]] = []
    problems: list[str] = []
    seen: set[str] = set()
    while entry is not None:
        try:
            entry = _check_entry(entry, source)
        except ManifestError as e:
            problems.append(str(e))
            break
        path = entry["segment"]
        if base and run_exists(storage, join(base, path)):  # moved with its branch, else shared with main
            path = join(base, path)
        url = storage.url(path)
        if path in seen or len(seen) > 1_000_000:
            problems.append(f"{url}: expected a chain of segments, actual a loop")
            break
        seen.add(path)
        try:
            data = storage.read_bytes(path, limit=SEGMENT_CAP)
        except (OSError, ValueError) as e:
            problems.append(f"{url}: expected a journal segment, actual {type(e).__name__}: {clip(str(e), 120)}")
            break
        if len(data) != entry["size"] or checksum_bytes(data) != entry["checksum"]:
            problems.append(f"{url}: expected {entry['size']} bytes with checksum {entry['checksum']} "
                            f"({source}), actual {len(data)} bytes with {checksum_bytes(data)}")
            break
        try:
            header = _parse_header(data, url)
        except ManifestError as e:
            problems.append(str(e))
            break
        records, bad = _parse_records(data, url)
        problems += bad
        segments.append(records)
        source, entry = url, header.get("prev")
    records = [r for seg in reversed(segments) for r in seg]
    return records, problems


@dataclass
class Branch:
    """Records of one line of the run's history."""

    name: str
    """'main' (sealed, the committed checkpoints' chain), 'unsealed' (this launch's, after the newest
    commit), 'lost after N' (a crash lost them), 'rewind N' (abandoned by a rewind)."""
    records: list[dict]
    abandoned: bool = False
    note: str = ""
    problems: list[str] = field(default_factory=list)


@dataclass
class JournalView:
    branches: list[Branch]

    @property
    def main(self) -> Branch:
        return self.branches[0]

    def all_records(self) -> list[tuple[Branch, dict]]:
        return [(b, r) for b in self.branches for r in b.records]


def read_journal(storage: Storage, newest: dict | None, *, source: str,
                 abandoned_branches: list[tuple[str, str, dict | None, int]] = ()) -> JournalView:
    """Every branch: the main line sealed by ``newest`` (the newest committed manifest's journal
    entry), records after it still open, records lost in crashes, and each rewind's abandoned
    line (``abandoned_branches``: (name, directory, its newest journal entry, the step it left the
    main line at))."""
    records, problems = read_segment_chain(storage, newest, source=source)
    branches = [Branch("main", records, problems=problems)]
    last = records[-1]["it"] if records else 0
    for name in _names(storage, JOURNAL_DIR):
        path = join(JOURNAL_DIR, name)
        if name.startswith("open-"):
            found, bad = _read_records(storage, path)
            branches.append(Branch("unsealed", [r for r in found if r["it"] > last], problems=bad,
                                   note=f"{name}: a launch's updates not committed yet (or it was killed)"))
        elif name.startswith("lost-after-"):
            found, bad = _read_records(storage, path)
            branches.append(Branch(f"lost {name[len('lost-after-'):-len('.jsonl')]}", found, abandoned=True,
                                   problems=bad, note=f"{name}: updates a crash lost (after the checkpoint restored)"))
    for name, directory, entry, after in abandoned_branches:
        found, bad = read_segment_chain(storage, entry, source=source, base=directory)
        found = [r for r in found if r["it"] > after]  # before it, the line is the main one
        for open_name in _names(storage, join(directory, JOURNAL_DIR)):
            if open_name.startswith(("open-", "lost-after-")):
                more, worse = _read_records(storage, join(directory, JOURNAL_DIR, open_name))
                found += [r for r in more if not found or r["it"] > found[-1]["it"]]
                bad += worse
        branches.append(Branch(name, found, abandoned=True, problems=bad, note=f"{directory}: abandoned by {name}"))
    return JournalView(branches)


def run_exists(storage: Storage, path: str) -> bool:
    try:
        return storage.exists(path)
    except (OSError, ValueError):
        return False


def _names(storage: Storage, directory: str) -> list[str]:
    try:
        return sorted(storage.listdir(directory))
    except (FileNotFoundError, NotADirectoryError):
        return []


def _read_records(storage: Storage, path: str) -> tuple[list[dict], list[str]]:
    try:
        return _parse_records(storage.read_bytes(path, limit=OPEN_CAP), storage.url(path))
    except (OSError, ValueError) as e:
        return [], [f"{storage.url(path)}: expected a journal file, actual {type(e).__name__}: {clip(str(e), 120)}"]
