"""Megatron-LM: Megatron's own checkpoints, with the counters and continuity Megatron does not keep.

Megatron writes its checkpoints itself (``--ckpt-format torch_dist``:
``iter_%07d/`` and ``latest_checkpointed_iteration.txt``). ``MegatronRecorder``
adds what it lacks:

- after each save, a manifest beside Megatron's files
  (``iter_%07d/resume-manifest.json``): every file with its size and xxh3
  checksum, the three counters, and the expectations: the next global batch
  from the sampler position, the LR of every param group for the next K
  updates computed with Megatron-Core's own ``OptimizerParamScheduler``, each
  rank's RNG digest, the config and the layout. ``resume verify``, ``ls`` and
  ``inspect`` then work on the save directory as on a native run, and the
  Slurm hook waits for "committed" rather than "tracker file changed";
- before each load, the choice of the newest checkpoint whose manifest is
  committed and whose files verify (Megatron is pointed at it with
  ``args.ckpt_step`` when its tracker names a newer, unverified one), the
  pickles Megatron will unpickle read first with restricted loaders, and the
  run's arguments checked against what the checkpoint recorded (config, and
  the LR the arguments' schedule gives at the next updates); with
  ``--use-checkpoint-opt_param-scheduler``, a warning for each schedule argument
  Megatron will ignore, naming its value and the checkpoint's, which Megatron uses;
- after each load, the continuity check on the live objects: counters,
  scheduler position, LR ahead, schedule, next batch, RNG; a mismatch raises
  ``ContinuityError`` before the first iteration. LRs are named in Megatron's
  numbering (``megatron_lr_numbering``: the LR Megatron logs at iteration N).

Saves Megatron made before ``resume`` was installed have no manifest: with nothing
recorded, the tracker's save is checked against its own ``.metadata``
(``megatron_check``) before Megatron loads it, and loaded without the continuity
check; ``resume megatron adopt`` (``megatron_adopt``) records one, and the restart
after it is checked (the scheduler's LR; RNG and group overrides were not known).

It is built on the same core objects as the coordinator, not beside them: the
commit is ``resume.commit.StepCommit`` (``prepare`` withdraws an old manifest,
``finalize`` writes the new one), discovery is ``Run.find_latest``, rank
agreement is ``resume.collective.Collective`` (errors travel as records, every
rank raises the same one), the lease is ``resume.lease.Lease`` and save requests
are ``resume.control``'s.

Call sequence (every rank, in this order; some calls are collective):

  save: ``before_save(iteration)`` -> Megatron's ``save_checkpoint`` returns
        (synchronous save: data written, barrier passed, tracker updated) ->
        ``after_save(iteration, args, scheduler, optimizer)``.
        With ``--async-save``: ``before_save`` -> ``snapshot_save`` (counters, next batch,
        LR ahead, RNG: collective, at the iteration saved) -> Megatron schedules the save ->
        ... -> Megatron's finalize step (every rank, once every rank's write is done, after
        Megatron's own finalize functions and its tracker) -> ``commit_save`` (files listed
        and checksummed, manifest written); ``resume.adapters.megatron_async``.
  load: ``before_load(args)`` -> Megatron's ``load_checkpoint`` ->
        ``after_load(iteration, args, scheduler, optimizer)``
  each iteration (optional): ``count_iteration(skipped)``, ``poll_control()``

``install()`` wires this into ``megatron.training`` for the stock entry point
(``pretrain_gpt.py``): import ``resume.adapters.megatron`` in the launch script
and call ``install()`` before ``pretrain(...)``. ``megatron.training`` of
megatron-core 0.19.2 needs Python >= 3.12 (it imports ``typing.override``), as
Megatron's own containers have; this module does not patch the standard library
(the tests, on 3.11, alias it in ``tests/support/megatron.py``).
"""

from __future__ import annotations

import argparse
import atexit
import copy
import logging
import time
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .environment import JobEnvironment

from resume.checksum import digest_parts
from resume.collective import Collective
from resume.comm import Comm, LocalComm
from resume.commit import StepCommit
from resume.continuity import Expectation, compare_config
from resume.control import ControlArea, SaveRequest
from resume.errors import (
    CheckpointNotFoundError,
    ContinuityError,
    InvariantError,
    NoValidCheckpointError,
    ResumeError,
    UnsafeCheckpointError,
    UsageError,
)
from resume.lease import Lease
from resume.manifest import Manifest
from resume.restore import verify_share
from resume.run import Run
from resume.state import TrainState
from resume.storage import join, open_storage

from .megatron_async import AsyncCommits, SaveSnapshot
from .megatron_ckpt import (
    MEGATRON_LAYOUT,
    CommonState,
    read_common_state,
    read_tracker,
    require_torch_dist,
)
from .megatron_schedule import STILL_FROM_ARGUMENTS, MegatronSchedule, ignored_schedule_arguments

__all__ = ["MegatronRecorder", "install", "next_batch_ids"]

log = logging.getLogger("resume")

