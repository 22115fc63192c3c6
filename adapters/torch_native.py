"""The native PyTorch adapter: torch.distributed.checkpoint for the sharded state.

Covers a plain module, DDP, and FSDP2/DTensor modules (``get_state_dict`` /
``set_state_dict`` handle all three), any ``torch.optim`` optimizer and several
at once (AdamW for embeddings and head plus Muon for the matrices), several LR
schedulers, and any data object with ``state_dict``/``load_state_dict``.

AdamW creates its moments lazily, at its first step: loading into a fresh
optimizer must first create them, or there is nothing for the load to fill
and they silently stay empty. ``get_state_dict`` does that (a zero-LR step on
zero gradients) before the load; the step counters of ours ignore that step.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import math
import pickle
import re
import struct
import warnings
import weakref
import zipfile
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import xxhash
from .environment import JobEnvironment
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    _get_fqns,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.optim.lr_scheduler import ReduceLROnPlateau

from resume.adapter import Adapter
from resume.collective import Collective
from resume.comm import Comm, LocalComm
from resume.errors import (
    CorruptCheckpointError,
    ResumeError,
    SaveFailedError,
    StorageError,
    UnsafeCheckpointError,
    UsageError,
)
from resume.manifest import MANIFEST_NAME
from resume.schedule import describe_callable, describe_lr_schedule, is_lr_schedule, lr_schedule_values
from resume.storage import MANIFEST_CAP, Storage
from resume.text import clip, parse_json, short

from . import jsonstate
from .data import check_loader, load_loader_state, loader_state
from .dcp_io import make_reader, make_writer, without_torch_crc32
from .dcp_plan_cache import SavePlanCache
from .dcp_safe import (
    SafeLoadPlanner,
    pickle_refusal,
    restricted_load_metadata,
)

log = logging.getLogger("resume")

__all__ = ["NativeTorchAdapter", "TorchDistComm", "allreduce_each_gradient", "comm_for"]

# Scheduler attributes that move with training; everything else in a
# scheduler's state_dict is its configuration.
_DYNAMIC_SCHEDULER_KEYS = {"last_epoch", "_step_count", "_last_lr", "_get_lr_called_within_step",
                           "_is_initial", "verbose", "_schedulers", "_milestones_reached",
                           "best", "num_bad_epochs", "cooldown_counter", "last_epoch_", "T_cur",
                           "T_i", "_initial_step"}


class TorchDistComm:
    """``resume.comm.Comm`` over torch.distributed (any backend; gloo on CPU)."""

    def __init__(self, group: Any = None) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)

    def barrier(self) -> None:
        dist.barrier(group=self.group)

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        box = [obj]
        dist.broadcast_object_list(box, src=src, group=self.group)
        return box[0]

    def all_gather_object(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def gather_object(self, obj: Any, dst: int = 0) -> list[Any] | None:
        out: list[Any] | None = [None] * self.world_size if self.rank == dst else None
        # dst is a rank of this group; torch wants the global rank.
        dist.gather_object(obj, out, dst=dist.get_global_rank(self.group, dst) if self.group else dst,
                           group=self.group)
        return out

    def scatter_object(self, objs: list[Any] | None, src: int = 0) -> Any:
        out: list[Any] = [None]
        dist.scatter_object_list(out, objs if self.rank == src else None,
                                 src=dist.get_global_rank(self.group, src) if self.group else src, group=self.group)
        return out[0]

    def fork(self) -> TorchDistComm:
        # gloo whatever training uses: the background save moves CPU objects only.
        # For a subgroup only its members take part (the rest of the world never calls this).
        ranks = None if self.group is None else dist.get_process_group_ranks(self.group)
        return TorchDistComm(dist.new_group(ranks=ranks, backend="gloo",
                                            use_local_synchronization=ranks is not None))

    def max_flags(self, flags: list[int]) -> list[int]:
        # On the device NCCL needs; gloo and others take CPU tensors.
        device = "cuda" if dist.get_backend(self.group) == "nccl" else "cpu"
        t = torch.tensor([int(f) for f in flags], dtype=torch.int64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return [int(x) for x in t.tolist()]


def _state_bytes(obj: Any) -> int:
    if isinstance(obj, torch.Tensor):
        local = obj.to_local() if hasattr(obj, "to_local") else obj
        return local.numel() * local.element_size()
    if isinstance(obj, dict):
        return sum(_state_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_state_bytes(v) for v in obj)
    return 0


def _explain_dcp_failure(e: BaseException, state: Any, storage: Storage, step_dir: str) -> str:
    """One line: what failed where and on which ranks; for a full disk, the bytes needed and free."""
    import os

    failures = getattr(e, "failures", None) or {}
    causes = {rank: (c[0] if isinstance(c, tuple) else c) for rank, c in failures.items()}
    where = storage.url(step_dir)
    ranks = sorted(causes)
    cause = causes[ranks[0]] if ranks else None
    full = {rank for rank, c in causes.items() if _is_out_of_space(c)}
    if full:
        needed = _state_bytes(state)
        local = storage.local_path(step_dir)
        free = ""
        if local is not None:
            st = os.statvfs(local)
            free = f", {st.f_bavail * st.f_frsize} bytes free now"
        return (f"{where}: disk full (or quota) on ranks {sorted(full)[:8]}: expected room for each rank's "
                f"shards, about {needed} bytes for this one, actual no space left{free} (the previous "
                "checkpoint is untouched; the partial step is removed: free space or move the run)")
    detail = f"{type(cause).__name__}: {cause}" if cause is not None else str(e).splitlines()[0]
    return f"{where}: writing the shards failed on ranks {ranks[:8]}: {detail}"


def _load_failure(e: BaseException, storage: Storage, step_dir: str) -> ResumeError:
    """DCP's CheckpointException of a load as one of our errors: a refused pickle stays an
    UnsafeCheckpointError, anything else a CorruptCheckpointError; both name the step and ranks."""
    import pickle

    failures = getattr(e, "failures", None) or {}
    causes = {rank: (c[0] if isinstance(c, tuple) else c) for rank, c in failures.items()}
    ranks = sorted(causes)
    cause = causes[ranks[0]] if ranks else e
    where = f"{storage.url(step_dir)}: loading the shards failed on ranks {ranks[:8]}"
    for c in causes.values():
        if isinstance(c, UnsafeCheckpointError):
            return UnsafeCheckpointError(f"{where}: {c}")
        if isinstance(c, pickle.UnpicklingError):
            return UnsafeCheckpointError(f"{where}: pickle: expected tensor data only, actual "
                                         f"{pickle_refusal(c)} (refused, nothing run)")
    if isinstance(cause, ResumeError):
        return cause
    detail = str(cause).splitlines()[0] if str(cause) else ""
    return CorruptCheckpointError(f"{where}: {type(cause).__name__}: {detail}")


def _is_out_of_space(exc: BaseException | None) -> bool:
    """ENOSPC or EDQUOT anywhere in the chain: torch.save's zip writer re-raises it as a RuntimeError."""
    import errno

    seen = 0
    while exc is not None and seen < 10:
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        exc = exc.__cause__ or exc.__context__
        seen += 1
    return False


