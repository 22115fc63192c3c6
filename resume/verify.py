"""What ``resume verify`` (and ``inspect``) finds in a run: a ``Verdict``, and no output.

``verify_run`` applies the one commit check (``Run.check``) to every step directory (or the
one asked for), adds verify's own checks to each committed checkpoint (the schedule's
sanity; with ``deep`` the rank state files and whatever ``deep_checks`` the caller hands
in) and checks the layout's pointer and our ``LATEST``. The verdict's exit code is the
command's: 0 sound, 1 problems, 3 no committed checkpoint.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from .errors import (
    EXIT_NOTHING,
    EXIT_OK,
    EXIT_PROBLEM,
    CheckpointNotFoundError,
    ManifestError,
    UnsafePathError,
    message_fields,
)
from .run import CheckResult, Run
from .storage import SMALL_FILE_CAP
from .text import short

__all__ = ["DeepCheck", "Verdict", "checkpoint_problems", "latest_problems", "semantic_problems",
           "steps_to_check", "verify_run"]

DeepCheck = Callable[[Run, CheckResult], list[str]]
"""A check ``verify --deep`` adds for a committed checkpoint: its problems, one line each."""


@dataclass
class Verdict:
    """What ``verify`` finds in a run, or in the one step asked for. ``inspect`` takes the
    same verdict, so both exit with the same code for the same state."""

    results: list[CheckResult]
    """Every step directory checked, ascending, with verify's own problems added."""
    restorable: int | None
    """The newest step that passes the commit check: the one restore would load."""
    pointer: list[str]
    """Problems of the layout's pointer (our LATEST, a framework's own) and of the run as a whole."""
    notes: list[str]
    whole_run: bool = True
    """Every step directory was checked (no step asked for)."""

    def located_problems(self) -> list[tuple[CheckResult | None, str]]:
        """Everything that makes the exit code 1, in the order it is reported, each with the
        step directory it is of (None: the run's). A step directory without any manifest is a
        save that never finished: not a problem unless it was asked for; a framework's own
        save with problems is broken, as a checkpoint of ours with problems is."""
        return [(r, p) for r in self.results if r.status == "broken" or not self.whole_run
                for p in r.problems] + [(None, p) for p in self.pointer]

    @property
    def problems(self) -> list[str]:
        return [p for _, p in self.located_problems()]

    @property
    def ok(self) -> bool:
        """No problem, and something a restart loads: a committed checkpoint, or a framework's
        own save that is sound (``unrecorded``; loaded without the continuity check)."""
        return not self.problems and any(r.status in ("committed", "unrecorded") for r in self.results)

    @property
    def exit_code(self) -> int:
        """0 sound, 1 problems, 3 no committed checkpoint."""
        if self.problems:
            return EXIT_PROBLEM
        return EXIT_OK if self.ok else EXIT_NOTHING

    def errors(self, run: Run) -> list[str]:
        """What stderr says: each problem, or that there is no committed checkpoint."""
        if self.problems or self.ok:
            return self.problems
        return [f"{run.url}: expected a committed checkpoint, actual none"]

    def error_records(self, run: Run) -> list[dict[str, Any]]:
        """``errors`` as records: ``error`` (the line), ``what`` (the step's status, ``broken``
        or ``uncommitted``; ``pointer`` for the run's; ``nothing`` when no checkpoint is
        committed), ``step`` (None for the run's), and where, field, expected, actual
        (``errors.message_fields``)."""
        located = self.located_problems()
        if not located and not self.ok:
            located = [(None, message) for message in self.errors(run)]
        return [{"error": message,
                 "what": r.status if r is not None else "pointer" if self.problems else "nothing",
                 "step": r.step if r is not None else None, **message_fields(message)}
                for r, message in located]


def verify_run(run: Run, step: int | None = None, *, deep: bool = False,
               check: Callable[[int], CheckResult] | None = None,
               deep_checks: Sequence[DeepCheck] = ()) -> Verdict:
    """The commit check on every step directory (or on ``step``; ``check`` replaces
    ``run.check(step, deep=deep)``, e.g. to show progress), verify's own checks on each
    committed one, then the layout's pointer and, for the whole run, our LATEST.
    CheckpointNotFoundError (exit 3) when there is no step directory (or not ``step``)."""
    check = check or (lambda s: run.check(s, deep=deep))
    results, restorable, unrecorded = [], None, None
    for s in steps_to_check(run, step):
        result = check(s)
        if result.committed:
            restorable = s
            result.problems.extend(checkpoint_problems(run, result, deep=deep, deep_checks=deep_checks))
        else:
            result.examine_framework(run, deep=deep)
            unrecorded = s if result.status == "unrecorded" else unrecorded
        results.append(result)
    if restorable is None:
        restorable = unrecorded  # nothing of ours: the framework loads its own save
    whole_run = step is None
    pointer = run.layout.pointer_problems(run, results, whole_run=whole_run)
    notes: list[str] = []
    if whole_run and run.layout.latest:
        latest, notes = latest_problems(run, results)
        pointer += latest
    return Verdict(results, restorable, pointer, notes, whole_run)


