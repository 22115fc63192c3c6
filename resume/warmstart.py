"""Warm start: a new run's first weights from another run's committed checkpoint, or from an
export of one (``resume export``), recorded as the run's origin.

Only a run with no checkpoint of its own is warm-started: once it has committed one, every
restart restores its own and never reads the source again (it may change or disappear). The
source is verified before anything is loaded (a checkpoint: the commit check reading every
file's checksum; an export: every file its record lists), and the model's tensors are compared
with the source's by name and shape, each difference on a line of its own (``WarmStartError``).
Only the weights load: the new run starts with fresh counters, its own optimizer, schedule and
data position. The origin (kind, source, step, the source manifest's checksum, what was loaded)
is written into every manifest of the run (``Manifest.origin``) and shown by ``inspect``.

``Coordinator(warm_start="URL")`` (``URL@STEP`` for a step other than the newest committed one),
or the environment's ``RESUME_WARM_START`` for a job the Slurm hook launches.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .checksum import checksum_bytes, checksum_file
from .collective import Collective
from .comm import Comm
from .errors import ResumeError, UsageError, WarmStartError
from .manifest import check_relative_path
from .run import Run, utc_now
from .storage import MANIFEST_CAP, open_storage
from .text import short

__all__ = ["ENV", "EXPORT_RECORD", "WarmStart", "compare_shapes", "resolve", "warm_start"]

log = logging.getLogger("resume")

ENV = "RESUME_WARM_START"
EXPORT_RECORD = "resume-export.json"
_MAX_LINES = 20


@dataclass(frozen=True)
class WarmStart:
    source: str
    """A run (local path or fsspec URL: its committed checkpoint), or an export directory."""
    step: int | None = None
    """The source's step; None: its newest committed checkpoint."""

    @classmethod
    def parse(cls, text: str | WarmStart | None, *, field: str = "warm_start") -> WarmStart | None:
        """``URL`` or ``URL@STEP``; a WarmStart as is; None or '' for none."""
        if text is None or isinstance(text, WarmStart):
            return text
        if not isinstance(text, str):
            raise UsageError(f"{field}: expected a run URL or URL@STEP, actual {short(text)}")
        text = text.strip()
        if not text:
            return None
        url, sep, step = text.rpartition("@")
        if sep and step.isdigit() and url:
            return cls(url, int(step))
        return cls(text)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> WarmStart | None:
        return cls.parse((environ if environ is not None else os.environ).get(ENV), field=ENV)


def resolve(ws: WarmStart) -> dict[str, Any]:
    """The verified source as the origin to record (rank 0): refused with the reason when it is
    missing, uncommitted or damaged."""
    try:
        storage = open_storage(ws.source)
        if storage.exists(EXPORT_RECORD):
            return _export_origin(ws, storage)
        return _checkpoint_origin(ws)
    except WarmStartError:
        raise
    except ResumeError as e:
        raise WarmStartError(f"warm start from {ws.source}: {e} (nothing loaded)") from e
    except OSError as e:
        raise WarmStartError(f"warm start from {ws.source}: expected a readable source, actual "
                             f"{type(e).__name__}: {short(str(e))} (nothing loaded)") from e


def _checkpoint_origin(ws: WarmStart) -> dict[str, Any]:
    run = Run.open(ws.source)
    manifest = run.manifest_for(ws.step)
    result = run.check(manifest.step, deep=True)
    if not result.committed:
        raise WarmStartError(f"warm start from {run.storage.url(run.dirname(manifest.step))}: expected a committed "
                             f"checkpoint whose files verify, actual {result.reason} (nothing loaded)")
    text = run.storage.read_bytes(run.manifest_path(manifest.step), limit=MANIFEST_CAP)
    return {"kind": "checkpoint", "source": run.url, "step": manifest.step, "manifest_checksum": checksum_bytes(text),
            "adapter": manifest.adapter, "step_dir": run.dirname(manifest.step), "layout": run.layout.name,
            "loaded": ["model"], "at": utc_now()}


