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
    batch: Any
    rng_state: dict
    data_state: Any


class NextIteration:
    """This rank's next batch and its share of the Expectation (no collectives)."""

    def __init__(self, adapter: Adapter, rng: RngRegistry, *, lr_lookahead: int) -> None:
        self.adapter = adapter
        self.rng = rng
        self.lr_lookahead = lr_lookahead
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
        """The next batch for the loop (the one fetched early, if any); END at the end of a pass."""
        if self._fetched is not None:
            batch, self._fetched = self._fetched.batch, None
        else:
            batch = next(self._data(), END)
        if batch is END:
            self._iterator = None  # the next pass starts afresh
        else:
            self._drawn = True
        return batch

    def rank_state(self) -> dict:
        """What a save writes for this rank: RNG and data state from before the next batch."""
        ahead = self._fetch()
        return {"rng": ahead.rng_state, "data": ahead.data_state, "adapter": self.adapter.state_dict()}

    def expectation_part(self, schedule: list[dict] | None = None, *, moments: bool = True) -> dict:
        """This rank's share of the Expectation (``Expectation.assemble`` joins the ranks')."""
        ahead = self._fetch()
        adapter = self.adapter
        return {
            "batch": [] if ahead.batch is END else adapter.describe_batch(ahead.batch),
            "rng": RngRegistry.digest(ahead.rng_state),
            "optimizer": adapter.optimizer_fingerprint() if moments else None,
            "lr_ahead": adapter.lr_ahead(self.lr_lookahead),
            "lr_groups": adapter.lr_groups(),
            "schedule": adapter.describe_schedule() if schedule is None else schedule,
            "structure": adapter.describe_structure(),
            "optimizer_steps": adapter.optimizer_steps(),
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
            return _Fetched(END, self.rng.capture(), None)
        if self._fetched is None:
            rng_state = self.rng.capture()
            data_state = self.adapter.data_state()
            batch = next(self._data(), END)
            if batch is END:
                self._iterator = None
            self._fetched = _Fetched(batch, rng_state, data_state)
        return self._fetched
