"""The adapter contract: how one framework writes and reads its state, as six small protocols.

``Adapter`` is all of them together; the coordinator makes every call. "all" = every rank, in
the same order, because some calls are collective.

On restore:
  0. all  ``layout_part()`` while the checkpoint is chosen, before its files are read: another
          layout is let through where the shards load exactly, refused otherwise (resume.layout)
     all  ``describe_structure()``, ``describe_schedule()``: the code's optimizers and schedule,
          compared with the manifest before anything is loaded (resume.changes);
          ``snapshot_settings()`` when changes were accepted
  1. rank 0 ``shard_problems(storage, step_dir, manifest)`` during the choice (verify_on_restore)
  2. all  ``load_shards(storage, step_dir, manifest)`` collective: sharded tensors
  3. all  ``load_state_dict(state)``, then ``load_data_state(state)``; with accepted changes
          ``apply_changes(items, snapshot)``
  4. all  ``optimizer_steps()``, ``scheduler_positions()``, ``optimizer_fingerprint()``,
          ``lr_ahead(k)``: recomputed from the live objects and compared
  5. all  ``data_iterator()``, ``describe_batch(batch)``: the next batch, peeked
  After the first update: all ``applied_lrs()`` and ``lr_groups()``.
  ``manifest`` is the ``resume.manifest.Manifest`` the restore verified: adapters read sizes
  and topology from it, never ``manifest.json`` again.

On save (at an iteration boundary, all ranks agreed):
  0. all  ``layout_part()``, with the rank's other facts
  1. all  ``data_state()`` before the look-ahead batch is fetched, ``describe_batch(batch)`` of it
  2. all  ``lr_ahead(k)``, ``lr_groups()``, ``optimizer_fingerprint()``, ``describe_schedule()``,
          ``describe_structure()``
  3. all  ``state_dict()``: this rank's small state, written as JSON by the coordinator
  4. all  ``save_shards(storage, step_dir)`` collective; rank 0 then commits the manifest.
  Asynchronous instead of 4: all ``stage_shards()`` (the loop waits), then in a background
  thread all ``write_staged(staged, ...)`` over a forked Comm; the commit follows.
  With asynchronous saves, after the process's first applied update: all ``prepare_staging()``.

Every iteration: all ``optimizer_steps()`` and ``scheduler_positions()`` (cheap), to catch an
update that stepped the optimizer or scheduler on a skipped iteration.

Values returned for the manifest must be JSON-serialisable.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from typing import Any

from .comm import Comm
from .errors import UsageError
from .manifest import Manifest
from .storage import Storage

__all__ = ["Adapter", "DataPosition", "OptimizerView", "RankState", "SettingsView", "ShardIO",
           "StagedShardIO", "WarmStartIO"]


class DataPosition(ABC):
    """This rank's data: its batches and its position in them."""

    def has_data(self) -> bool:
        """False when the adapter was given no data: the next batch is then not recorded."""
        return True

    @abstractmethod
    def data_iterator(self) -> Iterator[Any]:
        """A fresh iterator over this rank's batches, from the current data position."""

    @abstractmethod
    def data_state(self) -> Any:
        """The data position (JSON), as it is now, i.e. before the next batch is fetched."""

    @abstractmethod
    def load_data_state(self, state: Any) -> None: ...

    def skip_samples(self, skips: Any) -> None:
        """Pass over the ``resume.skips.Skips`` ranges of the run's sample numbering from now on
        (a rewind's declared skip), set before ``load_data_state``. An adapter whose data cannot
        skip exactly raises ``UsageError`` saying why."""
        from .errors import UsageError

        raise UsageError(f"{type(self).__name__}: data: expected a loader that can pass over samples exactly "
                         "(resume.adapters.data.GlobalPositionSampler), actual one that cannot: the rewind's "
                         "skip cannot be made")

    def batch_ids(self, batch: Any) -> Any:
        """The sample ids ``batch`` carries (no content read), for the update journal: a sequence of
        integers or an object with ``tolist()`` (a tensor), read later by the journal's writer;
        None if none."""
        return None

    @abstractmethod
    def describe_batch(self, batch: Any) -> list[tuple[int, str]]:
        """(global sample id, content digest) of every sample of this rank's batch. A batch that
        carries no sample ids gives ``-1 - row`` for each row: the next batch is then recorded
        and checked by its content alone (``continuity.merge_batch_descriptions``)."""


