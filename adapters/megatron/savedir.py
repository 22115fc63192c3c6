"""A Megatron-LM save directory's names: the iteration directories, the tracker, the format.

``--save`` holds ``latest_checkpointed_iteration.txt`` (the tracker: the iteration
Megatron last finished saving) and one ``iter_%07d/`` per checkpoint; only
``--ckpt-format torch_dist`` directories are understood.
"""

from __future__ import annotations

import re

from resume.errors import (
    CheckpointNotFoundError,
    ManifestError,
    ResumeError,
    RunNotFoundError,
    UnsafePathError,
)
from resume.storage import SMALL_FILE_CAP, Storage, join
from resume.text import parse_json, short

__all__ = ["ITERATION_DIR", "ITERATION_FORMAT", "MANIFEST_NAME", "MEGATRON_TRACKER", "iteration_dirname",
           "iteration_dirs", "read_tracker", "require_save_dir", "require_torch_dist", "tracker_or_none",
           "tracker_problems"]

MEGATRON_TRACKER = "latest_checkpointed_iteration.txt"
ITERATION_DIR = re.compile(r"^iter_(\d{7,})$")
ITERATION_FORMAT = "iter_{:07d}"
MANIFEST_NAME = "resume-manifest.json"
"""Our manifest, beside Megatron's files in each iteration directory."""


def iteration_dirname(iteration: int) -> str:
    return ITERATION_FORMAT.format(iteration)


def read_tracker(storage: Storage) -> int | None:
    """Megatron's pointer: the iteration it last finished saving; None if there is no tracker."""
    try:
        text = storage.read_bytes(MEGATRON_TRACKER, limit=SMALL_FILE_CAP).decode(errors="replace").strip()
    except FileNotFoundError:
        return None
    if text == "release":
        raise ManifestError(f"{storage.url(MEGATRON_TRACKER)}: expected an iteration, actual 'release' "
                            "(a converted release checkpoint has no training state to resume)")
    try:
        return int(text)
    except ValueError as e:
        raise ManifestError(f"{storage.url(MEGATRON_TRACKER)}: expected an iteration number, "
                            f"actual {text[:40]!r}") from e


def tracker_or_none(storage: Storage) -> int | None:
    """``read_tracker``, None where it cannot be read."""
    try:
        return read_tracker(storage)
    except (OSError, ResumeError):
        return None


def iteration_dirs(storage: Storage) -> list[int]:
    return sorted(int(m.group(1)) for m in map(ITERATION_DIR.match, storage.listdir("")) if m)


def require_save_dir(storage: Storage) -> None:
    """A clear error unless this is a Megatron save directory whose tracker points at something."""
    if not storage.isdir(""):
        raise RunNotFoundError(f"{storage.root}: Megatron save directory: expected a directory, "
                               f"actual {'a file' if storage.exists('') else 'missing'}")
    tracker = read_tracker(storage)
    iterations = iteration_dirs(storage)
    if tracker is None and not iterations:
        raise RunNotFoundError(f"{storage.root}: expected a Megatron save directory ({MEGATRON_TRACKER} "
                               f"or iter_NNNNNNN/), actual neither")
    if tracker is not None and tracker not in iterations:
        raise CheckpointNotFoundError(
            f"{storage.url(MEGATRON_TRACKER)}: expected {iteration_dirname(tracker)}/ to exist, "
            f"actual missing (iterations present: {iterations[-5:]})")


def tracker_problems(storage: Storage) -> list[str]:
    """Megatron's pointer must name an iteration that exists."""
    try:
        require_save_dir(storage)
    except (CheckpointNotFoundError, ManifestError, UnsafePathError) as e:  # a linked or FIFO tracker too
        return [str(e)]
    return []


def require_torch_dist(storage: Storage, iteration: int) -> None:
    """Only ``--ckpt-format torch_dist`` checkpoints are understood; say what else it is."""
    d = iteration_dirname(iteration)
    names = storage.listdir(d)
    if any(n.startswith("mp_rank_") for n in names) and ".metadata" not in names:
        raise ManifestError(f"{storage.url(d)}: format: expected torch_dist (.metadata, *.distcp), actual "
                            "the legacy torch format (mp_rank_*/model_optim_rng.pt); save with "
                            "--ckpt-format torch_dist")
    try:
        meta = parse_json(storage.read_bytes(join(d, "metadata.json"), limit=SMALL_FILE_CAP))
    except FileNotFoundError:
        raise ManifestError(f"{storage.url(join(d, 'metadata.json'))}: expected Megatron's metadata.json "
                            "({\"sharded_backend\": \"torch_dist\"}), actual missing") from None
    except ValueError as e:
        raise ManifestError(f"{storage.url(join(d, 'metadata.json'))}: {e}") from e
    backend = meta.get("sharded_backend") if isinstance(meta, dict) else None
    if backend != "torch_dist":
        raise ManifestError(f"{storage.url(join(d, 'metadata.json'))}: sharded_backend: expected "
                            f"'torch_dist', actual {short(backend)}")
    if ".metadata" not in names:
        raise ManifestError(f"{storage.url(join(d, '.metadata'))}: expected DCP's .metadata (written last; "
                            "it lists every record's file, offset and length), actual missing")
