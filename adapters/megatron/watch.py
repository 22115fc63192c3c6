"""Hang detection in Megatron's own loop: the process watchdog (``resume.watchdog``) told what
``megatron.training`` is doing, from the calls ``install()`` wraps. No Coordinator runs there;
this plays its part.

- ``load_checkpoint``: ``restore`` (measured); ``save_checkpoint``, a wait for an async save's
  finalize and our commit in it: ``save`` (measured: the blocking part);
- ``train_step``: each return that ``train()`` counts is an iteration's progress; the exit
  check's poll (a collective every iteration) is where the ranks agree (``synced``);
- ``--async-save``, from scheduled to committed: ``save-background`` (``asyncsave``);
- ``evaluate_and_print_results``: a declared phase bounded by ``max(floor_s, factor × the
  slowest evaluation measured)``, ``first_s`` before one was;
- ``train()``'s end closes the watchdog: what the program does after it is not watched.

Attached at the first wrapped call once torch.distributed is initialised (Megatron has parsed
its arguments and set up the ranks by then): the save directory receives the reports unless the
hook named the run. Per ``train_step``: a clock read and a few stores, no I/O, no collective.
"""

from __future__ import annotations

import contextlib
from typing import Any

from resume.watchdog import HangBounds, Watchdog, process_watchdog

__all__ = ["EVALUATION", "LoopWatch"]

EVALUATION = "evaluation"
"""The measured kind (``Progress.slowest``) and the ``what`` of Megatron's evaluation."""


class LoopWatch:
    """The watchdog's side of ``install()``'s wrappers (module docstring)."""

    def __init__(self, watchdog: Watchdog | None = None, *, bounds: HangBounds | None = None) -> None:
        """
        Args:
            watchdog: default the process's (``resume.watchdog.process_watchdog``).
            bounds: the program's own bounds; None: the hook's (``RESUME_HANG``) or the defaults.
        """
        self.watchdog = watchdog if watchdog is not None else process_watchdog()
        self.progress = self.watchdog.progress
        self.bounds = bounds
        self.attached = False
        self._storage: Any = None

    def maybe_attach(self, storage: Any) -> None:
        """Take the watchdog over once the ranks exist: this rank's place, ``storage`` (the save
        directory's, or None) for the reports, the thread started. Cheap once attached."""
        if self.attached:
            return
        place = _rank_and_world()
        if place is None:  # before torch.distributed: the rank is not known yet
            return
        self._storage = storage
        self.watchdog.attach(storage, rank=place[0], world_size=place[1], bounds=self.bounds)
        self.watchdog.start()
        self.attached = True

    def phase(self, name: str, *, measure: str | None = None) -> contextlib.AbstractContextManager[None]:
        return self.watchdog.phase(name, measure=measure)

    def evaluation(self) -> contextlib.AbstractContextManager[None]:
        """Megatron's evaluation, declared: it makes no iteration's progress, and may take long."""
        bound = self.watchdog.bounds.bound(self.progress.slowest.get(EVALUATION))
        return self.watchdog.phase("declared", what=EVALUATION, measure=EVALUATION, bound=bound)

    def reopen(self) -> None:
        """A ``train()`` begins after an earlier one closed the watchdog: watched again."""
        w = self.watchdog
        if self.attached and self.progress.phase == "closed":  # attach() puts it back in start-up
            w.attach(self._storage, rank=w.rank, world_size=w.world_size, bounds=self.bounds)
            w.start()

    def close(self) -> None:
        """``train()`` ended: nothing more is watched (a save or an evaluation after it neither)."""
        self.watchdog.close()


def _rank_and_world() -> tuple[int, int] | None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return None
