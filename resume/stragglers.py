"""Stragglers: which ranks and nodes iterate slower than the rest, recorded in each manifest.

Each rank measures its iteration times between two saves (``Progress.take_times``: count,
median, slowest); the parts travel to rank 0 with the save's own gather (no collective of their
own), and rank 0 puts ``summarize(parts)`` in the manifest as ``stragglers``:

- ``ranks``: how many ranks measured an iteration; ``median_s``: the median over them of each
  rank's median iteration time;
- ``slowest``: the slowest ranks by their median, slowest first: rank, node, ``median_s``,
  ``max_s``, ``factor`` (the rank's median over ``median_s``);
- ``nodes``: the slowest nodes, slowest first: node, ``factor`` (its slowest rank's median over
  ``median_s``).

``StragglerPolicy`` reads the records of the last saves and names a node to replace with a spare
(off unless given). ``describe`` is the one-line form ``resume inspect`` and the events show.
"""

from __future__ import annotations

import heapq
import math
import statistics
from dataclasses import dataclass
from typing import Any

from .errors import ManifestError, UsageError
from .text import short

__all__ = ["MAX_LISTED", "StragglerPolicy", "check_stragglers", "describe", "summarize"]

MAX_LISTED = 64
"""The most ranks (and nodes) a record lists: ``summarize``'s ``top`` and the reader's bound."""
MAX_NODE_NAME = 255
"""Characters of a node name (a host name is at most 255)."""
MAX_RANKS = 1 << 24
"""The largest rank count (and rank) a record may hold."""
RESOLUTION_S = 1e-6
"""Times are rounded to a microsecond (``Progress.take_times``): a median below it counts as it."""


def summarize(parts: list[dict], *, top: int = 3) -> dict[str, Any] | None:
    """The manifest's ``stragglers`` record from every rank's part (index = rank): ``{"times":
    {"count", "median_s", "max_s"}, "node"}``; a part with ``count`` 0 (or no usable times) is
    left out. None when no rank measured anything. O(ranks): rank 0 runs it inside every save."""
    if not isinstance(top, int) or isinstance(top, bool) or not 1 <= top <= MAX_LISTED:
        raise UsageError(f"stragglers: top: expected an integer in [1, {MAX_LISTED}], actual {short(top)}")
    measured = [m for rank, part in enumerate(parts) if (m := _measured(rank, part)) is not None]
    if not measured:
        return None
    median = statistics.median(m["median_s"] for m in measured)
    per = max(median, RESOLUTION_S)
    nodes: dict[str, float] = {}
    for m in measured:
        if m["median_s"] > nodes.get(m["node"], -1.0):
            nodes[m["node"]] = m["median_s"]
    slowest = heapq.nlargest(top, measured, key=lambda m: m["median_s"])
    return {
        "ranks": len(measured),
        "median_s": round(median, 6),
        "slowest": [{**m, "factor": round(m["median_s"] / per, 3)} for m in slowest],
        "nodes": [{"node": node, "factor": round(s / per, 3)}
                  for node, s in heapq.nlargest(top, nodes.items(), key=lambda item: item[1])],
    }


def _measured(rank: int, part: Any) -> dict[str, Any] | None:
    """One rank's measurement (rank, node, median_s, max_s), or None when it has none. A save
    must not fail over its statistics: a part out of shape counts as not measured."""
    times = part.get("times") if isinstance(part, dict) else None
    if not isinstance(times, dict) or not times.get("count"):
        return None
    median, slowest = times.get("median_s"), times.get("max_s", times.get("median_s"))
    if not (_is_time(median) and _is_time(slowest)):
        return None
    node = part.get("node")
    node = node[:MAX_NODE_NAME] if isinstance(node, str) and node.isprintable() and node else "?"
    return {"rank": rank, "node": node, "median_s": float(median), "max_s": float(slowest)}


def _is_time(value: Any) -> bool:
    return (isinstance(value, int | float) and not isinstance(value, bool)
            and math.isfinite(value) and value >= 0)


# -- Reading the record back (every file under a run is untrusted) ------------------------------

_RANK_FIELDS = {"rank": "rank", "node": "node", "median_s": "number", "max_s": "number", "factor": "number"}
_NODE_FIELDS = {"node": "node", "factor": "number"}
_EXPECTED = {"rank": f"an integer in [0, {MAX_RANKS}]",
             "node": f"a printable name of 1 to {MAX_NODE_NAME} characters",
             "number": "a finite number >= 0"}


