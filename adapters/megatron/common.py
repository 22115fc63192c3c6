"""Megatron's common state of a ``torch_dist`` save, read without Megatron and without running its code.

The common state (iteration, the argparse ``args``, the scheduler's state, the
checkpoint version) is the object entry ``common_state`` of a ``.distcp`` file,
stored as ``torch.save([dict])``. ``.metadata`` is read through ``resume.adapters.dcp.unpickle``'s
allow-list unpickler and the entry through ``_CommonUnpickler``, which admits plain
containers and numbers and turns every other global into an inert ``Opaque``:
nothing from the checkpoint is ever called.

Counters Megatron does not keep are derived: samples read is
``consumed_train_samples``; successful updates the scheduler position (in samples)
over the global batch; skipped = iteration - successful.
"""

from __future__ import annotations

import io
import pickle
import zipfile
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from resume.errors import InvariantError, ManifestError, UnsafeCheckpointError
from resume.state import TrainState
from resume.storage import Storage, join

from .savedir import iteration_dirname
from .schedule import MegatronSchedule

__all__ = ["ARG_FIELDS", "COMMON_KEY", "SAMPLE_COUNTERS", "CommonState", "Opaque", "common_state_from_dict",
           "read_common_state", "unpickle_torch_save"]

COMMON_KEY = "common_state"
SAMPLE_COUNTERS = ("consumed_train_samples", "skipped_train_samples")
"""Megatron's own counters of samples (in its ``args``), shown beside ours."""
ARG_FIELDS = (
    "global_batch_size", "micro_batch_size", "seq_length", "consumed_train_samples",
    "skipped_train_samples", "train_samples", "train_iters", "seed", "data_parallel_size",
    "tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size",
    "world_size", "lr", "min_lr", "lr_warmup_init", "lr_warmup_samples", "lr_warmup_iters",
    "lr_warmup_fraction", "lr_decay_samples", "lr_decay_iters", "lr_decay_style",
    "lr_wsd_decay_samples", "lr_wsd_decay_iters", "lr_wsd_decay_style", "dataloader_type",
    "data_path", "split", "tokenizer_type", "vocab_size", "rampup_batch_size", "ckpt_format",
    # the layout and the format settings that decide which degrees a restart may change (``parallel``)
    "expert_model_parallel_size", "num_distributed_optimizer_instances", "use_distributed_optimizer",
    "use_layer_wise_distributed_optimizer", "dist_ckpt_optim_fully_reshardable", "ckpt_fully_parallel_save",
    "use_megatron_fsdp", "use_torch_fsdp2",
)
"""The arguments the orchestrator reads (JSON-able values only)."""


# -- the common state ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Opaque:
    """What a global we do not admit became: its name and arguments, never called."""

    name: str
    args: tuple = ()
    state: Any = None

    def __repr__(self) -> str:
        return f"<{self.name}{self.args!r}>" if self.args else f"<{self.name}>"


class _Record:
    """Stands in for ``argparse.Namespace``: a bag of attributes."""

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)


def _opaque_class(module: str, name: str) -> type:
    qualname = f"{module}.{name}"

    class _Stub:
        opaque_name = qualname

        def __new__(cls, *args: Any) -> Any:
            return _StubValue(qualname, args)

    return _Stub


class _StubValue:
    def __init__(self, name: str, args: tuple) -> None:
        self.opaque = Opaque(name, args)

    def __setstate__(self, state: Any) -> None:
        self.opaque = Opaque(self.opaque.name, self.opaque.args, state)


_PLAIN_GLOBALS: dict[tuple[str, str], Any] = {
    ("collections", "OrderedDict"): OrderedDict, ("builtins", "set"): set,
    ("builtins", "frozenset"): frozenset, ("builtins", "slice"): slice, ("builtins", "complex"): complex}


class _CommonUnpickler(pickle.Unpickler):

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _PLAIN_GLOBALS:
            return _PLAIN_GLOBALS[(module, name)]
        if (module, name) in (("argparse", "Namespace"), ("types", "SimpleNamespace")):
            return _Record
        return _opaque_class(module, name)

    def persistent_load(self, pid: Any) -> Any:
        return Opaque("storage", tuple(str(p) for p in pid) if isinstance(pid, tuple) else ())


def _plain(value: Any) -> Any:
    """Opaque stand-ins become Opaque; records become dicts."""
    if isinstance(value, _StubValue):
        return value.opaque
    if isinstance(value, type) and hasattr(value, "opaque_name"):
        return Opaque(value.opaque_name)  # a global referenced, not called (e.g. torch.bfloat16)
    if isinstance(value, _Record):
        return {k: _plain(v) for k, v in vars(value).items()}
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_plain(v) for v in value)
    return value


def unpickle_torch_save(raw: bytes, *, source: str) -> Any:
    """Read a ``torch.save`` blob's object tree without calling anything from it."""
    try:
        with zipfile.ZipFile(io.BytesIO(raw)) as z:
            pkl = next((n for n in z.namelist() if n.endswith("/data.pkl") or n == "data.pkl"), None)
            if pkl is None:
                raise ValueError("no data.pkl in the archive")
            data = z.read(pkl)
        return _plain(_CommonUnpickler(io.BytesIO(data)).load())
    except (zipfile.BadZipFile, pickle.UnpicklingError, ValueError, EOFError, TypeError,
            AttributeError, IndexError, KeyError) as e:
        raise UnsafeCheckpointError(f"{source}: expected a torch.save object, actual unreadable "
                                    f"({type(e).__name__}: {e})") from e


