"""What the hook does with stragglers: each new committed checkpoint's ``stragglers`` record
(``resume.stragglers``, gathered with the save) as an event, and, when ``--replace-stragglers``
is on, the node ``StragglerPolicy`` chooses to replace.

Invariant: one look at the newest committed checkpoint at most every ``every_s`` (discovery
through the run's one commit check); the history is this allocation's only.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from resume.stragglers import StragglerPolicy

from .events import EventLog
from .watch import RunWatcher

__all__ = ["StragglerWatch"]


class StragglerWatch:
    def __init__(self, watch: RunWatcher, factor: float | None, saves: int, log: EventLog, *,
                 every_s: float = 10.0) -> None:
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
        self._next_look = now + self.every_s
        manifest = self.watch.latest_manifest()
        if manifest is None or manifest.step == self._last_step:
            return False
        first = self._last_step is None
        self._last_step = manifest.step
        record: Any = getattr(manifest, "stragglers", None)
        if first:
            return False  # a checkpoint of an earlier launch: not this allocation's history
        self.history.append(record)
        if record:
            slowest = record["slowest"][0]
            self.log.event("stragglers", step=manifest.step, slowest=record["slowest"], nodes=record["nodes"],
                           reason=f"slowest rank {slowest['rank']} on {slowest['node']}: "
                                  f"x{slowest['factor']} the median iteration time")
        if self.policy is None:
            return False
        node = self.policy.decide(self.history)
        if node is not None and spare_free():
            self.chosen = node
            return True
        return False

    def reset(self) -> None:
        self.history.clear()
        self.chosen = None
