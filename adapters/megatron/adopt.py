"""``resume megatron adopt``: a manifest for a Megatron save that ``resume`` never recorded.

The newest save up to the tracker that passes ``check``'s deep check (or ``--iteration N``)
is committed through ``StepCommit`` under the save directory's lease: the checksums of
every file, taken now; the counters Megatron's common state gives (refused, never guessed,
without the scheduler's state); the expectation from Megatron's saved arguments and
scheduler. RNG digests and the param groups' own LR overrides cannot be known: ``rng``
stays empty and the restart compares the scheduler's LR. The manifest is marked
``expectation.megatron.adopted``; an iteration with a manifest of ours is never adopted again.
"""


from __future__ import annotations

import types
from collections.abc import Callable
from dataclasses import dataclass, field

from resume.commit import StepCommit
from resume.errors import AdoptRefusedError, CheckpointNotFoundError, UsageError
from resume.lease import Lease
from resume.manifest import Manifest
from resume.run import Run, utc_now
from resume.state import TrainState

from .check import SaveCheck, check_save
from .layout import MEGATRON_LAYOUT
from .record import ADAPTER_NAME, list_files, next_batch, run_config, topology
from .savedir import read_tracker

__all__ = ["AdoptRefusedError", "Adopted", "adopt"]

ADOPTED_BY = "resume megatron adopt"


@dataclass
class Adopted:
    """What ``adopt`` did: the manifest written (None when the iteration was already recorded)."""

    iteration: int
    manifest: Manifest | None
    already: bool = False
    passed_over: list[tuple[int, str]] = field(default_factory=list)


def adopt(save_dir: str, *, iteration: int | None = None, lr_lookahead: int = 3,
          progress: Callable[[int], None] | None = None) -> Adopted:
    """Adopt ``iteration`` (default: the newest save up to Megatron's tracker that passes the
    deep check). Holds the save directory's lease while it writes: a job with ``resume``
    installed that is running there refuses it (RunBusyError)."""
    if lr_lookahead < 2:
        raise UsageError(f"--lr-lookahead: expected >= 2, actual {lr_lookahead}")
    run = Run.open(save_dir, layout=MEGATRON_LAYOUT)
    tracker = read_tracker(run.storage)
    candidates = _candidates(run, tracker, iteration)
    lease = Lease(run.storage, ttl_s=120.0)
    lease.acquire()
    try:
        return _adopt_first(run, lease, candidates, iteration, lr_lookahead, progress)
    finally:
        lease.release()


def _candidates(run: Run, tracker: int | None, iteration: int | None) -> list[int]:
    steps = run.step_dirs()
    if iteration is not None:
        if iteration not in steps:
            raise CheckpointNotFoundError(f"{run.storage.url(run.dirname(iteration))}: expected a Megatron "
                                          f"save, actual missing (iterations: {steps[-8:]})")
        return [iteration]
    if tracker is None:
        raise CheckpointNotFoundError(f"{run.storage.url(MEGATRON_LAYOUT.pointer)}: expected Megatron's tracker "
                                      "naming its last finished save, actual missing (name one with --iteration)")
    found = [s for s in reversed(steps) if s <= tracker]
    if not found:
        raise CheckpointNotFoundError(f"{run.url}: expected a Megatron save up to the tracker's iteration "
                                      f"{tracker}, actual none")
    return found


def _adopt_first(run: Run, lease: Lease, candidates: list[int], pinned: int | None, lr_lookahead: int,
                 progress: Callable[[int], None] | None) -> Adopted:
    passed_over: list[tuple[int, str]] = []
    for step in candidates:
        if run.storage.exists(run.manifest_path(step)):
            result = run.check(step)
            if result.committed:
                return Adopted(step, None, already=True, passed_over=passed_over)
            why = f"a resume manifest that fails the check ({result.reason}); it is never replaced"
        else:
            check = check_save(run.storage, step, deep=True, progress=progress)
            why = _refusal(check)
            if why is None:
                manifest = _manifest(check, lr_lookahead)
                commit = StepCommit(run, step, lease=lease)  # synced, lease checked, then the manifest
                files = [n for n in list_files(run, commit.dirname) if n != MEGATRON_LAYOUT.manifest_name]
                commit.finalize([commit.checksum_share(sorted(files))], manifest)
                return Adopted(step, manifest, passed_over=passed_over)
        if pinned is not None:
            raise AdoptRefusedError(f"{run.storage.url(run.dirname(step))}: cannot adopt: {why}")
        passed_over.append((step, why))
    listed = "; ".join(f"{run.dirname(s)}: {w}" for s, w in passed_over[:3])
    raise AdoptRefusedError(f"{run.url}: expected a save that passes the deep check, actual none ({listed})")


def _refusal(check: SaveCheck) -> str | None:
    if check.problems:
        return "; ".join(check.problems[:3])
    counters = check.counters
    if counters is None or check.common is None:
        return "Megatron's common state cannot be read"
    if counters.unknown:  # covers a save without scheduler state (derived_counters)
        return f"the counters cannot be derived: {counters.unknown}"
    return None


def _manifest(check: SaveCheck, lr_lookahead: int) -> Manifest:
    """The manifest of an adopted save but its files (the commit adds their checksums, taken now):
    counters and expectation from Megatron's state (see the module docstring for what cannot be
    recorded)."""
    common = check.common
    counters = check.counters
    assert common is not None and counters is not None
    args = types.SimpleNamespace(**common.args)
    gbs = common.args["global_batch_size"]
    state = TrainState(iteration=counters.iteration, samples_read=counters.samples_read,
                       updates_successful=counters.updates_successful, updates_skipped=counters.updates_skipped)
    state.check_invariants(global_batch=gbs, where=common.source)
    schedule = common.schedule()
    position = common.scheduler_position
    flat = [row[0] for row in schedule.lr_ahead(position, gbs, lr_lookahead)]
    world_size = common.args.get("world_size") or 1
    expectation = {
        "next_batch": next_batch(state.samples_read, gbs, args),
        "lr_ahead": [[lr] for lr in flat],
        "schedule": [schedule.to_dict()],
        "rng": [],
        "world_size": world_size,
        "megatron": {"scheduler_position": position, "increment": gbs, "lr_schedule_ahead": flat,
                     "samples": dict(counters.megatron),
                     "adopted": {"at": utc_now(), "by": ADOPTED_BY,
                                 "not_recorded": "RNG digests and the param groups' own LR overrides"}},
    }
    return Manifest(step=check.step, train_state=state, files={}, expectation=expectation,
                    topology=topology(args, world_size), config=run_config(args), adapter=ADAPTER_NAME)


def describe(result: Adopted, run_url: str) -> str:
    """One line for the operator."""
    d = MEGATRON_LAYOUT.dirname(result.iteration)
    if result.already:
        return f"{d}: already recorded by resume (nothing written)"
    m = result.manifest
    assert m is not None
    s = m.train_state
    return (f"{d}: adopted: {len(m.files)} files checksummed; iteration {s.iteration}, samples read "
            f"{s.samples_read}, updates {s.updates_successful} successful / {s.updates_skipped} skipped; "
            "the next restart with resume installed checks continuity from it")

