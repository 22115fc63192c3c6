"""The parallel layout a run trains on, as each manifest records it, and what a change of it means.

Every save records the layout (``topology.layout`` of the manifest): the data-parallel degrees
(replicate and shard), tensor, pipeline, context and expert degrees, how the parameters are
placed (DTensor placements over their mesh, or plain tensors), the pipeline split (the distinct
sets of state names the ranks hold, with which ranks hold which) and, where a format decides
it, which degrees a checkpoint cannot be loaded at another value of (``fixed``)::

    saved = ParallelLayout.from_dict(manifest.topology["layout"], source=url)
    live = assemble_layout(parts, world_size=4)     # every rank's ``Adapter.layout_part()``
    change = layout_change(saved, live)             # None: the same layout
                                                    # ContinuityError("layout", ...): refused

A change is let through where the checkpoint's shards load exactly on the new layout
(``torch.distributed.checkpoint`` reshards global tensors by name: another DP or TP degree,
FSDP instead of DDP, a DTensor of other placements); it is refused, before anything is read,
where per-stage state cannot follow (another pipeline split), where the program shards by its
own scheme, or where the saved format fixes a degree (a Megatron format). The moments are then
compared as totals over the global tensors (``global_moments``), the same for any layout.
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass, field, replace
from typing import Any

from .errors import ContinuityError, ManifestError, UsageError
from .text import short

__all__ = ["DEGREES", "LayoutChange", "ParallelLayout", "Stage", "assemble_layout", "global_moments",
           "layout_change", "layout_topology", "name_weight", "stage_digest", "stated_layout"]

DEGREES = ("dp_replicate", "dp_shard", "tensor", "pipeline", "context", "expert")
"""The degrees a layout names, besides the world size (data-parallel = replicate x shard)."""

STATED_KEYS = (*DEGREES, "scheme")
"""What a program may state of its layout (``NativeTorchAdapter(parallel=...)``)."""

_LABELS = {"dp_replicate": "replicate", "dp_shard": "shard", "tensor": "TP", "pipeline": "PP",
           "context": "CP", "expert": "EP"}
_NAME_CAP = 200  # a state name kept in the record (a stage's first and last), characters
_PLACEMENTS_CAP = 64  # placement kinds kept in the record


def stage_digest(names: Any) -> str:
    """The digest of a set of state names: which pipeline stage a rank holds."""
    h = hashlib.sha256()
    for name in sorted(names):
        h.update(name.encode("utf-8", "surrogatepass") + b"\0")
    return h.hexdigest()[:16]


@functools.lru_cache(maxsize=1 << 16)
def name_weight(name: str) -> int:
    """An odd 32-bit weight per state name: a moment's bit sum times its name's weight, summed,
    tells a moment loaded under another name from the right one (``global_moments``)."""
    return int.from_bytes(hashlib.sha256(name.encode("utf-8", "surrogatepass")).digest()[:4], "little") | 1


@dataclass(frozen=True)
class Stage:
    """One pipeline stage: the set of state names some ranks hold."""

    digest: str
    names: int
    first: str = ""
    last: str = ""

    def describe(self) -> str:
        return f"{self.first} .. {self.last} ({self.names} names)" if self.first else f"{self.names} names"

    def to_dict(self) -> dict:
        return {"digest": self.digest, "names": self.names, "first": self.first, "last": self.last}


@dataclass(frozen=True)
class ParallelLayout:
    """The parallel layout of a run, as recorded in each manifest (``topology.layout``)."""

    world_size: int
    dp_replicate: int = 1
    dp_shard: int = 1
    tensor: int = 1
    pipeline: int = 1
    context: int = 1
    expert: int = 1
    how: str = "read"
    """``read`` from the objects (device meshes, DTensor specs, DDP, FSDP); ``stated`` by the
    program where it cannot be read; ``assumed``: plain tensors, every rank a data-parallel replica."""
    scheme: str | None = None
    """A program-defined shard scheme, named by the program: only this layout loads it."""
    placements: dict[str, int] = field(default_factory=dict)
    """How rank 0's parameters are placed: ``"Shard(0) over dp_shard=2"`` or ``"plain"`` -> count."""
    stages: tuple[Stage, ...] = ()
    rank_stage: tuple[tuple[int, int], ...] = ()
    """Runs of (stage index, ranks), in rank order: which ranks hold which stage."""
    fixed: dict[str, str] = field(default_factory=dict)
    """Degrees (or ``"*"``: any change) the checkpoint cannot be loaded at another value of, with
    why and what would make it possible (a Megatron format setting)."""
    formats: dict[str, Any] = field(default_factory=dict)
    """The checkpoint format settings that decide reshardability (Megatron's), as recorded."""

    @property
    def data_parallel(self) -> int:
        return self.dp_replicate * self.dp_shard

    def stage_of_rank(self) -> list[int]:
        return [stage for stage, count in self.rank_stage for _ in range(count)]

    def degrees(self) -> dict[str, int]:
        return {"world_size": self.world_size, **{d: getattr(self, d) for d in DEGREES}}

    def describe(self) -> str:
        """``DP2 (shard 2) x TP2 on 4 ranks`` (degrees of 1 left out), with the scheme or the
        placements' kind."""
        dp = f"DP{self.data_parallel}"
        if self.data_parallel > 1:
            parts = [f"{_LABELS[d]} {getattr(self, d)}" for d in ("dp_replicate", "dp_shard") if getattr(self, d) > 1]
            dp += f" ({', '.join(parts)})" if self.dp_shard > 1 else ""
        items = [dp] + [f"{_LABELS[d]}{getattr(self, d)}" for d in ("tensor", "pipeline", "context", "expert")
                        if getattr(self, d) > 1]
        text = f"{' x '.join(items)} on {self.world_size} rank{'s' if self.world_size != 1 else ''}"
        if self.scheme:
            text += f", the program's shard scheme {self.scheme!r}"
        if self.formats:
            text += ", " + ", ".join(f"{k}={v}" for k, v in sorted(self.formats.items()))
        return text

    def to_dict(self) -> dict:
        body: dict[str, Any] = {**self.degrees(), "data_parallel": self.data_parallel, "how": self.how}
        if self.scheme is not None:
            body["scheme"] = self.scheme
        body["placements"] = dict(self.placements)
        if self.stages:
            body["stages"] = [s.to_dict() for s in self.stages]
            body["rank_stage"] = [list(r) for r in self.rank_stage]
        if self.fixed:
            body["fixed"] = dict(self.fixed)
        if self.formats:
            body["formats"] = dict(self.formats)
        return body

    @classmethod
    def from_dict(cls, data: Any, *, source: str) -> ParallelLayout:
        """A recorded layout, checked in shape and bounds: a manifest is untrusted input."""
        def bad(name: str, expected: str, actual: Any) -> ManifestError:
            return ManifestError(f"{source}: topology.layout.{name}: expected {expected}, actual {short(actual, 80)}")
        if not isinstance(data, dict):
            raise bad("", "an object", data)
        degrees = {}
        for name in ("world_size", *DEGREES):
            value = data.get(name, 1)
            if type(value) is not int or not 1 <= value <= 1 << 24:
                raise bad(name, "an integer from 1 to 2**24", value)
            degrees[name] = value
        strings = {k: data.get(k) for k in ("how", "scheme")}
        for name, value in strings.items():
            if value is not None and not (isinstance(value, str) and len(value) <= _NAME_CAP):
                raise bad(name, f"a string of at most {_NAME_CAP} characters", value)
        stages, runs = _stages_from(data, degrees["world_size"], bad)
        return cls(**degrees, how=strings["how"] or "read", scheme=strings["scheme"],
                   placements=_counts_from(data.get("placements", {}), bad), stages=stages, rank_stage=runs,
                   fixed=_strings_from(data.get("fixed", {}), "fixed", bad),
                   formats=_scalars_from(data.get("formats", {}), bad))


