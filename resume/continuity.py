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

from dataclasses import dataclass, field, fields
from typing import Any

from .checksum import digest_parts
from .errors import ContinuityError, ManifestError
from .layout import global_moments
from .text import short

__all__ = ["Expectation", "compare", "compare_config", "merge_batch_descriptions", "state_changes"]


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
    """Per rank, per optimizer: a fingerprint of the moments (Adapter.optimizer_fingerprint)."""
    rng: list[str] = field(default_factory=list)
    """Per rank: a digest of every generator's state."""
    world_size: int = 1
    lr_groups: list[str] = field(default_factory=list)
    """A label per param group, in the order of each ``lr_ahead`` row (empty: positional)."""
    structure: list[dict] = field(default_factory=list)
    """Per optimizer: class, param groups, their parameters and settings (resume.changes)."""
    state: list[dict] = field(default_factory=list)
    """Per rank, each registered object's state digest (``Coordinator.register``); one row when
    every rank had the same."""
    state_shown: dict = field(default_factory=dict)
    """Rank 0's registered objects: kind and a few values (``resume inspect``, messages)."""

    before_replicas: dict | None = field(default=None, repr=False, compare=False)
    """Not recorded: the next batch as a manifest written before replicas were merged records it
    (every rank's pairs, replicas included); set by ``assemble`` only when it differs."""

    def to_dict(self) -> dict:
        # Shallow: the values are plain JSON data already (asdict's deep copy costs rank 0 time in
        # proportion to the ranks at every save).
        return {name: getattr(self, name) for name in _RECORDED}

    @classmethod
    def assemble(cls, parts: list[dict], *, world_size: int, to_compare: bool = False) -> Expectation:
        """From every rank's ``part`` (Adapter-side, ``expectation_part``): LR, schedule and step
        counts are the same on every rank (rank 0's stand); batches, moments and RNG are per rank.
        ``to_compare``: after a restart, with the next batch as older manifests record it too."""
        first = parts[0]
        batches = [p["batch"] for p in parts]
        merged = merge_batch_descriptions(batches)
        state = [p.get("state") or {} for p in parts]
        return cls(next_batch=merged, state=state[:1] if all(r == state[0] for r in state) else state,
                   state_shown=first.get("state_shown") or {},
                   lr_ahead=first["lr_ahead"], lr_groups=first["lr_groups"], structure=first["structure"],
                   schedule=first["schedule"], optimizer_steps=first["optimizer_steps"],
                   optimizer=[p["optimizer"] for p in parts], rng=[p["rng"] for p in parts],
                   world_size=world_size,
                   before_replicas=(merge_batch_descriptions(batches, replicas=False)
                                    if to_compare and merged is not None and merged.get("replicas") else None))

    @classmethod
    def from_dict(cls, data: Any, *, source: str) -> Expectation:
        if not isinstance(data, dict):
            raise ManifestError(f"{source}: expectation: expected an object, actual {type(data).__name__}")
        known = set(_RECORDED)
        if "lr_ahead" not in data or "next_batch" not in data:
            raise ManifestError(f"{source}: expectation: expected fields next_batch and lr_ahead, "
                                f"actual {sorted(data)}")
        _check_shape(data, source)
        return cls(**{k: v for k, v in data.items() if k in known})


_RECORDED = tuple(f.name for f in fields(Expectation) if f.name != "before_replicas")


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _check_shape(data: dict, source: str) -> None:
    """The types the comparison and the CLI rely on; a hand-edited manifest fails here."""
    def bad(field_name: str, expected: str) -> ManifestError:
        return ManifestError(f"{source}: expectation.{field_name}: expected {expected}, "
                             f"actual {short(data.get(field_name), 80)}")

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
    for name in ("schedule", "optimizer", "rng", "structure"):
        if not isinstance(data.get(name, []), list):
            raise bad(name, "a list")
    state = data.get("state", [])
    if not (isinstance(state, list) and all(isinstance(r, dict) and all(isinstance(v, str) for v in r.values())
                                            for r in state)):
        raise bad("state", "per rank, an object of digests")
    shown = data.get("state_shown", {})
    if not (isinstance(shown, dict) and all(isinstance(v, dict) and isinstance(v.get("values", {}), dict)
                                            for v in shown.values())):
        raise bad("state_shown", "an object of registered objects")
    labels = data.get("lr_groups", [])
    if not (isinstance(labels, list) and all(isinstance(x, str) for x in labels)
            and (not labels or all(len(r) == len(labels) for r in lr))):
        raise bad("lr_groups", "a list of labels, one per LR of each lr_ahead row")
    structure = data.get("structure", [])
    if not all(isinstance(o, dict) and isinstance(o.get("groups", []), list)
               and all(isinstance(g, dict) and isinstance(g.get("settings", {}), dict) for g in o.get("groups", []))
               for o in structure):
        raise bad("structure", "a list of optimizers with param groups")
    for rank in data.get("optimizer", []):
        if not (isinstance(rank, list) and all(isinstance(o, dict) for o in rank)):
            raise bad("optimizer", "per rank, a list of objects")
        for o in rank:
            if _is_bits_fingerprint(o) and not all(
                    isinstance(part := o[kind], dict) and isinstance(part.get("numel"), int)
                    and isinstance(part.get("bits"), dict)
                    and all(isinstance(v, int) and not isinstance(v, bool) for v in part["bits"].values())
                    for kind in ("replicated", "sharded")):
                raise bad("optimizer", "per optimizer, replicated and sharded moment sums (integers)")


