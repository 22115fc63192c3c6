"""A restart around Megatron's own load: the checkpoint chosen and vetted before, continuity after.

Before the load (``choose``, collective): the newest committed checkpoint whose files
verify (a failing one is passed over for the next older; ``--ckpt-step``: that one
only); Megatron is pointed at it (``args.ckpt_step``) when its tracker names another;
the pickles Megatron will unpickle are vetted; the run's arguments are checked against
the record (another config or another LR ahead is refused), and so is the parallel layout they
give (``parallel``: another layout whose checkpoint format Megatron cannot reshard is refused,
naming the flag; one it can is logged and carried in ``changes``). Without any manifest,
Megatron's own save is checked against its ``.metadata`` and loaded unchecked.

A rewind to the checkpoint chosen (``resume rewind``, ``resume.rewind.pending_rewind``) is
applied as the native restore applies it, less the skips (refused: Megatron's data position
cannot skip): when its accepted names (``resume.changes`` names) name every field of the
schedule the arguments change (``schedule[0].lr_decay_steps``, ``lr_decay_steps``, ``lr`` or
``max_lr`` for the peak, ``schedule`` for all: ``rewind_accepts``), this restart continues with
the arguments' schedule, as ``accept_schedule_change`` lets it (logged). Megatron itself loads
another schedule only with ``--override-opt_param-scheduler``, and no other ``--lr`` or
``--min-lr`` at all (its optimizer's param groups are matched by them).

After the load (``check_live``, collective): counters, scheduler position, LR ahead,
schedule, next batch, RNG and the fp16 loss scaler against the record; a mismatch on any rank is the same
``ContinuityError`` on every rank, before the first iteration.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from resume.changes import AcceptChanges
from resume.collective import Collective
from resume.continuity import Expectation, compare_config
from resume.errors import CheckpointNotFoundError, ContinuityError, NoValidCheckpointError
from resume.manifest import Manifest
from resume.restore import choose_verified, verify_share
from resume.rewind import RewindRefused, pending_rewind
from resume.run import Run
from resume.storage import join, open_storage

from .check import check_save
from .parallel import saved_layout_change
from .record import (
    data_parallel_rank,
    group_overrides,
    loss_scale,
    lr_ahead_megatron,
    megatron_lr_numbering,
    next_batch_ids,
    rng_digest,
    run_config,
    same_degrees,
    topology,
)
from .savedir import iteration_dirname, tracker_or_none
from .schedule import STILL_FROM_ARGUMENTS, MegatronSchedule, ignored_schedule_arguments
from .vet import vet_pickles

__all__ = ["Loaded", "MegatronRestart", "rewind_accepts"]

log = logging.getLogger("resume")


@dataclass
class Loaded:
    """The checkpoint verified for Megatron's load, and where its manifest is."""

    manifest: Manifest
    source: str
    rewind: dict | None = None
    """The rewind to this checkpoint this restart applies (``resume.rewind.pending_rewind``)."""
    changes: list[dict] = field(default_factory=list)
    """What this restart changes on purpose (``{step, item, from, to}``: another parallel layout),
    carried in every later manifest (``Manifest.changes``)."""


@dataclass
class _Search:
    """What the search for a checkpoint to load found."""

    chosen: Manifest | None = None
    passed_over: list[tuple[int, str]] = field(default_factory=list)
    """(iteration, why), newest first."""
    recorded: bool = False
    """Some checkpoint on the way had a manifest: a restart without one is then refused."""


