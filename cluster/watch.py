"""What the hook reads of the run it supervises: its committed steps, through the core's
one commit check (``Run.check``) and one discovery (``Run.find_latest``).

Invariant: the run's layout is detected again before each look (a framework's first
save may have made it), unless it was fixed when the run was opened (``fixed_layout``).
"""

from __future__ import annotations

from resume.errors import ResumeError
from resume.manifest import Manifest
from resume.run import CheckResult, Run, detect_layout

__all__ = ["RunWatcher"]


class RunWatcher:
    def __init__(self, run: Run, *, fixed_layout: bool = False) -> None:
        self.run = run
        self.fixed_layout = fixed_layout

    def check(self, step: int) -> CheckResult:
        """The commit check of ``step`` (a save request's answer counts only for a committed one)."""
        self._detect_layout()
        return self.run.check(step)

    def latest_committed(self) -> int | None:
        """The newest committed step; storage errors propagate."""
        self._detect_layout()
        manifest, _ = self.run.find_latest()
        return manifest.step if manifest is not None else None

    def committed_quietly(self) -> int | None:
        """The newest committed step for an event line; None when there is none or storage refuses."""
        try:
            return self.latest_committed()
        except (ResumeError, OSError):
            return None

    def newer_committed(self, before: int | None) -> int | None:
        """The newest committed step after ``before`` (only newer directories are checked); None
        when there is none yet or storage refuses (the next poll looks again)."""
        try:
            manifest, _ = self.run.find_latest(above=before)
        except OSError:  # StorageError included
            return None
        return manifest.step if manifest is not None else None

    def committed_since(self, step: int | None, *, limit: int = 16) -> list[Manifest]:
        """The manifests of the committed steps after ``step`` (all of them when None), oldest
        first, at most the newest ``limit``; [] when storage refuses (the next look tries again)."""
        try:
            self._detect_layout()
            found: list[Manifest] = []
            for result in self.run.discover(above=step):  # newest first: older ones are not read
                if result.committed and result.manifest is not None:
                    found.append(result.manifest)
                    if len(found) >= limit:
                        break
        except (ResumeError, OSError):
            return []
        return list(reversed(found))

    def complete_step(self) -> int | None:
        """The newest committed step when its manifest marks the run complete, else None."""
        try:
            self._detect_layout()
            manifest, _ = self.run.find_latest()
        except (ResumeError, OSError):
            return None
        return manifest.step if manifest is not None and manifest.complete else None

    def _detect_layout(self) -> None:
        if not self.fixed_layout:
            self.run.layout = detect_layout(self.run.storage)
