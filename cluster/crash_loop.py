"""The crash-loop stop: when the requeue hook gives up on a job that keeps failing.

The hook records each failure on healthy nodes with the newest committed step at that moment
and asks the policy; ``CrashLoopPolicy(3).should_stop(failures)`` true means exit 5, no requeue.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from resume.errors import UsageError

__all__ = ["CrashLoopPolicy"]


@dataclass(frozen=True, slots=True)
class CrashLoopPolicy:
    """Stop after ``limit`` failures in a row with no new committed checkpoint between them.

    The history is the hook's: failures on nodes Slurm reports bad are hardware and are
    not recorded, and a finished step or a save-and-requeue clears it. Failures with a
    checkpoint committed in between are progress, not a loop.
    """

    limit: int = 3
    """Failures in a row, all at the same committed step, that stop the requeueing."""

    def __post_init__(self) -> None:
        if self.limit < 1:
            raise UsageError(f"crash loop: limit: expected >= 1, actual {self.limit}")

    def should_stop(self, failures: Sequence[Mapping[str, Any]]) -> bool:
        """``failures``: oldest first, each with its ``committed_step`` (None: none yet)."""
        recent = failures[-self.limit:]
        return len(recent) == self.limit and len({f.get("committed_step") for f in recent}) == 1