class MegatronRestart:
    """The checks of one restart of ``run`` around Megatron's load, collective over every rank."""

    def __init__(self, run: Run, collective: Collective, *, verify_on_load: bool,
                 accept_schedule_change: bool) -> None:
        self.run = run
        self.collective = collective
        self.verify_on_load = verify_on_load
        self.accept_schedule_change = accept_schedule_change

    # -- before the load ----------------------------------------------------------------------------

    def choose(self, args: Any) -> Loaded | None:
        """Collective: the checkpoint Megatron is pointed at, verified and vetted; None when
        Megatron will load nothing of ours (a fresh start, an unrecorded save, a pretrained or
        non-persistent checkpoint)."""
        pinned = getattr(args, "ckpt_step", None) or None
        search = self._search(pinned)
        if self.collective.rank == 0:
            for step, why in search.passed_over:
                log.warning("resume: passing over %s: %s", iteration_dirname(step), why)
        if search.chosen is None:
            self._without_manifest(pinned, search, args)
            return None
        return self._point_megatron_at(search.chosen, args)

    def _search(self, pinned: int | None) -> _Search:
        """Collective: the newest committed checkpoint whose files verify (only ``pinned`` when set)."""
        if not self.collective.on_rank0(lambda: self.run.storage.isdir("")):
            return _Search()

        def problems(manifest: Manifest) -> list[str]:
            return verify_share(self.run, self.collective, manifest) if self.verify_on_load else []
        choice = choose_verified(self.run, self.collective, problems, only=pinned)
        return _Search(choice.manifest, [(step, why) for step, why, _ in choice.passed_over],
                       recorded=choice.manifest is not None or any(had for *_, had in choice.passed_over))

    def _without_manifest(self, pinned: int | None, search: _Search, args: Any) -> None:
        """Collective: nothing of ours to load. Refused when ``--ckpt-step`` names a missing
        checkpoint or when every recorded one failed; else Megatron loads the newest of its own
        saves whose files match its .metadata (``args.ckpt_step``), pickles vetted first, and
        continuity is not checked for this restart."""
        if pinned and not search.passed_over and not search.recorded:
            d = iteration_dirname(pinned)
            if not self.collective.on_rank0(lambda: self.run.storage.isdir(d)):
                raise CheckpointNotFoundError(f"{self.run.storage.url(d)}: expected the checkpoint "
                                              "--ckpt-step names, actual missing")
        if search.recorded:
            raise NoValidCheckpointError(
                f"{self.run.url}: expected a checkpoint whose files verify, actual none ("
                + "; ".join(f"{iteration_dirname(s)}: {w}" for s, w in search.passed_over[:3]) + ")")
        megatron_choice = pinned or self.collective.on_rank0(lambda: tracker_or_none(self.run.storage))
        if megatron_choice:
            sound = self.collective.on_rank0(lambda: self._sound_unrecorded(megatron_choice, pinned))
            if sound != megatron_choice:
                args.ckpt_step = sound  # restored after this load (install's load_checkpoint)
            log.warning("resume: %s: no resume manifest; Megatron loads %s and continuity is NOT "
                        "checked for this restart (`resume megatron adopt` records it)", self.run.url,
                        iteration_dirname(sound))
            self.collective.on_rank0(lambda: vet_pickles(self.run, sound, None))

    def _sound_unrecorded(self, choice: int, pinned: int | None) -> int:
        """Rank 0: ``choice`` if its files match Megatron's .metadata, else the newest older save
        that does (logged); NoValidCheckpointError when none does (or ``choice`` was pinned)."""
        problems: list[str] = []
        for step in [choice] if pinned else [s for s in reversed(self.run.step_dirs()) if s <= choice]:
            check = check_save(self.run.storage, step)
            if check.ok:
                return step
            problems.append(f"{iteration_dirname(step)}: {check.problems[0]}")
            log.warning("resume: passing over %s (no resume manifest): %s", iteration_dirname(step),
                        "; ".join(check.problems))
        raise NoValidCheckpointError(f"{self.run.url}: expected a Megatron save whose files match its "
                                     f".metadata, actual none ({'; '.join(problems[:3])})")

    def _point_megatron_at(self, chosen: Manifest, args: Any) -> Loaded | None:
        """Collective: the arguments checked and the pickles vetted, Megatron pointed at ``chosen``.
        None where Megatron will load something else (a pretrained or non-persistent checkpoint)."""
        source = self.run.storage.url(self.run.manifest_path(chosen.step))
        loaded = Loaded(chosen, source, self._rewind_to(chosen))
        self._check_arguments(chosen, args, source, rewind=loaded.rewind)  # before Megatron touches anything
        self._check_layout(loaded, args)
        self.collective.on_rank0(lambda: self._vet_and_name_ignored(chosen, args))
        tracker = self.collective.on_rank0(lambda: tracker_or_none(self.run.storage))
        if tracker != chosen.step:
            if tracker is None and getattr(args, "pretrained_checkpoint", None):
                return None  # Megatron loads the pretrained checkpoint, not this directory
            log.warning("resume: loading %s, not %s named by Megatron's tracker",
                        iteration_dirname(chosen.step), tracker)
            args.ckpt_step = chosen.step
        if self._non_persistent_wins(args, chosen.step):
            log.warning("resume: Megatron prefers its non-persistent checkpoint over %s: no resume "
                        "manifest, continuity is NOT checked for this restart",
                        iteration_dirname(chosen.step))
            return None
        return loaded

    def _check_layout(self, loaded: Loaded, args: Any) -> None:
        """The checkpoint's parallel layout against the arguments' (``parallel``), on every rank alike
        from the same manifest and arguments: another layout Megatron cannot load is refused here,
        before its load reads anything; one it loads is logged and recorded in ``loaded.changes``."""
        change = saved_layout_change(loaded.manifest, args, self.collective.world_size, source=loaded.source)
        if change is None:
            return
        if self.collective.rank == 0:
            log.warning("resume: %s: %s", iteration_dirname(loaded.manifest.step), change.describe())
        loaded.changes.append(change.record(loaded.manifest.step))

    def _rewind_to(self, chosen: Manifest) -> dict | None:
        """Collective: the rewind this restart applies (None: none); refused with skips."""
        rewind = self.collective.on_rank0(lambda: pending_rewind(self.run, chosen))
        if rewind is None:
            return None
        if rewind.get("skips"):
            raise RewindRefused(
                f"{self.run.url}: rewind {rewind['n']}: skips: expected none on a Megatron run (its data position "
                f"is consumed_train_samples, which cannot pass over samples), actual {rewind['skips']}")
        if self.collective.rank == 0:
            log.warning("resume: applying rewind %d to %s (%s); accepted: %s", rewind["n"],
                        iteration_dirname(chosen.step), rewind.get("reason", ""), rewind.get("accept") or "nothing")
        return rewind

    def _non_persistent_wins(self, args: Any, step: int) -> bool:
        """Megatron loads a non-persistent checkpoint when it is at least as new (checkpointing.py)."""
        if not getattr(args, "non_persistent_save_interval", None):
            return False
        if getattr(args, "non_persistent_ckpt_type", "global") != "global":
            return True  # local checkpoints: where they stand is the local manager's business
        directory = getattr(args, "non_persistent_global_ckpt_dir", None) or join(self.run.storage.root,
                                                                                   "non_persistent")
        iteration = self.collective.on_rank0(lambda: tracker_or_none(open_storage(directory)))
        return iteration is not None and iteration >= step

    def _vet_and_name_ignored(self, manifest: Manifest, args: Any) -> None:
        """Rank 0: vet the pickles; with --use-checkpoint-opt_param-scheduler, a warning for each
        argument Megatron will ignore for the value in the scheduler state it is about to load."""
        state = vet_pickles(self.run, manifest.step, manifest)
        if getattr(args, "use_checkpoint_opt_param_scheduler", False):
            for message in ignored_schedule_arguments(args, state):
                log.warning("resume: %s: %s", iteration_dirname(manifest.step), message)

    def _check_arguments(self, manifest: Manifest, args: Any, source: str, *, rewind: dict | None = None) -> None:
        """The run's config and the LR its arguments give at the next updates, against the record
        (another schedule is accepted by ``accept_schedule_change`` or by ``rewind``)."""
        compare_config(manifest.config, run_config(args))
        mega = manifest.expectation.get("megatron", {})
        position = mega.get("scheduler_position")
        recorded = mega.get("lr_schedule_ahead")
        if not isinstance(position, int) or not isinstance(recorded, list):
            return
        saved = manifest.expectation.get("schedule")
        if getattr(args, "use_checkpoint_opt_param_scheduler", False):
            if not (isinstance(saved, list) and saved):
                return
            schedule, who, why = _kept_schedule(args, MegatronSchedule.from_dict(saved[0], source=source))
        else:
            schedule = MegatronSchedule.from_args(args)
            who, why = "the run's arguments (--lr, --min-lr, --lr-warmup-*, --lr-decay-*) give", ""
        flat = [row[0] for row in schedule.lr_ahead(position, args.global_batch_size, len(recorded))]
        if flat != recorded:
            i = next(i for i, (a, b) in enumerate(zip(recorded, flat)) if a != b)
            where = megatron_lr_numbering(manifest.train_state.iteration, i)
            changed = changed_fields(saved, [schedule.to_dict()])
            error = ContinuityError(f"lr_ahead[+{i}]", recorded[i], flat[i],
                                    f"{who} another LR {where} than the checkpoint's schedule{why}"
                                    + (f" (changed: {', '.join(changed)})" if changed else ""))
            if not (self.accept_schedule_change or rewind_accepts(rewind, saved, [schedule.to_dict()])):
                raise error
            log.warning("resume: accepted schedule change: %s", error)

    # -- after the load -----------------------------------------------------------------------------

    def check_live(self, loaded: Loaded, iteration: int, args: Any, scheduler: Any, optimizer: Any) -> None:
        """Collective: every rank checks its live objects; when one fails, every rank raises the
        same ContinuityError."""
        self.collective.each(lambda: self._check_live(loaded, iteration, args, scheduler, optimizer),
                             f"continuity check of {iteration_dirname(iteration)}")

    def _check_live(self, loaded: Loaded, iteration: int, args: Any, scheduler: Any, optimizer: Any) -> None:
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
        self._check_lr_and_schedule(loaded, expected, iteration, args, scheduler, optimizer)
        ids = next_batch_ids(args.consumed_train_samples, args.global_batch_size)
        if expected.next_batch is not None and expected.next_batch["ids"] != ids:
            raise ContinuityError("next_batch.ids", expected.next_batch["ids"][:8], ids[:8],
                                  "the data stream does not continue where it stopped")
        self._check_rng(expected, loaded.manifest, args)
        _check_loss_scale(loaded.manifest, args, optimizer)

    def _check_lr_and_schedule(self, loaded: Loaded, expected: Expectation, iteration: int, args: Any,
                               scheduler: Any, optimizer: Any) -> None:
        manifest = loaded.manifest
        live_schedule = [MegatronSchedule.from_scheduler(scheduler).to_dict()]
        accept = self.accept_schedule_change or rewind_accepts(loaded.rewind, expected.schedule, live_schedule)
        adopted = isinstance((manifest.expectation.get("megatron") or {}).get("adopted"), dict)
        if adopted:
            # Adopted (resume megatron adopt): the param groups' own overrides were not known, only
            # the scheduler's LR was recorded; the next save records every group's.
            rows = MegatronSchedule.from_scheduler(scheduler).lr_ahead(
                scheduler.num_steps, args.global_batch_size, len(expected.lr_ahead))
            actual_lr = [[row[0]] for row in rows]
        else:
            actual_lr = lr_ahead_megatron(scheduler, args.global_batch_size, len(expected.lr_ahead),
                                          group_overrides(optimizer))
        if actual_lr != expected.lr_ahead and not accept:
            k = next(i for i, (a, b) in enumerate(zip(expected.lr_ahead, actual_lr)) if a != b)
            raise ContinuityError(f"lr_ahead[+{k}]", expected.lr_ahead[k], actual_lr[k],
                                  f"the learning-rate schedule does not continue where it stopped (the LR "
                                  f"{megatron_lr_numbering(iteration, k)})")
        if live_schedule != expected.schedule and not accept:
            for key in sorted(live_schedule[0]):
                if expected.schedule[0].get(key) != live_schedule[0][key]:
                    raise ContinuityError(f"schedule[0].{key}", expected.schedule[0].get(key),
                                          live_schedule[0][key], "the scheduler was rebuilt differently")

    def _check_rng(self, expected: Expectation, manifest: Manifest, args: Any) -> None:
        """This rank's generators, where Megatron restores them exactly."""
        same_layout = same_degrees(manifest.topology, topology(args, self.collective.world_size))
        if not same_layout or getattr(args, "no_load_rng", False) or getattr(args, "finetune", False):
            return  # Megatron restores RNG per (pp, tp) rank only on the same layout
        if getattr(args, "data_parallel_random_init", False) and data_parallel_rank() != 0:
            return  # Megatron gives every data-parallel rank the state of data-parallel rank 0
        digest = rng_digest()
        rank = self.collective.rank
        if rank < len(expected.rng) and expected.rng[rank] != digest:
            raise ContinuityError(f"rng (rank {rank})", expected.rng[rank], digest,
                                  "a generator was re-seeded or not restored")


