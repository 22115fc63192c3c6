"""The grace budget: how long before Slurm's kill the hook must hear of it.

One formula, for ``resume slurm template`` (``--signal=B:USR1@<grace>``) and for the hook
started without ``--grace``::

    grace = 2 x slowest recent save + BOUNDARY_S + STOP_MARGIN_S     (UNMEASURED_S before any save)

The slowest of the last ``RECENT_SAVES`` committed saves (``timing.save_s`` in their manifests;
a manifest without a valid one counts but adds no time); ``BOUNDARY_S`` for the training to reach
an iteration boundary and read the request; ``STOP_MARGIN_S`` for the step to leave and the job
to be requeued. The hook waits ``grace - STOP_MARGIN_S`` for the save.
"""

from __future__ import annotations

import itertools
import math

from resume.errors import ResumeError, UsageError
from resume.run import Run

__all__ = ["BOUNDARY_S", "RECENT_SAVES", "STOP_MARGIN_S", "UNMEASURED_S", "fit_to_time_limit", "grace_budget",
           "recent_save_times", "slurm_time_s"]

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


def slurm_time_s(text: str) -> int:
    """Seconds of a Slurm ``--time`` value: ``M``, ``M:S``, ``H:M:S``, ``D-H``, ``D-H:M`` or
    ``D-H:M:S``. UsageError for anything else (``UNLIMITED`` included: no limit to fit)."""
    days, _, clock = text.strip().rpartition("-")
    try:
        parts = [int(p) for p in clock.split(":")]
        day_count = int(days) if days else 0
    except ValueError:
        parts = []
    if days:  # D-H, D-H:M, D-H:M:S
        units = [3600, 60, 1][: len(parts)]
    else:  # M, M:S, H:M:S
        units = {1: [60], 2: [60, 1], 3: [3600, 60, 1]}.get(len(parts), [])
    if not parts or not units or len(units) != len(parts) or any(p < 0 for p in parts) or (days and day_count < 0):
        raise UsageError(f"--time: expected a Slurm time limit (M, M:S, H:M:S, D-H, D-H:M, D-H:M:S), "
                         f"actual {text!r}")
    return (day_count if days else 0) * 86400 + sum(p * u for p, u in zip(parts, units))


def fit_to_time_limit(grace_s: float, time_text: str | None, *, given: bool) -> str | None:
    """Check a grace against the job's time limit: UsageError when the signal would come before
    the job starts its first save (grace >= the limit); a warning (returned) when the grace
    takes more than half of the limit. ``given``: the user chose it (else measured/default)."""
    if time_text is None or time_text.strip().lower() in ("unlimited", "infinite"):
        return None
    limit = slurm_time_s(time_text)
    source = "--grace" if given else "the grace measured from recent saves (or the 300 s default)"
    if grace_s >= limit:
        raise UsageError(f"{source}: expected less than the time limit ({limit} s, --time {time_text}), "
                         f"actual {grace_s:g} s: the warning signal would come before the job could "
                         "train; give a longer --time or a shorter --grace (at least 60)")
    if grace_s > limit / 2:
        return (f"{source} ({grace_s:g} s) is more than half of the time limit ({limit} s): "
                "most of each allocation may go to waiting for the save")
    return None
