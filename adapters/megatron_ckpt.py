"""Reading a Megatron-LM save directory without Megatron and without running its code.

A save directory (``--save``) holds ``latest_checkpointed_iteration.txt`` and
one ``iter_%07d/`` per checkpoint. With ``--ckpt-format torch_dist`` (the
default) each is a torch.distributed.checkpoint directory: ``.metadata`` (a
pickle), ``__<rank>_<n>.distcp`` data files and ``metadata.json``. Megatron's
common state (iteration, the whole argparse ``args``, the scheduler's state,
the checkpoint version) is one object entry, ``common_state``, inside a
``.distcp`` file, stored as ``torch.save([dict])``.

Megatron itself reads both pickles with full unpickling. Here ``.metadata``
goes through the allow-list unpickler of ``dcp_safe`` and the common state
through ``_CommonUnpickler``, which admits plain containers and numbers and
turns every other global (Megatron's enums, tensors, anything planted) into
an inert ``Opaque`` record: nothing from the checkpoint is ever called.

The counters Megatron does not keep are derived here: samples read is
``consumed_train_samples``; successful updates is the scheduler position
(in samples) divided by the global batch; skipped = iteration - successful.
"""

from __future__ import annotations

import io
import pickle
import re
import zipfile
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from resume.errors import (
    CheckpointNotFoundError,
    InvariantError,
    ManifestError,
    RunNotFoundError,
    UnsafeCheckpointError,
    UnsafePathError,
)
from resume.run import RESUME_LAYOUT, CheckResult, FrameworkSave, Run, RunLayout, register_layout
from resume.state import TrainState
from resume.storage import SMALL_FILE_CAP, Storage, join
from resume.text import parse_json, short

from .megatron_schedule import MegatronSchedule

__all__ = ["MEGATRON_LAYOUT", "MEGATRON_TRACKER", "CommonState", "MegatronLayout", "Opaque", "iteration_dirs",
           "read_common_state", "read_tracker", "require_save_dir", "require_torch_dist"]

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
)
"""The arguments the orchestrator reads (JSON-able values only)."""


# -- the layout: a save directory as a run ------------------------------------------------------

MEGATRON_TRACKER = "latest_checkpointed_iteration.txt"


@dataclass(frozen=True, slots=True)
class MegatronLayout(RunLayout):
    """A Megatron-LM save directory as a run: its ``iter_0000200/`` directories hold
    Megatron's own files and our manifest beside them (``resume-manifest.json``); Megatron
    keeps its own pointer (the tracker), so there is no ``LATEST`` of ours.

    Registered at import: importing this module (cheap, no megatron-core) is what lets
    ``resume verify/ls/inspect`` and the Slurm hook recognise a save directory.
    """

    def claims(self, storage: Storage) -> bool:
        """The tracker or ``iter_NNNNNNN/`` directories, in a directory holding nothing of ours.

        A step directory or our ``LATEST`` makes it a run of ours whatever else is there: a
        stray tracker (copied in, or written by a tool pointed at the wrong directory) must
        not hide a native run's checkpoints. (``run.json`` decides nothing: a job using the
        Megatron integration writes one into the save directory too.)
        """
        names = storage.listdir("")
        if RESUME_LAYOUT.latest in names or any(RESUME_LAYOUT.parse(n) is not None for n in names):
            return False
        return MEGATRON_TRACKER in names or any(self.parse(n) is not None for n in names)

    def extra_problems(self, run: Run, result: CheckResult) -> list[str]:
        """Megatron's own state (format, counters, schedule) must agree with our manifest."""
        if result.manifest is None:
            return []
        return cross_check(run.storage, result.step, result.manifest.train_state, result.manifest.expectation)

    def pointer_problems(self, run: Run, results: list[CheckResult], *, whole_run: bool) -> list[str]:
        """The tracker must name an iteration that exists (an iteration's own problems are
        that iteration's, ``framework_save``)."""
        return tracker_problems(run.storage) if whole_run else []

    def framework_save(self, run: Run, step: int, *, deep: bool = False,
                       progress: Callable[[int], None] | None = None) -> FrameworkSave | None:
        """An iteration without our manifest. Megatron's tracker is its commit: an iteration
        newer than the tracker (or with no tracker at all) is a save Megatron did not finish,
        uncommitted and ignored, as Megatron ignores it. Up to the tracker it is Megatron's
        own save: checked from its ``.metadata`` (``megatron_check``), unrecorded when sound,
        broken otherwise."""
        from .megatron_check import UNCAUGHT, check_save

        try:
            tracker = read_tracker(run.storage)
        except (OSError, ValueError, RuntimeError):
            tracker = None  # its own problem is the pointer's (tracker_problems)
        if tracker is None or step > tracker:
            named = "no iteration" if tracker is None else self.dirname(tracker)
            return FrameworkSave("uncommitted", reason=(
                f"{run.storage.url(self.dirname(step))}: no resume manifest, and Megatron's tracker names "
                f"{named}: a save Megatron did not finish (ignored, as Megatron ignores it)"))
        check = check_save(run.storage, step, deep=deep, progress=progress)
        counters = check.counters
        return FrameworkSave("broken" if check.problems else "unrecorded", list(check.problems),
                             counters.to_dict() if counters else None,
                             dict(counters.megatron) if counters else {},
                             checked=f"{check.summary()}; {UNCAUGHT}")

    def framework_counters(self, run: Run, result: CheckResult) -> dict | None:
        """Megatron's own sample counters of a committed iteration: as recorded at the save,
        else read from its common state."""
        if result.manifest is None:
            return None
        megatron = result.manifest.expectation.get("megatron")
        recorded = megatron.get("samples") if isinstance(megatron, dict) else None
        if not isinstance(recorded, dict):
            try:
                recorded = read_common_state(run.storage, result.step).args
            except (OSError, ValueError, RuntimeError):
                return None
        # Read from the run's files: only the two counters, and only as integers.
        return {k: v if isinstance(v, int) and not isinstance(v, bool) else None
                for k, v in ((k, recorded.get(k)) for k in SAMPLE_COUNTERS)}


