"""What the hook does with stragglers: each new committed checkpoint's ``stragglers`` record
(``resume.stragglers``, gathered with the save) as an event, and, when ``--replace-stragglers``
is on, the node ``StragglerPolicy`` chooses to replace.

Invariant: one look at the committed checkpoints newer than the last seen at most every
``every_s`` (discovery through the run's one commit check: the newer step directories only);
every checkpoint counts once; the history is this allocation's only.
"""

from __future__ import annotations

from collections.abc import Callable

from resume.stragglers import StragglerPolicy, describe

from .events import EventLog
from .watch import RunWatcher

__all__ = ["StragglerWatch"]


class StragglerWatch:
    def __init__(self, watch: RunWatcher, factor: float | None, saves: int, log: EventLog, *,
                 every_s: float = 2.0) -> None:
        self.watch = watch
        self.policy = StragglerPolicy(factor=factor, saves=saves) if factor is not None else None
        self.log = log
        self.every_s = every_s
        self.history: list[dict | None] = []
        self.chosen: str | None = None
        self._last_step: int | None = None
        self._next_look: float | None = None

    def poll(self, now: float, *, spare_free: Callable[[], bool]) -> bool:
        """True when the policy chose a node to replace (``chosen``) and a spare is free."""
        if self._next_look is not None and now < self._next_look:
            return False
        first = self._next_look is None
        self._next_look = now + self.every_s
        new = self.watch.committed_since(self._last_step, limit=1 if first else 16)
        if not new:
            return False
        self._last_step = new[-1].step
        if first:
            return False  # checkpoints of earlier launches: not this allocation's history
        for manifest in new:
            self._record(manifest.step, manifest.stragglers)
        if self.policy is None:
            return False
        node = self.policy.decide(self.history)
        if node is not None and spare_free():
            self.chosen = node
            return True
        return False

    def _record(self, step: int, record: dict | None) -> None:
        self.history.append(record)
        del self.history[:-64]
        if record:
            self.log.event("stragglers", step=step, slowest=record["slowest"], nodes=record["nodes"],
                           reason=describe(record))

    def reset(self) -> None:
        self.history.clear()
        self.chosen = None