def _check_loss_scale(manifest: Manifest, args: Any, optimizer: Any) -> None:
    """The fp16 loss scaler continues where it stopped: Megatron loads it with the optimizer, and
    silently starts a fresh one where the checkpoint has none or a constant ``--loss-scale`` is given."""
    recorded = (manifest.expectation.get("megatron") or {}).get("loss_scale")
    if recorded is None or optimizer is None or getattr(args, "no_load_optim", False) \
            or getattr(args, "finetune", False):
        return  # nothing recorded (fp32, bf16), or the optimizer's state deliberately not loaded
    if not isinstance(recorded, list):
        raise ContinuityError("megatron.loss_scale", "a list (one scaler per optimizer)",
                              type(recorded).__name__, "the manifest's record is damaged")
    live = loss_scale(optimizer) or []
    for i, saved in enumerate(recorded):
        now = live[i] if i < len(live) else None
        if now != saved:
            raise ContinuityError(f"megatron.loss_scale[{i}]", saved, now,
                                  "the fp16 loss scaler does not continue where it stopped (a constant "
                                  "--loss-scale, --bf16, or a checkpoint without the scaler's state)")


def _kept_schedule(args: Any, kept: MegatronSchedule) -> tuple[MegatronSchedule, str, str]:
    """With --use-checkpoint-opt_param-scheduler: the schedule Megatron will run (the checkpoint's
    lengths and style, the arguments' --lr and --min-lr), who gives it, and why."""
    schedule = MegatronSchedule.from_args(args, checkpoint=kept)
    which = [f"{flag} {getattr(schedule, name)} (the checkpoint's {getattr(kept, name)})"
             for name, flag in STILL_FROM_ARGUMENTS if getattr(schedule, name) != getattr(kept, name)]
    who = f"the run's {', '.join(which) or '--lr, --min-lr'} give{'s' if len(which) == 1 else ''}"
    why = ("; with --use-checkpoint-opt_param-scheduler Megatron keeps the checkpoint's warm-up, "
           "decay length and style, but --lr and --min-lr still apply (every param group of "
           "Megatron-Core's optimizer keeps them) and its scheduler does not save --lr-warmup-init "
           "or the WSD length")
    return schedule, who, why


def changed_fields(saved: Any, live: list[dict]) -> list[str]:
    """The fields in which the ``live`` schedule differs from the ``saved`` one (``[schedule.to_dict()]``
    both); none when nothing was saved."""
    if not (isinstance(saved, list) and saved and isinstance(saved[0], dict)):
        return []
    return [k for k in sorted(set(saved[0]) | set(live[0])) if saved[0].get(k) != live[0].get(k)]


def rewind_accepts(rewind: dict | None, saved: Any, live: list[dict]) -> bool:
    """Whether ``rewind``'s accepted names (``resume.changes`` names) name every field in which the
    ``live`` schedule differs from the ``saved`` one; ``lr`` and ``initial_lr`` name the peak (``max_lr``)."""
    changed = changed_fields(saved, live)
    if rewind is None or not changed:
        return False
    accept = AcceptChanges(tuple(rewind.get("accept", ())))
    return all(accept.accepts(f"schedule[0].{k}") or (k == "max_lr" and accept.accepts("schedule[0].base_lrs"))
               for k in changed)

