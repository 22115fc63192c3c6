"""The native PyTorch adapter: torch.distributed.checkpoint for the sharded state.

Covers a plain module, DDP, and FSDP2/DTensor modules (``get_state_dict`` /
``set_state_dict`` handle all three), any ``torch.optim`` optimizer and several
at once (AdamW for embeddings and head plus Muon for the matrices), several LR
schedulers, and any data object with ``state_dict``/``load_state_dict``.

AdamW creates its moments lazily, at its first step: loading into a fresh
optimizer must first create them, or there is nothing for the load to fill
and they silently stay empty. ``get_state_dict`` does that (a zero-LR step on
zero gradients) before the load; the step counters of ours ignore that step.

The adapter's parts live in ``resume.adapters.torch`` (one protocol of ``resume.adapter``
each): ``shards`` (shard I/O), ``state`` (state dicts), ``view`` (optimizer view),
``settings`` (structure and changes); ``comm`` (``TorchDistComm``, ``allreduce_each_gradient``).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from resume.adapter import Adapter
from resume.comm import Comm
from resume.errors import UsageError
from resume.layout import stated_layout

from .data import check_loader, load_loader_state, loader_state, skip_loader_samples
from .dcp.filesystem import COMPRESSIONS
from .dcp.plan_cache import SavePlanCache
from .environment import JobEnvironment
from .torch.batches import batch_ids, describe_batch
from .torch.comm import TorchDistComm, allreduce_each_gradient, comm_for
from .torch.layout import read_layout_part
from .torch.metadata import CheckedMetadata
from .torch.objects import (
    MODEL_STATE_MODES,
    function_schedule,
    model_parts,
    optimizer_parts,
    renames_state,
    unpack_optimizers,
    unpack_schedulers,
)
from .torch.registered import Registered, unregistered_state
from .torch.schedules import lr_value
from .torch.settings import SettingsMixin
from .torch.shards import DcpShardsMixin, IndexedLoadMixin
from .torch.state import StateMixin
from .torch.view import OptimizerViewMixin
from .torch.warm import WarmStartMixin

__all__ = ["MODEL_STATE_MODES", "NativeTorchAdapter", "TorchDistComm", "allreduce_each_gradient", "comm_for"]


class NativeTorchAdapter(DcpShardsMixin, IndexedLoadMixin, StateMixin, SettingsMixin, OptimizerViewMixin, WarmStartMixin,
                         Adapter):
    """Model + optimizers + schedulers + data, saved with torch.distributed.checkpoint.

    ``model``: a module, or the model parts this rank holds (pipeline stages; torchtitan's
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

    ``compression``: ``"zstd"`` compresses every shard item (a per-run choice; off by default).

    ``moving_settings``: param-group fields besides ``lr`` that the loop sets as training goes
    (a hand-set momentum warm-up, say): restored from the checkpoint and never compared with
    the code's value. Fields a torch scheduler moves (``betas``/``momentum`` with
    ``cycle_momentum``) count as moving by themselves. Every other scalar field of a group is
    a setting: a value in the code that differs from the checkpoint's is refused at restore
    unless accepted (``Coordinator(accept_changes=...)``).

    ``parallel``: what the program states of its parallel layout where the objects cannot say it
    (``resume.adapters.torch.layout`` reads device meshes, DTensor specs, FSDP2 and DDP): degrees
    (``dp_replicate``, ``dp_shard``, ``tensor``, ``pipeline``, ``context``, ``expert``) and
    ``scheme``, the name of a shard scheme of the program's own (a hand-split tensor-parallel
    layer, a flat ZeRO buffer), which only the layout it was saved on can load.

    ``plan_caching``: DCP's save-plan caching (on by default): a save whose every rank's local
    plan equals its last one reuses rank 0's global plan and ``.metadata`` layout instead of
    planning anew. The cache is this adapter's own, one per save path (synchronous,
    asynchronous), dropped after a failed save; any change replans. Rank 0 keeps every rank's
    plan in memory (``resume.adapters.dcp.plan_cache``): ``False`` gives the memory back.
    """

    name = "torch-native"

    def __init__(self, model: torch.nn.Module | Iterable[torch.nn.Module],
                 optimizers: torch.optim.Optimizer | Iterable, schedulers: Any = (), data: Any = None, *,
                 comm: Comm | None = None, process_group: Any = None, compression: str | None = None,
                 moving_settings: Iterable[str] = (), model_state: str = "auto",
                 plan_caching: bool = True, parallel: dict | None = None) -> None:
        if compression not in COMPRESSIONS:
            raise UsageError(f"compression: expected one of {COMPRESSIONS}, actual {compression!r}")
        self.compression = compression
        self.parallel = stated_layout(dict(parallel or {}), where="NativeTorchAdapter: parallel")
        self._plan_cache = SavePlanCache(type(self).__name__, enabled=plan_caching)
        self._metadata = CheckedMetadata()  # shard_problems' check, kept for the load
        self.model_parts = model_parts(model)
        self.model = self.model_parts[0]
        self.optimizers = unpack_optimizers(optimizers)
        self.schedulers = unpack_schedulers(schedulers)
        if model_state not in MODEL_STATE_MODES:
            raise UsageError(f"model_state: expected one of {MODEL_STATE_MODES}, actual {model_state!r}")
        self.model_state = (model_state if model_state != "auto" else
                            "module" if any(renames_state(m) for m in self.model_parts) else "get_state_dict")
        self._optimizer_part = optimizer_parts(self.model_parts, self.optimizers)
        self.data = data
        self.process_group = process_group
        self.comm = comm if comm is not None else comm_for(process_group)
        self._function_schedule = function_schedule(self.schedulers)
        self.moving_settings = set(moving_settings)
        if any(getattr(s, "cycle_momentum", False) for s in self.schedulers):
            self.moving_settings |= {"betas", "momentum"}
        self._steps = [0] * len(self.optimizers)
        self._applied: list[list[float] | None] = [None] * len(self.optimizers)
        self._internal_step = False
        self._staged_state: Any = None  # the last staged copy, reused by the next (stage_shards)
        self.registered = Registered()
        """The objects registered by name (``register_state``; ``resume.adapters.torch.registered``)."""
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
                me._applied[index] = [lr_value(g["lr"]) for g in optimizer.param_groups]
        return hook

    # -- registered state (resume.adapter.RankState) ------------------------------------------

    def register_state(self, name: str, obj: Any) -> None:
        self.registered.add(name, obj)

    def registered_digests(self) -> dict[str, str]:
        return self.registered.digests()

    def registered_shown(self) -> dict[str, dict]:
        return self.registered.shown()

    def unregistered_state(self) -> list[str]:
        return unregistered_state(self.registered, self.model_parts)

    # -- data (resume.adapter.DataPosition) ---------------------------------------------------

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

    def skip_samples(self, skips: Any) -> None:
        skip_loader_samples(self.data, skips)

    def batch_ids(self, batch: Any) -> list[int] | None:
        return batch_ids(batch)

    def describe_batch(self, batch: Any) -> list[tuple[int, str]]:
        """Sample ids from a dict's ``ids`` (``sample_ids``, ``index``) or a tuple's first item
        (an integer vector); the digest of each row over every other tensor of the batch
        (``resume.adapters.torch.batches``)."""
        return describe_batch(batch)

    # -- the run (resume.adapter.RankState) ---------------------------------------------------

    @property
    def job_id(self) -> str | None:
        """Slurm's job id or torchrun's run id (``resume.adapters.environment``): the lease
        holder's name, the same in the job's requeued and restarted copies."""
        return JobEnvironment.from_env().job_id

    def layout_part(self) -> dict:
        """Read from the objects (``resume.adapters.torch.layout``), ``parallel`` stated over it;
        read again only when the parameters changed (every save asks)."""
        names = self._param_names()
        cached = getattr(self, "_layout_cache", None)
        if cached is None or cached[0] is not names:
            cached = self._layout_cache = (names, read_layout_part(self.model_parts, names, self.parallel))
        return cached[1]

    def topology(self) -> dict:
        topology: dict = {"world_size": self.comm.world_size}
        if self.compression is not None:
            # What a restore honours: a compression transform in .metadata counts only when
            # the manifest records it (``dcp.reader.SafeFileSystemReader.compressed``).
            topology["compression"] = self.compression
        return topology