def _counts_from(value: Any, bad: Any) -> dict[str, int]:
    if not (isinstance(value, dict) and len(value) <= _PLACEMENTS_CAP
            and all(isinstance(k, str) and len(k) <= _NAME_CAP and type(v) is int and v >= 0
                    for k, v in value.items())):
        raise bad("placements", f"at most {_PLACEMENTS_CAP} placement kinds with counts", value)
    return dict(value)


def _strings_from(value: Any, name: str, bad: Any) -> dict[str, str]:
    if not (isinstance(value, dict) and len(value) <= 16
            and all(isinstance(k, str) and len(k) <= 40 and isinstance(v, str) and len(v) <= 1000
                    for k, v in value.items())):
        raise bad(name, "an object of at most 16 strings", value)
    return dict(value)


def _scalars_from(value: Any, bad: Any) -> dict[str, Any]:
    if not (isinstance(value, dict) and len(value) <= 32
            and all(isinstance(k, str) and len(k) <= 60 and (v is None or isinstance(v, (bool, int, str)))
                    and len(str(v)) <= _NAME_CAP for k, v in value.items())):
        raise bad("formats", "an object of at most 32 settings (booleans, integers, strings)", value)
    return dict(value)


def _stages_from(data: dict, world_size: int, bad: Any) -> tuple[tuple[Stage, ...], tuple[tuple[int, int], ...]]:
    raw, runs = data.get("stages", []), data.get("rank_stage", [])
    if not isinstance(raw, list) or len(raw) > world_size:
        raise bad("stages", f"a list of at most {world_size} stages", raw)
    stages = []
    for i, s in enumerate(raw):
        if not (isinstance(s, dict) and isinstance(s.get("digest"), str) and len(s["digest"]) <= 64
                and type(s.get("names")) is int and s["names"] >= 0
                and all(isinstance(s.get(k, ""), str) and len(s.get(k, "")) <= _NAME_CAP for k in ("first", "last"))):
            raise bad(f"stages[{i}]", "an object with digest, names, first and last", s)
        stages.append(Stage(s["digest"], s["names"], s.get("first", ""), s.get("last", "")))
    if not isinstance(runs, list) or not all(
            isinstance(r, list) and len(r) == 2 and all(type(x) is int for x in r)
            and 0 <= r[0] < len(stages) and r[1] >= 1 for r in runs):
        raise bad("rank_stage", "a list of [stage, ranks] runs naming the stages listed", runs)
    if stages and sum(r[1] for r in runs) != world_size:
        raise bad("rank_stage", f"runs covering {world_size} ranks", runs)
    return tuple(stages), tuple((r[0], r[1]) for r in runs)


