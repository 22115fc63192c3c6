"""DCP's failures as our errors: what failed, where, on which ranks (a full disk: the bytes)."""

from __future__ import annotations

import errno
import os
import pickle
import struct
import zipfile
from typing import Any

import torch

from resume.errors import CorruptCheckpointError, ResumeError, UnsafeCheckpointError
from resume.storage import Storage

from ..dcp.unpickle import pickle_refusal

__all__ = ["DAMAGE", "explain_save_failure", "is_out_of_space", "load_failure", "state_bytes"]

DAMAGE = (ValueError, TypeError, KeyError, IndexError, AttributeError, OverflowError, RecursionError,
          EOFError, struct.error, zipfile.BadZipFile, pickle.UnpicklingError)
"""What a damaged file makes torch or DCP raise outside ``dcp.load``."""


def state_bytes(obj: Any) -> int:
    if isinstance(obj, torch.Tensor):
        local = obj.to_local() if hasattr(obj, "to_local") else obj
        return local.numel() * local.element_size()
    if isinstance(obj, dict):
        return sum(state_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(state_bytes(v) for v in obj)
    return 0


def explain_save_failure(e: BaseException, state: Any, storage: Storage, step_dir: str) -> str:
    """One line: what failed where and on which ranks; for a full disk, the bytes needed and free."""
    failures = getattr(e, "failures", None) or {}
    causes = {rank: (c[0] if isinstance(c, tuple) else c) for rank, c in failures.items()}
    where = storage.url(step_dir)
    ranks = sorted(causes)
    cause = causes[ranks[0]] if ranks else None
    full = {rank for rank, c in causes.items() if is_out_of_space(c)}
    if full:
        needed = state_bytes(state)
        local = storage.local_path(step_dir)
        free = ""
        if local is not None:
            st = os.statvfs(local)
            free = f", {st.f_bavail * st.f_frsize} bytes free now"
        return (f"{where}: disk full (or quota) on ranks {sorted(full)[:8]}: expected room for each rank's "
                f"shards, about {needed} bytes for this one, actual no space left{free} (the previous "
                "checkpoint is untouched; the partial step is removed: free space or move the run)")
    detail = f"{type(cause).__name__}: {cause}" if cause is not None else str(e).splitlines()[0]
    return f"{where}: writing the shards failed on ranks {ranks[:8]}: {detail}"


def load_failure(e: BaseException, storage: Storage, step_dir: str) -> ResumeError:
    """DCP's CheckpointException of a load as one of our errors: a refused pickle stays an
    UnsafeCheckpointError, anything else a CorruptCheckpointError; both name the step and ranks."""
    failures = getattr(e, "failures", None) or {}
    causes = {rank: (c[0] if isinstance(c, tuple) else c) for rank, c in failures.items()}
    ranks = sorted(causes)
    cause = causes[ranks[0]] if ranks else e
    where = f"{storage.url(step_dir)}: loading the shards failed on ranks {ranks[:8]}"
    for c in causes.values():
        if isinstance(c, UnsafeCheckpointError):
            return UnsafeCheckpointError(f"{where}: {c}")
        if isinstance(c, pickle.UnpicklingError):
            return UnsafeCheckpointError(f"{where}: pickle: expected tensor data only, actual "
                                         f"{pickle_refusal(c)} (refused, nothing run)")
    if isinstance(cause, ResumeError):
        return cause
    detail = str(cause).splitlines()[0] if str(cause) else ""
    return CorruptCheckpointError(f"{where}: {type(cause).__name__}: {detail}")


def is_out_of_space(exc: BaseException | None) -> bool:
    """ENOSPC or EDQUOT anywhere in the chain: torch.save's zip writer re-raises it as a RuntimeError."""
    seen = 0
    while exc is not None and seen < 10:
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        exc = exc.__cause__ or exc.__context__
        seen += 1
    return False
