"""TrainState: the counters, kept separately, with their invariants."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .errors import InvariantError, ManifestError
from .text import number, short

__all__ = ["COUNTER_LIMIT", "TrainState"]

COUNTER_LIMIT = 2**63
"""Counters read from a file are below this (an int64): a larger one is damage, and a
4,000-digit one would make every message that prints it fail."""


@dataclass(kw_only=True, slots=True)
class TrainState:
    """The counters persisted in every manifest and checked on every restore."""

    iteration: int = 0
    """Global batches processed = ``updates_successful + updates_skipped``."""
    samples_read: int = 0
    """Samples taken from the data stream, skipped iterations included."""
    updates_successful: int = 0
    """Iterations whose optimizer update was applied; the scheduler advances only on these."""
    updates_skipped: int = 0
    """Iterations whose update was skipped; their samples still count as read."""
    samples_skipped: int = 0
    """Samples read from the stream and not trained on: passed over by a rewind's declared skip
    (``resume rewind --skip-samples``). Counted in ``samples_read`` too, so ``samples_read`` is
    the data position (the next batch starts there) and the run's own sample numbering."""
    tokens_read: int | None = None
    """Optional: input tokens read."""
    tokens_in_loss: int | None = None
    """Optional: tokens that took part in the loss (padding and masked positions excluded)."""

    def advance(self, *, applied: bool, samples: int, tokens: int | None = None,
                tokens_in_loss: int | None = None, passed_over: int = 0) -> None:
        """Count one iteration: successful when ``applied``, skipped otherwise. ``passed_over``:
        samples a declared skip passed over before this batch (read, not trained on)."""
        self.iteration += 1
        self.samples_read += samples + passed_over
        self.samples_skipped += passed_over
        if applied:
            self.updates_successful += 1
        else:
            self.updates_skipped += 1
        if tokens is not None:
            self.tokens_read = (self.tokens_read or 0) + tokens
        if tokens_in_loss is not None:
            self.tokens_in_loss = (self.tokens_in_loss or 0) + tokens_in_loss

    def check_invariants(self, *, global_batch: int | None = None, where: str = "train state") -> None:
        """Raise InvariantError naming the counter when the counters contradict each other."""
        for name in ("iteration", "samples_read", "updates_successful", "updates_skipped", "samples_skipped"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise InvariantError(f"{where}: {name}: expected a non-negative integer, actual {short(value)}")
        total = self.updates_successful + self.updates_skipped
        if self.iteration != total:
            raise InvariantError(
                f"{where}: iteration: expected updates_successful + updates_skipped = {number(total)}, "
                f"actual {number(self.iteration)}")
        if global_batch is not None and self.samples_read != self.iteration * global_batch + self.samples_skipped:
            skipped = f" + samples_skipped {number(self.samples_skipped)}" if self.samples_skipped else ""
            raise InvariantError(
                f"{where}: samples_read: expected iteration x global_batch{' + samples_skipped' if skipped else ''} = "
                f"{number(self.iteration)} x {number(global_batch)}{skipped} = "
                f"{number(self.iteration * global_batch + self.samples_skipped)}, actual {number(self.samples_read)}")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: object, *, source: str = "manifest") -> TrainState:
        if not isinstance(data, dict):
            raise ManifestError(f"{source}: train_state: expected an object, actual {type(data).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        for required in ("iteration", "samples_read", "updates_successful", "updates_skipped"):
            if required not in data:
                raise ManifestError(f"{source}: train_state.{required}: expected an integer, actual missing")
        unknown = set(data) - known
        if unknown:
            raise ManifestError(f"{source}: train_state: unknown fields {sorted(unknown)}")
        optional = {"tokens_read", "tokens_in_loss"}
        for name, value in data.items():
            if value is None and name in optional:
                continue
            if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < COUNTER_LIMIT:
                raise ManifestError(f"{source}: train_state.{name}: expected a non-negative "
                                    f"integer below 2**63, actual {short(value)}")
        return cls(**data)