def merge_batch_descriptions(per_rank: list[list[tuple[int, str]]], *, replicas: bool = True) -> dict | None:
    """Combine each rank's (sample id, content digest) pairs into one global-batch record.

    Sorted by sample id, so the record is the same for any data-parallel size. A batch
    without sample ids (negative ids: rows by their position, ``Adapter.describe_batch``)
    is recorded by content alone: no ids, the digest of its rows' digests in sorted order.

    Ranks that describe exactly the same batch (the tensor- and pipeline-parallel peers of
    one data-parallel rank read the same samples) are replicas: their batch counts once, and
    ``replicas`` records how many descriptions were folded so (64 of every 64 at TP8 x PP8).
    A sample two data-parallel ranks both read (a sampler's padding) still counts twice:
    only whole descriptions are folded. ``replicas=False`` is the record as manifests written
    before the folding have it (every rank's pairs).
    """
    if replicas:
        distinct = {tuple(map(tuple, rank)) for rank in per_rank if rank}
        folded = sum(1 for rank in per_rank if rank) - len(distinct)
        per_rank = [list(rank) for rank in distinct]
    pairs = sorted(tuple(p) for rank in per_rank for p in rank)
    if not pairs:
        return None
    if any(int(i) < 0 for i, _ in pairs):
        rows = sorted(d for _, d in pairs)
        record = {"ids": [], "digest": digest_parts(rows), "samples": len(rows)}
    else:
        ids = [int(i) for i, _ in pairs]
        record = {"ids": ids, "digest": digest_parts(f"{i}:{d}" for i, d in pairs), "samples": len(ids)}
    if replicas and folded:
        record["replicas"] = folded
    return record


def _first_difference(a: list, b: list) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def compare(expected: Expectation, actual: Expectation, *, resized: bool = False,
            stages: tuple[list[int], list[int]] | None = None) -> None:
    """Raise ContinuityError for the first item that differs (order: cheapest to explain first).

    ``resized``: a restart on another data-parallel size may change the per-rank
    RNG streams and the per-rank layout of optimizer shards; those are then
    compared only as totals (moments must still be there), everything else exactly.
    ``stages``: after a layout change (``resume.layout``), each rank's pipeline stage as saved
    and now: the moments are compared as totals over the global tensors, whatever the layout.
    """
    if expected.schedule != actual.schedule:
        for i, (e, a) in enumerate(zip(expected.schedule, actual.schedule)):
            for key in sorted(set(e) | set(a)):
                if e.get(key) != a.get(key):
                    raise ContinuityError(f"schedule[{i}].{key}", short(e.get(key)), short(a.get(key)),
                                          "the scheduler was rebuilt with another configuration")
        raise ContinuityError("schedule", f"{len(expected.schedule)} schedulers",
                              f"{len(actual.schedule)} schedulers")
    if expected.optimizer_steps != actual.optimizer_steps:
        raise ContinuityError("optimizer.steps", expected.optimizer_steps, actual.optimizer_steps)
    if stages is not None and _comparable_globally(expected, actual):
        _compare_global_moments(expected, actual, stages)
    else:
        _compare_moments(expected, actual, resized=resized)
    changed = state_changes(expected, actual, resized=resized)
    if changed:
        raise changed[0][1]
    if expected.lr_ahead != actual.lr_ahead:
        k = _first_difference(expected.lr_ahead, actual.lr_ahead)
        e = expected.lr_ahead[k] if k is not None and k < len(expected.lr_ahead) else None
        a = actual.lr_ahead[k] if k is not None and k < len(actual.lr_ahead) else None
        raise ContinuityError(f"lr_ahead[+{k}]", e, a,
                              "the learning-rate schedule does not continue where it stopped")
    if not resized and expected.rng != actual.rng:
        k = _first_difference(expected.rng, actual.rng)
        raise ContinuityError(f"rng (rank {k})", short(expected.rng), short(actual.rng),
                              "a generator was re-seeded or not restored")
    _compare_batch(expected.next_batch, actual.next_batch, actual.before_replicas)


