"""Learning-rate schedules that are not torch ``LRScheduler`` objects.

An ``LRSchedule`` is anything with ``lr_at(updates)``, or a plain function of ``updates``,
returning the LR of every param group (all optimizers, in order) at the update that follows
``updates`` successful updates; the loop sets the LR itself. Its position is
``TrainState.updates_successful``, which ``resume`` keeps: it needs no state of its own (an
object's ``state_dict``/``load_state_dict``, if any, are saved and loaded). Its configuration is
what ``describe()`` returns (JSON), or for a function its code and the numbers it closes over;
another peak or length is a changed setting (``schedule[0]...``), refused unless accepted.
Usage: docs/pytorch.md.
"""

from __future__ import annotations

import math
import types
from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import xxhash

from .errors import UsageError

__all__ = ["LRSchedule", "describe_callable", "describe_lr_schedule", "is_lr_schedule", "lr_schedule_values"]


@runtime_checkable
class LRSchedule(Protocol):
    def lr_at(self, updates: int) -> Sequence[float]:
        """The LR of every param group (all optimizers, in order) at the update that follows
        ``updates`` successful updates."""
        ...


def is_lr_schedule(obj: Any) -> bool:
    """An object with ``lr_at``, or a function of the update count (a torch scheduler is neither)."""
    return callable(getattr(obj, "lr_at", None)) or callable(obj)


def lr_schedule_values(schedule: Any, updates: int) -> list[float]:
    fn = getattr(schedule, "lr_at", None) or schedule
    values = fn(updates)
    if isinstance(values, (int, float)):
        values = [values]
    try:
        out = [float(v) for v in values]
    except (TypeError, ValueError) as e:
        raise UsageError(f"schedule: lr_at({updates}): expected a list of numbers, actual {values!r:.80}") from e
    if any(not math.isfinite(v) or v < 0 for v in out):
        raise UsageError(f"schedule: lr_at({updates}): expected finite non-negative LRs, actual {out}")
    return out


def describe_lr_schedule(schedule: Any) -> dict:
    """The schedule's configuration as JSON (compared at restore; no position)."""
    describe = getattr(schedule, "describe", None)
    if callable(describe):
        return {"class": type(schedule).__name__, "config": describe()}
    if callable(getattr(schedule, "lr_at", None)):
        return {"class": type(schedule).__name__, "lr_at": describe_callable(schedule)}
    return {"class": "function", "lr_at": describe_callable(schedule)}


def _plain(value: Any) -> bool:
    return isinstance(value, (int, float, str, bool)) and not (isinstance(value, float) and not math.isfinite(value))


def describe_callable(fn: Any) -> Any:
    """A stable description of a schedule function: its code and the numbers it closes over.

    A schedule rebuilt with another length or peak closes over other numbers,
    so the difference shows before a single update.
    """
    if isinstance(fn, types.MethodType):
        # Not the instance's attributes: they hold more than configuration (the rank, say).
        # An object declares its configuration with describe().
        return {"method": fn.__func__.__qualname__,
                "code": xxhash.xxh3_64_hexdigest(fn.__func__.__code__.co_code)}
    if isinstance(fn, types.FunctionType):
        cells = []
        for cell in fn.__closure__ or ():
            try:
                value = cell.cell_contents
            except ValueError:
                continue
            if _plain(value) or value is None:
                cells.append(value)
        return {"function": fn.__qualname__, "code": xxhash.xxh3_64_hexdigest(fn.__code__.co_code),
                "closure": cells, "defaults": [d for d in (fn.__defaults__ or ()) if _plain(d)]}
    if hasattr(fn, "func") and hasattr(fn, "args"):  # functools.partial
        return {"partial": getattr(fn.func, "__qualname__", repr(fn.func)),
                "args": [a for a in fn.args if _plain(a)],
                "keywords": {k: v for k, v in fn.keywords.items() if _plain(v)}}
    return {"object": type(fn).__qualname__,
            "state": {k: v for k, v in sorted(vars(fn).items()) if _plain(v)} if hasattr(fn, "__dict__") else {}}
