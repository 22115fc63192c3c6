"""One checkpoint's commit, as an object: prepare, write, finalize, or abandon.

    commit = StepCommit(run, step, lease=lease)
    rank 0:      commit.prepare()            # a torn leftover removed, a damaged checkpoint moved aside
    every rank:  files = commit.write(rank_file, lambda: adapter.save_shards(...))
    rank 0:      commit.finalize(reports, manifest)   # sync, lease check, manifest (the commit), LATEST,
                                                      # retention
    on failure:  commit.abandon()            # rank 0 removes what the failed save left

The synchronous save, the background save and the Megatron integration all commit
through it; the fault points of the crash matrix sit here, between the phases.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

from . import faults
from .checksum import checksum_bytes, checksum_file
from .collective import Collective, collector_paused
from .errors import LeaseLostError, StorageError
from .lease import Lease
from .manifest import FileEntry, Manifest
from .policy import KeepPolicy
from .run import Run
from .storage import join

__all__ = ["StepCommit", "rank_state_name"]

log = logging.getLogger("resume")


def rank_state_name(rank: int) -> str:
    return f"rank-{rank:05d}.json"


class StepCommit:
    """The commit of step ``step`` of ``run``; ``lease`` (rank 0's) is checked before anything
    is written or removed, so a job that was taken over stops before it commits."""

    def __init__(self, run: Run, step: int, *, lease: Lease | None = None) -> None:
        self.run = run
        self.step = step
        self.dirname = run.dirname(step)
        self.lease = lease

    @property
    def url(self) -> str:
        return self.run.storage.url(self.dirname)

    # -- rank 0, before anything is written -------------------------------------------------------

    def prepare(self, *, clear: bool = True) -> bool:
        """Rank 0: True if the step is already committed (nothing to write).

        A leftover without a manifest is removed; a damaged checkpoint (a manifest that
        fails the check) is moved aside, never deleted. ``clear=False`` (a framework that
        writes into an existing directory itself) only withdraws an old manifest, so its
        new files never sit under a record of other bytes.
        """
        self._check_lease()
        if not clear:
            self._withdraw_manifest()
            return False
        if self.step in self.run.step_dirs():
            result = self.run.check(self.step)
            if result.unreadable:
                raise StorageError(f"{self.url}: expected readable storage, actual {result.reason} "
                                   "(nothing passed over or moved; try again)")
            if result.committed:
                return True
            if result.has_manifest:
                self.run.quarantine_step(self.step, result.reason)
                self._repoint_latest()
            else:
                log.warning("resume: removing uncommitted leftover %s", self.dirname)
                self.run.delete_step(self.step)
        self.run.storage.makedirs(self.dirname)
        return False

    def _withdraw_manifest(self) -> None:
        path = self.run.manifest_path(self.step)
        if self.run.storage.exists(path):
            log.warning("resume: %s is being rewritten: its manifest is withdrawn first", self.dirname)
            self.run.storage.delete(path)

    def _repoint_latest(self) -> None:
        """The hint must not name what was moved aside."""
        manifest, _ = self.run.find_latest()
        if manifest is not None:
            self.run.point_latest(manifest.step)

    # -- every rank ---------------------------------------------------------------------------------

    def write(self, rank_file: tuple[str, bytes] | None, write_shards: Callable[[], Any]) -> dict:
        """This rank's state file, then the shards ``write_shards`` writes; the records of both,
        ``{path: (size, checksum)}``. ``write_shards`` returns the paths it wrote, or a dict of
        them with the (size, checksum) it took while writing."""
        records = {}
        if rank_file is not None:
            name, body = rank_file
            self.run.storage.write_bytes_atomic(join(self.dirname, name), body)
            records[name] = (len(body), checksum_bytes(body))
        faults.point("save.before_shards")
        written = write_shards()
        faults.point("save.after_shards")
        for rel in written:
            known = written.get(rel) if isinstance(written, dict) else None
            records[rel] = tuple(known) if known else checksum_file(self.run.storage, join(self.dirname, rel))
        return records

    @staticmethod
    def shares(names: Iterable[str], world_size: int) -> list[list[str]]:
        """Files someone else wrote, dealt out to the ranks for ``checksum_share``."""
        ordered = sorted(names)
        return [ordered[rank::world_size] for rank in range(world_size)]

    def checksum_share(self, share: Iterable[str]) -> dict:
        """Records of this rank's share of files someone else wrote (read once, in parallel)."""
        return {rel: checksum_file(self.run.storage, join(self.dirname, rel)) for rel in share}

    # -- rank 0, last ---------------------------------------------------------------------------------

    def finalize(self, records: Iterable[dict], manifest: Manifest, *, keep: KeepPolicy | None = None) -> Manifest:
        """Rank 0: the commit point. The files' directory entries are made durable, the lease
        checked, then the manifest is written atomically (with every rank's file records),
        LATEST pointed at it, and retention applied (its failure never fails the commit)."""
        with collector_paused():
            return self._finalize(records, manifest, keep=keep)

    def _finalize(self, records: Iterable[dict], manifest: Manifest, *, keep: KeepPolicy | None) -> Manifest:
        for part in records:
            for rel, (size, checksum) in part.items():
                manifest.files[rel] = FileEntry(size, checksum)
        # One sync here, not one per rank and file.
        self.run.storage.sync_dir(self.dirname)
        self._check_lease()
        faults.point("save.before_manifest")
        self.run.write_manifest(manifest)
        log.info("resume: committed %s (%d files, %d bytes)", self.dirname, len(manifest.files),
                 manifest.total_bytes)
        if keep is not None:
            self._retain(keep)
        return manifest

    def write_and_finalize(self, coll: Collective, local: Callable[[], dict],
                           manifest_of: Callable[[list[dict]], Manifest], *, keep: KeepPolicy | None = None) -> None:
        """Phases 2 and 3, collective: ``local`` writes this rank's files and returns
        ``{"files": records, ...}`` (a failure on any rank fails the save on every rank, nothing
        committed); then rank 0 commits the manifest ``manifest_of(every rank's report)``."""
        # Only rank 0 receives the reports (each rank sends its own records, O(1) per rank).
        reports = coll.gather(local, f"{self.url} (writing the shards)", saving=True)
        faults.point("save.after_gather")
        coll.on_rank0(lambda: self._commit(reports, manifest_of, keep))

    def _commit(self, reports: list[dict], manifest_of: Callable[[list[dict]], Manifest],
                keep: KeepPolicy | None) -> int:
        with collector_paused():  # the manifest of every rank's report, then the commit
            return self.finalize([r["files"] for r in reports], manifest_of(reports), keep=keep).step

    def _retain(self, keep: KeepPolicy) -> None:
        try:
            deleted = self.run.apply_retention(keep, just_committed=self.step)
        except OSError as e:  # retention must never fail a committed save
            log.warning("resume: retention failed after committing step %d: %s", self.step, e)
        else:
            if deleted:
                log.info("resume: retention removed %s", ", ".join(map(self.run.dirname, deleted)))

    def abandon(self) -> None:
        """Rank 0, after a failed save: remove what it left unless it committed (frees a full
        disk). Never raises: what stays is passed over by discovery and swept by retention."""
        try:
            self._check_lease()  # after a takeover it may be the new holder's save in progress
            if not self.run.storage.isdir(self.dirname):
                return
            if self.run.storage.exists(self.run.manifest_path(self.step)):
                return  # committed after all (the failure came later): never removed here
            self.run.delete_step(self.step)
            log.warning("resume: removed %s, left uncommitted by the failed save", self.dirname)
        except (OSError, LeaseLostError) as e:
            log.warning("resume: %s left as it is: %s", self.dirname, e)

    def _check_lease(self) -> None:
        if self.lease is not None:
            self.lease.check()
