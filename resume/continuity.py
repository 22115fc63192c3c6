"""The Expectation recorded at save time, and its comparison after a restart.

At save time the coordinator records what the next iteration must look like:
the next global batch (sample ids and a digest of their content), the LR of
every param group for the next K successful updates, the optimizer step
counts and a fingerprint of the moments, a digest of every generator, the
schedule as declared, and the config (global batch, sequence length, seed...).
On restore each item is recomputed from the live, restored objects; the first
difference raises ``ContinuityError`` naming the item, before any update.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from .checksum import digest_parts
from .errors import ContinuityError, ManifestError

__all__ = ["Expectation", "compare", "compare_config", "merge_batch_descriptions"]


@dataclass(kw_only=True)
class Expectation:
    next_batch: dict | None
    """``{"ids": [...], "digest": str, "samples": n}`` of the next global batch; None at end of data."""
    lr_ahead: list[list[float]]
    """LR of every param group (all optimizers, in order) for the next K successful updates."""
    schedule: list[dict] = field(default_factory=list)
    """The schedulers' static configuration (lengths, peaks, ...), as declared by the code."""
    optimizer_steps: list[int] = field(default_factory=list)
    """Step count of every optimizer."""
    optimizer: list[list[dict]] = field(default_factory=list)
    """Per rank, per optimizer: a fingerprint of the moments (digest, abs-sum, element count)."""
    rng: list[str] = field(default_factory=list)
    """Per rank: a digest of every generator's state."""
    world_size: int = 1

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Any, *, source: str) -> Expectation:
        if not isinstance(data, dict):
            raise ManifestError(f"{source}: expectation: expected an object, actual {type(data).__name__}")
        known = set(cls.__dataclass_fields__)
        if "lr_ahead" not in data or "next_batch" not in data:
            raise ManifestError(f"{source}: expectation: expected fields next_batch and lr_ahead, "
                                f"actual {sorted(data)}")
        _check_shape(data, source)
        return cls(**{k: v for k, v in data.items() if k in known})


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _check_shape(data: dict, source: str) -> None:
    """The types the comparison and the CLI rely on; a hand-edited manifest fails here."""
    def bad(field_name: str, expected: str) -> ManifestError:
        return ManifestError(f"{source}: expectation.{field_name}: expected {expected}, "
                             f"actual {data.get(field_name)!r:.80}")

    lr = data["lr_ahead"]
    if not (isinstance(lr, list) and all(isinstance(r, list) and all(map(_is_number, r)) for r in lr)):
        raise bad("lr_ahead", "a list of lists of numbers")
    nb = data["next_batch"]
    if nb is not None and not (isinstance(nb, dict) and isinstance(nb.get("ids"), list)
                               and isinstance(nb.get("digest"), str)
                               and isinstance(nb.get("samples"), int)):
        raise bad("next_batch", "null or an object with ids, digest and samples")
    steps = data.get("optimizer_steps", [])
    if not (isinstance(steps, list) and all(isinstance(s, int) for s in steps)):
        raise bad("optimizer_steps", "a list of integers")
    for name in ("schedule", "optimizer", "rng"):
        if not isinstance(data.get(name, []), list):
            raise bad(name, "a list")


def merge_batch_descriptions(per_rank: list[list[tuple[int, str]]]) -> dict | None:
    """Combine each rank's (sample id, content digest) pairs into one global-batch record.

    Sorted by sample id, so the record is the same for any data-parallel size.
    """
    pairs = sorted(p for rank in per_rank for p in rank)
    if not pairs:
        return None
    ids = [int(i) for i, _ in pairs]
    return {"ids": ids, "digest": digest_parts(f"{i}:{d}" for i, d in pairs), "samples": len(ids)}