ADAPTER_NAME = "megatron-core"
DATA_ARGS = ("data_path", "split", "dataloader_type", "tokenizer_type", "vocab_size", "seq_length", "seed")


def next_batch_ids(consumed: int, global_batch: int) -> list[int]:
    """Sample positions of the next global batch.

    Megatron's pretraining samplers read the stream in order: the next global
    batch is positions ``consumed .. consumed + global_batch - 1``, split over
    the data-parallel ranks in micro-batches (for ``single`` these are the
    dataset indices; for ``cyclic`` positions in the epoch's permutation).
    A test checks this against ``MegatronPretrainingSampler`` itself.
    """
    return list(range(consumed, consumed + global_batch))


def _data_config(args: Any) -> dict:
    return {k: _jsonable(getattr(args, k, None)) for k in DATA_ARGS}


def _jsonable(value: Any) -> Any:
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return str(value)


def megatron_lr_numbering(iteration: int, k: int) -> str:
    """Where Megatron's own log shows an LR of ``lr_ahead[+k]`` recorded at ``iteration``.

    Megatron logs, at iteration N, the LR after that iteration's update: the one the next
    update uses. ``lr_ahead[+0]`` is the LR in force when the checkpoint was saved, which
    Megatron logged at the saved iteration; ``lr_ahead[+k]`` is the one after k more successful
    updates, logged at iteration ``iteration + k`` when none of them is skipped."""
    return (f"Megatron logs at iteration {iteration + k} ('learning rate' of its log line; "
            f"{k} successful update{'s' if k != 1 else ''} after the saved iteration {iteration})")


def _group_overrides(optimizer: Any) -> list[dict]:
    """Per param group, the fields the scheduler reads (max_lr/min_lr overrides); [{}] without groups."""
    groups = getattr(optimizer, "param_groups", None) if optimizer is not None else None
    if not groups:
        return [{}]
    return [{k: float(g[k]) for k in ("max_lr", "min_lr") if k in g} for g in groups]


def lr_ahead_megatron(scheduler: Any, increment: int, k: int, groups: list[dict]) -> list[list[float]]:
    """LR of every group now and after each of the next k-1 updates, by Megatron's own scheduler.

    A shallow copy steps over copies of the groups (only the fields get_lr
    reads), so the live scheduler and the optimizer's groups are untouched.
    """
    probe = copy.copy(scheduler)
    probe_groups = [dict(g) for g in groups]
    probe.optimizer = types.SimpleNamespace(param_groups=probe_groups)
    out = []
    for i in range(k):
        if i:
            probe.step(increment=increment)
        out.append([float(probe.get_lr(g)) for g in probe_groups])
    return out


@dataclass
class _Loaded:
    manifest: Manifest
    source: str


@dataclass
class _Search:
    """What the search for a checkpoint to load found."""

    chosen: Manifest | None = None
    passed_over: list[tuple[int, str]] = field(default_factory=list)
    """(iteration, why), newest first."""
    recorded: bool = False
    """Some checkpoint on the way had a manifest: a restart without one is then refused."""


