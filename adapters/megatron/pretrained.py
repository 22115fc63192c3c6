"""``--pretrained-checkpoint``: Megatron's warm start, verified before Megatron reads it and
recorded as the run's origin (``resume.warmstart``).

Megatron loads the pretrained directory (model only, ``--finetune`` implied, iteration 0) when the
``--load`` directory has no checkpoint of its own. Then, before its load, rank 0 checks the save it
will read (the tracker's iteration, or ``--ckpt-step``): one with our manifest by the commit check
reading every file's checksum, one without by its files against Megatron's ``.metadata``; every
pickle Megatron will unpickle there is vetted. Every manifest of the new run then names the origin
(source, iteration, the source manifest's checksum or None for an unrecorded save, what was loaded).
Once the run has a checkpoint of its own Megatron loads that, and the source is never read again.
"""

from __future__ import annotations

import logging
from typing import Any

from resume.collective import Collective
from resume.errors import ResumeError, WarmStartError
from resume.run import Run, utc_now
from resume.storage import join, open_storage
from resume.warmstart import WarmStart, resolve

from .check import check_save
from .layout import MEGATRON_LAYOUT
from .savedir import MANIFEST_NAME, iteration_dirname, tracker_or_none
from .vet import vet_pickles

__all__ = ["pretrained_origin"]

log = logging.getLogger("resume")


def pretrained_origin(args: Any, collective: Collective, own: Run) -> dict | None:
    """Collective: the origin of a warm start through ``--pretrained-checkpoint`` (verified), or
    None when Megatron will not load it (none given, or ``own`` has a checkpoint to load)."""
    source = getattr(args, "pretrained_checkpoint", None)
    if not source or collective.on_rank0(lambda: tracker_or_none(own.storage)) is not None:
        return None
    pinned = getattr(args, "ckpt_step", None) or None
    return collective.on_rank0(lambda: _verified(source, pinned))


def _verified(source: str, pinned: int | None) -> dict:
    try:
        storage = open_storage(source)
        step = pinned or tracker_or_none(storage)
        if step is None:
            raise WarmStartError(f"{storage.url('')}: --pretrained-checkpoint: expected a Megatron save "
                                 "directory with its tracker (latest_checkpointed_iteration.txt), actual none "
                                 "(nothing loaded)")
        run = Run(storage, MEGATRON_LAYOUT)
        if storage.exists(join(iteration_dirname(step), MANIFEST_NAME)):
            origin = resolve(WarmStart(source, step))
            manifest = run.read_manifest(step)
        else:
            check = check_save(storage, step, deep=True)
            if not check.ok:
                raise WarmStartError(f"{storage.url(iteration_dirname(step))}: --pretrained-checkpoint: expected a "
                                     f"save whose files match its .metadata, actual {check.problems[0]} (nothing "
                                     "loaded)")
            log.warning("resume: --pretrained-checkpoint %s: %s has no resume manifest; its files match "
                        "Megatron's .metadata (no checksums to verify)", storage.root, iteration_dirname(step))
            origin = {"kind": "megatron-save", "source": storage.root, "step": step, "manifest_checksum": None,
                      "adapter": "megatron-core", "at": utc_now()}
            manifest = None
        vet_pickles(run, step, manifest)
    except WarmStartError:
        raise
    except (ResumeError, OSError) as e:
        raise WarmStartError(f"warm start from {source} (--pretrained-checkpoint): {e} (nothing loaded)") from e
    kept = {k: v for k, v in origin.items() if k not in ("step_dir", "files", "layout")}
    return {**kept, "loaded": ["model"], "through": "--pretrained-checkpoint"}