@dataclass
class CommonState:
    """Megatron's common state of one checkpoint, as plain values."""

    iteration: int
    checkpoint_version: float | None
    args: dict[str, Any]
    """The arguments in ARG_FIELDS (JSON-able values only)."""
    scheduler: dict | None
    source: str
    extra: dict[str, Any] = field(default_factory=dict)

    def schedule(self) -> MegatronSchedule:
        if self.scheduler is None:
            raise ManifestError(f"{self.source}: opt_param_scheduler: expected the scheduler's state, "
                                "actual missing")
        wsd = self.args.get("lr_wsd_decay_samples")
        if wsd is None and self.args.get("lr_wsd_decay_iters") is not None:
            wsd = self.args["lr_wsd_decay_iters"] * self.args.get("global_batch_size", 1)
        return MegatronSchedule.from_state_dict(
            self.scheduler, init_lr=self.args.get("lr_warmup_init") or 0.0, source=self.source,
            wsd_decay_steps=wsd, lr_wsd_decay_style=self.args.get("lr_wsd_decay_style"))

    @property
    def scheduler_position(self) -> int:
        return int((self.scheduler or {}).get("num_steps", 0))

    def counters(self) -> TrainState:
        """The three counters, derived (Megatron keeps no count of skipped updates)."""
        gbs = self.args.get("global_batch_size")
        consumed = self.args.get("consumed_train_samples")
        if not isinstance(gbs, int) or gbs <= 0 or not isinstance(consumed, int):
            raise ManifestError(f"{self.source}: args: expected global_batch_size and "
                                f"consumed_train_samples, actual {gbs!r}, {consumed!r}")
        if self.args.get("rampup_batch_size"):
            raise InvariantError(f"{self.source}: args.rampup_batch_size: expected none (the counters "
                                 f"assume a constant global batch), actual {self.args['rampup_batch_size']}")
        position = self.scheduler_position
        if position % gbs:
            raise InvariantError(f"{self.source}: opt_param_scheduler.num_steps: expected a multiple of "
                                 f"the global batch {gbs}, actual {position}")
        successful = position // gbs
        if successful > self.iteration:
            raise InvariantError(f"{self.source}: opt_param_scheduler.num_steps: expected at most "
                                 f"iteration x global batch = {self.iteration * gbs}, actual {position}")
        return TrainState(iteration=self.iteration, samples_read=consumed,
                          updates_successful=successful, updates_skipped=self.iteration - successful)


def _json_value(value: Any) -> bool:
    if isinstance(value, (str, int, float, bool)) or value is None:
        return True
    if isinstance(value, (list, tuple)):
        return all(map(_json_value, value))
    return False


def common_state_from_dict(common: Any, *, source: str) -> CommonState:
    if isinstance(common, list) and len(common) == 1:
        common = common[0]
    if not isinstance(common, dict):
        raise ManifestError(f"{source}: common_state: expected a dict, actual {type(common).__name__}")
    args = common.get("args")
    if not isinstance(args, dict):
        raise ManifestError(f"{source}: common_state.args: expected Megatron's arguments, actual "
                            f"{type(args).__name__}")
    iteration = common.get("iteration")
    if not isinstance(iteration, int) or iteration < 0:
        raise ManifestError(f"{source}: common_state.iteration: expected a non-negative integer, "
                            f"actual {iteration!r}")
    picked = {k: (list(v) if isinstance(v, tuple) else v)
              for k, v in args.items() if k in ARG_FIELDS and _json_value(v)}
    scheduler = common.get("opt_param_scheduler")
    return CommonState(iteration=iteration, checkpoint_version=common.get("checkpoint_version"),
                       args=picked, scheduler=scheduler if isinstance(scheduler, dict) else None,
                       source=source,
                       extra={"num_floating_point_operations_so_far":
                              common.get("num_floating_point_operations_so_far")})


def read_common_state(storage: Storage, iteration: int) -> CommonState:
    """The common state of ``iter_<iteration>/``: restricted .metadata, then the object entry."""
    from ..dcp.unpickle import read_step_metadata

    d = iteration_dirname(iteration)
    meta_path = join(d, ".metadata")
    metadata = read_step_metadata(storage, d)
    entries = [(idx, info) for idx, info in metadata.storage_data.items()
               if idx.fqn == COMMON_KEY or idx.fqn.startswith(COMMON_KEY + "/")]
    if not entries:
        raise ManifestError(f"{storage.url(meta_path)}: expected a '{COMMON_KEY}' entry (Megatron's "
                            f"common state), actual none among {len(metadata.storage_data)} entries")
    _, info = entries[0]
    if getattr(info, "transform_descriptors", None):
        raise ManifestError(f"{storage.url(meta_path)}: {COMMON_KEY}: expected an untransformed entry, "
                            f"actual transforms {info.transform_descriptors}")
    data_path = join(d, info.relative_path)
    source = storage.url(data_path)
    with storage.open_read(data_path) as f:
        f.seek(info.offset)
        raw = f.read(info.length)
    if len(raw) != info.length:
        raise ManifestError(f"{source}: {COMMON_KEY}: expected {info.length} bytes at offset "
                            f"{info.offset}, actual {len(raw)} (truncated file)")
    return common_state_from_dict(unpickle_torch_save(raw, source=source), source=source)
