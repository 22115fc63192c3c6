"""Fault injection: named points between the phases of a save, for tests and drills.

A save passes these points in order (``rank`` says who passes them)::

    save.before_shards    every rank   its rank-state file written, shards not yet
    save.mid_shards       every rank   a shard file half-written (the first block of each file)
    save.after_shards     every rank   its shards written and synced, not yet reported
    save.after_gather     every rank   every rank's report gathered; nothing committed
    save.before_manifest  rank 0       step directory synced, manifest not written
    save.after_manifest   rank 0       manifest written (committed), LATEST not yet updated
    save.after_latest     rank 0       LATEST updated, retention not yet run
    retention.mid_delete  rank 0       an old checkpoint's manifest deleted, its files not yet

A fault is armed with the environment variable ``RESUME_FAULT`` (read once, at
the first point reached) or, in tests, with :func:`arm`::

    RESUME_FAULT="save.after_shards:kill rank=1 step=6"
    RESUME_FAULT="save.before_manifest:raise; retention.mid_delete:kill rank=0"

``POINT:ACTION [rank=R] [step=S] [hit=N]``: at POINT, on rank R (any rank when
absent), during the save of step S (any step) and the N-th time it matches
(the first), do ACTION: ``kill`` (SIGKILL this process: a dead node), ``raise``
(:class:`InjectedFault`), ``enospc`` or ``eio`` (the ``OSError`` a full or
failing disk raises), ``hang`` (block there for good: a storage call that never returns). Several faults are separated by ``;``. Unarmed, a point
costs one comparison. At ``save.before_shards`` and ``save.after_gather`` (the
edge of a collective) an error other than ``kill`` is armed on every rank
(no ``rank=``); rank-0 points take no other rank.
"""

from __future__ import annotations

import errno
import os
import signal
import time
from dataclasses import dataclass

from .errors import InjectedFault

__all__ = ["ACTIONS", "ENV", "POINTS", "Fault", "InjectedFault", "arm", "disarm", "fired", "parse", "point",
           "set_context"]

ENV = "RESUME_FAULT"
POINTS = (
    "save.before_shards",
    "save.mid_shards",
    "save.after_shards",
    "save.after_gather",
    "save.before_manifest",
    "save.after_manifest",
    "save.after_latest",
    "retention.mid_delete",
)
RANK0_POINTS = frozenset({"save.before_manifest", "save.after_manifest", "save.after_latest",
                          "retention.mid_delete"})
ACTIONS = ("kill", "raise", "enospc", "eio", "hang")
COLLECTIVE_EDGE = frozenset({"save.before_shards", "save.after_gather"})
"""Points right before a collective: an error there must happen on every rank or none."""


@dataclass
class Fault:
    point: str
    action: str
    rank: int | None = None
    step: int | None = None
    hit: int = 1
    seen: int = 0


@dataclass
class _Context:
    rank: int = 0
    step: int | None = None


_armed: list[Fault] | None = None  # None: the environment not read yet
_context = _Context()


def parse(spec: str) -> list[Fault]:
    """The faults a ``RESUME_FAULT`` value arms; ``ValueError`` naming the bad part."""
    faults = []
    for part in filter(None, (p.strip() for p in spec.split(";"))):
        head, *options = part.split()
        name, _, action = head.partition(":")
        if name not in POINTS:
            raise ValueError(f"{ENV}: point: expected one of {', '.join(POINTS)}, actual {name!r}")
        if action not in ACTIONS:
            raise ValueError(f"{ENV}: {name}: action: expected one of {', '.join(ACTIONS)}, "
                             f"actual {action!r}")
        fault = Fault(name, action)
        for option in options:
            key, _, value = option.partition("=")
            # isascii: "²".isdigit() is true, and int() would refuse it without naming the option
            if key not in ("rank", "step", "hit") or not (value.isascii() and value.isdigit()):
                raise ValueError(f"{ENV}: {name}: expected rank=N, step=N or hit=N, actual {option!r}")
            setattr(fault, key, int(value))
        if fault.hit < 1:
            raise ValueError(f"{ENV}: {name}: hit: expected >= 1, actual {fault.hit}")
        if fault.rank is not None and fault.action != "kill" and name in COLLECTIVE_EDGE:
            # One rank raising there leaves the others inside a collective it never enters.
            raise ValueError(f"{ENV}: {name}: expected kill with rank=, or {fault.action} on every "
                             f"rank (no rank=), actual {fault.action} on rank {fault.rank}")
        if fault.rank not in (None, 0) and name in RANK0_POINTS:
            raise ValueError(f"{ENV}: {name}: rank: expected 0 (only rank 0 passes it), actual {fault.rank}")
        faults.append(fault)
    return faults


def arm(spec: str) -> None:
    """Arm the faults of ``spec`` (replacing any armed before), as ``RESUME_FAULT`` would."""
    global _armed
    _armed = parse(spec)


def fired() -> list[str]:
    """The points whose armed faults have fired in this process (those that raise or fail)."""
    return [f.point for f in _armed or () if f.seen >= f.hit]


def disarm() -> None:
    global _armed
    _armed = []


def set_context(*, rank: int | None = None, step: int | None = None) -> None:
    """Who is saving what: the coordinator tells the points the rank and the step."""
    if rank is not None:
        _context.rank = rank
    _context.step = step


def point(name: str) -> None:
    """A named point: does nothing unless a fault armed for it matches here and now."""
    global _armed
    if _armed is None:
        _armed = parse(os.environ.get(ENV, ""))
    if not _armed:
        return
    # Every matching fault counts this pass before any fires: "hit=1; hit=2" at one point
    # fires at its first and its second pass (one that fired must not hide the pass from
    # the others). Of several due at the same pass, the first listed fires.
    due = None
    for fault in _armed:
        if fault.point != name or fault.rank not in (None, _context.rank) or \
                fault.step not in (None, _context.step):
            continue
        fault.seen += 1
        if fault.seen == fault.hit and due is None:
            due = fault
    if due is not None:
        _fire(due)


def _fire(fault: Fault) -> None:
    where = f"{fault.point} (rank {_context.rank}, step {_context.step})"
    if fault.action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if fault.action == "enospc":
        raise OSError(errno.ENOSPC, f"No space left on device (injected at {where})")
    if fault.action == "eio":
        raise OSError(errno.EIO, f"Input/output error (injected at {where})")
    if fault.action == "hang":
        while True:  # a storage call that never returns
            time.sleep(3600)
    raise InjectedFault(f"injected fault at {where}")
