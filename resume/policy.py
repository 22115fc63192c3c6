"""Policies as small objects: when to save, how many failed saves to bear, what to keep.

The mechanism (the coordinator, the commit, the run) asks; these answer. Each is a
value that can be read, tested and composed on its own::

    decide = EveryN(200) | OnRequest() | OnSignal()
    decide(DecisionContext(iteration=400, ...))   # -> Decision(save=True, ...)
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass

from .errors import LeaseLostError, SaveFailedError, UsageError

__all__ = ["AnySavePolicy", "AtEnd", "Decision", "DecisionContext", "EveryN", "KeepPolicy", "OnRequest", "OnSignal",
           "SaveFailureTolerance", "SavePolicy"]

log = logging.getLogger("resume")


# -- the save decision -----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class DecisionContext:
    """What every rank knows at an iteration boundary, after the ranks agreed on their flags."""

    iteration: int
    requested: bool = False
    """``Coordinator.request_save()`` was called on some rank."""
    stop: bool = False
    """A signal or a ``request_save(stop=True)`` asks to save and stop."""
    requests: tuple = ()
    """Save requests from outside (``resume save``, the Slurm hook), ``control.SaveRequest``."""


@dataclass(frozen=True, slots=True)
class Decision:
    save: bool = False
    stop: bool = False
    reasons: frozenset[str] = frozenset()

    @property
    def scheduled_only(self) -> bool:
        """Only the schedule asked: nobody waits for this commit, so it may run in the background."""
        return self.reasons == {"scheduled"}


class SavePolicy:
    """One reason to save. ``a | b`` saves when either says so."""

    reason = ""

    def wants(self, ctx: DecisionContext) -> bool:
        raise NotImplementedError

    def stops(self, ctx: DecisionContext) -> bool:
        return False

    def __call__(self, ctx: DecisionContext) -> Decision:
        wants = self.wants(ctx)
        return Decision(save=wants, stop=wants and self.stops(ctx),
                        reasons=frozenset({self.reason}) if wants else frozenset())

    def __or__(self, other: SavePolicy) -> AnySavePolicy:
        return AnySavePolicy((self, other))


@dataclass(frozen=True)
class AnySavePolicy(SavePolicy):
    policies: tuple[SavePolicy, ...]

    def __call__(self, ctx: DecisionContext) -> Decision:
        parts = [p(ctx) for p in self.policies]
        return Decision(save=any(p.save for p in parts), stop=any(p.stop for p in parts),
                        reasons=frozenset().union(*(p.reasons for p in parts)))

    def __or__(self, other: SavePolicy) -> AnySavePolicy:
        return AnySavePolicy((*self.policies, other))


@dataclass(frozen=True)
class EveryN(SavePolicy):
    """Every ``n`` iterations (0: never)."""

    n: int
    reason = "scheduled"

    def __post_init__(self) -> None:
        if isinstance(self.n, bool) or not isinstance(self.n, int) or self.n < 0:
            raise UsageError(f"every: expected >= 0 iterations (0 = only on request), actual {self.n!r}")

    def wants(self, ctx: DecisionContext) -> bool:
        return self.n > 0 and ctx.iteration % self.n == 0


@dataclass(frozen=True)
class OnRequest(SavePolicy):
    """A request from outside or from the program; stops when a request says so."""

    reason = "requested"

    def wants(self, ctx: DecisionContext) -> bool:
        return ctx.requested or bool(ctx.requests)

    def stops(self, ctx: DecisionContext) -> bool:
        return any(r.stop for r in ctx.requests)


@dataclass(frozen=True)
class OnSignal(SavePolicy):
    """SIGUSR1/SIGTERM or ``request_save(stop=True)``: save, then stop."""

    reason = "stop"

    def wants(self, ctx: DecisionContext) -> bool:
        return ctx.stop

    def stops(self, ctx: DecisionContext) -> bool:
        return True


@dataclass(frozen=True)
class AtEnd(SavePolicy):
    """The run's last iteration (``total_iterations``): save it (marked complete), then stop."""

    total: int
    reason = "end"

    def __post_init__(self) -> None:
        if isinstance(self.total, bool) or not isinstance(self.total, int) or self.total < 1:
            raise UsageError(f"total_iterations: expected >= 1 iterations, actual {self.total!r}")

    def wants(self, ctx: DecisionContext) -> bool:
        return ctx.iteration >= self.total

    def stops(self, ctx: DecisionContext) -> bool:
        return True


# -- save failures ---------------------------------------------------------------------------------


@dataclass
class SaveFailureTolerance:
    """What a failed scheduled save does: ``"raise"`` (the job stops and is restarted) or
    ``"continue"`` (logged; training goes on and the next scheduled save tries again, until
    ``max_in_row`` failures in a row). Only storage trouble is ever tolerated; a lost lease,
    a continuity or usage error never is."""

    mode: str = "raise"
    max_in_row: int = 3
    failures: int = 0
    """Scheduled saves failed in a row."""

    def __post_init__(self) -> None:
        if self.mode not in ("raise", "continue"):
            raise UsageError(f"on_save_failure: expected 'raise' or 'continue', actual {self.mode!r}")
        if isinstance(self.max_in_row, bool) or not isinstance(self.max_in_row, int) or self.max_in_row < 1:
            raise UsageError(f"max_save_failures: expected >= 1, actual {self.max_in_row!r}")

    def tolerate(self, error: BaseException, step: int) -> bool:
        """Count one failure; True while training may go on without this save."""
        storage_trouble = isinstance(error, SaveFailedError | OSError) and not isinstance(error, LeaseLostError)
        if self.mode != "continue" or not storage_trouble:
            return False
        self.failures += 1
        if self.failures >= self.max_in_row:
            log.error("resume: %d scheduled saves failed in a row (max_save_failures=%d); stopping",
                      self.failures, self.max_in_row)
            return False
        log.error("resume: the save of step %d failed (%d in a row, stopping at %d); training goes on "
                  "and the next scheduled save tries again: %s", step, self.failures, self.max_in_row, error)
        return True

    def succeeded(self) -> None:
        self.failures = 0


# -- retention -------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True, slots=True)
class KeepPolicy:
    """Which committed checkpoints retention keeps."""

    keep_last: int = 3
    """The newest K committed checkpoints are kept. K >= 2: the newest may be
    torn by a crash during its verification, so the one before must survive."""
    keep_every: int | None = None
    """Additionally keep, forever, every checkpoint whose step is a multiple of M."""

    def __post_init__(self) -> None:
        if isinstance(self.keep_last, bool) or not isinstance(self.keep_last, int) or self.keep_last < 2:
            raise UsageError(f"keep: expected >= 2, actual {self.keep_last} (the newest checkpoint "
                             "may turn out torn; the one before it must survive)")
        if self.keep_every is not None and self.keep_every < 1:
            raise UsageError(f"keep_every: expected >= 1 or None, actual {self.keep_every}")

    def keeps(self, step: int, newer_committed: int) -> bool:
        """Whether the committed checkpoint ``step``, with ``newer_committed`` newer ones, stays."""
        return newer_committed < self.keep_last or self.kept_forever(step)

    def kept_forever(self, step: int) -> bool:
        return bool(self.keep_every) and step % self.keep_every == 0

    def select_deletions(self, committed: Iterable[int]) -> list[int]:
        newest_first = sorted(committed, reverse=True)
        return sorted(s for newer, s in enumerate(newest_first) if not self.keeps(s, newer))
