"""The manifest: the commit record of one checkpoint, JSON, written last.

A step directory without a valid manifest is not a checkpoint. The manifest
lists every file with its size and checksum, the counters, the continuity
expectation, the topology, the config and which adapter wrote it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from .errors import ManifestError
from .layout import ParallelLayout
from .state import TrainState
from .stragglers import check_stragglers
from .text import short

__all__ = ["SCHEMA", "SCHEMA_VERSION", "FileEntry", "Manifest", "check_relative_path"]

SCHEMA = "resume.manifest"
SCHEMA_VERSION = 1
MANIFEST_NAME = "manifest.json"


@dataclass(frozen=True, slots=True)
class FileEntry:
    size: int
    checksum: str


def check_relative_path(path: object, *, source: str) -> str:
    """Paths in a manifest are relative and confined to the step directory."""
    if not isinstance(path, str) or not path:
        raise ManifestError(f"{source}: files: expected a relative path, actual {path!r}")
    parts = path.split("/")
    if path.startswith("/") or "\\" in path or ":" in parts[0] or any(p in ("", ".", "..") for p in parts):
        raise ManifestError(f"{source}: files: expected a path inside the step directory, "
                            f"actual {path!r}")
    return path


@dataclass(kw_only=True)
class Manifest:
    step: int
    train_state: TrainState
    files: dict[str, FileEntry]
    expectation: dict[str, Any] = field(default_factory=dict)
    topology: dict[str, Any] = field(default_factory=dict)
    config: dict[str, Any] = field(default_factory=dict)
    timing: dict[str, float] = field(default_factory=dict)
    """Measured costs, e.g. ``save_s`` (blocking time of this save): the Slurm hook's grace budget."""
    adapter: str = ""
    created_at: str = ""
    schema_version: int = SCHEMA_VERSION
    user: dict[str, Any] = field(default_factory=dict)
    """The program's own values (``Coordinator.user``: a stage, a curriculum position), readable
    before the shards load (``Coordinator.peek()``)."""
    changes: list[dict[str, Any]] = field(default_factory=list)
    """Settings changed on purpose at a restart (``accept_changes``): ``{step, item, from, to}``,
    oldest first, carried from manifest to manifest."""
    complete: bool = False
    """The run's last checkpoint: saved at ``total_iterations`` (the run is done; the Slurm hook
    does not requeue it)."""
    journal: dict[str, Any] | None = None
    """The update journal's segment this commit sealed (``resume.journal``: segment, size, checksum,
    step, records, first); None without a journal (and in older manifests)."""
    rewinds: list[dict[str, Any]] = field(default_factory=list)
    """The rewinds this line of the run went through (``resume.rewind``: n, to, from, skips, accept,
    reason, time), oldest first, carried from manifest to manifest."""
    stragglers: dict[str, Any] | None = None
    """The slowest ranks and nodes since the previous save (``resume.stragglers.summarize``:
    ranks, median_s, slowest, nodes); None when nothing was measured (and in older manifests)."""
    origin: dict[str, Any] | None = None
    """Where a warm-started run's first weights came from (``resume.warmstart``: kind, source,
    step, manifest_checksum, loaded, at), carried from manifest to manifest; None for a run that
    started from scratch (and in older manifests)."""

    def to_json(self) -> str:
        body = {
            "schema": SCHEMA,
            "schema_version": self.schema_version,
            "step": self.step,
            "created_at": self.created_at,
            "adapter": self.adapter,
            "train_state": self.train_state.to_dict(),
            "files": {p: {"size": e.size, "checksum": e.checksum} for p, e in sorted(self.files.items())},
            "topology": self.topology,
            "config": self.config,
            "timing": self.timing,
            "expectation": self.expectation,
            "user": self.user,
            "changes": self.changes,
            "complete": self.complete,
        }
        if self.stragglers is not None:  # absent when not measured: older readers see no change
            body["stragglers"] = self.stragglers
        if self.journal is not None:
            body["journal"] = self.journal
        if self.rewinds:
            body["rewinds"] = self.rewinds
        if self.origin is not None:
            body["origin"] = self.origin
        return _two_levels(body)

    @property
    def total_bytes(self) -> int:
        return sum(e.size for e in self.files.values())

    @classmethod
    def from_json(cls, text: bytes | str, *, source: str) -> Manifest:
        """Parse and validate; ManifestError names the file and the field."""
        body = _parse_body(text, source=source)
        step = body.get("step")
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise ManifestError(f"{source}: step: expected a non-negative integer, actual {step!r}")
        files = _parse_files(body.get("files"), source=source)
        for name in ("expectation", "topology", "config", "timing", "user"):
            if not isinstance(body.get(name, {}), dict):
                raise ManifestError(f"{source}: {name}: expected an object, actual {body.get(name)!r:.80}")
        if "layout" in body.get("topology", {}):  # refused here: the commit check passes it over
            ParallelLayout.from_dict(body["topology"]["layout"], source=source)
        changes = _parse_changes(body.get("changes", []), source=source)
        complete = body.get("complete", False)
        if not isinstance(complete, bool):
            raise ManifestError(f"{source}: complete: expected true or false, actual {short(complete)}")
        return cls(
            step=step,
            train_state=TrainState.from_dict(body.get("train_state"), source=source),
            files=files,
            expectation=body.get("expectation", {}),
            topology=body.get("topology", {}),
            config=body.get("config", {}),
            timing=body.get("timing", {}),
            adapter=str(body.get("adapter", "")),
            created_at=str(body.get("created_at", "")),
            schema_version=body["schema_version"],
            user=body.get("user", {}),
            changes=changes,
            complete=complete,
            stragglers=check_stragglers(body.get("stragglers"), source),
            journal=_parse_journal(body.get("journal"), source=source),
            rewinds=_parse_rewinds(body.get("rewinds", []), source=source),
            origin=_parse_origin(body.get("origin"), source=source),
        )


