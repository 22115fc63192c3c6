"""The adapter contract: how one framework writes and reads its state.

Call sequence (the coordinator makes every call; "all" = every rank, in the
same order, because some calls are collective):

On restore:
  0. all  ``describe_structure()``, ``describe_schedule()`` before anything is loaded: the optimizers
          and schedule as the code builds them (compared with the manifest: resume.changes);
          ``snapshot_settings()`` when changes were accepted
  1. all  ``describe_schedule()``          before anything is loaded: the schedule as the code declares it
  2. all  ``load_shards(step_dir, manifest)`` collective: sharded tensors (model, optimizers)
  3. all  ``load_state_dict(state)``       this rank's small state (schedulers, step counters)
  4. all  ``load_data_state(state)``       the data position
  5. all  ``optimizer_steps()``, ``scheduler_positions()``, ``optimizer_fingerprint()``,
          ``lr_ahead(k)``                  recomputed from the live objects and compared
  6. all  ``data_iterator()``, ``describe_batch(batch)`` the next batch, peeked
  After 4, with accepted changes: all ``apply_changes(items, snapshot)``.
  After the first update: all ``applied_lrs()`` (the LR the step applied) and ``lr_groups()``.

On save (at an iteration boundary, all ranks agreed):
  1. all  ``data_state()``                 before the look-ahead batch is fetched
  2. all  ``describe_batch(batch)``        of the look-ahead batch
  3. all  ``lr_ahead(k)``, ``lr_groups()``, ``optimizer_fingerprint()``, ``describe_schedule()``,
          ``describe_structure()``
  4. all  ``state_dict()``                 this rank's small state, written as JSON by the coordinator
  5. all  ``save_shards(step_dir)``        collective; returns the files this rank wrote
  Rank 0 then gathers the file lists and commits the manifest.
  Asynchronous save instead of 5: all ``stage_shards()`` (a memory copy, the loop
  waits for it), then in a background thread all ``write_staged(staged, ...)``
  over a forked Comm; the commit follows when every rank's write finished.

Every iteration:
  all ``optimizer_steps()`` and ``scheduler_positions()`` (cheap), to catch an
  update that stepped the optimizer or scheduler on a skipped iteration.

Values returned for the manifest must be JSON-serialisable.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from typing import Any

from .comm import Comm
from .storage import Storage

__all__ = ["Adapter"]


class Adapter(ABC):
    name: str = "adapter"
    comm: Comm

    # -- data ------------------------------------------------------------------
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

    @abstractmethod
    def describe_batch(self, batch: Any) -> list[tuple[int, str]]:
        """(global sample id, content digest) of every sample of this rank's batch. A batch that
        carries no sample ids gives ``-1 - row`` for each row: the next batch is then recorded
        and checked by its content alone (``continuity.merge_batch_descriptions``)."""

    # -- schedule and optimizer ---------------------------------------------------
    @abstractmethod
    def describe_schedule(self) -> list[dict]:
        """Static configuration of every scheduler (no position)."""

    @abstractmethod
    def lr_ahead(self, k: int) -> list[list[float]]:
        """LR of every param group now and after each of the next k-1 successful updates."""

    @abstractmethod
    def current_lrs(self) -> list[float]: ...

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

    # -- structure, settings and changes (optional; the defaults record nothing) ------------
    def describe_structure(self) -> list[dict]:
        """Per optimizer: ``{"class", "groups": [{"name", "params", "names", "settings"}]}``
        (resume.changes): compared before a load, so that another structure or a changed
        setting is named instead of failing inside the load."""
        return []

    def lr_groups(self) -> list[str]:
        """A label per param group, in the order of ``current_lrs()``."""
        return [f"group[{i}]" for i in range(len(self.current_lrs()))]

    def applied_lrs(self) -> list[float | None] | None:
        """Per param group: the LR the last optimizer step applied (None: unknown)."""
        return None

    @property
    def job_id(self) -> str | None:
        """The job's identity, kept across requeues and restarts, from the cluster layer
        (``resume.adapters.environment``); the lease names its holder with it. None: the
        lease uses ``RESUME_JOB_ID``, else ``host:pid``."""
        return None

    @property
    def lr_set_by_loop(self) -> bool:
        """True when the loop sets the LR just before each step (a hand-set schedule)."""
        return False

    def snapshot_settings(self) -> object:
        """The code's settings, before a load overwrites them (for ``apply_changes``)."""
        return None

    def apply_changes(self, items: list[str], snapshot: object) -> None:
        """After a load: the code's values for the accepted ``items`` (resume.changes)."""
        if items:
            raise NotImplementedError(f"{type(self).__name__} cannot apply changed settings {items}")

    # -- persistence ---------------------------------------------------------------
    @abstractmethod
    def state_dict(self) -> dict:
        """This rank's small non-tensor state (JSON)."""

    @abstractmethod
    def load_state_dict(self, state: dict) -> None: ...

    @abstractmethod
    def save_shards(self, storage: Storage, step_dir: str) -> list[str] | dict[str, tuple[int, str] | None]:
        """Collective. Write the sharded state; return the paths (relative to step_dir) this rank
        wrote, or a mapping path -> (size, checksum) for those checksummed while written (None:
        read it back)."""

    def can_stage(self) -> bool:
        """Whether ``stage_shards``/``write_staged`` are implemented (asynchronous save)."""
        return False

    def stage_shards(self) -> Any:
        """A private copy of the sharded state (a memory copy); the loop may change the live one."""
        raise NotImplementedError

    def can_fingerprint_staged(self) -> bool:
        """Whether ``fingerprint_staged`` is implemented: an asynchronous save then takes the
        moments' fingerprint from the staged copy in the background, not in the loop's stall."""
        return False

    def fingerprint_staged(self, staged: Any) -> list[dict]:
        """``optimizer_fingerprint()`` of the state as ``stage_shards`` copied it (same values)."""
        raise NotImplementedError

    def write_staged(self, staged: Any, storage: Storage, step_dir: str, comm: Comm) -> Any:
        """Collective over ``comm`` (a background thread): write ``staged``; like ``save_shards``."""
        raise NotImplementedError

    @abstractmethod
    def load_shards(self, storage: Storage, step_dir: str) -> None:
        """Collective. Load the sharded state written by ``save_shards``."""

    def shard_problems(self, storage: Storage, step_dir: str) -> list[str]:
        """Rank 0 only, during the restore's choice (``verify_on_restore``), before
        ``load_shards``: what makes the step's shards unloadable that checksums cannot see (a
        framework's metadata file of the wrong shape or bounds). Each problem passes the
        checkpoint over, like a bad checksum; a file that tries to run code
        (UnsafeCheckpointError) and storage errors raise instead. Default: none."""
        return []

    def prepare_load(self) -> object:
        """Local (no collectives; may run while another thread reads files): make the live
        objects ready to be loaded into, e.g. create a fresh optimizer's state. Returns what
        ``discard_prepared`` needs to undo it when nothing is loaded after all."""
        return None

    def discard_prepared(self, token: object) -> None:
        """Undo ``prepare_load()`` (a fresh start, or a restore that failed)."""

    def topology(self) -> dict:
        return {"world_size": self.comm.world_size}
