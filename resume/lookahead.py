"""The next iteration, known before it runs: the next batch fetched early, without consuming it.

A save records what the next iteration must look like (``resume.continuity``); a
restore recomputes it from the live objects. Both ask ``NextIteration``: it fetches
the next batch once, with the RNG and data state from just before the fetch, and
hands the same batch to the loop afterwards.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from .adapter import Adapter
from .errors import UsageError
from .rng import RngRegistry

__all__ = ["END", "NextIteration"]

END = object()
"""The data is exhausted (this pass)."""


@dataclass
class _Fetched:
    batches: list
    """The next update's items (``accumulation`` of them, fewer where the data ends), not yet taken."""
    rng_state: dict
    data_state: Any
    ended: bool = False
    """The data ended before the update's items were all fetched: END once those are taken."""


class NextIteration:
    """This rank's next batch and its share of the Expectation (no collectives)."""

    def __init__(self, adapter: Adapter, rng: RngRegistry, *, lr_lookahead: int, accumulation: int = 1) -> None:
        self.adapter = adapter
        self.rng = rng
        self.lr_lookahead = lr_lookahead
        self.accumulation = accumulation
        """Items of ``coord.batches()`` per update (micro-batches): a save records them all."""
        self._taken = 0  # items taken since the last update
        self._last_taken: int | None = None  # items the last update took
        self._iterator: Iterator[Any] | None = None
        self._fetched: _Fetched | None = None
        self._drawn = False  # a batch went out through take() since the start or the restore
        self._start_iteration = 0

    def reset(self) -> None:
        """After a load: the data is read again from the restored position."""
        self._iterator = None
        self._fetched = None

    def start(self, iteration: int) -> None:
        """The loop starts (fresh or restored) at ``iteration``."""
        self._drawn = False
        self._taken, self._last_taken = 0, None
        self._start_iteration = iteration

    def refuse_untracked_batches(self, iteration: int) -> None:
        """A loop that draws its batches around ``coord.batches()`` would make every checkpoint
        record a wrong next batch (the loader's first, each time): refused at the first save."""
        counted = iteration - self._start_iteration
        if counted and not self._drawn and self.adapter.has_data():
            raise UsageError(
                "next_batch: expected the training loop to draw its batches through coord.batches() "
                f"(the checkpoint records the next batch from it), actual {counted} iterations counted "
                "by update() and no batch drawn through it; write `for batch in coord.batches():`, or "
                "build the adapter with data=None to save without the next-batch check (the loader's "
                "position is then the program's to keep, e.g. in coord.user)")

    def take(self) -> Any:
        """The next batch for the loop (the ones fetched early first); END at the end of a pass."""
        fetched = self._fetched
        if fetched is not None:
            batch = fetched.batches.pop(0) if fetched.batches else END
            if not fetched.batches and not (fetched.ended and batch is not END):
                self._fetched = None  # ended: kept (empty) until its END is taken
        else:
            batch = next(self._data(), END)
        if batch is END:
            self._iterator = None  # the next pass starts afresh
        else:
            self._drawn = True
            self._taken += 1
        return batch

    def updated(self) -> None:
        """An update was counted: the items it took are the update's."""
        self._last_taken, self._taken = self._taken, 0

    def check_accumulation(self) -> None:
        """At a save: the last update took ``accumulation`` items, or the checkpoint's next-batch
        record would cover another share of the next update than the loop takes (refused)."""
        taken = self._last_taken
        if taken is None or taken == 0 or taken == self.accumulation or not self.adapter.has_data():
            return
        raise UsageError(
            f"accumulation: expected the loop to take {self.accumulation} item(s) of coord.batches() per "
            f"update, actual {taken} in the last update: the checkpoint records the next update's items; "
            f"set Coordinator(accumulation={taken}) when each update accumulates {taken} micro-batches")

    def rank_state(self) -> dict:
        """What a save writes for this rank: RNG and data state from before the next batch."""
        ahead = self._fetch()
        return {"rng": ahead.rng_state, "data": ahead.data_state, "adapter": self.adapter.state_dict()}

    def expectation_part(self, schedule: list[dict] | None = None, *, moments: bool = True) -> dict:
        """This rank's share of the Expectation (``Expectation.assemble`` joins the ranks')."""
        ahead = self._fetch()
        adapter = self.adapter
        return {
            "batch": [pair for batch in ahead.batches for pair in adapter.describe_batch(batch)],
            "rng": RngRegistry.digest(ahead.rng_state),
            "optimizer": adapter.optimizer_fingerprint() if moments else None,
            "lr_ahead": adapter.lr_ahead(self.lr_lookahead),
            "lr_groups": adapter.lr_groups(),
            "schedule": adapter.describe_schedule() if schedule is None else schedule,
            "structure": adapter.describe_structure(),
            "optimizer_steps": adapter.optimizer_steps(),
            "state": adapter.registered_digests(),
            "state_shown": adapter.registered_shown(),
        }

    def _data(self) -> Iterator[Any]:
        if self._iterator is None:
            self._iterator = iter(self.adapter.data_iterator())
        return self._iterator

    def _fetch(self) -> _Fetched:
        # RNG and data position are snapshotted BEFORE the fetch: a restarted
        # run re-fetches this batch from the snapshot, consuming randomness
        # exactly as the uninterrupted run did.
        if not self.adapter.has_data():  # nothing to look ahead into; nothing kept between saves
            return _Fetched([], self.rng.capture(), None)
        if self._fetched is not None and self._taken:
            raise UsageError(f"accumulation: expected a save between updates, actual one after {self._taken} of "
                             f"the update's {self.accumulation} items were taken")
        if self._fetched is None:
            rng_state = self.rng.capture()
            data_state = self.adapter.data_state()
            batches: list = []
            ended = False
            for _ in range(self.accumulation):
                batch = next(self._data(), END)
                if batch is END:
                    self._iterator, ended = None, True
                    break
                batches.append(batch)
            self._fetched = _Fetched(batches, rng_state, data_state, ended)
        return self._fetched