class OptimizerView(ABC):
    """LRs, counters and moments, read from the live optimizers and schedulers."""

    @abstractmethod
    def describe_schedule(self) -> list[dict]:
        """Static configuration of every scheduler (no position)."""

    @abstractmethod
    def lr_ahead(self, k: int) -> list[list[float]]:
        """LR of every param group now and after each of the next k-1 successful updates."""

    @abstractmethod
    def current_lrs(self) -> list[float]: ...

    def lr_groups(self) -> list[str]:
        """A label per param group, in the order of ``current_lrs()``."""
        return [f"group[{i}]" for i in range(len(self.current_lrs()))]

    def applied_lrs(self) -> list[float | None] | None:
        """Per param group: the LR the last optimizer step applied (None: unknown)."""
        return None

    @property
    def lr_set_by_loop(self) -> bool:
        """True when the loop sets the LR just before each step (a hand-set schedule)."""
        return False

    @abstractmethod
    def optimizer_steps(self) -> list[int]:
        """How many updates each optimizer has applied."""

    @abstractmethod
    def scheduler_positions(self) -> list[int]:
        """How many times each scheduler was advanced (in updates)."""

    @abstractmethod
    def optimizer_fingerprint(self) -> list[dict]:
        """Per optimizer: a fingerprint of this rank's moments, computed where they live:
        ``{"replicated": {"bits": {key: int}, "numel": n}, "sharded": {...}}`` with the sum of
        the bit patterns mod 2**32 per state key (``sharded``: each element counted on one rank,
        so the total over ranks is the same for any sharding)."""


class SettingsView(ABC):
    """Structure and settings, compared before a load; accepted changes put back after it.
    Optional: the defaults record nothing."""

    def describe_structure(self) -> list[dict]:
        """Per optimizer: ``{"class", "groups": [{"name", "params", "names", "settings"}]}``
        (resume.changes): another structure or a changed setting is named instead of failing
        inside the load."""
        return []

    def snapshot_settings(self) -> object:
        """The code's settings, before a load overwrites them (for ``apply_changes``)."""
        return None

    def apply_changes(self, items: list[str], snapshot: object) -> None:
        """After a load: the code's values for the accepted ``items`` (resume.changes)."""
        if items:
            raise NotImplementedError(f"{type(self).__name__} cannot apply changed settings {items}")


class RankState(ABC):
    """This rank's small state and the facts the manifest records about the run."""

    comm: Comm

    @abstractmethod
    def state_dict(self) -> dict:
        """This rank's small non-tensor state (JSON)."""

    @abstractmethod
    def load_state_dict(self, state: dict) -> None: ...

    def check_state(self, state: dict, *, source: str) -> None:
        """``state_dict()`` as read back from a run's file (``source``), checked in shape before
        anything loads it: ``CorruptCheckpointError`` naming the field. Nothing by default."""

    def register_state(self, name: str, obj: Any) -> None:
        """Save and restore ``obj`` (``state_dict()`` / ``load_state_dict()``) under ``name``."""
        raise UsageError(f"register({name!r}): expected an adapter that saves registered state "
                         f"(torch-native), actual {getattr(self, 'name', type(self).__name__)}")

    def registered_digests(self) -> dict[str, str]:
        """Each registered object's state in a digest (compared after a restore)."""
        return {}

    def registered_shown(self) -> dict[str, dict]:
        """Each registered object's kind and a few values (``resume inspect``, messages)."""
        return {}

    def unregistered_state(self) -> list[str]:
        """Stateful objects in use that nothing registered, each with the line to add (the first
        save warns once)."""
        return []

    def topology(self) -> dict:
        return {"world_size": self.comm.world_size}

    def layout_part(self) -> dict | None:
        """This rank's share of the parallel layout (``resume.layout.assemble_layout``): degrees,
        placements, its pipeline stage. Compared with the checkpoint's before a restore loads
        anything; None: the adapter knows no layout (every rank a data-parallel replica, as before)."""
        return None

    @property
    def job_id(self) -> str | None:
        """The job's identity, kept across requeues and restarts, from the cluster layer
        (``resume.adapters.environment``); the lease names its holder with it. None: the
        lease uses ``RESUME_JOB_ID``, else ``host:pid``."""
        return None


