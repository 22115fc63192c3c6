"""A Megatron run's parallel layout (``resume.layout``), read from its arguments, and which degrees
the checkpoint format it saves with fixes.

What Megatron-Core 0.19.2 loads on another layout (``megatron/training/checkpointing.py``
``load_checkpoint``, ``megatron/core/optimizer/distrib_optimizer.py``):

- ``--ckpt-format torch_dist``: the model and a plain optimizer are sharded tensors with global
  offsets, loaded at any TP, PP, DP, CP or EP. The distributed optimizer's state is saved as
  ``dp_reshardable`` (its internal buffers, one key per TP x PP rank, per expert TP x EP x PP rank
  for the experts) unless ``--dist-ckpt-optim-fully-reshardable`` makes it ``fully_reshardable``:
  ``dp_reshardable`` loads at another data-parallel degree only, and Megatron raises
  ``(TP, PP) mismatch after resume ... not supported for DistributedOptimizer with sharding type
  dp_reshardable`` once it has read the checkpoint's common state (it checks no EP). The
  ``--ckpt-fully-parallel-save`` that message names decides nothing of the format in 0.19.2 (only
  how the writing is split over DP): the sharding type comes from the checkpoint's
  ``content_metadata``, written from ``--dist-ckpt-optim-fully-reshardable``.
- ``--ckpt-format torch``: one file per (TP, PP, EP) rank, loaded at those degrees only.
- ``--ckpt-format torch_dcp``: each rank's local state dict without global offsets, and only the
  first model chunk: loaded on the layout it was saved on only.
- ``--ckpt-format fsdp_dtensor``: DTensors, resharded by ``torch.distributed.checkpoint``.

Context parallelism is resharded like data parallelism: the dense distributed optimizer shards over
DP x CP and keys its buffers by the TP x PP rank, which another CP leaves as they are.
"""

from __future__ import annotations

from typing import Any

from resume.layout import LayoutChange, ParallelLayout, layout_change
from resume.manifest import Manifest

__all__ = ["FORMAT_ARGS", "fixed_degrees", "formats", "megatron_layout", "saved_layout_change"]

FORMAT_ARGS = (("ckpt_format", "torch_dist"), ("use_distributed_optimizer", False),
               ("dist_ckpt_optim_fully_reshardable", False), ("ckpt_fully_parallel_save", True))
"""The arguments that decide how a checkpoint reshards, with Megatron's defaults (``formats``)."""

_FULLY_RESHARDABLE = "--dist-ckpt-optim-fully-reshardable"
_DP_RESHARDABLE = ("the distributed optimizer's state was saved dp_reshardable (its internal buffers per "
                   "TP x PP and expert TP x EP x PP rank), which Megatron-Core loads at another data-parallel "
                   f"degree only: save with {_FULLY_RESHARDABLE} to change {{what}}, or restart with the "
                   "saved degree")
_PER_RANK_FILES = ("--ckpt-format torch writes one file per (TP, PP, EP) rank, which Megatron loads at those "
                   "degrees only: save with --ckpt-format torch_dist to change {what}, or restart with the "
                   "saved degree")
_LOCAL_STATE = ("--ckpt-format torch_dcp saves each rank's local state dict (no global shard offsets), which "
                "Megatron loads on the layout it was saved on only: save with --ckpt-format torch_dist, or "
                "restart on the saved layout")
_WHAT = {"tensor": "TP (--tensor-model-parallel-size)", "pipeline": "PP (--pipeline-model-parallel-size)",
         "expert": "EP (--expert-model-parallel-size)"}


def _degree(args: Any, name: str) -> int:
    value = getattr(args, name, None)
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 1 else 1


def formats(args: Any) -> dict[str, Any]:
    """The format settings of ``args`` (``FORMAT_ARGS``; the layer-wise distributed optimizer, which
    Megatron's parser records as ``use_distributed_optimizer`` off, saves the same sharding type)."""
    out = {name: getattr(args, name, default) for name, default in FORMAT_ARGS}
    out["use_distributed_optimizer"] = bool(out["use_distributed_optimizer"]
                                            or getattr(args, "use_layer_wise_distributed_optimizer", False))
    return out


def fixed_degrees(settings: dict[str, Any]) -> dict[str, str]:
    """The degrees a checkpoint saved with ``settings`` (``formats``) cannot be loaded at another
    value of, each with why and the flag that would make it possible (``ParallelLayout.fixed``)."""
    ckpt_format = settings.get("ckpt_format")
    if ckpt_format == "torch_dcp":
        return {"*": _LOCAL_STATE}
    if ckpt_format == "torch":
        why = _PER_RANK_FILES
    elif ckpt_format == "torch_dist" and settings.get("use_distributed_optimizer") \
            and not settings.get("dist_ckpt_optim_fully_reshardable"):
        why = _DP_RESHARDABLE
    else:
        return {}
    return {degree: why.format(what=what) for degree, what in _WHAT.items()}


def megatron_layout(args: Any, world_size: int) -> ParallelLayout:
    """The layout Megatron's arguments give on ``world_size`` ranks (``how="read"``: Megatron's own
    degrees; its data-parallel size is what TP x PP x CP leave, as its ``validate_args`` computes it)."""
    tp, pp, cp = (_degree(args, n) for n in ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                                             "context_parallel_size"))
    dp = _degree(args, "data_parallel_size") if getattr(args, "data_parallel_size", None) \
        else max(1, world_size // (tp * pp * cp))
    settings = formats(args)
    # What a checkpoint holds sharded over data parallelism: with the distributed optimizer
    # (ZeRO-1) or Megatron's FSDP the optimizer state, the bulk of a checkpoint, is sharded over
    # DP within each of --num-distributed-optimizer-instances replicas; without, every DP rank
    # holds a replica of everything.
    sharded = settings["use_distributed_optimizer"] or getattr(args, "use_megatron_fsdp", False) \
        or getattr(args, "use_torch_fsdp2", False)
    instances = _degree(args, "num_distributed_optimizer_instances")
    replicate = (instances if dp % instances == 0 else 1) if sharded else dp
    return ParallelLayout(world_size=world_size, dp_replicate=replicate, dp_shard=dp // replicate,
                          tensor=tp, pipeline=pp, context=cp, expert=_degree(args, "expert_model_parallel_size"),
                          how="read", fixed=fixed_degrees(settings), formats=settings)


def saved_layout_change(manifest: Manifest, args: Any, world_size: int, *, source: str) -> LayoutChange | None:
    """The checkpoint's layout against the one ``args`` give now, before Megatron reads anything:
    None when the same (or the manifest records none: written before layouts were); a
    ``LayoutChange`` when Megatron loads the checkpoint on the new layout; else ContinuityError
    ("layout", saved, now, why and which flag would make it possible)."""
    raw = manifest.topology.get("layout")
    if raw is None:
        return None
    return layout_change(ParallelLayout.from_dict(raw, source=source), megatron_layout(args, world_size))
