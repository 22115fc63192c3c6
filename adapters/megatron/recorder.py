"""Megatron-LM: Megatron's own checkpoints, with the counters and continuity Megatron does not keep.

Megatron writes and reads its checkpoints itself (``--ckpt-format torch_dist``);
``MegatronRecorder`` adds, through the core's objects (``StepCommit``,
``Run.find_latest``, ``Collective``, ``Lease``, ``resume.control``):

- after each save, the commit: a manifest beside Megatron's files
  (``iter_%07d/resume-manifest.json``) with every file's size and checksum, the three
  counters and the expectation (next batch, LR ahead by Megatron-Core's own scheduler,
  each rank's RNG digest, config, layout);
- around each load, the restart's checks (``restart``): the newest committed checkpoint
  whose files verify, vetted pickles, the arguments against the record, and the
  continuity check on the live objects (``ContinuityError`` before the first iteration);
  a rewind to the checkpoint loaded (``resume rewind``) is applied and carried in every
  later manifest (``rewinds``); another parallel layout is refused before Megatron's load
  where its format cannot reshard, else logged and carried (``changes``; ``parallel``);
- rank 0's update journal (``updates``): one record per iteration, sealed by each commit
  (the manifest's ``journal``).

Call sequence (every rank, in this order; some calls are collective):

  save: ``before_save(iteration)`` -> Megatron's ``save_checkpoint`` returns ->
        ``after_save(iteration, args, scheduler, optimizer)``.
        ``--async-save``: ``before_save`` -> ``snapshot_save`` -> Megatron schedules the
        save -> ... -> Megatron's finalize step -> ``commit_save`` (``asyncsave``).
  load: ``before_load(args)`` -> Megatron's ``load_checkpoint`` ->
        ``after_load(iteration, args, scheduler, optimizer)``
  each iteration (optional): ``count_iteration(skipped)``, ``updates`` (rank 0's journal,
        ``updates``), ``poll_control()``; the end of ``train()``: ``close_journal()``

``install()`` (``install``) wires this into ``megatron.training``.
"""

from __future__ import annotations

import atexit
import logging
import time
from collections.abc import Callable
from typing import Any

from resume.collective import Collective
from resume.comm import Comm, LocalComm
from resume.commit import StepCommit
from resume.control import ControlArea, SaveRequest, poll_everywhere
from resume.errors import InvariantError
from resume.lease import Lease
from resume.manifest import Manifest
from resume.rewind import carried
from resume.run import Run
from resume.state import TrainState
from resume.storage import open_storage
from resume.stragglers import summarize
from resume.watchdog import Watchdog, process_watchdog

from ..environment import JobEnvironment
from .args import check_supported
from .asyncsave import SaveSnapshot
from .common import CommonState
from .layout import MEGATRON_LAYOUT
from .pretrained import pretrained_origin
from .record import (
    ADAPTER_NAME,
    group_overrides,
    list_files,
    loss_scale,
    lr_ahead_megatron,
    next_batch,
    rng_digest,
    run_config,
    topology,
)
from .restart import Loaded, MegatronRestart
from .schedule import MegatronSchedule
from .updates import MegatronUpdates

__all__ = ["MegatronRecorder"]

log = logging.getLogger("resume")


