"""Loss spikes in the update journal: the updates whose loss or gradient norm stand out.

The rule (``resume journal --spikes``), per branch, oldest first: an update is a spike when
its loss or gradient norm is not finite, or when, with at least ``min_history`` earlier
updates in its window, its loss exceeds ``loss_factor`` x the median loss of the last
``window`` updates before it that were not spikes themselves, or its gradient norm exceeds
``grad_factor`` x their median gradient norm. Updates without a loss or norm are passed over
for that quantity.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Any

__all__ = ["SpikeRule", "find_spikes"]


@dataclass(frozen=True)
class SpikeRule:
    window: int = 20
    min_history: int = 5
    loss_factor: float = 1.5
    grad_factor: float = 4.0


def _value(record: dict, key: str) -> float | None:
    v = record.get(key)
    if isinstance(v, str):
        return {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}.get(v)
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return float(v)
    return None


def find_spikes(records: list[dict], rule: SpikeRule = SpikeRule()) -> list[dict[str, Any]]:
    """Each spike as ``{"record", "why"}``, oldest first."""
    calm: list[dict] = []
    out = []
    for r in records:
        why = []
        for key, factor in (("loss", rule.loss_factor), ("grad_norm", rule.grad_factor)):
            value = _value(r, key)
            if value is None:
                continue
            if not math.isfinite(value):
                why.append(f"{key} {r[key]}")
                continue
            history = [h for h in (_value(c, key) for c in calm[-rule.window:]) if h is not None]
            if len(history) >= rule.min_history:
                median = statistics.median(history)
                if median > 0 and value > factor * median:
                    why.append(f"{key} {value:.4g} > {factor:g} x median {median:.4g} of the last {len(history)}")
        if why:
            out.append({"record": r, "why": "; ".join(why)})
        else:
            calm.append(r)
    return out