def state_changes(expected: Expectation, actual: Expectation, *,
                  resized: bool = False) -> list[tuple[str, ContinuityError]]:
    """The registered objects whose state after the load is not the state saved: (name, its
    error; item ``state.NAME.FIELD`` where one of the values shown differs, else ``state.NAME``).
    Another data-parallel size: compared only where every rank saved the same state."""
    if not expected.state:
        return []
    saved, live = expected.state, actual.state
    if len(saved) == 1 and len(live) > 1:
        saved = saved * len(live)
    elif len(live) == 1 and len(saved) > 1:
        live = live * len(saved)
    if resized:
        if any(row != expected.state[0] for row in expected.state):
            return []  # per-rank state (a sharded EMA) on another size: not comparable rank by rank
        saved = [expected.state[0]] * len(live)
    out: list[tuple[str, ContinuityError]] = []
    for name in dict.fromkeys(n for row in saved for n in row):
        rank = next((r for r, (e, a) in enumerate(zip(saved, live)) if e.get(name) != a.get(name)), None)
        if rank is not None:
            out.append((name, _state_error(name, rank, saved[rank].get(name), live[rank].get(name), expected,
                                           actual)))
    return out


def _state_error(name: str, rank: int, saved: str | None, live: str | None, expected: Expectation,
                 actual: Expectation) -> ContinuityError:
    hint = (f"the registered object's state after the load is not the state saved: its load_state_dict "
            f"does not restore it, or the program changed it; accept_changes=['state.{name}'] keeps it")
    e_values = expected.state_shown.get(name, {}).get("values", {})
    a_values = actual.state_shown.get(name, {}).get("values", {})
    for key in dict.fromkeys([*e_values, *a_values]):
        if e_values.get(key) != a_values.get(key):
            return ContinuityError(f"state.{name}.{key}", e_values.get(key), a_values.get(key), hint)
    return ContinuityError(f"state.{name} (rank {rank})", f"digest {saved}", f"digest {live}", hint)


def matched(expected: Expectation, *, resized: bool = False, relaid: bool = False) -> str:
    """What ``compare`` found equal, in words, for the line a restore prints (``relaid``: after a
    layout change, the moments as totals over the global tensors)."""
    items = [f"{len(expected.schedule)} scheduler(s)", f"optimizer steps {expected.optimizer_steps}"]
    if expected.optimizer and expected.optimizer[0]:
        items.append(f"moments of {len(expected.optimizer[0])} optimizer(s)"
                     + (" (as totals over the global tensors: another layout)" if relaid else
                        " (as totals: another data-parallel size)" if resized else ""))
    if expected.state_shown or (expected.state and expected.state[0]):
        names = sorted(expected.state_shown or expected.state[0])
        items.append(f"registered state {', '.join(names)}")
    items.append(f"LR of the next {len(expected.lr_ahead)} updates")
    items.append("RNG not compared (another data-parallel size)" if resized else
                 f"RNG of {len(expected.rng)} rank(s)")
    batch = expected.next_batch
    items.append("next batch: end of data (not compared)" if batch is None else
                 f"next batch ({batch['samples']} samples, "
                 f"{'by sample id and content' if batch['ids'] else 'by content: no sample ids'})")
    return ", ".join(items)


def _is_bits_fingerprint(record: Any) -> bool:
    return isinstance(record, dict) and "replicated" in record and "sharded" in record


def _bits_total(parts: list[dict]) -> dict:
    """Sharded parts summed over ranks (mod 2**32): the same for any sharding."""
    bits: dict[str, int] = {}
    numel = 0
    for part in parts:
        for key, value in part.get("bits", {}).items():
            bits[key] = (bits.get(key, 0) + int(value)) & 0xFFFFFFFF
        numel += int(part.get("numel", 0))
    return {"bits": bits, "numel": numel}


def _describe_bits(part: dict) -> str:
    bits = ", ".join(f"{k} {v:08x}" for k, v in sorted(part.get("bits", {}).items())) or "none"
    return f"moments {bits} over {part.get('numel', 0)} values"


def _moment_hint(actual: dict) -> str:
    values = actual.get("bits", {})
    if actual.get("numel", 0) and not any(values.values()):
        return "optimizer state not loaded or re-initialised (every moment is zero)"
    if not actual.get("numel", 0):
        return "optimizer state not loaded or re-initialised (no moments)"
    return "the moments differ from those saved"