def _export_origin(ws: WarmStart, storage: Any) -> dict[str, Any]:
    """An export directory: its record read as untrusted JSON, every file it lists verified."""
    where = storage.url(EXPORT_RECORD)
    data = storage.read_bytes(EXPORT_RECORD, limit=MANIFEST_CAP)
    try:
        record = json.loads(data)
    except (ValueError, RecursionError) as e:
        raise WarmStartError(f"{where}: expected JSON, actual unparsable ({short(str(e))})") from e
    files = record.get("files") if isinstance(record, dict) else None
    if not isinstance(files, dict) or not files:
        raise WarmStartError(f"{where}: files: expected an object of the export's files, actual {short(files)}")
    for name, entry in sorted(files.items()):
        check_relative_path(name, source=where)
        if not isinstance(entry, dict) or type(entry.get("size")) is not int or not isinstance(entry.get("checksum"), str):
            raise WarmStartError(f"{where}: files[{name!r}]: expected {{size, checksum}}, actual {short(entry)}")
        try:
            size, checksum = checksum_file(storage, name)
        except FileNotFoundError as e:
            raise WarmStartError(f"{storage.url(name)}: expected a file of {entry['size']} bytes (the export's record "
                                 "lists it), actual missing (nothing loaded)") from e
        if (size, checksum) != (entry["size"], entry["checksum"]):
            raise WarmStartError(f"{storage.url(name)}: checksum: expected {entry['checksum']} ({entry['size']} "
                                 f"bytes), actual {checksum} ({size} bytes) (nothing loaded)")
    src = record.get("source") if isinstance(record.get("source"), dict) else {}
    if record.get("format") != "safetensors":
        raise WarmStartError(f"{where}: format: expected safetensors (a warm start reads those), actual "
                             f"{short(record.get('format'))}")
    return {"kind": "export", "source": storage.root, "step": src.get("step") if type(src.get("step")) is int else None,
            "manifest_checksum": src.get("manifest_checksum") if isinstance(src.get("manifest_checksum"), str) else None,
            "exported_from": src.get("run") if isinstance(src.get("run"), str) else None,
            "export_checksum": checksum_bytes(data), "files": sorted(n for n in files if n.endswith(".safetensors")),
            "loaded": ["model"], "at": utc_now()}


def compare_shapes(source: Mapping[str, list[int]], model: Mapping[str, list[int]], where: str) -> None:
    """Every tensor of the model in the source with its shape, and nothing else there;
    WarmStartError with each difference on a line of its own."""
    lines = [f"missing in the source: {name} {list(shape)}" for name, shape in sorted(model.items())
             if name not in source]
    lines += [f"not in the model: {name} {list(shape)}" for name, shape in sorted(source.items()) if name not in model]
    lines += [f"shape of {name}: source {list(source[name])}, model {list(shape)}"
              for name, shape in sorted(model.items()) if name in source and list(source[name]) != list(shape)]
    if lines:
        more = [f"... and {len(lines) - _MAX_LINES} more"] if len(lines) > _MAX_LINES else []
        head = f"warm start from {where}: the model does not fit the source ({len(lines)} differences; nothing loaded):"
        raise WarmStartError("\n".join([head, *lines[:_MAX_LINES], *more]))


def warm_start(ws: WarmStart, adapter: Any, comm: Comm) -> dict[str, Any]:
    """Collective: resolve and verify the source (rank 0), compare names and shapes (every rank's
    model tensors against the source's, on rank 0), load the weights (every rank). The origin."""
    coll = Collective(comm)
    origin = coll.on_rank0(lambda: resolve(ws))

    def check(parts: list[dict]) -> None:
        model: dict = {}
        for part in parts:
            model.update(part)
        compare_shapes(adapter.source_shapes(origin), model, origin["source"])
    coll.gather(adapter.weight_shapes, f"warm start from {origin['source']}", combine=check)
    adapter.load_weights(origin)
    log.log(logging.WARNING if comm.rank == 0 else logging.INFO,
            "resume: warm start: model weights from %s (%s, step %s); counters, optimizer, schedule and data fresh",
            origin["source"], origin["kind"], origin.get("step"))
    return {k: v for k, v in origin.items() if k not in ("step_dir", "files", "layout")}