def _short(value: Any, limit: int = 120) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _first_difference(a: list, b: list) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def compare(expected: Expectation, actual: Expectation, *, resized: bool = False) -> None:
    """Raise ContinuityError for the first item that differs (order: cheapest to explain first).

    ``resized``: a restart on another data-parallel size may change the per-rank
    RNG streams and the per-rank layout of optimizer shards; those are then
    compared only as totals (moments must still be there), everything else exactly.
    """
    if expected.schedule != actual.schedule:
        for i, (e, a) in enumerate(zip(expected.schedule, actual.schedule)):
            for key in sorted(set(e) | set(a)):
                if e.get(key) != a.get(key):
                    raise ContinuityError(f"schedule[{i}].{key}", _short(e.get(key)), _short(a.get(key)),
                                          "the scheduler was rebuilt with another configuration")
        raise ContinuityError("schedule", f"{len(expected.schedule)} schedulers",
                              f"{len(actual.schedule)} schedulers")
    if expected.optimizer_steps != actual.optimizer_steps:
        raise ContinuityError("optimizer.steps", expected.optimizer_steps, actual.optimizer_steps)
    if resized:
        _compare_moment_totals(expected, actual)
    else:
        for rank, (e_rank, a_rank) in enumerate(zip(expected.optimizer, actual.optimizer)):
            for i, (e, a) in enumerate(zip(e_rank, a_rank)):
                if e != a:
                    raise ContinuityError(
                        f"optimizer[{i}].moments (rank {rank})",
                        f"digest {e.get('digest')} |sum| {e.get('abs_sum')!r} over {e.get('numel')} values",
                        f"digest {a.get('digest')} |sum| {a.get('abs_sum')!r} over {a.get('numel')} values",
                        "optimizer state not loaded or re-initialised" if not a.get("abs_sum") else "")
    if expected.lr_ahead != actual.lr_ahead:
        k = _first_difference(expected.lr_ahead, actual.lr_ahead)
        e = expected.lr_ahead[k] if k is not None and k < len(expected.lr_ahead) else None
        a = actual.lr_ahead[k] if k is not None and k < len(actual.lr_ahead) else None
        raise ContinuityError(f"lr_ahead[+{k}]", e, a,
                              "the learning-rate schedule does not continue where it stopped")
    if not resized and expected.rng != actual.rng:
        k = _first_difference(expected.rng, actual.rng)
        raise ContinuityError(f"rng (rank {k})", _short(expected.rng), _short(actual.rng),
                              "a generator was re-seeded or not restored")
    _compare_batch(expected.next_batch, actual.next_batch)


def _compare_moment_totals(expected: Expectation, actual: Expectation) -> None:
    """On another data-parallel size shards differ, but moments that were there must still be."""
    n_opt = max((len(r) for r in expected.optimizer), default=0)
    for i in range(n_opt):
        had = sum(r[i].get("abs_sum", 0.0) for r in expected.optimizer if i < len(r))
        has = sum(r[i].get("abs_sum", 0.0) for r in actual.optimizer if i < len(r))
        if had > 0 and has == 0:
            raise ContinuityError(f"optimizer[{i}].moments", f"|sum| {had!r} over all ranks",
                                  "|sum| 0.0", "optimizer state not loaded or re-initialised")


def _compare_batch(expected: dict | None, actual: dict | None) -> None:
    if expected is None:
        # Saved at the end of a pass over the data: what the next pass starts
        # with is the loader's business (a new epoch, a new shuffle).
        return
    if actual is None:
        raise ContinuityError("next_batch", _short(expected), "end of data",
                              "the data stream ended where it had more")
    if expected["ids"] != actual["ids"]:
        raise ContinuityError("next_batch.ids", _short(expected["ids"], 80), _short(actual["ids"], 80),
                              "the data stream does not continue where it stopped")
    if expected["digest"] != actual["digest"]:
        raise ContinuityError("next_batch.digest", expected["digest"], actual["digest"],
                              "same sample ids, different content: the data set changed")


def compare_config(expected: dict, actual: dict, *, source: str = "config") -> None:
    for key in sorted(set(expected) | set(actual)):
        if expected.get(key) != actual.get(key):
            raise ContinuityError(f"{source}.{key}", _short(expected.get(key)), _short(actual.get(key)))
