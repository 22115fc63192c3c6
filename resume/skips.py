"""Declared data skips: ranges of the run's sample numbering that a rewind passes over.

The run's own sample numbering is the data position: sample ``p`` is the ``p``-th sample the
run's data stream gives (``TrainState.samples_read`` is the position of the next batch).
A rewind may declare ranges ``[start, end)`` to pass over; a batch then takes the next samples
outside them, and the samples passed over count as read and not trained on
(``TrainState.samples_skipped``). The coordinator counts with ``Skips.take`` and the sampler
(``resume.adapters.data.GlobalPositionSampler``) reads with ``Skips.spans``: one arithmetic.
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["Skips"]


class Skips:
    """Disjoint ``[start, end)`` ranges of sample positions, sorted."""

    __slots__ = ("ranges",)

    def __init__(self, ranges: Iterable[Iterable[int]] = ()) -> None:
        merged: list[tuple[int, int]] = []
        for start, end in sorted((int(a), int(b)) for a, b in ranges):
            if not 0 <= start < end:
                raise ValueError(f"skip range: expected 0 <= start < end, actual [{start}, {end})")
            if merged and start <= merged[-1][1]:
                merged[-1] = (merged[-1][0], max(end, merged[-1][1]))
            else:
                merged.append((start, end))
        self.ranges: tuple[tuple[int, int], ...] = tuple(merged)

    def __bool__(self) -> bool:
        return bool(self.ranges)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Skips) and other.ranges == self.ranges

    def __repr__(self) -> str:
        return f"Skips({[list(r) for r in self.ranges]})"

    def to_list(self) -> list[list[int]]:
        return [list(r) for r in self.ranges]

    def spans(self, position: int, n: int) -> tuple[list[tuple[int, int]], int]:
        """The ``n`` positions a batch starting at ``position`` takes, as ``[start, end)`` spans
        outside every range, and the position after them (where the next batch starts)."""
        spans: list[tuple[int, int]] = []
        need, p = n, position
        for start, end in self.ranges:
            if end <= p:
                continue
            if need == 0:
                break
            if start > p:
                free = min(start - p, need)
                spans.append((p, p + free))
                need -= free
                p += free
                if need == 0:
                    break
            p = max(p, end)  # inside a range (or at its start): past it
        if need:
            spans.append((p, p + need))
            p += need
        return spans, p

    def take(self, position: int, n: int) -> tuple[int, int, int]:
        """(the batch's first position, the position after it, samples passed over before and
        within it) for a batch of ``n`` samples from ``position``."""
        if not self.ranges:
            return position, position + n, 0
        spans, end = self.spans(position, n)
        first = spans[0][0] if spans else end
        return first, end, (end - position) - n

    def overlaps(self, start: int, end: int) -> bool:
        return any(a < end and start < b for a, b in self.ranges)