def _compare_moments(expected: Expectation, actual: Expectation, *, resized: bool) -> None:
    """Moments as saved. Same size: every rank's fingerprint exactly. Another data-parallel size:
    sharded moments as totals over the ranks, replicated ones on every rank as on rank 0 then."""
    if not expected.optimizer:
        return
    if not all(_is_bits_fingerprint(o) for r in expected.optimizer for o in r):
        # Recorded by an older resume (a host-side digest): not comparable with ours.
        return
    n_opt = len(expected.optimizer[0])
    for i in range(n_opt):
        saved = [r[i] for r in expected.optimizer if i < len(r)]
        live = [r[i] for r in actual.optimizer if i < len(r)]
        if not resized:
            for rank, (e, a) in enumerate(zip(saved, live)):
                for kind in ("replicated", "sharded"):
                    if e[kind] != a.get(kind):
                        raise ContinuityError(f"optimizer[{i}].moments (rank {rank}, {kind})",
                                              _describe_bits(e[kind]), _describe_bits(a.get(kind, {})),
                                              _moment_hint(a.get(kind, {})))
            continue
        e_total, a_total = _bits_total([e["sharded"] for e in saved]), _bits_total([a["sharded"] for a in live])
        if e_total != a_total:
            raise ContinuityError(f"optimizer[{i}].moments (sharded, all ranks)", _describe_bits(e_total),
                                  _describe_bits(a_total), _moment_hint(a_total))
        for rank, a in enumerate(live):
            if saved[0]["replicated"] != a["replicated"]:
                raise ContinuityError(f"optimizer[{i}].moments (rank {rank}, replicated)",
                                      _describe_bits(saved[0]["replicated"]), _describe_bits(a["replicated"]),
                                      _moment_hint(a["replicated"]))


def _comparable_globally(expected: Expectation, actual: Expectation) -> bool:
    return bool(expected.optimizer) and all(_is_bits_fingerprint(o) for e in (expected, actual)
                                            for r in e.optimizer for o in r)


def _compare_global_moments(expected: Expectation, actual: Expectation, stages: tuple[list[int], list[int]]) -> None:
    """Per optimizer, the moments' bit sums over the global tensors (``resume.layout.global_moments``),
    saved and now: equal on any layout the shards were loaded on exactly; the sums weighted by
    name too where both sides recorded them."""
    saved, live = global_moments(expected.optimizer, stages[0]), global_moments(actual.optimizer, stages[1])
    for i, (e, a) in enumerate(zip(saved, live)):
        if e["bits"] != a["bits"] or e["numel"] != a["numel"]:
            raise ContinuityError(f"optimizer[{i}].moments (global tensors, all ranks)", _describe_bits(e),
                                  _describe_bits(a), _moment_hint(a) + " after the layout change")
        if "named" in e and "named" in a and e["named"] != a["named"]:
            raise ContinuityError(f"optimizer[{i}].moments (by parameter name, all ranks)",
                                  _describe_bits({"bits": e["named"], "numel": e["numel"]}),
                                  _describe_bits({"bits": a["named"], "numel": a["numel"]}),
                                  "the same moments, under other parameters: the layout change loaded "
                                  "a parameter's moments into another")
    if len(saved) != len(live):
        raise ContinuityError("optimizer.moments", f"{len(saved)} optimizers", f"{len(live)} optimizers")


def _compare_batch(expected: dict | None, actual: dict | None, before_replicas: dict | None = None) -> None:
    if expected is not None and before_replicas is not None and "replicas" not in expected:
        actual = before_replicas  # a manifest written before replicas were folded records them all
    if expected is None:
        # Saved at the end of a pass over the data: what the next pass starts
        # with is the loader's business (a new epoch, a new shuffle).
        return
    if actual is None:
        raise ContinuityError("next_batch", short(expected), "end of data",
                              "the data stream ended where it had more")
    if expected["ids"] != actual["ids"]:
        raise ContinuityError("next_batch.ids", short(expected["ids"], 80), short(actual["ids"], 80),
                              "the data stream does not continue where it stopped")
    if expected["digest"] != actual["digest"]:
        raise ContinuityError("next_batch.digest", expected["digest"], actual["digest"],
                              "same sample ids, different content: the data set changed" if expected["ids"]
                              else "the batches carry no sample ids and their content differs: the "
                                   "data stream does not continue where it stopped, or the data changed")


def compare_config(expected: dict, actual: dict, *, source: str = "config") -> None:
    for key in sorted(set(expected) | set(actual)):
        if expected.get(key) != actual.get(key):
            raise ContinuityError(f"{source}.{key}", short(expected.get(key)), short(actual.get(key)))