def steps_to_check(run: Run, step: int | None) -> list[int]:
    """Every step directory, or the one asked for; CheckpointNotFoundError (exit 3) if none."""
    steps = run.step_dirs()
    if step is not None:
        if step not in steps:
            raise CheckpointNotFoundError(f"{run.storage.url(run.dirname(step))}: expected a step "
                                          f"directory, actual missing (steps: {steps})")
        return [step]
    if not steps:
        raise CheckpointNotFoundError(f"{run.url}: expected checkpoints, actual none")
    return steps


def checkpoint_problems(run: Run, result: CheckResult, *, deep: bool,
                        deep_checks: Sequence[DeepCheck] = ()) -> list[str]:
    """What verify adds to the commit check of a committed checkpoint: the schedule's sanity,
    with ``deep`` the ``deep_checks`` and every rank state file in shape and bounds, and what
    the layout's framework says against the manifest."""
    problems = semantic_problems(run, result)
    if deep:
        from .restore import rank_state_problems

        assert result.manifest is not None
        for deep_check in deep_checks:
            problems += deep_check(run, result)
        problems += rank_state_problems(run, result.manifest)
    return problems + run.layout.extra_problems(run, result)


def semantic_problems(run: Run, result: CheckResult) -> list[str]:
    """Schedule sanity of a committed checkpoint's manifest (the counters' invariants are
    part of the commit check)."""
    from .continuity import Expectation

    manifest = result.manifest
    assert manifest is not None
    source = run.storage.url(run.manifest_path(result.step))
    try:
        expectation = Expectation.from_dict(manifest.expectation, source=source)
    except ManifestError as e:
        return [str(e)]
    problems: list[str] = []
    successful = manifest.train_state.updates_successful
    for i, steps in enumerate(expectation.optimizer_steps):
        if steps != successful:
            problems.append(f"{source}: expectation.optimizer_steps[{i}]: expected {successful} "
                            f"(updates_successful), actual {steps}")
    if len(expectation.lr_ahead) < 2:
        problems.append(f"{source}: expectation.lr_ahead: expected >= 2 updates, "
                        f"actual {len(expectation.lr_ahead)}")
    if any(math.isnan(lr) or lr < 0 for lrs in expectation.lr_ahead for lr in lrs):
        problems.append(f"{source}: expectation.lr_ahead: expected non-negative LRs, "
                        f"actual {expectation.lr_ahead}")
    return problems


def latest_problems(run: Run, results: list[CheckResult]) -> tuple[list[str], list[str]]:
    """Our LATEST hint: (problems, notes). Missing is fine; it must name a committed step.

    Naming a broken step, or one older than the newest committed step (a crash between the
    manifest write and the LATEST update leaves it so; discovery trusts manifests), is only
    a note.
    """
    name = run.layout.latest
    assert name is not None
    source = run.storage.url(name)
    try:
        # Capped and never through a link: a LATEST linked to a secret is refused, not quoted.
        text = run.storage.read_bytes(name, limit=SMALL_FILE_CAP).decode(errors="replace").strip()
    except FileNotFoundError:
        return [], []
    except UnsafePathError as e:
        return [str(e)], []
    except OSError as e:
        return [f"{source}: expected a readable file, actual {type(e).__name__}: {short(str(e))}"], []
    if not (text.isascii() and text.isdigit()):
        return [f"{source}: expected a step number, actual {short(text, 60)}"], []
    return _named_step_problems(run, results, source, int(text))


def _named_step_problems(run: Run, results: list[CheckResult], source: str,
                         latest: int) -> tuple[list[str], list[str]]:
    """``latest_problems`` for the step LATEST names."""
    named = run.dirname(latest)
    expected = f"{source}: names {named}: expected a committed checkpoint, actual"
    by_step = {r.step: r for r in results}
    if latest not in by_step:
        aside = [n for n in run.storage.listdir("") if n.startswith(f"quarantine-{named}-")]
        why = (f" (moved aside as {aside[-1]} by a restore that passed over it; the next commit "
               "rewrites LATEST)") if aside else ""
        return [f"{expected} no such directory{why}"], []
    if by_step[latest].status == "broken":
        return [], [f"{source}: names {named}, which is broken (its problems are listed)"]
    if not by_step[latest].committed:
        return [f"{expected} {by_step[latest].status} ({by_step[latest].reason})"], []
    newest = max(r.step for r in results if r.committed)
    if latest < newest:
        note = (f"{source}: names {named}, older than the newest committed {run.dirname(newest)} "
                "(a hint only; discovery trusts manifests)")
        return [], [note]
    return [], []