MEGATRON_LAYOUT = register_layout(MegatronLayout(
    "megatron", re.compile(r"^iter_(\d{7,})$"), "iter_{:07d}", "resume-manifest.json", latest=None,
    pointer=MEGATRON_TRACKER))


# -- the tracker and the directories -------------------------------------------------------


def read_tracker(storage: Storage) -> int | None:
    """Megatron's pointer: the iteration it last finished saving; None if there is no tracker."""
    try:
        text = storage.read_bytes(MEGATRON_TRACKER, limit=SMALL_FILE_CAP).decode(errors="replace").strip()
    except FileNotFoundError:
        return None
    if text == "release":
        raise ManifestError(f"{storage.url(MEGATRON_TRACKER)}: expected an iteration, actual 'release' "
                            "(a converted release checkpoint has no training state to resume)")
    try:
        return int(text)
    except ValueError as e:
        raise ManifestError(f"{storage.url(MEGATRON_TRACKER)}: expected an iteration number, "
                            f"actual {text[:40]!r}") from e


def iteration_dirs(storage: Storage) -> list[int]:
    return sorted(s for s in map(MEGATRON_LAYOUT.parse, storage.listdir("")) if s is not None)


def require_save_dir(storage: Storage) -> None:
    """A clear error unless this is a Megatron save directory whose tracker points at something."""
    if not storage.isdir(""):
        raise RunNotFoundError(f"{storage.root}: Megatron save directory: expected a directory, "
                               f"actual {'a file' if storage.exists('') else 'missing'}")
    tracker = read_tracker(storage)
    iterations = iteration_dirs(storage)
    if tracker is None and not iterations:
        raise RunNotFoundError(f"{storage.root}: expected a Megatron save directory ({MEGATRON_TRACKER} "
                               f"or iter_NNNNNNN/), actual neither")
    if tracker is not None and tracker not in iterations:
        raise CheckpointNotFoundError(
            f"{storage.url(MEGATRON_TRACKER)}: expected {MEGATRON_LAYOUT.dirname(tracker)}/ to exist, "
            f"actual missing (iterations present: {iterations[-5:]})")