class ShardIO(ABC):
    """The sharded state (model, optimizers), written and read collectively."""

    @abstractmethod
    def save_shards(self, storage: Storage, step_dir: str) -> list[str] | dict[str, tuple[int, str] | None]:
        """Collective. Write the sharded state; return the paths (relative to step_dir) this rank
        wrote, or a mapping path -> (size, checksum) for those checksummed while written (None:
        read it back)."""

    def shard_problems(self, storage: Storage, step_dir: str, manifest: Manifest) -> list[str]:
        """Rank 0 only, during the restore's choice, before ``load_shards``: what makes the
        step's shards unloadable that checksums cannot see (a framework's metadata file of the
        wrong shape or bounds for ``manifest``). Each problem passes the checkpoint over; a file
        that tries to run code (UnsafeCheckpointError) and storage errors raise. Default: none."""
        return []

    def verify_while_loading(self, manifest: Manifest, storage: Storage | None = None,
                             step_dir: str | None = None) -> set[str]:
        """Rank-local, with ``verify_on_restore``, before ``load_shards(manifest)``: the files of
        ``manifest`` the load will check against their checksums from the bytes it reads (each
        read once; a mismatch raises ``DamagedShardsError`` before anything reaches the live
        objects). The restore's checksum pass leaves them out; ``storage`` and
        ``step_dir``: where the load may start reading ahead. Default: none."""
        return set()

    def prepare_load(self) -> object:
        """Local (no collectives; may run while another thread reads files): make the live
        objects ready to be loaded into, e.g. create a fresh optimizer's state. Returns what
        ``discard_prepared`` needs to undo it when nothing is loaded after all."""
        return None

    def discard_prepared(self, token: object) -> None:
        """Undo ``prepare_load()`` (a fresh start, or a restore that failed)."""

    @abstractmethod
    def load_shards(self, storage: Storage, step_dir: str, manifest: Manifest) -> None:
        """Collective. Load the sharded state ``save_shards`` wrote, as ``manifest`` describes it."""


class StagedShardIO(ABC):
    """Asynchronous save (optional): a memory copy in the loop, the write in the background."""

    def can_stage(self) -> bool:
        """Whether ``stage_shards``/``write_staged`` are implemented."""
        return False

    def stage_shards(self) -> Any:
        """A private copy of the sharded state (a memory copy); the loop may change the live one."""
        raise NotImplementedError

    def write_staged(self, staged: Any, storage: Storage, step_dir: str, comm: Comm) -> Any:
        """Collective over ``comm`` (a background thread): write ``staged``; like ``save_shards``."""
        raise NotImplementedError

    def prepare_staging(self) -> None:
        """Once, in the loop, after the first applied update: start making what the first
        ``stage_shards`` needs (host buffers) in the background; ``stage_shards`` takes it, whole
        or in part, and never uses it while it is being made. Default: nothing."""

    def can_fingerprint_staged(self) -> bool:
        """Whether ``fingerprint_staged`` is implemented: the moments' fingerprint is then taken
        from the staged copy in the background, not in the loop's stall."""
        return False

    def fingerprint_staged(self, staged: Any) -> list[dict]:
        """``optimizer_fingerprint()`` of the state as ``stage_shards`` copied it (same values)."""
        raise NotImplementedError


class WarmStartIO(ABC):
    """A new run's first weights from another run's checkpoint or an export (``resume.warmstart``;
    optional). ``origin``: what ``resume.warmstart.resolve`` verified (kind, source, step_dir or
    files)."""

    def weight_shapes(self) -> dict[str, list[int]]:
        """Local: the model tensors this rank holds, by the names a checkpoint gives them, with
        their whole (global) shapes."""
        raise UsageError(f"warm_start: expected an adapter that can load weights, actual {type(self).__name__}")

    def source_shapes(self, origin: dict) -> dict[str, list[int]]:
        """Rank 0: the source's model tensors, by the same names, with their shapes."""
        raise UsageError(f"warm_start: expected an adapter that can load weights, actual {type(self).__name__}")

    def load_weights(self, origin: dict) -> None:
        """Collective: the source's model tensors into the live model (nothing else)."""
        raise UsageError(f"warm_start: expected an adapter that can load weights, actual {type(self).__name__}")


class Adapter(DataPosition, OptimizerView, SettingsView, RankState, ShardIO, StagedShardIO, WarmStartIO):
    """Every protocol above: what the coordinator needs of one framework."""

    name: str = "adapter"
    comm: Comm
