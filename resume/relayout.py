"""The layouts a checkpoint can be restored on (``resume plan --from-run``), judged as a restore
would judge them.

Every TP x PP x CP x DP over a number of ranks is a candidate: tensor within a node (a divisor of
the GPUs per node, or the saved degree), context and pipeline among the divisors of what is left,
data parallel the rest, where it splits the global batch into equal micro-batches; expert as
saved (it must divide DP x CP). Each candidate is the saved layout with those degrees
(``with_degrees``) and ``layout_change(saved, candidate)`` says what a restore on it would do:
``as saved``, ``resharded`` (the shards load exactly on it) or ``refused`` (why, and what would
make it possible). A candidate keeping the saved pipeline degree keeps the saved stages (the split
is unchanged); another pipeline degree is another split, which the checkpoint's ``fixed`` decides.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import gcd
from typing import Any

from .errors import CheckpointNotFoundError, ContinuityError, ManifestError, UsageError
from .layout import ParallelLayout, layout_change, with_degrees

__all__ = ["AS_SAVED", "REFUSED", "RESHARDED", "Candidate", "candidate_layouts", "judge",
           "restorable_layouts", "saved_layout", "split_data_parallel"]

AS_SAVED = "as saved"
RESHARDED = "resharded"
REFUSED = "refused"
_ORDER = {AS_SAVED: 0, RESHARDED: 1, REFUSED: 2}
_SHOWN = ("tensor", "pipeline", "context", "dp_replicate", "dp_shard", "expert")


@dataclass(frozen=True)
class Candidate:
    """One layout a restore could run on, and what the restore would do there."""

    layout: ParallelLayout
    verdict: str
    """``as saved``, ``resharded`` or ``refused``."""
    changed: tuple[str, ...] = ()
    """What differs from the saved layout: degree names, ``placements``."""
    why: str = ""
    """Refused: why, and what would make it possible."""

    def key(self) -> tuple[int, ...]:
        """Sorting: as saved, then resharded, then refused; by tensor, pipeline, context degree."""
        lay = self.layout
        return (_ORDER[self.verdict], lay.tensor, lay.pipeline, lay.context)

    def degrees_text(self) -> str:
        """``TP2 x PP1 x CP1 x DP4``."""
        lay = self.layout
        return f"TP{lay.tensor} x PP{lay.pipeline} x CP{lay.context} x DP{lay.data_parallel}"

    def change_text(self, saved: ParallelLayout) -> str:
        """``tensor 1->2, dp_replicate 2->1`` (the degrees that change; placements by name)."""
        return ", ".join(f"{d} {getattr(saved, d)}->{getattr(self.layout, d)}" if d in _SHOWN else d
                         for d in self.changed if d != "world_size")

    def to_dict(self) -> dict[str, Any]:
        lay = self.layout
        return {"tensor": lay.tensor, "pipeline": lay.pipeline, "context": lay.context,
                "data_parallel": lay.data_parallel, "dp_replicate": lay.dp_replicate, "dp_shard": lay.dp_shard,
                "expert": lay.expert, "description": lay.describe(), "verdict": self.verdict,
                "changed": list(self.changed), "why": self.why or None}


def saved_layout(topology: dict, *, source: str) -> ParallelLayout:
    """The layout a manifest's topology records (validated: a manifest is untrusted input);
    CheckpointNotFoundError (exit 3) when it records none."""
    if "layout" not in topology:
        raise CheckpointNotFoundError(f"{source}: topology.layout: expected a recorded parallel layout, actual "
                                      "none (written before layouts were recorded; the next save records it)")
    return ParallelLayout.from_dict(topology["layout"], source=source)


def batch_sizes(config: dict, *, source: str, micro_batch: int | None) -> tuple[int, int]:
    """(global batch, micro-batch) of a manifest's config: the global batch it records, the
    micro-batch given, else recorded (``micro_batch`` or ``micro_batch_size``), else 1."""
    gb = config.get("global_batch")
    if type(gb) is not int or gb < 1:
        raise ManifestError(f"{source}: config.global_batch: expected a positive integer, actual {gb!r:.80}")
    if micro_batch is None:
        recorded = config.get("micro_batch", config.get("micro_batch_size"))
        micro_batch = recorded if type(recorded) is int and recorded >= 1 else 1
    if micro_batch < 1 or gb % micro_batch:
        raise UsageError(f"--micro-batch: expected a divisor of the global batch {gb}, actual {micro_batch}")
    return gb, micro_batch


def _divisors(n: int) -> list[int]:
    small = [d for d in range(1, int(n ** 0.5) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def split_data_parallel(saved: ParallelLayout, dp: int) -> tuple[int, int]:
    """(replicate, shard) for ``dp`` data-parallel ranks, as the saved split goes: all replicas
    (DDP), all shards (FSDP), or, for HSDP, the saved shard degree where it divides ``dp``
    (else their greatest common divisor)."""
    if saved.dp_shard == 1:
        return dp, 1
    if saved.dp_replicate == 1:
        return 1, dp
    shard = gcd(dp, saved.dp_shard)
    return dp // shard, shard


def candidate_layouts(saved: ParallelLayout, *, world_size: int, gpus_per_node: int, global_batch: int,
                      micro_batch: int = 1, only: dict[str, int] | None = None) -> list[ParallelLayout]:
    """Every TP x PP x CP x DP over ``world_size`` ranks (module docstring), ``only`` the degrees
    named there (``{"tensor": 8}``)."""
    only = only or {}
    micro_batches = global_batch // micro_batch
    tensors = sorted({d for d in _divisors(gpus_per_node) if world_size % d == 0}
                     | ({saved.tensor} if world_size % saved.tensor == 0 else set()))
    out = []
    for tp in tensors:
        for cp in _divisors(world_size // tp):
            for pp in _divisors(world_size // (tp * cp)):
                dp = world_size // (tp * cp * pp)
                wanted = {"tensor": tp, "context": cp, "pipeline": pp}
                if any(only.get(k, v) != v for k, v in wanted.items()):
                    continue
                if micro_batches % dp or (dp * cp) % saved.expert:
                    continue
                out.append(_candidate(saved, world_size, tp, pp, cp, dp))
    return out


def _candidate(saved: ParallelLayout, world_size: int, tp: int, pp: int, cp: int, dp: int) -> ParallelLayout:
    """The saved layout on these degrees; its stages where the pipeline degree is kept (the same
    split), none known where it is not (another split). Which rank holds which stage is not known."""
    replicate, shard = split_data_parallel(saved, dp)
    stages = saved.stages if pp == saved.pipeline else ()
    return with_degrees(saved, world_size=world_size, tensor=tp, pipeline=pp, context=cp,
                        dp_replicate=replicate, dp_shard=shard, stages=stages, rank_stage=())


def judge(saved: ParallelLayout, candidate: ParallelLayout) -> Candidate:
    """What a restore of a checkpoint saved on ``saved`` would do on ``candidate``."""
    # With another pipeline degree the candidate's stages are not known: the saved ones are left
    # out of the comparison too, so the refusal says why without an empty list of stages.
    compared = saved if candidate.stages or not saved.stages else with_degrees(saved, stages=(), rank_stage=())
    try:
        change = layout_change(compared, candidate)
    except ContinuityError as e:
        return Candidate(candidate, REFUSED, why=e.hint or str(e))
    if change is None:
        return Candidate(candidate, AS_SAVED)
    return Candidate(candidate, RESHARDED, changed=change.changed)


def restorable_layouts(saved: ParallelLayout, *, world_size: int, gpus_per_node: int, global_batch: int,
                       micro_batch: int = 1, only: dict[str, int] | None = None) -> list[Candidate]:
    """Every candidate layout (``candidate_layouts``), judged (``judge``): as saved first, then
    resharded, then refused."""
    found = [judge(saved, c) for c in candidate_layouts(saved, world_size=world_size, gpus_per_node=gpus_per_node,
                                                         global_batch=global_batch, micro_batch=micro_batch,
                                                         only=only)]
    return sorted(found, key=Candidate.key)