def _parse_body(text: bytes | str, *, source: str) -> dict[str, Any]:
    """A JSON object of our schema and version (no NaN or Infinity)."""
    try:
        body = json.loads(text, parse_constant=_reject_constant)
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise ManifestError(f"{source}: expected JSON, actual unparsable ({e})") from e
    if not isinstance(body, dict):
        raise ManifestError(f"{source}: expected a JSON object, actual {type(body).__name__}")
    if body.get("schema") != SCHEMA:
        raise ManifestError(f"{source}: schema: expected {SCHEMA!r}, actual {body.get('schema')!r}")
    version = body.get("schema_version")
    if version != SCHEMA_VERSION:
        raise ManifestError(f"{source}: schema_version: expected {SCHEMA_VERSION}, actual {version!r}")
    return body


def _parse_files(files_raw: Any, *, source: str) -> dict[str, FileEntry]:
    """Each listed file: a path inside the step directory, its size and its xxh3 checksum."""
    if not isinstance(files_raw, dict) or not files_raw:
        raise ManifestError(f"{source}: files: expected a non-empty object, actual {files_raw!r:.80}")
    files = {}
    for path, entry in files_raw.items():
        check_relative_path(path, source=source)
        if not isinstance(entry, dict):
            raise ManifestError(f"{source}: files[{path!r}]: expected an object, actual {entry!r}")
        size, checksum = entry.get("size"), entry.get("checksum")
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise ManifestError(f"{source}: files[{path!r}].size: expected a non-negative "
                                f"integer, actual {size!r}")
        if not isinstance(checksum, str) or not checksum.startswith("xxh3:"):
            raise ManifestError(f"{source}: files[{path!r}].checksum: expected 'xxh3:<hex>', "
                                f"actual {checksum!r}")
        files[path] = FileEntry(size, checksum)
    return files


ORIGIN_FIELDS = {"kind": str, "source": str, "step": int, "manifest_checksum": str, "loaded": list, "at": str}


def _parse_origin(origin: Any, *, source: str) -> dict[str, Any] | None:
    """``origin``: absent, or an object whose known fields have their types (others kept)."""
    if origin is None:
        return None
    if not isinstance(origin, dict):
        raise ManifestError(f"{source}: origin: expected an object, actual {short(origin)}")
    for name, kind in ORIGIN_FIELDS.items():
        value = origin.get(name)
        if value is not None and (not isinstance(value, kind) or isinstance(value, bool)):
            raise ManifestError(f"{source}: origin.{name}: expected {kind.__name__}, actual {short(value)}")
    return origin


def _parse_changes(changes: Any, *, source: str) -> list[dict[str, Any]]:
    """The settings changed on purpose: a list of ``{step, item, from, to}``."""
    if not (isinstance(changes, list) and all(
            isinstance(c, dict) and isinstance(c.get("item"), str) and isinstance(c.get("step"), int)
            and "from" in c and "to" in c for c in changes)):
        raise ManifestError(f"{source}: changes: expected a list of {{step, item, from, to}}, "
                            f"actual {changes!r:.80}")
    return changes


def _parse_journal(entry: Any, *, source: str) -> dict[str, Any] | None:
    if entry is None:
        return None
    if not (isinstance(entry, dict) and isinstance(entry.get("segment"), str) and type(entry.get("size")) is int
            and isinstance(entry.get("checksum"), str) and type(entry.get("step")) is int):
        raise ManifestError(f"{source}: journal: expected {{segment, size, checksum, step}}, actual {short(entry)}")
    return entry


def _parse_rewinds(rewinds: Any, *, source: str) -> list[dict[str, Any]]:
    if not (isinstance(rewinds, list) and all(isinstance(r, dict) and type(r.get("n")) is int
                                              and type(r.get("to")) is int for r in rewinds)):
        raise ManifestError(f"{source}: rewinds: expected a list of {{n, to, skips, ...}}, actual {short(rewinds)}")
    for r in rewinds:
        skips = r.get("skips", [])
        if not (isinstance(skips, list) and all(
                isinstance(s, list) and len(s) == 2 and all(type(x) is int for x in s) and 0 <= s[0] < s[1]
                for s in skips)):
            raise ManifestError(f"{source}: rewinds[{r['n']}].skips: expected [[start, end], ...] with "
                                f"0 <= start < end, actual {short(skips)}")
    return rewinds


def _reject_constant(name: str) -> float:
    raise ValueError(f"non-standard JSON constant {name}")


def _two_levels(body: dict) -> str:
    """JSON with one line per top-level item and, inside an object, per entry (one file per
    line); deeper values compact on their line. Written with the C encoder (``indent`` would take
    Python's, much slower for a large run's manifest)."""
    def one(value: Any) -> str:
        return json.dumps(value, allow_nan=False)

    items = []
    for key, value in body.items():
        if isinstance(value, dict) and value:
            inner = ",\n".join(f"  {one(str(k))}: {one(v)}" for k, v in value.items())
            items.append(f" {one(key)}: {{\n{inner}\n }}")
        else:
            items.append(f" {one(key)}: {one(value)}")
    return "{\n" + ",\n".join(items) + "\n}\n"
