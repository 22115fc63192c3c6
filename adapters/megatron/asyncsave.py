"""Megatron's ``--async-save``: our manifest is written when Megatron finalizes the save.

Megatron's ``save_checkpoint`` returns once the save is scheduled; the save is finalized
later (``maybe_finalize_async_save``), on every rank together, once every rank's write is
done: dist_checkpointing's finalize functions, then Megatron's (the tracker).
``AsyncCommits`` appends our commit to them. Invariants:

- the manifest is written in Megatron's finalize step, after Megatron's own finalize
  functions: a job killed before it leaves the iteration uncommitted, passed over;
- what the manifest says of the training (counters, next batch, LR ahead, RNG digests, the
  update records it seals) is taken when the save is scheduled; only the file records are
  taken at the finalize;
- ours is appended last on every rank, so its collectives line up;
- two saves of one iteration never write at once, and a ``resume save`` request is
  answered only once its step is committed (``maybe_wait_for_commit`` first);
- the watchdog (``watch``) counts the saves in flight, from the first scheduled to the last
  committed, as ``save-background``; a wait for their finalize and our commit as ``save``.
"""


from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from resume.errors import InvariantError
from resume.run import Run
from resume.watchdog import HangBounds, Watchdog

from .layout import MEGATRON_LAYOUT

__all__ = ["AsyncCommits", "SaveSnapshot"]

log = logging.getLogger("resume")


class SaveRecorder(Protocol):
    """What an asynchronous save needs of the recorder (``MegatronRecorder`` is one)."""

    run: Run

    def before_save(self, iteration: int) -> None: ...

    def snapshot_save(self, iteration: int, args: Any, scheduler: Any, optimizer: Any) -> SaveSnapshot: ...

    def commit_save(self, snapshot: SaveSnapshot, args: Any) -> Any: ...


@dataclass
class SaveSnapshot:
    """What the manifest of ``iteration`` records of the training, taken when the save was scheduled."""

    iteration: int
    parts: list[dict] | None
    """Every rank's part of the manifest but its files: counters, RNG digest (rank 0: the
    expectation); on rank 0 only (None on the others, which send theirs)."""
    started: float
    journal_lines: list[bytes] | None = None
    """Rank 0: the update records up to ``iteration`` not sealed yet, which its commit seals
    (``updates``); None elsewhere or without a journal."""


class AsyncCommits:
    """The commits of Megatron's scheduled async saves, each run in Megatron's finalize step.

    ``schedule_async_save`` is put in place of the name ``megatron.training.checkpointing``
    calls; it passes every request on, and appends the commit to the one a recorded save
    arms (the request that carries Megatron's finalize functions).
    """

    def __init__(self, schedule: Callable[[Any], Any], finalize: Callable[..., Any], *,
                 watchdog: Watchdog | None = None) -> None:
        """
        Args:
            schedule: Megatron's ``schedule_async_save`` (what the replacement passes requests to).
            finalize: Megatron's ``maybe_finalize_async_save(blocking=..., terminate=...)``.
            watchdog: told of the saves in flight (``install()``: the process's); None: one
                that watches nothing.
        """
        self._schedule = schedule
        self._finalize = finalize
        self._watchdog = watchdog if watchdog is not None else Watchdog(HangBounds(enabled=False))
        self._armed: Callable[[], Any] | None = None
        self.pending: list[int] = []
        """Iterations scheduled and not yet committed, oldest first (alike on every rank)."""

    @classmethod
    def install(cls, checkpointing: Any, *, watchdog: Watchdog | None = None) -> AsyncCommits:
        """Put ``schedule_async_save`` in place in ``megatron.training.checkpointing``."""
        from megatron.training import async_utils

        commits = cls(checkpointing.schedule_async_save, async_utils.maybe_finalize_async_save, watchdog=watchdog)
        checkpointing.schedule_async_save = commits.schedule_async_save
        return commits

    def schedule_async_save(self, request: Any) -> Any:
        """Megatron's ``schedule_async_save``, with the armed commit appended to the request.

        Megatron moves its finalize functions to the last request it schedules for a save
        (a logits request, when distillation writes one): the commit goes with them, on
        every rank alike, and never on a request that carries none.
        """
        if self._armed is not None and request.finalize_fns:
            request.add_finalize_fn(self._armed)
            self._armed = None
        return self._schedule(request)

    def save(self, recorder: SaveRecorder, iteration: int, args: Any, scheduler: Any, optimizer: Any,
             megatron_save: Callable[[], Any]) -> Any:
        """Collective: one recorded async save; ``megatron_save`` is Megatron's ``save_checkpoint``.

        Returns what Megatron returns, once the save is scheduled; the manifest is written
        when Megatron finalizes it.
        """
        self.maybe_wait_for_commit(iteration)  # never two writers in one directory
        recorder.before_save(iteration)
        snapshot = recorder.snapshot_save(iteration, args, scheduler, optimizer)
        self._armed = lambda: self._commit(recorder, snapshot, args)
        self.pending.append(iteration)
        try:
            result = megatron_save()
            if self._armed is not None:
                raise InvariantError(
                    f"{recorder.run.storage.url(MEGATRON_LAYOUT.dirname(iteration))}: expected Megatron to "
                    "schedule an async request with finalize functions (--async-save), actual none: "
                    "the save is left uncommitted")
        except BaseException:
            self._armed = None
            self.pending.remove(iteration)
            raise
        if self.pending == [iteration]:  # the first in flight starts the background's clock
            self._watchdog.progress.background(True)
        return result

    def _commit(self, recorder: SaveRecorder, snapshot: SaveSnapshot, args: Any) -> None:
        """Megatron's finalize step, every rank: the files are complete (all-reduced), commit them."""
        try:
            with self._watchdog.phase("save"):
                recorder.commit_save(snapshot, args)
        finally:
            self.pending.remove(snapshot.iteration)
            if not self.pending:
                self._watchdog.progress.background(False)

    def maybe_wait_for_commit(self, iteration: int) -> None:
        """Collective: when the save of ``iteration`` is still pending, finalize (waiting) every
        pending save up to it, so its manifest exists on return."""
        if iteration in self.pending:
            log.info("resume: waiting for the async save of %s to finalize", MEGATRON_LAYOUT.dirname(iteration))
            with self._watchdog.phase("save"):
                self._finalize(blocking=True)