def check_stragglers(value: Any, source: str) -> dict[str, Any] | None:
    """The manifest's ``stragglers`` as read back: None (absent), or the record in shape, its
    lists at most ``MAX_LISTED`` long, every number finite and >= 0, every node name printable.
    A ManifestError names ``source``, the field, the expected and the actual value; keys the
    record does not know are dropped."""
    if value is None:
        return None
    if not isinstance(value, dict):
        _refuse(source, "stragglers", "an object or null", value)
    ranks = value.get("ranks")
    if not isinstance(ranks, int) or isinstance(ranks, bool) or not 1 <= ranks <= MAX_RANKS:
        _refuse(source, "stragglers.ranks", f"an integer in [1, {MAX_RANKS}]", ranks)
    return {"ranks": ranks,
            "median_s": _checked("number", value.get("median_s"), source, "stragglers.median_s"),
            "slowest": _checked_list(value.get("slowest"), _RANK_FIELDS, source, "stragglers.slowest"),
            "nodes": _checked_list(value.get("nodes"), _NODE_FIELDS, source, "stragglers.nodes")}


def _checked_list(items: Any, fields: dict[str, str], source: str, name: str) -> list[dict[str, Any]]:
    if not isinstance(items, list) or len(items) > MAX_LISTED:
        _refuse(source, name, f"a list of at most {MAX_LISTED} objects",
                f"a list of {len(items)}" if isinstance(items, list) else items)
    checked = []
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            _refuse(source, f"{name}[{i}]", f"an object with {', '.join(fields)}", item)
        checked.append({key: _checked(kind, item.get(key), source, f"{name}[{i}].{key}")
                        for key, kind in fields.items()})
    return checked


def _checked(kind: str, value: Any, source: str, name: str) -> Any:
    if kind == "node":
        ok = isinstance(value, str) and 0 < len(value) <= MAX_NODE_NAME and value.isprintable()
    elif kind == "rank":
        ok = isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_RANKS
    else:
        ok = (isinstance(value, int | float) and not isinstance(value, bool)
              and _is_finite(value) and value >= 0)
    if not ok:
        _refuse(source, name, _EXPECTED[kind], value)
    return float(value) if kind == "number" else value


def _is_finite(value: float) -> bool:
    try:
        return math.isfinite(value)
    except OverflowError:  # an integer too large for a float
        return False


def _refuse(source: str, name: str, expected: str, actual: Any) -> None:
    raise ManifestError(f"{source}: {name}: expected {expected}, actual {short(actual)}", field=name)


# -- Showing it and acting on it ----------------------------------------------------------------

def describe(record: dict[str, Any]) -> str:
    """One line: ``slowest rank 3 (node n2) x1.42 the median 0.153 s over 8 ranks; nodes n2
    x1.42, n1 x1.01`` (a record ``check_stragglers`` passed: node names printable)."""
    parts = []
    if record["slowest"]:
        s = record["slowest"][0]
        parts.append(f"slowest rank {s['rank']} (node {s['node']}) x{s['factor']:.2f} the median "
                     f"{_seconds(record['median_s'])} over {record['ranks']} ranks")
    else:
        parts.append(f"median {_seconds(record['median_s'])} over {record['ranks']} ranks")
    if record["nodes"]:
        parts.append("nodes " + ", ".join(f"{n['node']} x{n['factor']:.2f}" for n in record["nodes"]))
    return "; ".join(parts)


def _seconds(value: float) -> str:
    return f"{value:.2f} s" if value >= 1 else f"{value:.3g} s"


@dataclass(frozen=True, slots=True)
class StragglerPolicy:
    """Replace a node that was the slowest node, by more than ``factor`` times the median
    iteration time, at each of the last ``saves`` checkpoints (with a free spare, at the next
    checkpoint: the caller's part). No policy (None) is the default: nothing is replaced."""

    factor: float
    """The slowest node's factor (its slowest rank's median over the median of all ranks) must
    exceed this; > 1 (the slowest node's factor is never below 1)."""
    saves: int
    """In this many checkpoints in a row (>= 1)."""

    def __post_init__(self) -> None:
        if not isinstance(self.factor, int | float) or isinstance(self.factor, bool) \
                or not _is_finite(self.factor) or not self.factor > 1:
            raise UsageError(f"straggler policy: factor: expected a finite number > 1, "
                             f"actual {short(self.factor)}")
        if not isinstance(self.saves, int) or isinstance(self.saves, bool) or self.saves < 1:
            raise UsageError(f"straggler policy: saves: expected an integer >= 1, actual {short(self.saves)}")

    def decide(self, history: list[dict[str, Any] | None]) -> str | None:
        """The node to replace, given the ``stragglers`` records of the last committed
        checkpoints (oldest first; None where one has no record): the same node was the slowest
        node with a factor above ``factor`` in each of the last ``saves``; else None."""
        if len(history) < self.saves:
            return None
        named = {self._slow_node(record) for record in history[-self.saves:]}
        return named.pop() if len(named) == 1 else None

    def _slow_node(self, record: dict[str, Any] | None) -> str | None:
        nodes = record.get("nodes") if isinstance(record, dict) else None
        if not nodes:
            return None
        first = nodes[0]
        return first["node"] if first["factor"] > self.factor else None
