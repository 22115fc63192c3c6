"""The coordinator's settings: one dataclass, each field documented, all checked at construction."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from .errors import UsageError
from .policy import AtEnd, EveryN, KeepPolicy, OnRequest, OnSignal, SaveFailureTolerance, SavePolicy
from .watchdog import HangBounds

__all__ = ["CoordinatorConfig", "as_json"]


@dataclass(kw_only=True)
class CoordinatorConfig:
    """How a ``Coordinator`` saves, restores and checks. ``Coordinator(url, adapter, **fields)``."""

    global_batch: int
    """Samples per update over all ranks: micro-batch × ``accumulation`` × data-parallel size."""
    accumulation: int = 1
    """Items of ``coord.batches()`` each update takes (micro-batches whose gradients it
    accumulates; 1: one item per update, which the loop may split itself). A save records the
    next update's items, all of them; a save after an update that took another number is
    refused. Not compared at a restore: a restart on fewer ranks takes more micro-batches for
    the same global batch (a changed global batch is refused, naming the accumulation)."""
    every: int = 200
    """Save every N iterations (0: only on request or signal)."""
    total_iterations: int | None = None
    """The run's end. ``batches()`` yields nothing once the iteration reaches it, the update
    that reaches it saves a checkpoint marked complete (``Manifest.complete``), and the Slurm
    hook never requeues a job whose run is complete. May grow at a restart (train longer);
    None: the run ends where the loop stops (its loader's end), unmarked."""
    keep: int = 3
    """Newest committed checkpoints kept by retention (>= 2)."""
    keep_every: int | None = None
    """Also keep every checkpoint whose step is a multiple of M, forever."""
    seq_len: int | None = None
    """Sequence length, recorded and checked on restore."""
    config: dict | None = None
    """Further JSON values that must not change across restarts (seed, ...)."""
    lr_lookahead: int = 3
    """How many successful updates ahead the LR is recorded (>= 2)."""
    allow_fresh_start: bool = False
    """Start from scratch even when step directories exist but none holds a valid checkpoint.
    Off by default: that loses the run."""
    verify_on_restore: bool = True
    """Check every file's checksum before loading it."""
    handle_signals: bool = True
    """SIGUSR1/SIGTERM request save-and-stop at the next boundary."""
    control_poll_s: float = 1.0
    """How often rank 0 looks for save requests under ``control/``."""
    async_save: bool = False
    """Scheduled saves block the loop only while the state is copied (staged); the shards are
    written and committed in the background, at most one save in flight. The next save, a
    requested save and ``close()`` wait for it and raise its error. Needs an adapter that can
    stage (``Adapter.stage_shards``); saves asked for by a request or a signal are synchronous
    (the asker waits for the commit anyway)."""
    on_save_failure: str = "raise"
    """What a failed scheduled save does (a full disk, storage down): ``"raise"``
    (SaveFailedError out of ``update()``: the job stops and is restarted) or ``"continue"``
    (logged; training goes on and the next scheduled save tries again; the
    ``max_save_failures``-th failure in a row raises). A requested or signalled save always raises."""
    max_save_failures: int = 3
    """With ``on_save_failure="continue"``: failures in a row that stop the job."""
    lease_ttl_s: float | None = 120.0
    """Rank 0 holds ``RUN/lease.json`` while the coordinator lives, with a heartbeat; another
    job is refused (RunBusyError) until the lease is older than this. None: no lease (only for
    a run nothing else can reach)."""
    accept_changes: Iterable[str] | str | None = None
    """Settings the code may change against the checkpoint at this restart (``"weight_decay"``,
    ``"initial_lr"``, ``"optimizer[1]"``, ``"schedule"``; resume.changes). Any other changed
    param-group or schedule setting is refused with ContinuityError. An accepted change keeps
    the code's value and is recorded in the next manifest (``changes``). The environment's
    ``RESUME_ACCEPT_CHANGES`` (comma-separated) adds to it, for a requeued job."""
    warm_start: Any = None
    """A new run's first weights from another run's committed checkpoint (its URL, ``URL@STEP``
    for a step other than its newest) or from a ``resume export`` directory (a
    ``resume.warmstart.WarmStart`` too): verified, compared by name and shape, and loaded into the
    model only when this run has no checkpoint of its own; counters, optimizer, schedule and data
    start fresh, and every manifest records the origin. None: the environment's
    ``RESUME_WARM_START``, else a start from scratch."""
    journal: bool = True
    """Rank 0 keeps the update journal (``resume.journal``: one record per update, sealed by each
    commit; ``resume journal RUN``). False: none is written."""

    hang: HangBounds | None = None
    """Hang detection's bounds (``resume.watchdog.HangBounds``: floor, factor, first-time bound,
    ``enabled``); None: the Slurm hook's (``RESUME_HANG``), else the defaults. Given, they are
    this process's bounds, the hook's aside (the hook reads them from rank 0's progress)."""

    def __post_init__(self) -> None:
        if self.hang is not None and not isinstance(self.hang, HangBounds):
            raise UsageError(f"hang: expected a resume.watchdog.HangBounds or None, actual {short_type(self.hang)}")
        if isinstance(self.global_batch, bool) or not isinstance(self.global_batch, int) or self.global_batch < 1:
            raise UsageError(f"global_batch: expected a positive integer, actual {self.global_batch!r}")
        if isinstance(self.accumulation, bool) or not isinstance(self.accumulation, int) or self.accumulation < 1:
            raise UsageError(f"accumulation: expected a positive integer, actual {self.accumulation!r}")
        if self.lr_lookahead < 2:
            raise UsageError(f"lr_lookahead: expected >= 2 updates, actual {self.lr_lookahead}")
        if self.lease_ttl_s is not None and self.lease_ttl_s <= 0:
            raise UsageError(f"lease_ttl_s: expected > 0 seconds or None, actual {self.lease_ttl_s}")
        self.save_policy()
        self.retention()
        self.failure_tolerance()
        self.recorded_config()

    @classmethod
    def from_settings(cls, settings: dict[str, Any]) -> CoordinatorConfig:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(settings) - names)
        if unknown:
            raise UsageError(f"Coordinator: expected settings among {sorted(names)}, actual also {unknown}")
        return cls(**settings)

    def save_policy(self) -> SavePolicy:
        """When to save: every N iterations, on a request, on a signal."""
        policy = EveryN(self.every) | OnRequest() | OnSignal()
        return policy | AtEnd(self.total_iterations) if self.total_iterations is not None else policy

    def retention(self) -> KeepPolicy:
        return KeepPolicy(keep_last=self.keep, keep_every=self.keep_every)

    def failure_tolerance(self) -> SaveFailureTolerance:
        return SaveFailureTolerance(self.on_save_failure, self.max_save_failures)

    def recorded_config(self) -> dict:
        """The config every manifest records and every restore compares, as JSON gives it back
        (tuples, int keys and the like then compare equal to what a manifest holds)."""
        return as_json({"global_batch": self.global_batch, "seq_len": self.seq_len, **(self.config or {})},
                       "config")


def short_type(value: Any) -> str:
    return type(value).__name__


def as_json(value: Any, name: str) -> Any:
    try:
        return json.loads(json.dumps(value, allow_nan=False))
    except (TypeError, ValueError) as e:
        raise UsageError(f"{name}: expected JSON-serialisable values, actual {e}") from e