# -- assembling every rank's part -------------------------------------------------------------------


def assemble_layout(parts: list[dict | None], *, world_size: int) -> ParallelLayout | None:
    """The run's layout from every rank's ``Adapter.layout_part()`` (rank 0's degrees, every
    rank's stage); None when the adapter reports none.

    A part: ``{"degrees": {name: n}, "how": str, "scheme": str | None, "placements": {...},
    "stage": {"digest", "names", "first", "last"}, "fixed": {...}, "formats": {...}}``. A pipeline
    degree not given is the number of distinct stages; the data-parallel degree not given is
    what the world size leaves after the others (every remaining rank a replica)."""
    first = parts[0] if parts else None
    if first is None:
        return None
    stages: list[Stage] = []
    index: dict[str, int] = {}
    runs: list[list[int]] = []
    for part in parts:
        s = (part or {}).get("stage") or {"digest": "", "names": 0}
        if s["digest"] not in index:
            index[s["digest"]] = len(stages)
            stages.append(Stage(s["digest"], int(s["names"]), s.get("first", ""), s.get("last", "")))
        i = index[s["digest"]]
        if runs and runs[-1][0] == i:
            runs[-1][1] += 1
        else:
            runs.append([i, 1])
    given = dict(first.get("degrees", {}))
    given.setdefault("pipeline", len(stages))
    rest = max(1, world_size // max(1, given.get("tensor", 1) * given.get("context", 1) * given["pipeline"]))
    shard = given.get("dp_shard", 1)
    given.setdefault("dp_replicate", max(1, rest // max(1, shard)))
    return ParallelLayout(world_size=world_size, **{d: int(given.get(d, 1)) for d in DEGREES},
                          how=first.get("how", "read"), scheme=first.get("scheme"),
                          placements=dict(first.get("placements", {})),
                          stages=tuple(stages), rank_stage=tuple((a, b) for a, b in runs),
                          fixed=dict(first.get("fixed", {})), formats=dict(first.get("formats", {})))


def layout_topology(parts: list[dict | None], *, world_size: int) -> dict:
    """What a manifest's ``topology`` records of the layout: ``layout`` and the real
    ``data_parallel`` degree (nothing when the adapter reports no layout)."""
    layout = assemble_layout(parts, world_size=world_size)
    return {} if layout is None else {"data_parallel": layout.data_parallel, "layout": layout.to_dict()}


# -- comparing ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LayoutChange:
    """A layout change a restore lets through: the checkpoint's shards load exactly on ``live``."""

    saved: ParallelLayout
    live: ParallelLayout
    changed: tuple[str, ...]
    """What differs: degree names, ``placements``."""

    def describe(self) -> str:
        return f"layout changed: {self.saved.describe()} -> {self.live.describe()}, resharded"

    def record(self, step: int) -> dict:
        """As accepted changes are recorded in the next manifests (``Manifest.changes``)."""
        return {"step": step, "item": "layout", "from": self.saved.describe(), "to": self.live.describe()}


def layout_change(saved: ParallelLayout | None, live: ParallelLayout | None) -> LayoutChange | None:
    """None when nothing differs (or the checkpoint records no layout: written before layouts
    were recorded, compared as before); a ``LayoutChange`` when the checkpoint loads exactly on
    ``live``; else ContinuityError("layout", saved, live, what would make it possible)."""
    if saved is None or live is None:
        return None
    changed = [d for d in ("world_size", *DEGREES) if getattr(saved, d) != getattr(live, d)]
    if "pipeline" not in changed and _split(saved) != _split(live):
        changed.append("pipeline")  # as many stages, at other boundaries
    if saved.placements != live.placements:
        changed.append("placements")
    if not changed and saved.scheme == live.scheme:
        return None
    if saved.scheme != live.scheme or saved.scheme is not None:
        scheme = saved.scheme or live.scheme
        _refuse(saved, live, f"the program shards its state by its own scheme {scheme!r}, which only the "
                             "layout it was saved on can load: restart on that layout")
    for degree in changed:
        why = saved.fixed.get(degree) or saved.fixed.get("*")
        if why and degree == "pipeline" and saved.stages:
            now = "; ".join(s.describe() for s in live.stages) or f"{live.pipeline} stage(s), not known yet"
            why += f" (saved stages: {'; '.join(s.describe() for s in saved.stages)}; now: {now})"
        if why:
            _refuse(saved, live, why)
    return LayoutChange(saved, live, tuple(changed))


def _split(layout: ParallelLayout) -> frozenset[str]:
    """The pipeline split: the stages' sets of state names. One stage is no split, whatever its
    names (another structure is ``resume.changes``' to name, a stage change the program's)."""
    return frozenset(s.digest for s in layout.stages) if len(layout.stages) > 1 else frozenset()


def _refuse(saved: ParallelLayout, live: ParallelLayout, why: str) -> None:
    raise ContinuityError("layout", saved.describe(), live.describe(), why)


def stated_layout(stated: dict, *, where: str) -> dict:
    """A program's statement of its layout (``NativeTorchAdapter(parallel=...)``), checked:
    degrees as positive integers, ``scheme`` a name."""
    unknown = sorted(set(stated) - set(STATED_KEYS))
    if unknown:
        raise UsageError(f"{where}: expected keys among {', '.join(STATED_KEYS)}, actual {', '.join(unknown)}")
    for key, value in stated.items():
        if key == "scheme":
            if not (isinstance(value, str) and 0 < len(value) <= _NAME_CAP):
                raise UsageError(f"{where}.scheme: expected a name, actual {value!r}")
        elif type(value) is not int or value < 1:
            raise UsageError(f"{where}.{key}: expected a positive integer, actual {value!r}")
    return dict(stated)


# -- the moments, layout-independent -----------------------------------------------------------------


def global_moments(per_rank: list[list[dict]], stage_of_rank: list[int]) -> list[dict]:
    """Per optimizer, the moments' bit sums over the global tensors, the same on any layout:
    every rank's ``sharded`` part (each element counted on one rank) plus the ``replicated`` part
    (plain tensors, the same on every rank of a stage) of one rank per stage. ``named``: the sums
    weighted by their state names (``name_weight``), where every rank recorded them."""
    if not per_rank:
        return []
    out = []
    first_of_stage: dict[int, int] = {}
    for rank, stage in enumerate(stage_of_rank[:len(per_rank)]):
        first_of_stage.setdefault(stage, rank)
    counted = set(first_of_stage.values()) or {0}
    for i in range(len(per_rank[0])):
        total: dict[str, Any] = {"bits": {}, "numel": 0, "named": {}}
        named = True
        for rank, fingerprints in enumerate(per_rank):
            record = fingerprints[i] if i < len(fingerprints) else {}
            for kind in ("sharded", "replicated"):
                if kind == "replicated" and rank not in counted:
                    continue
                part = record.get(kind, {})
                _add(total["bits"], part.get("bits", {}))
                total["numel"] += int(part.get("numel", 0))
                if "named" in part:
                    _add(total["named"], part["named"])
                else:
                    named = False
        if not named:
            del total["named"]
        out.append(total)
    return out


def _add(into: dict[str, int], values: dict[str, int]) -> None:
    for key, value in values.items():
        into[key] = (into.get(key, 0) + int(value)) & 0xFFFFFFFF


def with_degrees(layout: ParallelLayout, **degrees: int) -> ParallelLayout:
    """``layout`` with other degrees (``resume plan --from-run``: a layout to check)."""
    return replace(layout, **degrees)
