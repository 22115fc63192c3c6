"""Checkpoints written by hand, and the damage a crash, a bad disk or an attacker does to them.

A hand-written checkpoint is files plus a manifest written through ``Run``, as the commit
protocol writes them: no training, no torch.distributed.checkpoint.
"""

from __future__ import annotations

import json
import os
import pickle

from resume.checksum import checksum_bytes
from resume.manifest import FileEntry, Manifest
from resume.run import Run
from resume.state import TrainState

GLOBAL_BATCH = 4
DEFAULT_FILES = {
    "model/shard-0.bin": b"weights-of-rank-0",
    "model/shard-1.bin": b"weights-of-rank-1",
    "rank-0.json": b'{"rank": 0}',
}


# -- written by hand -----------------------------------------------------------------------------


def state_at(step: int) -> TrainState:
    """The counters of a run that applied every update so far, GLOBAL_BATCH samples each."""
    return TrainState(iteration=step, samples_read=step * GLOBAL_BATCH,
                      updates_successful=step, updates_skipped=0)


def make_manifest(step: int, files: dict[str, bytes] | None = None, **kwargs) -> Manifest:
    files = DEFAULT_FILES if files is None else files
    return Manifest(step=step, train_state=state_at(step),
                    files={p: FileEntry(len(d), checksum_bytes(d)) for p, d in files.items()},
                    **kwargs)


def write_checkpoint(run: Run, step: int, files: dict[str, bytes] | None = None, *,
                     commit: bool = True) -> Manifest:
    """Write the step's files, then (``commit``) its manifest, as the commit protocol does."""
    files = DEFAULT_FILES if files is None else files
    for rel, data in files.items():
        run.storage.write_bytes_atomic(run.step_path(step, rel), data)
    manifest = make_manifest(step, files)
    if commit:
        run.write_manifest(manifest)
    return manifest


def write_torn_checkpoint(run: Run, step: int) -> None:
    """A crash before the manifest: the files are there, the commit record is not."""
    write_checkpoint(run, step, commit=False)


# -- damage --------------------------------------------------------------------------------------


def flip_stored_byte(run: Run, step: int, rel: str, offset: int = 0) -> None:
    """Silent corruption through the run's storage: same size, one byte different."""
    path = run.step_path(step, rel)
    data = bytearray(run.storage.read_bytes(path))
    data[offset] ^= 0xFF
    run.storage.write_bytes_atomic(path, bytes(data))


def truncate(run: Run, step: int, rel: str, keep: int) -> None:
    """A file cut after ``keep`` bytes, through the run's storage."""
    path = run.step_path(step, rel)
    run.storage.write_bytes_atomic(path, run.storage.read_bytes(path)[:keep])


def flip_byte(path: str, offset: int | None = None) -> None:
    """Silent corruption of a local file: same size, one byte different (the middle one by default)."""
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2 if offset is None else offset)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))


class CodeRunningPickle:
    """Unpickled, runs ``command`` in a shell (``os.system``): what an attacker plants."""

    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self):
        return (os.system, (self.command,))


def plant_metadata_pickle(step_dir: str, marker: str, manifest: str = "manifest.json") -> None:
    """Replace DCP's ``.metadata`` with a pickle that creates ``marker`` when loaded (and its
    manifest entry to match: ``replace_listed_file``)."""
    replace_listed_file(step_dir, ".metadata", pickle.dumps(CodeRunningPickle(f"touch {marker}")), manifest)


def replace_listed_file(step_dir: str, rel: str, data: bytes, manifest: str = "manifest.json") -> None:
    """Write ``rel`` of ``step_dir``, and its entry in the manifest (``manifest``: the layout's file
    name) as an attacker who also rewrites the manifest would: sizes and checksums agree again,
    so only a check of the content can refuse it."""
    with open(os.path.join(step_dir, rel), "wb") as f:
        f.write(data)
    edit_manifest(step_dir, lambda body: body["files"].__setitem__(
        rel, {"size": len(data), "checksum": checksum_bytes(data)}), manifest)
    if rel == ".metadata":  # the restore is to read it: a step written before the index
        drop_index(step_dir, manifest)


def drop_index(step_dir: str, manifest: str = "manifest.json") -> None:
    """The step as a version before the index wrote it: no ``index.resume``, in the directory or
    the manifest; its restores read DCP's ``.metadata``."""
    path = os.path.join(step_dir, "index.resume")
    if os.path.exists(path):
        os.unlink(path)
        edit_manifest(step_dir, lambda body: body["files"].pop("index.resume", None), manifest)


def edit_manifest(step_dir: str, edit, manifest: str = "manifest.json") -> None:
    """``edit(body)`` applied to the step's manifest, rewritten in place (no checksum covers it)."""
    path = os.path.join(step_dir, manifest)
    with open(path) as f:
        body = json.load(f)
    edit(body)
    with open(path, "w") as f:
        f.write(json.dumps(body))