def require_torch_dist(storage: Storage, iteration: int) -> None:
    """Only ``--ckpt-format torch_dist`` checkpoints are understood; say what else it is."""
    d = MEGATRON_LAYOUT.dirname(iteration)
    names = storage.listdir(d)
    if any(n.startswith("mp_rank_") for n in names) and ".metadata" not in names:
        raise ManifestError(f"{storage.url(d)}: format: expected torch_dist (.metadata, *.distcp), actual "
                            "the legacy torch format (mp_rank_*/model_optim_rng.pt); save with "
                            "--ckpt-format torch_dist")
    try:
        meta = parse_json(storage.read_bytes(join(d, "metadata.json"), limit=SMALL_FILE_CAP))
    except FileNotFoundError:
        raise ManifestError(f"{storage.url(join(d, 'metadata.json'))}: expected Megatron's metadata.json "
                            "({\"sharded_backend\": \"torch_dist\"}), actual missing") from None
    except ValueError as e:
        raise ManifestError(f"{storage.url(join(d, 'metadata.json'))}: {e}") from e
    backend = meta.get("sharded_backend") if isinstance(meta, dict) else None
    if backend != "torch_dist":
        raise ManifestError(f"{storage.url(join(d, 'metadata.json'))}: sharded_backend: expected "
                            f"'torch_dist', actual {short(backend)}")
    if ".metadata" not in names:
        raise ManifestError(f"{storage.url(join(d, '.metadata'))}: expected DCP's .metadata (written last; "
                            "it lists every record's file, offset and length), actual missing")


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
    from .dcp_safe import read_step_metadata

    d = MEGATRON_LAYOUT.dirname(iteration)
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


# -- verification (resume verify on a Megatron save directory) --------------------------------------


def tracker_problems(storage: Storage) -> list[str]:
    """Megatron's pointer must name an iteration that exists."""
    try:
        require_save_dir(storage)
    except (CheckpointNotFoundError, ManifestError, UnsafePathError) as e:  # a linked or FIFO tracker too
        return [str(e)]
    return []


def cross_check(storage: Storage, iteration: int, recorded: TrainState, expectation: dict) -> list[str]:
    """Megatron's own state must agree with our manifest: format, counters, scheduler position."""
    try:
        require_torch_dist(storage, iteration)
        common = read_common_state(storage, iteration)
    except (OSError, ValueError, RuntimeError) as e:
        return [str(e)]
    problems = []
    if common.iteration != iteration:
        problems.append(f"{common.source}: common_state.iteration: expected {iteration} (the directory's), "
                        f"actual {common.iteration}")
    if common.scheduler is None:
        # Saved without the optimizer (Megatron saves the scheduler only with it): the updates
        # and the schedule cannot be derived; iteration and samples still can.
        consumed = common.args.get("consumed_train_samples")
        if consumed != recorded.samples_read:
            problems.append(f"{common.source}: samples_read: expected {recorded.samples_read} (manifest), "
                            f"actual {consumed} (Megatron's consumed_train_samples)")
        return problems
    try:
        derived = common.counters()
    except (ManifestError, InvariantError) as e:
        return [*problems, str(e)]
    for name in ("iteration", "samples_read", "updates_successful", "updates_skipped"):
        if getattr(derived, name) != getattr(recorded, name):
            problems.append(f"{common.source}: {name}: expected {getattr(recorded, name)} (manifest), "
                            f"actual {getattr(derived, name)} (Megatron's state)")
    position = (expectation.get("megatron") or {}).get("scheduler_position")
    if position is not None and position != common.scheduler_position:
        problems.append(f"{common.source}: opt_param_scheduler.num_steps: expected {position} (manifest), "
                        f"actual {common.scheduler_position}")
    recorded_lr = (expectation.get("megatron") or {}).get("lr_schedule_ahead")
    if recorded_lr and not problems:
        try:
            schedule = common.schedule()
        except ManifestError as e:
            return [str(e)]
        gbs = common.args["global_batch_size"]
        lrs = [row[0] for row in schedule.lr_ahead(common.scheduler_position, gbs, len(recorded_lr))]
        if lrs != recorded_lr:
            problems.append(f"{common.source}: opt_param_scheduler: expected the LR ahead {recorded_lr} "
                            f"(manifest), actual {lrs} from the saved schedule")
    return problems
