"""What Megatron will unpickle from a checkpoint, read first with restricted loaders.

Megatron loads its object entries and common state with full unpickling; here a
planted global fails, naming the entry, before Megatron reads anything.
"""

from __future__ import annotations

import argparse
import types
from typing import Any

from resume.errors import UnsafeCheckpointError
from resume.manifest import Manifest
from resume.run import Run
from resume.storage import join

from .common import read_common_state
from .record import list_files
from .savedir import MANIFEST_NAME, iteration_dirname, require_torch_dist

__all__ = ["vet_byte_entries", "vet_pickles"]


def vet_byte_entries(storage: Any, step_dir: str) -> None:
    """Read every object entry of a torch_dist checkpoint with ``torch.load(weights_only=True)``."""
    import io
    import pickle

    import torch
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    from ..dcp.unpickle import read_step_metadata

    metadata = read_step_metadata(storage, step_dir)
    for index, info in metadata.storage_data.items():
        if not isinstance(metadata.state_dict_metadata.get(index.fqn), BytesStorageMetadata):
            continue
        path = join(step_dir, info.relative_path)
        with storage.open_read(path) as f:
            f.seek(info.offset)
            raw = f.read(info.length)
        try:
            with torch.serialization.safe_globals([argparse.Namespace, types.SimpleNamespace]):
                torch.load(io.BytesIO(raw), weights_only=True)
        except (pickle.UnpicklingError, RuntimeError, ValueError, EOFError) as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise UnsafeCheckpointError(f"{storage.url(path)}: entry {index.fqn!r}: expected plain data, "
                                        f"actual a pickle that weights-only loading refuses ({first})") from e


def vet_pickles(run: Run, step: int, manifest: Manifest | None) -> dict | None:
    """Every pickle Megatron will unpickle from ``step``, vetted; the scheduler state Megatron
    will load (None when the checkpoint has none).

    With a manifest, a file in the directory that it does not list is refused: Megatron
    would read e.g. a planted ``common.pt``.
    """
    d = iteration_dirname(step)
    if manifest is not None:
        unlisted = sorted(set(list_files(run, d)) - set(manifest.files) - {MANIFEST_NAME})
        if unlisted:
            raise UnsafeCheckpointError(f"{run.storage.url(d)}: files: expected only those the "
                                        f"manifest lists, actual also {unlisted[:5]} (refused)")
    require_torch_dist(run.storage, step)
    common = read_common_state(run.storage, step)  # .metadata via the allow-list, then the entry
    vet_byte_entries(run.storage, d)
    return common.scheduler