class MegatronRecorder:
    """Our manifest beside Megatron's checkpoints, and the continuity check around its loads.

    An integration, not an ``Adapter`` (``resume/adapter.py``): Megatron writes and reads its
    own checkpoints; the recorder adds the commit, discovery and the checks around them.
    """

    def __init__(self, save_dir: str, *, comm: Comm | None = None, lr_lookahead: int = 3,
                 verify_on_load: bool = True, accept_schedule_change: bool = False,
                 control_poll_s: float = 5.0, lease_ttl_s: float | None = 120.0,
                 clock: Callable[[], float] = time.monotonic, watchdog: Watchdog | None = None,
                 journal: bool = True) -> None:
        """
        Args:
            save_dir: Megatron's ``--save`` (and ``--load``) directory, a path or fsspec URL.
            comm: collectives over all ranks; default torch.distributed's world group when
                initialised, else a single process.
            lr_lookahead: K, the number of updates whose LR is recorded (>= 2).
            verify_on_load: every rank checksums its share of the chosen checkpoint before
                Megatron loads it; a corrupt newest checkpoint is passed over.
            accept_schedule_change: let a run whose arguments give another LR schedule
                continue (logged); by default that is a ContinuityError.
            control_poll_s: how often rank 0 looks for ``resume save`` requests.
            lease_ttl_s: rank 0 holds the save directory's lease (``lease.json``) from the
                first load or save on, with a heartbeat; another job is refused
                (RunBusyError) until it is this old. None: no lease.
            watchdog: whose iteration times each save records (``stragglers``); default the
                process's (``resume.watchdog.process_watchdog``), which ``install()`` drives.
            journal: rank 0 keeps the update journal (``updates``; ``resume journal``).
        """
        if lr_lookahead < 2:
            raise ValueError(f"lr_lookahead: expected >= 2, actual {lr_lookahead}")
        self.run = Run(open_storage(save_dir), MEGATRON_LAYOUT)
        self._comm = comm
        self._collective: Collective | None = None
        self.lr_lookahead = lr_lookahead
        self.verify_on_load = verify_on_load
        self.accept_schedule_change = accept_schedule_change
        self.clock = clock
        self.control = ControlArea(self.run, poll_s=control_poll_s, clock=clock)
        self.loaded: Loaded | None = None
        self.last_committed: int | None = None
        self._skipped_base: int | None = None  # skipped updates at the last load or save
        self._skipped_since = 0
        self._skipped_samples_base = 0
        self.lease_ttl_s = lease_ttl_s
        self._lease: Lease | None = None
        self._lease_taken = False
        self.watchdog = watchdog if watchdog is not None else process_watchdog()
        self.keep_journal = journal
        self._updates: MegatronUpdates | None = None
        self.rewinds: list[dict] = []
        """The rewinds this line of the run went through (manifest ``rewinds``; ``resume.rewind``)."""
        self.changes: list[dict] = []
        """What restarts of this line changed on purpose, ``{step, item, from, to}``: another
        parallel layout (manifest ``changes``)."""
        self.origin: dict | None = None  # the first weights' source (--pretrained-checkpoint; manifest origin)

    @property
    def comm(self) -> Comm:
        if self._comm is None:
            self._comm = _default_comm()
        return self._comm

    @property
    def collective(self) -> Collective:
        if self._collective is None:
            self._collective = Collective(self.comm)
        return self._collective

    @property
    def updates(self) -> MegatronUpdates | None:
        """Rank 0's update journal (``updates``); None on the other ranks or with ``journal=False``."""
        if self._updates is None and self.keep_journal and self.comm.rank == 0:
            self._updates = MegatronUpdates(self.run.storage, clock=self.clock)
        return self._updates

    def close_journal(self) -> None:
        """The end of ``train()`` (rank 0; nothing elsewhere)."""
        if self._updates is not None:
            self._updates.close()

    # -- counting -------------------------------------------------------------------------------

    def count_iteration(self, *, skipped: bool) -> None:
        """Record one iteration as it happens (skipped: the optimizer did not apply the update)."""
        if skipped:
            self._skipped_since += 1

    def counters(self, iteration: int, args: Any, scheduler: Any) -> TrainState:
        """The three counters now, derived from Megatron's state and cross-checked with the count."""
        common = CommonState(iteration=iteration, checkpoint_version=None, source="live state",
                             args={"global_batch_size": args.global_batch_size,
                                   "consumed_train_samples": args.consumed_train_samples,
                                   "rampup_batch_size": getattr(args, "rampup_batch_size", None)},
                             scheduler={"num_steps": scheduler.num_steps})
        state = common.counters()
        if self._skipped_base is not None:
            # Skips counted as they happened: those train_step reported, plus the
            # iterations Megatron skips without a train_step (--iterations-to-skip),
            # which it books in args.skipped_train_samples.
            explicit = (args.skipped_train_samples - self._skipped_samples_base) // args.global_batch_size
            counted = self._skipped_base + self._skipped_since + explicit
            if state.updates_skipped != counted:
                raise InvariantError(
                    f"live state: updates_skipped: expected {counted} (counted as they happened), actual "
                    f"{state.updates_skipped} = iteration {iteration} - scheduler position "
                    f"{scheduler.num_steps} / global batch {args.global_batch_size} (was the scheduler "
                    "stepped on a skipped update, or not stepped on an applied one?)")
        state.check_invariants(global_batch=args.global_batch_size, where="live state")
        return state

    def _reset_count(self, skipped: int | None, args: Any) -> None:
        self._skipped_base = skipped
        self._skipped_since = 0
        self._skipped_samples_base = getattr(args, "skipped_train_samples", 0) or 0

    # -- save -------------------------------------------------------------------------------------

    def expectation(self, state: TrainState, args: Any, scheduler: Any, optimizer: Any) -> dict:
        """This rank's view of what the next iteration must look like."""
        gbs = args.global_batch_size
        schedule = MegatronSchedule.from_scheduler(scheduler)
        return {
            "next_batch": next_batch(state.samples_read, gbs, args),
            "lr_ahead": lr_ahead_megatron(scheduler, gbs, self.lr_lookahead, group_overrides(optimizer)),
            "schedule": [schedule.to_dict()],
            "megatron": {
                "scheduler_position": int(scheduler.num_steps),
                "increment": gbs,
                "lr_schedule_ahead": [row[0] for row in
                                      schedule.lr_ahead(scheduler.num_steps, gbs, self.lr_lookahead)],
                "samples": {"consumed_train_samples": int(args.consumed_train_samples),
                            "skipped_train_samples": int(getattr(args, "skipped_train_samples", 0) or 0)},
                **({"loss_scale": scales} if (scales := loss_scale(optimizer)) is not None else {})},
        }

    def before_save(self, iteration: int) -> None:
        """Collective, before Megatron writes ``iter_<iteration>/``: an old manifest there goes first.

        Megatron saves into an existing directory without clearing it (a second
        save of the same iteration, or reaching again an iteration whose
        checkpoint was passed over); its files must never sit under a manifest
        that describes other bytes. A job whose lease was taken over stops here.
        """
        self._hold_lease()
        commit = StepCommit(self.run, iteration, lease=self._lease)
        self.collective.on_rank0(lambda: commit.prepare(clear=False))

    def after_save(self, iteration: int, args: Any, scheduler: Any, optimizer: Any = None) -> Manifest | None:
        """Collective, after Megatron's synchronous save returned: write the manifest (the commit).
        The manifest on rank 0, None on the others. (``--async-save``: ``asyncsave`` takes
        the snapshot when the save is scheduled and commits it when Megatron finalizes it.)"""
        return self.commit_save(self.snapshot_save(iteration, args, scheduler, optimizer), args)

    def snapshot_save(self, iteration: int, args: Any, scheduler: Any, optimizer: Any) -> SaveSnapshot:
        """Collective, at the iteration saved: every rank's part of the manifest but the files
        (counters, RNG digest; rank 0 the expectation). The skip count restarts here: the
        updates after this point belong to the next save."""
        started = self.clock()

        def local() -> dict:
            state = self.counters(iteration, args, scheduler)
            # Only rank 0's view of the next batch and the LR goes into the manifest;
            # the others send their RNG digest (one copy of the ids per rank would add up).
            part = {"state": state.to_dict(), "rng": rng_digest(),
                    # this rank's iteration times since the last save (stragglers), with the gather
                    "times": self.watchdog.progress.take_times(), "node": self.watchdog.node}
            if self.comm.rank == 0:
                part["expectation"] = self.expectation(state, args, scheduler, optimizer)
            return part

        mine: dict = {}
        # Only rank 0 receives the parts (each rank sends its own); every rank restarts its
        # skip count from its own counters, which every rank checked alike.
        parts = self.collective.gather(lambda: mine.setdefault("part", local()),
                                       f"state of {MEGATRON_LAYOUT.dirname(iteration)}", saving=True)
        self._reset_count(mine["part"]["state"]["updates_skipped"], args)
        updates = self.updates
        return SaveSnapshot(iteration, parts, started,
                            journal_lines=updates.snapshot(iteration) if updates is not None else None)

    def commit_save(self, snapshot: SaveSnapshot, args: Any) -> Manifest | None:
        """Collective, once the files are complete: rank 0 lists the directory once, every rank
        checksums its share (the checkpoint is read once, in parallel), rank 0 writes the
        manifest. The manifest on rank 0, None on the others."""
        commit = StepCommit(self.run, snapshot.iteration, lease=self._lease)
        what = f"manifest of {commit.dirname}"
        # Each rank receives the names of its own share only (broadcast, every rank would
        # receive the whole listing, which grows with the world size).
        share = self.collective.scatter(lambda: commit.shares(
            (n for n in list_files(self.run, commit.dirname) if n != MEGATRON_LAYOUT.manifest_name),
            self.comm.world_size), what, saving=True)
        files = self.collective.gather(lambda: commit.checksum_share(share), what, saving=True)
        committed: list[Manifest] = []  # rank 0's, kept here rather than sent to every rank

        def finalize() -> None:
            parts = [{**part, "files": share} for part, share in zip(snapshot.parts, files)]
            manifest = self._manifest(snapshot.iteration, parts, args, snapshot.started)
            if self._updates is not None and snapshot.journal_lines is not None:  # sealed before the commit
                manifest.journal = self._updates.seal(snapshot.iteration, snapshot.journal_lines)
            committed.append(commit.finalize([part["files"] for part in parts], manifest))
        self.collective.on_rank0(finalize)
        self.last_committed = snapshot.iteration
        return committed[0] if committed else None

    def _manifest(self, iteration: int, parts: list[dict], args: Any, started: float) -> Manifest:
        """Rank 0: the manifest from every rank's part (the files are added by the commit)."""
        first = parts[0]
        expectation = dict(first["expectation"])
        expectation["rng"] = [part["rng"] for part in parts]
        expectation["world_size"] = self.comm.world_size
        return Manifest(step=iteration, train_state=TrainState(**first["state"]), files={},
                        expectation=expectation, topology=topology(args, self.comm.world_size),
                        config=run_config(args), adapter=ADAPTER_NAME, stragglers=summarize(parts),
                        timing={"manifest_s": round(self.clock() - started, 3)}, rewinds=list(self.rewinds),
                        changes=list(self.changes), origin=self.origin)

    # -- load -------------------------------------------------------------------------------------

    def before_load(self, args: Any) -> int | None:
        """Collective, before Megatron's load: choose and vet the checkpoint (``MegatronRestart.choose``);
        the iteration Megatron will load, None: nothing of ours."""
        self.loaded = None
        check_supported(args)
        self._hold_lease()
        self.loaded = self._restart().choose(args)
        if self.loaded is None:  # a fresh start, or Megatron's warm start from --pretrained-checkpoint
            self.origin = pretrained_origin(args, self.collective, self.run)
        return self.loaded.manifest.step if self.loaded is not None else None

    def after_load(self, iteration: int, args: Any, scheduler: Any, optimizer: Any = None) -> None:
        """Collective, after Megatron's load: the continuity check on the live objects. Every rank
        checks its own; when one fails, every rank raises the same ContinuityError."""
        loaded = self.loaded
        if loaded is None:
            # A fresh start counts from zero; an unrecorded checkpoint's count is
            # unknown until the next save derives it.
            self._reset_count(None if iteration else 0, args)
            self.rewinds, self.changes = [], []
            if self.updates is not None:
                self.updates.start(None, iteration or None)
            return
        self._restart().check_live(loaded, iteration, args, scheduler, optimizer)
        recorded = loaded.manifest.train_state
        self._reset_count(recorded.updates_skipped, args)
        # A rewind to this checkpoint (resume rewind) is carried in every later manifest.
        self.rewinds = list(loaded.manifest.rewinds) + ([carried(loaded.rewind)] if loaded.rewind else [])
        self.changes = list(loaded.manifest.changes) + loaded.changes  # another layout (``parallel``)
        self.origin = loaded.manifest.origin  # the run's own checkpoint: its source is not read again
        if self.updates is not None:
            self.updates.start(loaded.manifest.journal, loaded.manifest.step)
        if self.comm.rank == 0:
            log.info("resume: continuity check passed for %s (iteration %d, %d successful / %d skipped "
                     "updates)", MEGATRON_LAYOUT.dirname(iteration), iteration,
                     recorded.updates_successful, recorded.updates_skipped)

    def _restart(self) -> MegatronRestart:
        return MegatronRestart(self.run, self.collective, verify_on_load=self.verify_on_load,
                               accept_schedule_change=self.accept_schedule_change)

    # -- save requests (resume save RUN) ----------------------------------------------------------

    def poll_control(self) -> list[SaveRequest]:
        """Collective: the pending ``resume save`` requests (rank 0 looks, at most every control_poll_s)."""
        requests, _ = poll_everywhere(self.control, self.comm)
        return requests

    def answer(self, requests: list[SaveRequest], *, step: int | None, error: str | None = None) -> None:
        """Rank 0 answers the requests; the other ranks have nothing to do."""
        if self.comm.rank == 0:
            self.control.answer(requests, step=step, error=error)

    # -- helpers ----------------------------------------------------------------------------------

    def _hold_lease(self) -> None:
        """Collective, once: rank 0 takes the save directory's lease (RunBusyError on every rank
        while another job holds it)."""
        if self.lease_ttl_s is None or self._lease_taken:
            return

        def take() -> None:
            # The job's identity from the cluster's environment (Slurm's job id, torchrun's run
            # id): a requeued copy of this job takes its own lease over at once.
            self._lease = Lease.take(self.run.storage, ttl_s=self.lease_ttl_s,
                                     job_id=JobEnvironment.from_env().job_id)
            atexit.register(self._lease.release)  # Megatron has no close(): free the run at exit
        self.collective.on_rank0(take)
        self._lease_taken = True  # on every rank alike: the next call is no collective anywhere


def _default_comm() -> Comm:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        from ..torch.comm import TorchDistComm

        return TorchDistComm()
    return LocalComm()