class MegatronRecorder:
    """Our manifest beside Megatron's checkpoints, and the continuity check around its loads.

    An integration, not an ``Adapter`` (``resume/adapter.py``): an adapter hands its state to
    the coordinator, which writes and reads it; here Megatron writes and reads its own
    checkpoints and the recorder adds the commit, discovery and the checks around them,
    through the same core objects (module docstring).
    """

    def __init__(self, save_dir: str, *, comm: Comm | None = None, lr_lookahead: int = 3,
                 verify_on_load: bool = True, accept_schedule_change: bool = False,
                 control_poll_s: float = 5.0, lease_ttl_s: float | None = 120.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
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
        self.loaded: _Loaded | None = None
        self.last_committed: int | None = None
        self._skipped_base: int | None = None  # skipped updates at the last load or save
        self._skipped_since = 0
        self._skipped_samples_base = 0
        self.lease_ttl_s = lease_ttl_s
        self._lease: Lease | None = None
        self._lease_taken = False

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
        ids = next_batch_ids(state.samples_read, gbs)
        data = _data_config(args)
        schedule = MegatronSchedule.from_scheduler(scheduler)
        return {
            "next_batch": {"ids": ids, "samples": len(ids),
                           "digest": digest_parts([repr(sorted(data.items()))] + [str(i) for i in ids])},
            "lr_ahead": lr_ahead_megatron(scheduler, gbs, self.lr_lookahead, _group_overrides(optimizer)),
            "schedule": [schedule.to_dict()],
            "megatron": {
                "scheduler_position": int(scheduler.num_steps),
                "increment": gbs,
                "lr_schedule_ahead": [row[0] for row in
                                      schedule.lr_ahead(scheduler.num_steps, gbs, self.lr_lookahead)],
                "samples": {"consumed_train_samples": int(args.consumed_train_samples),
                            "skipped_train_samples": int(getattr(args, "skipped_train_samples", 0) or 0)}},
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
        The manifest on rank 0, None on the others. (``--async-save``: ``megatron_async`` takes
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
            # the others send their RNG digest (5,120 copies of 1,920 ids add up).
            part = {"state": state.to_dict(), "rng": rng_digest()}
            if self.comm.rank == 0:
                part["expectation"] = self.expectation(state, args, scheduler, optimizer)
            return part

        mine: dict = {}
        # Only rank 0 receives the parts (each rank sends its own); every rank restarts its
        # skip count from its own counters, which every rank checked alike.
        parts = self.collective.gather(lambda: mine.setdefault("part", local()),
                                       f"state of {MEGATRON_LAYOUT.dirname(iteration)}", saving=True)
        self._reset_count(mine["part"]["state"]["updates_skipped"], args)
        return SaveSnapshot(iteration, parts, started)

    def commit_save(self, snapshot: SaveSnapshot, args: Any) -> Manifest | None:
        """Collective, once the files are complete: rank 0 lists the directory once, every rank
        checksums its share (a 7 TB checkpoint is read once, in parallel), rank 0 writes the
        manifest. The manifest on rank 0, None on the others."""
        commit = StepCommit(self.run, snapshot.iteration, lease=self._lease)
        what = f"manifest of {commit.dirname}"
        # Each rank receives the names of its own share only (the directory of 5,120 ranks
        # lists over 10,000 files: broadcast, every rank would receive them all).
        share = self.collective.scatter(lambda: commit.shares(
            (n for n in _walk(self.run, commit.dirname) if n != MEGATRON_LAYOUT.manifest_name),
            self.comm.world_size), what, saving=True)
        files = self.collective.gather(lambda: commit.checksum_share(share), what, saving=True)
        committed: list[Manifest] = []  # rank 0's, kept here rather than sent to every rank

        def finalize() -> None:
            parts = [{**part, "files": share} for part, share in zip(snapshot.parts, files)]
            committed.append(commit.finalize([part["files"] for part in parts],
                                             self._manifest(snapshot.iteration, parts, args, snapshot.started)))
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
                        expectation=expectation, topology=_topology(args, self.comm.world_size),
                        config=_config(args), adapter=ADAPTER_NAME,
                        timing={"manifest_s": round(self.clock() - started, 3)})

    # -- load -------------------------------------------------------------------------------------

    def before_load(self, args: Any) -> int | None:
        """Collective, before Megatron's load: choose and vet the checkpoint; None: nothing of ours.

        Newest first, rank 0 runs the commit check until one passes; then every
        rank checksums its share; a checkpoint that fails is passed over for the
        next older one (``--ckpt-step``: that one only). Megatron is pointed at the
        choice (``args.ckpt_step``) when its tracker names another. Whatever Megatron
        will load, its pickles are read first with restricted loaders. The run's
        arguments are checked against the record (refused: another config, or
        another LR ahead); with ``--use-checkpoint-opt_param-scheduler`` rank 0 logs a
        warning for each schedule argument Megatron will ignore for the checkpoint's value.
        """
        self.loaded = None
        check_supported(args)
        self._hold_lease()
        pinned = getattr(args, "ckpt_step", None) or None
        search = self._search(pinned)
        if self.comm.rank == 0:
            for step, why in search.passed_over:
                log.warning("resume: passing over %s: %s", MEGATRON_LAYOUT.dirname(step), why)
        if search.chosen is None:
            self._without_manifest(pinned, search, args)
            return None
        return self._point_megatron_at(search.chosen, args)

    def _search(self, pinned: int | None) -> _Search:
        """Collective: the newest committed checkpoint whose files verify (only ``pinned`` when set)."""
        search = _Search()
        below = pinned + 1 if pinned else None
        while True:
            manifest, rejected = self.collective.on_rank0(lambda b=below: self._find_latest(b, pinned))
            search.passed_over += [(step, why) for step, why, _ in rejected]
            search.recorded = search.recorded or manifest is not None or any(had for *_, had in rejected)
            if manifest is None:
                return search
            problems = verify_share(self.run, self.collective, manifest) if self.verify_on_load else []
            if not problems:
                search.chosen = manifest
                return search
            search.passed_over.append((manifest.step, "; ".join(problems)))
            if pinned:
                return search
            below = manifest.step

    def _find_latest(self, below: int | None, only: int | None) -> tuple[Manifest | None, list[tuple]]:
        """Rank 0: ``Run.find_latest`` below ``below``; what it passed over as (iteration, why,
        had a manifest), small enough to send to every rank."""
        if not self.run.storage.isdir(""):
            return None, []
        manifest, rejected = self.run.find_latest(below=below, only=only)
        return manifest, [(r.step, r.reason, r.has_manifest) for r in rejected]

    def _without_manifest(self, pinned: int | None, search: _Search, args: Any) -> None:
        """Collective: nothing of ours to load. Refused when ``--ckpt-step`` names a missing
        checkpoint or when every recorded one failed; else Megatron loads what it would (its
        files checked against its own .metadata, its pickles vetted first), and continuity is
        not checked for this restart. A save of Megatron's whose files do not match its
        .metadata is passed over for the newest older one that does (``args.ckpt_step``)."""
        if pinned and not search.passed_over and not search.recorded:
            d = MEGATRON_LAYOUT.dirname(pinned)
            if not self.collective.on_rank0(lambda: self.run.storage.isdir(d)):
                raise CheckpointNotFoundError(f"{self.run.storage.url(d)}: expected the checkpoint "
                                              "--ckpt-step names, actual missing")
        if search.recorded:
            raise NoValidCheckpointError(
                f"{self.run.url}: expected a checkpoint whose files verify, actual none ("
                + "; ".join(f"{MEGATRON_LAYOUT.dirname(s)}: {w}" for s, w in search.passed_over[:3]) + ")")
        megatron_choice = pinned or self.collective.on_rank0(lambda: _tracker_or_none(self.run.storage))
        if megatron_choice:
            sound = self.collective.on_rank0(lambda: self._sound_unrecorded(megatron_choice, pinned))
            if sound != megatron_choice:
                args.ckpt_step = sound  # restored after this load (_Wiring.load_checkpoint)
            log.warning("resume: %s: no resume manifest; Megatron loads %s and continuity is NOT "
                        "checked for this restart (`resume megatron adopt` records it)", self.run.url,
                        MEGATRON_LAYOUT.dirname(sound))
            self.collective.on_rank0(lambda: self._vet_pickles(sound, None))

    def _sound_unrecorded(self, choice: int, pinned: int | None) -> int:
        """Rank 0: ``choice`` if its files match Megatron's .metadata, else the newest older save
        that does (logged); NoValidCheckpointError when none does (or ``choice`` was pinned)."""
        from .megatron_check import check_save

        problems: list[str] = []
        for step in [choice] if pinned else [s for s in reversed(self.run.step_dirs()) if s <= choice]:
            check = check_save(self.run.storage, step)
            if check.ok:
                return step
            problems.append(f"{MEGATRON_LAYOUT.dirname(step)}: {check.problems[0]}")
            log.warning("resume: passing over %s (no resume manifest): %s", MEGATRON_LAYOUT.dirname(step),
                        "; ".join(check.problems))
        raise NoValidCheckpointError(f"{self.run.url}: expected a Megatron save whose files match its "
                                     f".metadata, actual none ({'; '.join(problems[:3])})")

    def _point_megatron_at(self, chosen: Manifest, args: Any) -> int | None:
        """Collective: the arguments checked and the pickles vetted, Megatron pointed at ``chosen``.
        None where Megatron will load something else (a pretrained or non-persistent checkpoint)."""
        source = self.run.storage.url(self.run.manifest_path(chosen.step))
        # The run's arguments against the record, before Megatron touches anything.
        self._check_arguments(chosen, args, source)
        self.collective.on_rank0(lambda: self._vet_pickles_and_name_ignored(chosen.step, chosen, args))
        tracker = self.collective.on_rank0(lambda: _tracker_or_none(self.run.storage))
        if tracker != chosen.step:
            if tracker is None and getattr(args, "pretrained_checkpoint", None):
                return None  # Megatron loads the pretrained checkpoint, not this directory
            log.warning("resume: loading %s, not %s named by Megatron's tracker",
                        MEGATRON_LAYOUT.dirname(chosen.step), tracker)
            args.ckpt_step = chosen.step
        if self._non_persistent_wins(args, chosen.step):
            log.warning("resume: Megatron prefers its non-persistent checkpoint over %s: no resume "
                        "manifest, continuity is NOT checked for this restart",
                        MEGATRON_LAYOUT.dirname(chosen.step))
            return None
        self.loaded = _Loaded(chosen, source)
        return chosen.step

    def _non_persistent_wins(self, args: Any, step: int) -> bool:
        """Megatron loads a non-persistent checkpoint when it is at least as new (checkpointing.py)."""
        if not getattr(args, "non_persistent_save_interval", None):
            return False
        if getattr(args, "non_persistent_ckpt_type", "global") != "global":
            return True  # local checkpoints: where they stand is the local manager's business
        directory = getattr(args, "non_persistent_global_ckpt_dir", None) or join(self.run.storage.root,
                                                                                   "non_persistent")
        iteration = self.collective.on_rank0(lambda: _tracker_or_none(open_storage(directory)))
        return iteration is not None and iteration >= step

    def _vet_pickles(self, step: int, manifest: Manifest | None) -> dict | None:
        """Every pickle Megatron will unpickle, read first with restricted loaders; the
        scheduler state Megatron will load (None when the checkpoint has none).

        With a manifest, a file in the directory that it does not list is refused:
        Megatron would read e.g. a planted ``common.pt``.
        """
        d = MEGATRON_LAYOUT.dirname(step)
        if manifest is not None:
            unlisted = sorted(set(_walk(self.run, d)) - set(manifest.files) - {MEGATRON_LAYOUT.manifest_name})
            if unlisted:
                raise UnsafeCheckpointError(f"{self.run.storage.url(d)}: files: expected only those the "
                                            f"manifest lists, actual also {unlisted[:5]} (refused)")
        require_torch_dist(self.run.storage, step)
        common = read_common_state(self.run.storage, step)  # .metadata via the allow-list, then the entry
        vet_byte_entries(self.run.storage, d)
        return common.scheduler

    def _vet_pickles_and_name_ignored(self, step: int, manifest: Manifest, args: Any) -> None:
        """Rank 0: vet the pickles; with --use-checkpoint-opt_param-scheduler, a warning for each
        argument Megatron will ignore for the value in the scheduler state it is about to load."""
        state = self._vet_pickles(step, manifest)
        if getattr(args, "use_checkpoint_opt_param_scheduler", False):
            for message in ignored_schedule_arguments(args, state):
                log.warning("resume: %s: %s", MEGATRON_LAYOUT.dirname(step), message)

    def _check_arguments(self, manifest: Manifest, args: Any, source: str) -> None:
        compare_config(manifest.config, _config(args))
        mega = manifest.expectation.get("megatron", {})
        position = mega.get("scheduler_position")
        recorded = mega.get("lr_schedule_ahead")
        if not isinstance(position, int) or not isinstance(recorded, list):
            return
        iteration = manifest.train_state.iteration
        if getattr(args, "use_checkpoint_opt_param_scheduler", False):
            # Megatron keeps the checkpoint's lengths and style (the arguments it ignores are
            # named once the pickles are vetted); what it still takes from the arguments must
            # give the recorded LR.
            saved = manifest.expectation.get("schedule")
            if not (isinstance(saved, list) and saved):
                return
            kept = MegatronSchedule.from_dict(saved[0], source=source)
            schedule = MegatronSchedule.from_args(args, checkpoint=kept)
            which = [f"{flag} {getattr(schedule, name)} (the checkpoint's {getattr(kept, name)})"
                     for name, flag in STILL_FROM_ARGUMENTS if getattr(schedule, name) != getattr(kept, name)]
            who = f"the run's {', '.join(which) or '--lr, --min-lr'} give{'s' if len(which) == 1 else ''}"
            why = ("; with --use-checkpoint-opt_param-scheduler Megatron keeps the checkpoint's warm-up, "
                   "decay length and style, but --lr and --min-lr still apply (every param group of "
                   "Megatron-Core's optimizer keeps them) and its scheduler does not save --lr-warmup-init "
                   "or the WSD length")
        else:
            schedule = MegatronSchedule.from_args(args)
            who, why = "the run's arguments (--lr, --min-lr, --lr-warmup-*, --lr-decay-*) give", ""
        flat = [row[0] for row in schedule.lr_ahead(position, args.global_batch_size, len(recorded))]
        if flat != recorded:
            i = next(i for i, (a, b) in enumerate(zip(recorded, flat)) if a != b)
            error = ContinuityError(f"lr_ahead[+{i}]", recorded[i], flat[i],
                                    f"{who} another LR {megatron_lr_numbering(iteration, i)} than the "
                                    f"checkpoint's schedule{why}")
            if not self.accept_schedule_change:
                raise error
            log.warning("resume: accepted schedule change: %s", error)

    def after_load(self, iteration: int, args: Any, scheduler: Any, optimizer: Any = None) -> None:
        """Collective, after Megatron's load: the continuity check on the live objects. Every rank
        checks its own; when one fails, every rank raises the same ContinuityError."""
        loaded = self.loaded
        if loaded is None:
            # A fresh start counts from zero; an unrecorded checkpoint's count is
            # unknown until the next save derives it.
            self._reset_count(None if iteration else 0, args)
            return
        self.collective.each(lambda: self._check_live(loaded, iteration, args, scheduler, optimizer),
                             f"continuity check of {MEGATRON_LAYOUT.dirname(iteration)}")
        recorded = loaded.manifest.train_state
        self._reset_count(recorded.updates_skipped, args)
        if self.comm.rank == 0:
            log.info("resume: continuity check passed for %s (iteration %d, %d successful / %d skipped "
                     "updates)", MEGATRON_LAYOUT.dirname(iteration), iteration,
                     recorded.updates_successful, recorded.updates_skipped)

    def _check_live(self, loaded: _Loaded, iteration: int, args: Any, scheduler: Any, optimizer: Any) -> None:
        """This rank's live objects against the record: counters, scheduler, LR ahead, schedule,
        next batch, RNG; the first difference is a ContinuityError naming it."""
        expected = Expectation.from_dict(loaded.manifest.expectation, source=loaded.source)
        recorded = loaded.manifest.train_state
        if iteration != loaded.manifest.step:
            raise ContinuityError("iteration", loaded.manifest.step, iteration,
                                  "Megatron loaded another checkpoint than the one verified")
        if args.consumed_train_samples != recorded.samples_read:
            raise ContinuityError("counters.samples_read", recorded.samples_read, args.consumed_train_samples)
        position = recorded.updates_successful * args.global_batch_size
        if scheduler.num_steps != position:
            raise ContinuityError("scheduler.position", f"{position} samples (updates_successful x global "
                                  "batch)", scheduler.num_steps, "the scheduler did not resume where it stopped")
        adopted = isinstance((loaded.manifest.expectation.get("megatron") or {}).get("adopted"), dict)
        if adopted:
            # Adopted (resume megatron adopt): the param groups' own overrides were not known, only
            # the scheduler's LR was recorded; the next save records every group's.
            rows = MegatronSchedule.from_scheduler(scheduler).lr_ahead(
                scheduler.num_steps, args.global_batch_size, len(expected.lr_ahead))
            actual_lr = [[row[0]] for row in rows]
        else:
            actual_lr = lr_ahead_megatron(scheduler, args.global_batch_size, len(expected.lr_ahead),
                                          _group_overrides(optimizer))
        if actual_lr != expected.lr_ahead and not self.accept_schedule_change:
            k = next(i for i, (a, b) in enumerate(zip(expected.lr_ahead, actual_lr)) if a != b)
            raise ContinuityError(f"lr_ahead[+{k}]", expected.lr_ahead[k], actual_lr[k],
                                  f"the learning-rate schedule does not continue where it stopped (the LR "
                                  f"{megatron_lr_numbering(iteration, k)})")
        live_schedule = [MegatronSchedule.from_scheduler(scheduler).to_dict()]
        if live_schedule != expected.schedule and not self.accept_schedule_change:
            for key in sorted(live_schedule[0]):
                if expected.schedule[0].get(key) != live_schedule[0][key]:
                    raise ContinuityError(f"schedule[0].{key}", expected.schedule[0].get(key),
                                          live_schedule[0][key], "the scheduler was rebuilt differently")
        ids = next_batch_ids(args.consumed_train_samples, args.global_batch_size)
        if expected.next_batch is not None and expected.next_batch["ids"] != ids:
            raise ContinuityError("next_batch.ids", expected.next_batch["ids"][:8], ids[:8],
                                  "the data stream does not continue where it stopped")
        self._check_rng(expected, loaded.manifest, args)

    def _check_rng(self, expected: Expectation, manifest: Manifest, args: Any) -> None:
        """This rank's generators, where Megatron restores them exactly."""
        same_layout = manifest.topology == _topology(args, self.comm.world_size)
        if not same_layout or getattr(args, "no_load_rng", False) or getattr(args, "finetune", False):
            return  # Megatron restores RNG per (pp, tp) rank only on the same layout
        if getattr(args, "data_parallel_random_init", False) and _data_parallel_rank() != 0:
            return  # Megatron gives every data-parallel rank the state of data-parallel rank 0
        digest = rng_digest()
        rank = self.comm.rank
        if rank < len(expected.rng) and expected.rng[rank] != digest:
            raise ContinuityError(f"rng (rank {rank})", expected.rng[rank], digest,
                                  "a generator was re-seeded or not restored")

    # -- save requests (resume save RUN) ----------------------------------------------------------

    def poll_control(self) -> list[SaveRequest]:
        """Collective: the pending ``resume save`` requests (rank 0 looks, at most every control_poll_s)."""
        requests = self.control.poll() if self.comm.rank == 0 else []
        (has,) = self.comm.max_flags([bool(requests)])
        return self.comm.broadcast_object(requests, src=0) if has else []

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


def vet_byte_entries(storage: Any, step_dir: str) -> None:
    """Read every object entry of a torch_dist checkpoint with ``torch.load(weights_only=True)``.

    Megatron loads them with full unpickling; a planted global fails here,
    naming the entry, before Megatron reads anything.
    """
    import io
    import pickle

    import torch
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    from .dcp_safe import read_step_metadata

    metadata = read_step_metadata(storage, step_dir)
    for index, info in metadata.storage_data.items():
        if not isinstance(metadata.state_dict_metadata.get(index.fqn), BytesStorageMetadata):
            continue
        path = join(step_dir, info.relative_path)
        with storage.open_read(path) as f:
            f.seek(info.offset)
            raw = f.read(info.length)
        try:
            with torch.serialization.safe_globals([argparse.Namespace, types.SimpleNamespace]):
                torch.load(io.BytesIO(raw), weights_only=True)
        except (pickle.UnpicklingError, RuntimeError, ValueError, EOFError) as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise UnsafeCheckpointError(f"{storage.url(path)}: entry {index.fqn!r}: expected plain data, "
                                        f"actual a pickle that weights-only loading refuses ({first})") from e


def rng_digest() -> str:
    """A digest of what Megatron saves and restores per rank: python, numpy, torch CPU, the
    current CUDA device and Megatron's CUDA RNG tracker states (not other devices')."""
    import random
    import sys

    import torch

    parts = [repr(random.getstate())]
    np = sys.modules.get("numpy")
    if np is not None:
        name, keys, pos, has_gauss, cached = np.random.get_state()
        parts.append(f"{name}:{digest_parts([keys.tobytes().hex()])}:{pos}:{has_gauss}:{cached!r}")
    parts.append(torch.get_rng_state().numpy().tobytes().hex())
    if torch.cuda.is_available():
        parts.append(torch.cuda.get_rng_state().numpy().tobytes().hex())
    tracker = sys.modules.get("megatron.core.tensor_parallel.random")
    if tracker is not None:
        try:
            states = tracker.get_cuda_rng_tracker().get_states()
        except Exception:  # noqa: BLE001 - a tracker never seeded has nothing to compare
            states = {}
        for name in sorted(states):
            parts.append(f"{name}:{states[name].cpu().numpy().tobytes().hex()}")
    return digest_parts(parts)


def _data_parallel_rank() -> int:
    try:
        from megatron.core import parallel_state

        return parallel_state.get_data_parallel_rank()
    except Exception:  # noqa: BLE001 - not initialised: treat as the one rank
        return 0


def _tracker_or_none(storage: Any) -> int | None:
    try:
        return read_tracker(storage)
    except (OSError, ResumeError):
        return None


def check_supported(args: Any) -> None:
    """Settings whose saves resume cannot record yet: refused before training, not at a save."""
    problems = []
    if getattr(args, "rampup_batch_size", None):
        problems.append("--rampup-batch-size (the counters assume a constant global batch)")
    if getattr(args, "decrease_batch_size_if_needed", False):
        problems.append("--decrease-batch-size-if-needed (the counters assume a constant global batch)")
    if getattr(args, "save_retain_interval", None):
        problems.append("--save-retain-interval (Megatron deletes the previous checkpoint before the "
                        "new one is committed)")
    if problems:
        raise UsageError("megatron arguments: expected none of " + ", ".join(problems) + " with "
                         "resume.adapters.megatron installed, actual set")


def _walk(run: Run, d: str) -> list[str]:
    """Every file under ``d``, relative to it."""
    out = []
    for name in run.storage.listdir(d):
        path = join(d, name)
        if run.storage.isdir(path):
            out.extend(join(name, sub) for sub in _walk(run, path))
        else:
            out.append(name)
    return out


def _config(args: Any) -> dict:
    return {"global_batch": args.global_batch_size, "seq_length": getattr(args, "seq_length", None),
            "data": _data_config(args)}


def _topology(args: Any, world_size: int) -> dict:
    return {"world_size": world_size,
            "tensor_parallel": getattr(args, "tensor_model_parallel_size", 1),
            "pipeline_parallel": getattr(args, "pipeline_model_parallel_size", 1),
            "context_parallel": getattr(args, "context_parallel_size", 1),
            "data_parallel": getattr(args, "data_parallel_size", None)}


def _default_comm() -> Comm:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        from .torch_native import TorchDistComm

        return TorchDistComm()
    return LocalComm()


# -- megatron.training ------------------------------------------------------------------------------


def install(*, recorder: MegatronRecorder | None = None, **options: Any) -> MegatronRecorder:
    """Wire the recorder into ``megatron.training`` (save, load, the step, the exit decision).

    Call once, before ``pretrain(...)``. Wraps, by name, in both modules that
    bind them: ``checkpointing.save_checkpoint``/``load_checkpoint`` and
    ``training.save_checkpoint``/``load_checkpoint``/``train_step``/
    ``checkpoint_and_decide_exit``, and ``checkpointing.schedule_async_save``
    (``--async-save``: the commit runs in Megatron's finalize step). ``options`` go to ``MegatronRecorder``
    when it is created here (from ``args.save`` at the first call).
    """
    if _INSTALLED:  # once per process: wrapping the wrappers would record every save twice
        return _INSTALLED[0]
    checkpointing, training, get_args = _import_megatron_training()
    wiring = _Wiring(checkpointing, training, get_args, recorder, options)
    for module in (checkpointing, training):
        if hasattr(module, "save_checkpoint"):
            module.save_checkpoint = wiring.save_checkpoint
        if hasattr(module, "load_checkpoint"):
            module.load_checkpoint = wiring.load_checkpoint
    wiring.async_commits = AsyncCommits.install(checkpointing)  # --async-save: commit at finalize
    training.train_step = wiring.train_step
    training.checkpoint_and_decide_exit = wiring.checkpoint_and_decide_exit
    log.info("resume: Megatron integration installed (manifests beside each torch_dist save)")
    handle = _Lazy(wiring.recorder)
    _INSTALLED.append(handle)
    return handle  # type: ignore[return-value]


_INSTALLED: list[Any] = []


def _import_megatron_training() -> tuple[Any, Any, Callable[[], Any]]:
    """``megatron.training``'s checkpointing and training modules and its ``get_args``."""
    try:
        from megatron.training import checkpointing, training
        from megatron.training.global_vars import get_args
    except ImportError as e:
        raise ImportError(f"resume.adapters.megatron.install(): expected megatron.training (megatron-core, "
                          f"on Python >= 3.12), actual {type(e).__name__}: {e}") from e
    return checkpointing, training, get_args


class _Wiring:
    """What ``install()`` puts in place of megatron.training's functions: each wrapper calls the
    original it holds, with the recorder's steps around it. The recorder is made at first use,
    from Megatron's arguments (``install()`` may run before ``pretrain()`` parses them)."""

    def __init__(self, checkpointing: Any, training: Any, get_args: Callable[[], Any],
                 recorder: MegatronRecorder | None, options: dict) -> None:
        self._training = training
        self._get_args = get_args
        self._recorder = recorder
        self._options = options
        self._save = checkpointing.save_checkpoint
        self._load = checkpointing.load_checkpoint
        self._train_step = training.train_step
        self._decide = training.checkpoint_and_decide_exit

    def recorder(self) -> MegatronRecorder | None:
        """The recorder; None until Megatron's arguments name a save (or load) directory."""
        if self._recorder is None:
            try:
                args = self._get_args()
            except AssertionError:  # install() runs before pretrain() parses the arguments
                return None
            save_dir = args.save or args.load
            if save_dir:
                self._recorder = MegatronRecorder(save_dir, **self._options)
        return self._recorder

    def save_checkpoint(self, iteration, model, optimizer, opt_param_scheduler, *a: Any, **kw: Any):
        args = self._get_args()
        r = self.recorder()
        recorded = (r is not None and not kw.get("non_persistent_ckpt") and args.ckpt_format == "torch_dist"
                    and opt_param_scheduler is not None)  # upcycling saves a model alone
        if recorded:
            check_supported(args)
            if args.async_save:  # committed when Megatron finalizes the save (megatron_async)
                return self.async_commits.save(
                    r, iteration, args, opt_param_scheduler, optimizer,
                    lambda: self._save(iteration, model, optimizer, opt_param_scheduler, *a, **kw))
            r.before_save(iteration)
        result = self._save(iteration, model, optimizer, opt_param_scheduler, *a, **kw)
        if recorded:
            r.after_save(iteration, args, opt_param_scheduler, optimizer)
        return result

    def load_checkpoint(self, model, optimizer, opt_param_scheduler, *a: Any, **kw: Any):
        args = self._get_args()
        load_dir = getattr(args, kw.get("load_arg", "load"), None)
        r = self.recorder()
        if r is None or not load_dir or open_storage(load_dir).root != r.run.storage.root:
            return self._load(model, optimizer, opt_param_scheduler, *a, **kw)
        pinned = getattr(args, "ckpt_step", None)
        r.before_load(args)  # also refuses settings it cannot record, before any training
        try:
            result = self._load(model, optimizer, opt_param_scheduler, *a, **kw)
        finally:
            args.ckpt_step = pinned  # a choice made for this load only
        iteration = result[0] if isinstance(result, tuple) else result
        r.after_load(iteration, args, opt_param_scheduler, optimizer)
        return result

    def train_step(self, *a: Any, **kw: Any):
        result = self._train_step(*a, **kw)
        r = self.recorder()
        if r is not None:
            count_train_step(r, result)
        return result

    def checkpoint_and_decide_exit(self, model, optimizer, opt_param_scheduler, iteration,
                                   num_floating_point_operations_so_far, checkpointing_context,
                                   train_data_iterator):
        """Megatron's own decision first (interval, exit signal, duration): a save it makes at
        this iteration answers pending ``resume save`` requests too, without a second save."""
        r = self.recorder()
        requests = r.poll_control() if r is not None and self._get_args().save else []
        try:
            exit_now = self._decide(model, optimizer, opt_param_scheduler, iteration,
                                    num_floating_point_operations_so_far, checkpointing_context,
                                    train_data_iterator)
            if requests:
                # --async-save: answered only once the step is committed (Megatron's own save of
                # this iteration, or ours below): its finalize is waited for here.
                self.async_commits.maybe_wait_for_commit(iteration)
                if r.last_committed != iteration:
                    self._training.save_checkpoint_and_time(iteration, model, optimizer, opt_param_scheduler,
                                                            num_floating_point_operations_so_far,
                                                            checkpointing_context,
                                                            train_data_iterator=train_data_iterator)
                    self.async_commits.maybe_wait_for_commit(iteration)
        except Exception as e:
            if requests:
                r.answer(requests, step=None, error=str(e))
            raise
        if requests:
            r.answer(requests, step=iteration)
        return exit_now or any(q.stop for q in requests)


def count_train_step(recorder: MegatronRecorder, result: Any) -> None:
    """Count what megatron.training's ``train_step`` returned: ``(losses, skipped_iter,
    should_checkpoint, should_exit, ...)``. An early return that asks to checkpoint and
    exit (a rerun from a checkpoint) is not an iteration: train() does not advance for it."""
    if not isinstance(result, tuple) or len(result) < 2:
        return
    if len(result) > 3 and result[3]:
        return
    recorder.count_iteration(skipped=bool(result[1]))


class _Lazy:
    """The recorder, resolved at first use (``install()`` may run before ``args`` exist)."""

    def __init__(self, get: Callable[[], MegatronRecorder | None]) -> None:
        self._get = get

    def __getattr__(self, name: str) -> Any:
        recorder = self._get()
        if recorder is None:
            raise AttributeError(f"resume: no recorder yet (args.save is not set): {name}")
        return getattr(recorder, name)