def _copy_tree(obj: Any, reuse: Any = None) -> Any:
    """Tensors copied (to CPU), containers rebuilt, everything else shared (immutable scalars).

    ``reuse``: an earlier copy of the same structure; a plain tensor of the same shape and dtype
    there is copied into rather than allocated anew. Memory the process has touched before
    takes a copy several times faster than fresh pages that must be faulted in.
    """
    if isinstance(obj, torch.Tensor):
        if (type(obj) is torch.Tensor and type(reuse) is torch.Tensor and reuse.device.type == "cpu"
                and reuse.shape == obj.shape and reuse.dtype == obj.dtype and reuse.stride() == obj.stride()):
            return reuse.copy_(obj.detach())
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        old = reuse if isinstance(reuse, dict) else {}
        return {k: _copy_tree(v, old.get(k)) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        old = reuse if isinstance(reuse, (list, tuple)) and len(reuse) == len(obj) else [None] * len(obj)
        items = [_copy_tree(v, r) for v, r in zip(obj, old)]
        return items if isinstance(obj, list) else tuple(items)
    return copy.deepcopy(obj)


def allreduce_each_gradient(state, bucket):
    """Average gradients parameter by parameter, not per DDP bucket.

    With more than 2 ranks the sum's order depends on where an element falls in
    the buffer being reduced, and DDP lays its buckets out differently in the
    first iteration after it is constructed (a restarted job) than later. One
    reduction per parameter makes the order depend on the parameter alone, so
    a resumed run can be bitwise identical at any data-parallel size.

    Use: ``ddp.register_comm_hook(state=None, hook=allreduce_each_gradient)``.
    It costs one collective per parameter instead of one per bucket: for
    reproducibility checks and small models, not for a 500B run.
    """
    world = dist.get_world_size()
    for grad in bucket.gradients():
        grad.div_(world)
        dist.all_reduce(grad)
    future = torch.futures.Future()
    future.set_result(bucket.buffer())
    return future


def comm_for(group: Any = None) -> Comm:
    if dist.is_available() and dist.is_initialized():
        return TorchDistComm(group)
    return LocalComm()


class NativeTorchAdapter(Adapter):
    """Model + optimizers + schedulers + data, saved with torch.distributed.checkpoint."""

    name = "torch-native"

    def __init__(self, model: torch.nn.Module | Iterable[torch.nn.Module],
                 optimizers: torch.optim.Optimizer | Iterable, schedulers: Any = (), data: Any = None, *,
                 comm: Comm | None = None, process_group: Any = None, compression: str | None = None,
                 moving_settings: Iterable[str] = (), model_state: str = "auto",
                 plan_caching: bool = True) -> None:
        """``model``: a module, or the model parts this rank holds (pipeline stages; torchtitan's
        ``model_parts``), whose state names do not overlap.

        ``optimizers``: a torch optimizer, several, or a container of them: any object with an
        ``optimizers`` list (torchtitan's ``OptimizersContainer``) counts as the optimizers it
        holds. ``schedulers``: likewise, an object with a ``schedulers`` list
        (``LRSchedulersContainer``) counts as the schedulers it holds. An optimizer whose
        moments the adapter cannot see (param groups without ``lr``; no state after a step while
        it holds other optimizers) is refused, never saved without them.

        ``model_state``: how the model's state is read and put back. ``"get_state_dict"``:
        torch's ``get_model_state_dict``/``set_model_state_dict`` (names from the parameters;
        DDP, FSDP2 and activation-checkpoint wrappers unwrapped). ``"module"``: the model's own
        ``state_dict()``/``load_state_dict()``, with every state-dict hook it registers (a fused
        QKV projection that saves ``wq``/``wk``/``wv``, as torchtitan's ``FusedQKVLinear``);
        FSDP2/DTensor sharding is kept. ``"auto"`` (the default): ``"module"`` when a module of
        the model registers a state-dict hook of its own (outside torch), else ``"get_state_dict"``.
        The optimizers' state is torch's ``get_optimizer_state_dict`` either way.

        ``compression``: ``"zstd"`` compresses every shard item (a per-run choice; off by
        default: on a local disk here it costs more time than the bytes it saves).

        ``moving_settings``: param-group fields besides ``lr`` that the loop sets as training goes
        (a hand-set momentum warm-up, say): restored from the checkpoint and never compared with
        the code's value. Fields a torch scheduler moves (``betas``/``momentum`` with
        ``cycle_momentum``) count as moving by themselves. Every other scalar field of a group is
        a setting: a value in the code that differs from the checkpoint's is refused at restore
        unless accepted (``Coordinator(accept_changes=...)``).

        ``plan_caching``: DCP's save-plan caching (on by default): a save whose every rank's
        local plan equals its last one (same names, shapes, shardings, dtypes) reuses rank 0's
        global plan and ``.metadata`` layout instead of planning anew (55 s at 5,120 ranks of the
        reference layout, 0.2 ms cached). The cache is this adapter's own, one per save path
        (synchronous, asynchronous), dropped after a failed save; any change replans. Rank 0
        keeps every rank's plan in memory, about 4.3 GB at 5,120 ranks (adapters/dcp_plan_cache.py):
        ``False`` gives the memory back and plans every save in full."""
        from .dcp_io import COMPRESSIONS

        if compression not in COMPRESSIONS:
            raise UsageError(f"compression: expected one of {COMPRESSIONS}, actual {compression!r}")
        self.compression = compression
        self._plan_cache = SavePlanCache(type(self).__name__, enabled=plan_caching)
        self.model_parts = [model] if isinstance(model, torch.nn.Module) else list(model)
        if not self.model_parts or not all(isinstance(m, torch.nn.Module) for m in self.model_parts):
            raise UsageError("model: expected a torch.nn.Module or a list of them (model parts), actual "
                             f"{type(model).__name__}")
        self.model = self.model_parts[0]
        self.optimizers = _unpack_optimizers(optimizers)
        self.schedulers = _unpack_schedulers(schedulers)
        if model_state not in MODEL_STATE_MODES:
            raise UsageError(f"model_state: expected one of {MODEL_STATE_MODES}, actual {model_state!r}")
        self.model_state = (model_state if model_state != "auto" else
                            "module" if any(_renames_state(m) for m in self.model_parts) else "get_state_dict")
        self._optimizer_part = _optimizer_parts(self.model_parts, self.optimizers)
        self.data = data
        self.process_group = process_group
        self.comm = comm if comm is not None else comm_for(process_group)
        ours = [s for s in self.schedulers if not _is_torch_scheduler(s)]
        for s in ours:
            if not is_lr_schedule(s):
                raise UsageError(f"schedulers: expected torch LR schedulers or schedules with lr_at(updates) "
                                 f"(resume.schedule.LRSchedule), actual {type(s).__name__}")
        if ours and (len(ours) > 1 or len(self.schedulers) > 1):
            raise UsageError("schedulers: expected either torch LR schedulers or one schedule with "
                             "lr_at(updates) giving the LR of every param group, actual both or several "
                             f"({', '.join(type(s).__name__ for s in self.schedulers)})")
        self._function_schedule = ours[0] if ours else None
        self.moving_settings = set(moving_settings)
        if any(getattr(s, "cycle_momentum", False) for s in self.schedulers):
            self.moving_settings |= {"betas", "momentum"}
        self._steps = [0] * len(self.optimizers)
        self._applied: list[list[float] | None] = [None] * len(self.optimizers)
        self._internal_step = False
        self._staged_state: Any = None  # the last staged copy, reused by the next (stage_shards)
        self._checked_metadata: tuple | None = None  # (step_dir, bytes, recorded, Metadata): shard_problems'
        for i, opt in enumerate(self.optimizers):
            opt.register_step_pre_hook(self._make_lr_recorder(i))
            opt.register_step_post_hook(self._make_step_counter(i))

    def _make_step_counter(self, index: int):
        # A weak reference: the optimizer must not keep the adapter (and with it
        # the model and process group users) alive in a reference cycle.
        adapter = weakref.ref(self)

        def hook(optimizer, args, kwargs) -> None:
            me = adapter()
            if me is not None and not me._internal_step:
                me._steps[index] += 1
        return hook

    def _make_lr_recorder(self, index: int):
        """The LR each group is stepped with: what the first update after a restart is checked on."""
        adapter = weakref.ref(self)

        def hook(optimizer, args, kwargs) -> None:
            me = adapter()
            if me is not None and not me._internal_step:
                me._applied[index] = [_lr_value(g["lr"]) for g in optimizer.param_groups]
        return hook

    # -- data ---------------------------------------------------------------------------

    def has_data(self) -> bool:
        return self.data is not None

    def data_iterator(self) -> Iterator[Any]:
        if self.data is None:
            raise ValueError("NativeTorchAdapter: data: expected an iterable of batches, actual None")
        check_loader(self.data)  # e.g. a StatefulDataLoader whose state would not be exact
        return iter(self.data)

    def data_state(self) -> Any:
        # torchdata's StatefulDataLoader is wrapped with what a restore checks first
        # (num_workers, the sampler); any other loader's state_dict as it is.
        return loader_state(self.data)

    def load_data_state(self, state: Any) -> None:
        load_loader_state(self.data, state)

    def describe_batch(self, batch: Any) -> list[tuple[int, str]]:
        """Sample ids from a dict's ``ids`` (``sample_ids``, ``index``) or a tuple's first item
        (an integer vector); the digest of each row over every other tensor of the batch. A
        batch without ids (torchtitan's ``(inputs, labels)``) gives each row by its position."""
        ids, fields = _ids_and_fields(batch)
        tensors = [f for f in fields if f.dim() > 0]
        rows = len(ids) if ids is not None else (len(tensors[0]) if tensors else 0)
        if ids is None and not rows:
            raise ValueError(f"describe_batch: expected a batch of tensors (a dict or tuple of them, "
                             f"nested), actual {type(batch).__name__} without any")
        out = []
        for row in range(rows):
            h = xxhash.xxh3_64()
            for f in tensors:
                if len(f) == rows:
                    h.update(f[row].detach().cpu().contiguous().numpy().tobytes())
            out.append((int(ids[row]) if ids is not None else -1 - row, h.hexdigest()))
        return out

    # -- schedule and optimizer -------------------------------------------------------------

    def describe_schedule(self) -> list[dict]:
        return [_describe_scheduler(s) if _is_torch_scheduler(s) else describe_lr_schedule(s)
                for s in self.schedulers]

    def current_lrs(self) -> list[float]:
        return [float(g["lr"]) for opt in self.optimizers for g in opt.param_groups]

    def lr_ahead(self, k: int) -> list[list[float]]:
        if self._function_schedule is not None:
            return self._lr_ahead_of_function(k)
        # Step the real schedulers k-1 times and put everything back: cheaper
        # and more faithful than deep-copying optimizers with their parameters.
        saved_groups = [[{key: v for key, v in g.items() if key != "params"} for g in opt.param_groups]
                        for opt in self.optimizers]
        saved_schedulers = [copy.deepcopy(s.state_dict()) for s in self.schedulers]
        out = [self.current_lrs()]
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                for _ in range(k - 1):
                    for s in self.schedulers:
                        if not isinstance(s, ReduceLROnPlateau):  # moves on metrics only
                            s.step()
                    out.append(self.current_lrs())
        except (ValueError, IndexError, ZeroDivisionError):
            # A schedule with a fixed end (OneCycleLR) cannot step past it: the
            # look-ahead stops there, the same way at save and at restore.
            pass
        finally:
            for opt, groups in zip(self.optimizers, saved_groups):
                for g, saved in zip(opt.param_groups, groups):
                    g.update(saved)
            for s, state in zip(self.schedulers, saved_schedulers):
                s.load_state_dict(state)
        return out

    def optimizer_steps(self) -> list[int]:
        return list(self._steps)

    def scheduler_positions(self) -> list[int]:
        # A schedule of ours has no position of its own: it is the count of successful updates.
        return [_position(s) for s in self.schedulers if _is_torch_scheduler(s)]

    def _lr_ahead_of_function(self, k: int) -> list[list[float]]:
        schedule = self._function_schedule
        done = self._steps[0] if self._steps else 0
        groups = sum(len(opt.param_groups) for opt in self.optimizers)
        out = []
        for n in range(done, done + k):
            lrs = lr_schedule_values(schedule, n)
            if len(lrs) != groups:
                raise UsageError(f"schedule: expected {groups} LRs from lr_at({n}) (one per param group, "
                                 f"all optimizers in order), actual {len(lrs)}")
            out.append(lrs)
        return out

    def optimizer_fingerprint(self) -> list[dict]:
        """Per optimizer: the sum of the bit patterns of every moment, per state key, mod 2**32.

        Computed where each tensor lives (one reduction per tensor, no host copy; the
        partial sums stay on the device until one transfer per optimizer). Integer
        addition does not depend on order, so the sum over a sharded tensor's shards is
        the same for any sharding: ``sharded`` (DTensor shards, each element counted on
        one rank) survives an elastic restart as a total over the ranks, ``replicated``
        (plain tensors: every data-parallel rank holds the whole) as each rank's value.
        """
        return [_moment_fingerprint(opt) for opt in self.optimizers]

    def describe_structure(self) -> list[dict]:
        """Per optimizer: its class and, per param group, its name, its parameters (count and a
        digest of their checkpoint names) and its settings (every scalar but the LR itself)."""
        names = self._param_names()
        out = []
        for opt in self.optimizers:
            groups = []
            for g in opt.param_groups:
                fqns = sorted(n for p in g["params"] for n in names.get(p, ("?",)))
                groups.append({"name": _json_scalar(g.get("name")), "params": len(g["params"]),
                               "names": xxhash.xxh3_64_hexdigest("\n".join(fqns).encode()),
                               "settings": _group_settings(g, self.moving_settings)})
            out.append({"class": type(opt).__name__, "groups": groups, "moving": sorted(self.moving_settings)})
        return out

    def lr_groups(self) -> list[str]:
        """A label per param group, in the order of ``current_lrs()``."""
        return [_lr_label(i, j, g) for i, opt in enumerate(self.optimizers)
                for j, g in enumerate(opt.param_groups)]

    def applied_lrs(self) -> list[float | None]:
        """Per param group (as ``lr_groups()``): the LR its optimizer's last step applied, None
        if it has not stepped since the adapter was built (or the group is newer than that step)."""
        out: list[float | None] = []
        for opt, applied in zip(self.optimizers, self._applied):
            out += [applied[j] if applied is not None and j < len(applied) else None
                    for j in range(len(opt.param_groups))]
        return out

    @property
    def job_id(self) -> str | None:
        """Slurm's job id or torchrun's run id (``resume.adapters.environment``): the lease
        holder's name, the same in the job's requeued and restarted copies."""
        return JobEnvironment.from_env().job_id

    @property
    def lr_set_by_loop(self) -> bool:
        """True when a schedule of ours (``resume.schedule.LRSchedule``) is declared: the loop sets
        the LR just before each step, so the groups hold the previous update's LR in between."""
        return self._function_schedule is not None

    def snapshot_settings(self) -> Any:
        """The code's settings, taken before a load overwrites them (for ``apply_changes``)."""
        groups = [[{k: copy.deepcopy(v) for k, v in g.items() if k != "params"} for g in opt.param_groups]
                  for opt in self.optimizers]
        return {"groups": groups, "schedulers": [copy.deepcopy(s.state_dict()) if _is_torch_scheduler(s)
                                                 else None for s in self.schedulers]}

    def apply_changes(self, items: list[str], snapshot: Any) -> None:
        """After a load: put the code's values back for the accepted ``items`` (resume.changes),
        then set each affected optimizer's current LR once, from its schedule as it now is."""
        old_lrs = {i: [_lr_value(g["lr"]) for g in opt.param_groups] for i, opt in enumerate(self.optimizers)}
        old_peaks = {i: [g.get("initial_lr", g["lr"]) for g in opt.param_groups]
                     for i, opt in enumerate(self.optimizers)}
        peaks_moved, reconfigured = self._put_back(items, snapshot)
        for k in sorted(reconfigured):
            s, code_state = self.schedulers[k], snapshot["schedulers"][k]
            loaded = s.state_dict()
            merged = {key: v for key, v in code_state.items() if key not in _DYNAMIC_SCHEDULER_KEYS}
            merged.update({key: v for key, v in loaded.items() if key in _DYNAMIC_SCHEDULER_KEYS})
            s.load_state_dict(merged)
        for i, opt in enumerate(self.optimizers):
            driving = [k for k, s in enumerate(self.schedulers)
                       if _is_torch_scheduler(s) and getattr(s, "optimizer", None) is opt]
            touched = [k for k in driving if k in reconfigured]
            if i not in peaks_moved and not touched:
                continue
            new_peaks = [g.get("initial_lr", g["lr"]) for g in opt.param_groups]
            if i in peaks_moved:
                for k in driving:
                    if hasattr(self.schedulers[k], "base_lrs"):
                        self.schedulers[k].base_lrs = list(new_peaks)
            closed = _closed_form_lrs(self.schedulers[driving[0]]) if len(driving) == 1 else None
            if closed is not None:
                for g, lr in zip(opt.param_groups, closed):
                    g["lr"] = lr
            elif i in peaks_moved:
                for g, lr in zip(opt.param_groups, old_lrs[i]):
                    g["lr"] = lr
                _rescale_lrs(opt, old_peaks[i], new_peaks)
            else:
                log.warning("resume: the schedule of optimizer[%d] changed and has no closed form: its "
                            "current LR stays %s until the schedule moves it", i, old_lrs[i])

    def _put_back(self, items: list[str], snapshot: Any) -> tuple[set[int], set[int]]:
        """The code's param-group values for the accepted group items; (the optimizers whose
        peak moved, the torch schedulers whose configuration is the code's)."""
        peaks_moved: set[int] = set()
        reconfigured: set[int] = set()
        for item in items:
            m = _GROUP_ITEM.match(item)
            if m:
                i, j, key = int(m[1]), int(m[2]), m[3]
                group, code = self.optimizers[i].param_groups[j], snapshot["groups"][i][j]
                if key in code:
                    group[key] = copy.deepcopy(code[key])
                else:
                    group.pop(key, None)
                if key == "initial_lr":
                    peaks_moved.add(i)
                continue
            m = _SCHEDULE_ITEM.match(item)
            if m and snapshot["schedulers"][int(m[1])] is not None:  # ours: the code's already
                reconfigured.add(int(m[1]))
        return peaks_moved, reconfigured

    def _param_names(self) -> dict:
        names = {}
        for part in self.model_parts:
            for name, param in part.named_parameters():
                names[param] = _get_fqns(part, name)
        return names

    # -- persistence ------------------------------------------------------------------------

    def state_dict(self) -> dict:
        # Param-group hyperparameters travel here too: an optimizer without
        # state yet is not in the sharded checkpoint, but its LR still moved.
        groups = [[{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
                  for opt in self.optimizers]
        return {"schedulers": [jsonstate.encode(s.state_dict()) if hasattr(s, "state_dict") else None
                               for s in self.schedulers],
                "optimizer_steps": list(self._steps), "param_groups": jsonstate.encode(groups)}

    def load_state_dict(self, state: dict) -> None:
        saved = state["schedulers"]
        if len(saved) != len(self.schedulers):
            raise ValueError(f"schedulers: expected {len(saved)} (as saved), actual {len(self.schedulers)}")
        for s, sd in zip(self.schedulers, saved):
            if sd is not None and hasattr(s, "load_state_dict"):
                s.load_state_dict(jsonstate.decode(sd))
        steps = [int(x) for x in state["optimizer_steps"]]
        if len(steps) != len(self.optimizers):
            raise ValueError(f"optimizers: expected {len(steps)} (as saved), actual {len(self.optimizers)}")
        self._steps = steps
        for opt, groups in zip(self.optimizers, jsonstate.decode(state.get("param_groups", [])),
                               strict=False):
            for g, saved in zip(opt.param_groups, groups, strict=False):
                g.update(saved)

    def _sharded_state(self, optimizers: list) -> dict:
        """Model and optimizer state for DCP. ``get_state_dict`` creates the state of an
        optimizer that has none (a zero-LR step), so only optimizers named here are touched."""
        self._internal_step = True
        model_sd: dict = {}
        optim_sd: dict = {}
        try:
            for index, part in enumerate(self.model_parts):
                _merge_into(model_sd, self._part_model_state(part), f"model part {index}")
                mine = [o for o in optimizers if self._optimizer_part[id(o)] == index]
                if mine:
                    part_optim = get_optimizer_state_dict(part, mine)
                    _merge_into(optim_sd.setdefault("state", {}), part_optim.get("state", {}),
                                f"optimizer state of model part {index}")
                    optim_sd.setdefault("param_groups", []).extend(part_optim.get("param_groups", []))
        finally:
            self._internal_step = False
        return {"model": model_sd, "optim": optim_sd}

    def _part_model_state(self, part: torch.nn.Module) -> dict:
        if self.model_state == "module":
            return part.state_dict()
        return get_model_state_dict(part)

    def _check_visible(self, optimizers: list) -> None:
        """Refuse to save an optimizer whose moments are not in its own ``state``."""
        for opt in optimizers:
            i = self.optimizers.index(opt)
            if self._steps[i] and not opt.state and _holds_optimizers(opt):
                raise UsageError(
                    f"optimizers[{i}] ({type(opt).__name__}): expected its moments in its state after "
                    f"{self._steps[i]} steps, actual an empty state: it holds other optimizers, whose "
                    "state it does not show. Pass the optimizers it holds instead (a list), or give it "
                    "an 'optimizers' attribute listing them; saving it would lose the moments")

    def _set_loaded(self, state: dict, saved_optimizers: list) -> None:
        """The loaded ``state`` into every model part and its optimizers (strict for the model;
        parameters that had no optimizer state keep none)."""
        for index, part in enumerate(self.model_parts):
            mine = [o for o in saved_optimizers if self._optimizer_part[id(o)] == index]
            part_keys = self._part_model_state(part).keys() if len(self.model_parts) > 1 else None
            model_sd = state["model"] if part_keys is None else {k: state["model"][k] for k in part_keys}
            if self.model_state == "module":
                part.load_state_dict(model_sd)
            else:
                set_model_state_dict(part, model_sd)
            if mine:
                set_optimizer_state_dict(part, mine, optim_state_dict=self._optim_subset(state["optim"], part),
                                         options=StateDictOptions(strict=False))

    def _optim_subset(self, optim_sd: dict, part: torch.nn.Module) -> dict:
        if len(self.model_parts) == 1:
            return optim_sd
        fqns = {fqn for name, _ in part.named_parameters() for fqn in _get_fqns(part, name)}
        return {"state": {k: v for k, v in optim_sd.get("state", {}).items() if k in fqns},
                "param_groups": [g for g in optim_sd.get("param_groups", []) if set(g["params"]) & fqns]}

    def save_shards(self, storage: Storage, step_dir: str) -> list[str]:
        # An optimizer without state (no update applied yet) is left out: making
        # its state up for the save would change the training that follows.
        self._check_visible(self.optimizers)
        state = self._sharded_state([o for o in self.optimizers if o.state])
        return self._dcp_save(state, storage, step_dir, self.process_group)

    def _dcp_save(self, state: Any, storage: Storage, step_dir: str, group: Any, *,
                  background: bool = False) -> dict:
        writer = make_writer(storage, step_dir, durable=True, compression=self.compression,
                             copy_ahead=not background)
        # torch.save's CRC switch is process-wide: only a save on the training thread
        # (the loop is waiting) turns it off; a background write keeps it.
        crc = contextlib.nullcontext() if background else without_torch_crc32()
        # Both paths cache their plans, under keys of their own: the coordinator never runs two
        # of this adapter's saves at once (a save waits for the background one in flight), and
        # even if it did, two keys share no entry. dcp.async_save is not used here.
        planner = self._plan_cache.planner("staged" if background else "live", group)
        try:
            with _quiet_single_process(), crc, self._plan_cache.dropped_on_failure(planner):
                metadata = dcp.save(state, storage_writer=writer, planner=planner, process_group=group,
                                    no_dist=not dist.is_initialized())
        except CheckpointException as e:  # a BaseException: make it ours, with the cause
            raise SaveFailedError(_explain_dcp_failure(e, state, storage, step_dir)) from e
        # Checksummed while written: no second read of the shards.
        return {rel: writer.fs.written.get(rel) for rel in self._files_of_this_rank(metadata)}

    def _files_of_this_rank(self, metadata: Any) -> list[str]:
        # DCP names data files "__<rank>_<n>.distcp"; rank 0 also owns ".metadata"
        # and anything it cannot attribute.
        rank = self.comm.rank
        files = {info.relative_path for info in metadata.storage_data.values()}
        mine = set()
        for name in files:
            owner = _distcp_owner(name)
            if owner == rank or (owner is None and rank == 0):
                mine.add(name)
        if rank == 0:
            mine.add(".metadata")
        return sorted(mine)

    def can_stage(self) -> bool:
        return True

    def prepare_load(self) -> list:
        """The state of every optimizer that has none, created (a zero-LR step) so that a load
        can fill it: the part of a restore that costs compute, not I/O."""
        fresh = [o for o in self.optimizers if not o.state]
        if fresh:
            self._sharded_state(fresh)
        return fresh

    def discard_prepared(self, token: object) -> None:
        for opt in token or ():  # type: ignore[union-attr]
            opt.state.clear()

    def stage_shards(self) -> Any:
        """A private copy of the sharded state (model and optimizer tensors), for a background
        write, and which optimizer owns each parameter's state (for ``fingerprint_staged``)."""
        self._check_visible(self.optimizers)
        state = self._sharded_state([o for o in self.optimizers if o.state])
        names = self._param_names()
        owners = {fqn: (i, id(p)) for i, opt in enumerate(self.optimizers) for g in opt.param_groups
                  for p in g["params"] for fqn in names.get(p, ())}
        # The previous staged copy is reused (the coordinator has waited for its write): an
        # asynchronous save keeps one host copy of the state between saves, as a staging cache.
        staged = _copy_tree(state, self._staged_state)
        self._staged_state = staged
        return {"state": staged, "owners": owners}

    def write_staged(self, staged: Any, storage: Storage, step_dir: str, comm: Any) -> dict:
        return self._dcp_save(staged["state"], storage, step_dir, getattr(comm, "group", None), background=True)

    def can_fingerprint_staged(self) -> bool:
        return True

    def fingerprint_staged(self, staged: Any) -> list[dict]:
        per_optimizer: list[list[dict]] = [[] for _ in self.optimizers]
        seen = set()
        for fqn, entry in staged["state"]["optim"].get("state", {}).items():
            owner = staged["owners"].get(fqn)
            if owner is None or owner in seen:  # a parameter under two names counts once
                continue
            seen.add(owner)
            per_optimizer[owner[0]].append(entry)
        return [_fingerprint_states(states) for states in per_optimizer]

    def load_shards(self, storage: Storage, step_dir: str) -> None:
        try:
            self._load_shards(storage, step_dir)
        except (ResumeError, MemoryError):
            raise
        except _DAMAGE as e:  # what a damaged file makes torch or DCP raise outside dcp.load
            raise CorruptCheckpointError(f"{storage.url(step_dir)}: loading the shards failed: "
                                         f"{type(e).__name__}: {clip(str(e), 300)}") from e

    def shard_problems(self, storage: Storage, step_dir: str) -> list[str]:
        """DCP's .metadata unpickled and checked in shape and bounds against the manifest; kept
        for the load that follows (read and unpickled once per restore)."""
        self._checked_metadata = None
        try:
            data, recorded = self._read_metadata_and_record(storage, step_dir)
            metadata = self._parse_metadata(storage, step_dir, data, recorded)
        except UnsafeCheckpointError:
            raise  # code in a checkpoint: refused loudly, not passed over
        except CorruptCheckpointError as e:
            return [str(e)]
        self._checked_metadata = (step_dir, data, recorded, metadata)
        return []

    def _parse_metadata(self, storage: Storage, step_dir: str, data: bytes, recorded: dict) -> Any:
        checked = self._checked_metadata
        if checked is not None and checked[0] == step_dir and checked[1] is data:
            return checked[3]
        return restricted_load_metadata(data, source=storage.url(f"{step_dir}/.metadata"),
                                        file_sizes=recorded["sizes"], compression=recorded["compression"])

    def _load_shards(self, storage: Storage, step_dir: str) -> None:
        # Refuse a hostile .metadata here, with our error, before DCP sees it: its shape and
        # bounds checked against the manifest's files (the one reader below loads it).
        metadata, recorded = self._read_on_rank0(storage, step_dir)
        self._checked_metadata = None
        saved_fqns = {key[len("optim.state."):].rsplit(".", 1)[0]
                      for key in metadata.state_dict_metadata if key.startswith("optim.state.")}
        # A fresh optimizer has no state; DCP needs tensors to load into, so it
        # is created (zero-LR step) and then trimmed to what was saved: the
        # optimizers and parameters that had no state then have none now.
        saved_optimizers = [o for o, fqns in zip(self.optimizers, self._fqns_per_optimizer(), strict=True)
                            if fqns & saved_fqns]
        state = self._sharded_state(saved_optimizers)
        for fqn in [f for f in state["optim"].get("state", {}) if f not in saved_fqns]:
            del state["optim"]["state"][fqn]
        reader = make_reader(storage, step_dir)
        reader.preloaded_metadata = metadata  # parsed once above, not read again by every rank
        reader.compressed = recorded["compression"] == "zstd"
        try:
            with _quiet_single_process():
                dcp.load(state, storage_reader=reader, planner=SafeLoadPlanner(),
                         process_group=self.process_group, no_dist=not dist.is_initialized())
        except CheckpointException as e:  # a BaseException: make it ours, naming what refused
            raise _load_failure(e, storage, step_dir) from e
        # Every model key was loaded above (DCP fails on a missing one).
        self._set_loaded(state, saved_optimizers)
        for opt in self.optimizers:
            if opt not in saved_optimizers:
                opt.state.clear()

    def _read_on_rank0(self, storage: Storage, step_dir: str) -> tuple[Any, dict]:
        """DCP's metadata and what the manifest records about the shards (file sizes, the
        compression), read once (rank 0) and broadcast: thousands of ranks never open the
        same file of a parallel file system or an object store.

        Rank 0 parses ``.metadata`` with the allow-list unpickler and checks its shape and
        bounds; what the others receive is the object it built, pickled by rank 0 itself: the
        checkpoint's bytes never reach their unpickler, so they load it at plain pickle's
        speed (the restricted unpickler is several times slower: at 5,120 ranks ``.metadata``
        is over 600 MiB, ``benchmarks/scale.py``)."""
        def read() -> tuple[Any, dict]:
            checked = self._checked_metadata  # read by shard_problems (this rank 0) just before
            if checked is not None and checked[0] == step_dir:
                return checked[3], checked[2]
            data, recorded = self._read_metadata_and_record(storage, step_dir)
            return self._parse_metadata(storage, step_dir, data, recorded), recorded
        return Collective(self.comm).on_rank0(read)

    def _read_metadata_and_record(self, storage: Storage, step_dir: str) -> tuple[bytes, dict]:
        path = f"{step_dir}/.metadata"
        recorded = _recorded_for_shards(storage, step_dir)
        limit = (recorded["sizes"] or {}).get(".metadata")
        try:
            return storage.read_bytes(path, limit=limit), recorded
        except CorruptCheckpointError:
            raise
        except OSError as e:  # missing: the checkpoint is damaged; else storage trouble
            kind = CorruptCheckpointError if isinstance(e, FileNotFoundError) else StorageError
            raise kind(f"{storage.url(path)}: expected readable DCP metadata, actual "
                       f"{type(e).__name__}: {clip(str(e))}") from e

    def _fqns_per_optimizer(self) -> list[set[str]]:
        """The checkpoint names (FQNs) of each optimizer's parameters."""
        names = self._param_names()
        return [{fqn for g in opt.param_groups for p in g["params"] for fqn in names.get(p, ())}
                for opt in self.optimizers]

    def topology(self) -> dict:
        topology: dict = {"world_size": self.comm.world_size, "data_parallel": self.comm.world_size}
        if self.compression is not None:
            # What a restore honours: a compression transform in .metadata counts only when
            # the manifest records it (dcp_safe.SafeFileSystemReader.compressed).
            topology["compression"] = self.compression
        return topology


_DAMAGE = (ValueError, TypeError, KeyError, IndexError, AttributeError, OverflowError, RecursionError,
           EOFError, struct.error, zipfile.BadZipFile, pickle.UnpicklingError)


def _recorded_for_shards(storage: Storage, step_dir: str) -> dict:
    """From the step's manifest (already verified by the restore's choice): each file's size,
    which bounds every item of .metadata, and the compression the save used, the only
    transform a load honours. A manifest without them (another layout): no bounds, no
    compression."""
    path = f"{step_dir}/{MANIFEST_NAME}"
    try:
        body = parse_json(storage.read_bytes(path, limit=MANIFEST_CAP))
    except FileNotFoundError:
        return {"sizes": None, "compression": None}
    except ValueError as e:
        raise CorruptCheckpointError(f"{storage.url(path)}: {e}") from e
    files = body.get("files") if isinstance(body, dict) else None
    topology = body.get("topology") if isinstance(body, dict) else None
    sizes = {rel: entry["size"] for rel, entry in files.items()
             if isinstance(entry, dict) and type(entry.get("size")) is int} if isinstance(files, dict) else None
    compression = topology.get("compression") if isinstance(topology, dict) else None
    return {"sizes": sizes, "compression": compression if compression in ("zstd",) else None}


# Param-group keys that are not training settings: the parameters, the LR itself (moved by
# the schedule), and switches that choose how the update is computed, not what it computes.
_NOT_SETTINGS = {"params", "param_names", "lr", "foreach", "capturable", "differentiable", "fused"}
_GROUP_ITEM = re.compile(r"^optimizer\[(\d+)\]\.group\[(\d+)\]\.(.+)$")
_SCHEDULE_ITEM = re.compile(r"^schedule\[(\d+)\]\.")


MODEL_STATE_MODES = ("auto", "get_state_dict", "module")


def _unpack_optimizers(optimizers: Any) -> list:
    """The torch optimizers given: one, several, or a container's ``optimizers`` list (checked
    first: torchtitan's container is itself an ``Optimizer``, with an empty state)."""
    inner = getattr(optimizers, "optimizers", None)
    if isinstance(inner, (list, tuple)):
        found = list(inner)
    elif isinstance(optimizers, torch.optim.Optimizer):
        found = [optimizers]
    elif isinstance(optimizers, (list, tuple)):
        found = [o for item in optimizers for o in _unpack_optimizers(item)]
    else:
        raise UsageError(f"optimizers: expected a torch optimizer, a list of them or a container with an "
                         f"'optimizers' list, actual {type(optimizers).__name__}")
    for i, opt in enumerate(found):
        if not isinstance(opt, torch.optim.Optimizer):
            raise UsageError(f"optimizers[{i}]: expected a torch.optim.Optimizer, actual {type(opt).__name__}")
        if any("lr" not in g for g in opt.param_groups):
            raise UsageError(
                f"optimizers[{i}] ({type(opt).__name__}): expected param groups with 'lr', actual groups "
                "without: it does not show its optimizers' settings and state (a container?). Pass the "
                "optimizers it holds instead (a list), or give it an 'optimizers' attribute listing them")
    return found


def _unpack_schedulers(schedulers: Any) -> list:
    """The schedulers given: none, one, several, or a container's ``schedulers`` list."""
    inner = getattr(schedulers, "schedulers", None)
    if isinstance(inner, (list, tuple)):
        return list(inner)
    if isinstance(schedulers, (list, tuple)):
        return [s for item in schedulers for s in _unpack_schedulers(item)]
    return [schedulers] if schedulers else []


def _holds_optimizers(opt: torch.optim.Optimizer) -> bool:
    """Whether ``opt`` keeps other optimizers in its attributes (a container)."""
    for value in vars(opt).values():
        items = value if isinstance(value, (list, tuple)) else value.values() if isinstance(value, dict) else [value]
        if any(isinstance(v, torch.optim.Optimizer) for v in items):
            return True
    return False


def _hook_module(hook: Any) -> str:
    for attr in ("hook", "func", "__func__"):  # torch's _WrappedHook, functools.partial, a method
        hook = getattr(hook, attr, hook)
    return getattr(hook, "__module__", None) or ""


def _renames_state(model: torch.nn.Module) -> bool:
    """Whether a module of ``model`` has a state-dict hook of its own (one outside torch): its
    ``state_dict()`` may name entries no parameter has, which ``get_model_state_dict`` cannot map."""
    for module in model.modules():
        for hooks in (module._state_dict_hooks, module._load_state_dict_pre_hooks):
            if any(not _hook_module(h).startswith("torch.") for h in hooks.values()):
                return True
    return False


def _optimizer_parts(parts: list[torch.nn.Module], optimizers: list) -> dict[int, int]:
    """id(optimizer) -> the index of the model part holding its parameters."""
    owner = {id(p): i for i, part in enumerate(parts) for p in part.parameters()}
    out = {}
    for k, opt in enumerate(optimizers):
        held = {owner.get(id(p)) for g in opt.param_groups for p in g["params"]}
        if len(held) != 1 or None in held:
            where = "none of the model's" if held <= {None} else "several model parts'" if None not in held \
                else "some outside the model"
            raise UsageError(f"optimizers[{k}] ({type(opt).__name__}): expected the parameters of one model "
                             f"part, actual {where}: give each part its own optimizer")
        out[id(opt)] = held.pop()
    return out


def _merge_into(target: dict, part: dict, what: str) -> None:
    clash = target.keys() & part.keys()
    if clash:
        raise UsageError(f"{what}: expected names no other model part has, actual {short(sorted(clash)[:3])}")
    target.update(part)


_ID_KEYS = ("ids", "sample_ids", "index")


def _ids_and_fields(batch: Any) -> tuple[list[int] | None, list[torch.Tensor]]:
    """(the sample ids or None, every other tensor of the batch, in a fixed order)."""
    if isinstance(batch, dict):
        key = next((k for k in _ID_KEYS if k in batch), None)
        if key is not None:
            rest = {k: v for k, v in batch.items() if k != key}
            return torch.as_tensor(batch[key]).reshape(-1).tolist(), _tensors_of(rest)
    elif (isinstance(batch, (tuple, list)) and batch and isinstance(batch[0], torch.Tensor)
          and batch[0].dim() == 1 and not batch[0].is_floating_point() and batch[0].dtype != torch.bool):
        return batch[0].tolist(), _tensors_of(list(batch[1:]))
    return None, _tensors_of(batch)


def _tensors_of(value: Any) -> list[torch.Tensor]:
    """The tensors in ``value``: dicts by sorted key, sequences in order, nested."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        return [t for k in sorted(value, key=str) for t in _tensors_of(value[k])]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors_of(v)]
    return []


def _is_torch_scheduler(s: Any) -> bool:
    return isinstance(s, (torch.optim.lr_scheduler.LRScheduler, ReduceLROnPlateau)) or (
        hasattr(s, "optimizer") and hasattr(s, "step") and hasattr(s, "state_dict") and not hasattr(s, "lr_at"))


def _lr_value(lr: Any) -> float:
    return float(lr.item() if isinstance(lr, torch.Tensor) else lr)


def _lr_label(i: int, j: int, group: dict) -> str:
    name = group.get("name")
    return f"optimizer[{i}].group[{j}]" + (f" {name!r}" if isinstance(name, str) else "")


def _json_scalar(value: Any) -> Any:
    """A setting as JSON keeps it (tuples as lists, non-finite floats as text); None if it has no
    JSON form (a callable, a tensor of several values)."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            return None
        value = value.item()
    if isinstance(value, bool) or value is None or isinstance(value, (int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else repr(value)
    if isinstance(value, (tuple, list)):
        items = [_json_scalar(v) for v in value]
        return None if any(v is None and x is not None for v, x in zip(items, value)) else items
    return None


def _group_settings(group: dict, moving: set[str]) -> dict:
    out = {}
    for key, value in group.items():
        if key in _NOT_SETTINGS or key in moving or not isinstance(key, str):
            continue
        as_json = _json_scalar(value)
        if as_json is not None or value is None:
            out[key] = as_json
    return out


def _bits_view(t: torch.Tensor) -> tuple[torch.Tensor, torch.dtype]:
    """The tensor's bit patterns as integers of its element size, and the accumulation dtype."""
    if t.is_complex():
        t = torch.view_as_real(t)
    size = t.element_size()
    if size == 8:
        return t.view(torch.int64), torch.int64
    if size == 4:
        return t.view(torch.int32), torch.int32  # wraps mod 2**32: order-free, fast
    if size == 2:
        return t.view(torch.int16), torch.int32
    return t.view(torch.int8) if t.dtype != torch.bool else t.to(torch.int8), torch.int32


def _counts_here(value: Any) -> bool:
    """A DTensor replicated over some mesh dimension is counted by its first replica only."""
    placements = getattr(value, "placements", None)
    mesh = getattr(value, "device_mesh", None)
    if placements is None or mesh is None:
        return True
    for dim, placement in enumerate(placements):
        if placement.is_replicate() and mesh.get_local_rank(dim) != 0:
            return False
    return True


def _moment_fingerprint(opt: torch.optim.Optimizer) -> dict:
    return _fingerprint_states([opt.state.get(p, {}) for group in opt.param_groups for p in group["params"]])


def _fingerprint_states(states: list[dict]) -> dict:
    """Bit sums per state key of the given per-parameter optimizer states (resume.continuity)."""
    partial: dict[str, dict[str, list[torch.Tensor]]] = {"replicated": {}, "sharded": {}}
    numel = {"replicated": 0, "sharded": 0}
    for state in states:
        for key, value in state.items():
            if key == "step" or not isinstance(value, torch.Tensor):
                continue
            kind = "sharded" if hasattr(value, "to_local") else "replicated"
            if kind == "sharded" and not _counts_here(value):
                continue
            local = value.to_local() if kind == "sharded" else value
            if local.numel() == 0:
                continue
            bits, acc = _bits_view(local.detach())
            partial[kind].setdefault(str(key), []).append(bits.sum(dtype=acc).to(torch.int64))
            numel[kind] += local.numel()
    out = {}
    for kind in ("replicated", "sharded"):
        keys = sorted(partial[kind])
        if not keys:
            out[kind] = {"bits": {}, "numel": numel[kind]}
            continue
        # One transfer per optimizer and kind: the partial sums stay on their device until here.
        totals = torch.stack([torch.stack([t.to(partial[kind][keys[0]][0].device) for t in partial[kind][k]]
                                          ).sum() for k in keys]).cpu().tolist()
        out[kind] = {"bits": {k: int(v) & 0xFFFFFFFF for k, v in zip(keys, totals)}, "numel": numel[kind]}
    return out


def _rescale_lrs(opt: torch.optim.Optimizer, old: list[float], new: list[float]) -> None:
    """After a changed peak: each group's LR scaled by new/old peak (exact for every schedule that
    multiplies the peak by a factor of the position, as LambdaLR and most of torch's do)."""
    for g, before, after in zip(opt.param_groups, old, new):
        if before and before != after:
            g["lr"] = _lr_value(g["lr"]) * float(after) / float(before)


def _closed_form_lrs(s: Any) -> list[float] | None:
    if isinstance(s, torch.optim.lr_scheduler.LambdaLR):
        return [float(v) for v in s.get_lr()]
    closed = getattr(s, "_get_closed_form_lr", None)
    if callable(closed):
        try:
            return [float(v) for v in closed()]
        except (TypeError, AttributeError):
            return None
    return None


@contextlib.contextmanager
def _quiet_single_process() -> Iterator[None]:
    """DCP warns that it "assumes" a single process; without a process group that is the intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _position(scheduler: Any) -> int:
    """Updates a scheduler has taken; a chain of schedulers is where its children are."""
    if hasattr(scheduler, "last_epoch"):
        return int(scheduler.last_epoch)
    children = getattr(scheduler, "_schedulers", [])
    return min((_position(c) for c in children), default=0)


def _describe_scheduler(scheduler: Any) -> dict:
    """A scheduler's configuration (no position), children of SequentialLR/ChainedScheduler included."""
    entry: dict[str, Any] = {"class": type(scheduler).__name__}
    for key, value in sorted(scheduler.state_dict().items()):
        if key in _DYNAMIC_SCHEDULER_KEYS or key == "optimizer":
            continue
        if key == "lr_lambdas":
            value = [describe_callable(fn) for fn in getattr(scheduler, "lr_lambdas", [])]
        entry[key] = jsonstate.encode(value)
    children = getattr(scheduler, "_schedulers", None)
    if children:
        entry["children"] = [_describe_scheduler(c) for c in children]
    return entry


def _distcp_owner(name: str) -> int | None:
    if name.startswith("__") and name.endswith(".distcp"):
        head = name[2:].split("_", 1)[0]
        if head.isdigit():
            return int(head)
    return None
