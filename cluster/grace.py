"""The grace budget: how long before Slurm's kill the hook must hear of it.

``resume slurm template`` writes it as ``--signal=B:USR1@<grace>`` and passes the
same number to the hook (``--grace``); the hook, started without one, computes
it the same way. Of the budget, the hook waits ``grace - STOP_MARGIN_S`` for the
save; the rest is for stopping the step and requeueing.

One formula::

    grace = 2 x slowest recent save + BOUNDARY_S + STOP_MARGIN_S    (300 s before any save was measured)

- twice the slowest of the last ``RECENT_SAVES`` committed saves (``timing.save_s``
  in their manifests): a save under load, on a busier file system, may take
  longer than any seen so far;
- ``BOUNDARY_S`` for the training to reach its next iteration boundary and read
  the request in the run's control area;
- ``STOP_MARGIN_S`` for the step to leave and the job to be requeued.

A committed manifest without ``save_s`` (Megatron's, which times only its manifest),
or with a value that is not a number >= 0, measured nothing: it is one of the recent
checkpoints but adds no time. Only the newest committed checkpoints are checked.
"""

from __future__ import annotations

import itertools
import math

from resume.errors import ResumeError
from resume.run import Run

__all__ = ["BOUNDARY_S", "RECENT_SAVES", "STOP_MARGIN_S", "UNMEASURED_S", "grace_budget", "recent_save_times"]

BOUNDARY_S = 30.0
"""For the training to reach an iteration boundary and poll the control area."""
STOP_MARGIN_S = 30.0
"""Of the signal's lead time, what is kept for stopping the step and requeueing."""
UNMEASURED_S = 300.0
"""The budget before any save was measured."""
RECENT_SAVES = 5
"""How many of the newest committed checkpoints are measured."""


def grace_budget(run: Run, *, override: float | None = None) -> float:
    """Seconds between the signal and Slurm's kill: ``override`` when given (``--grace``),
    else the formula of this module over the run's recent saves."""
    if override is not None:
        return float(override)
    saves = recent_save_times(run)
    return 2 * max(saves) + BOUNDARY_S + STOP_MARGIN_S if saves else UNMEASURED_S


def recent_save_times(run: Run, *, count: int = RECENT_SAVES) -> list[float]:
    """``timing.save_s`` of the newest ``count`` committed checkpoints, of those that recorded one.

    Discovery stops at the ``count``-th committed one: older step directories are never
    checked. Storage that cannot be read ends the measurement with what it found so far.
    """
    saves: list[float] = []
    try:
        committed = (result.manifest for result in run.discover() if result.committed)
        for manifest in itertools.islice(committed, count):
            value = manifest.timing.get("save_s") if manifest is not None else None
            if _is_duration(value):
                saves.append(float(value))
    except (ResumeError, OSError):
        pass  # an outage measures nothing: the saves found so far, or the default, stand
    return saves


def _is_duration(value: object) -> bool:
    return (isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
            and value >= 0)
