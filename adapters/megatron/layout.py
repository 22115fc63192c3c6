"""A Megatron-LM save directory as a run of ``resume`` (``MEGATRON_LAYOUT``), and its cross-check.

Registered at import: importing this module (cheap, no megatron-core) is what lets
``resume verify/ls/inspect`` and the Slurm hook recognise a save directory.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from resume.errors import InvariantError, ManifestError
from resume.run import RESUME_LAYOUT, CheckResult, FrameworkSave, Run, RunLayout, register_layout
from resume.state import TrainState
from resume.storage import Storage

from .check import UNCAUGHT, check_save
from .common import SAMPLE_COUNTERS, read_common_state
from .savedir import (
    ITERATION_DIR,
    ITERATION_FORMAT,
    MANIFEST_NAME,
    MEGATRON_TRACKER,
    read_tracker,
    require_torch_dist,
    tracker_problems,
)

__all__ = ["MEGATRON_LAYOUT", "MegatronLayout", "cross_check"]


@dataclass(frozen=True, slots=True)
class MegatronLayout(RunLayout):
    """A Megatron-LM save directory as a run: its ``iter_0000200/`` directories hold
    Megatron's own files and our manifest beside them (``resume-manifest.json``); Megatron
    keeps its own pointer (the tracker), so there is no ``LATEST`` of ours.
"""

    def claims(self, storage: Storage) -> bool:
        """The tracker or ``iter_NNNNNNN/`` directories, in a directory holding nothing of ours.

        A step directory or our ``LATEST`` makes it a run of ours whatever else is there: a
        stray tracker (copied in, or written by a tool pointed at the wrong directory) must
        not hide a native run's checkpoints. (``run.json`` decides nothing: a job using the
        Megatron integration writes one into the save directory too.)
        """
        names = storage.listdir("")
        if RESUME_LAYOUT.latest in names or any(RESUME_LAYOUT.parse(n) is not None for n in names):
            return False
        return MEGATRON_TRACKER in names or any(self.parse(n) is not None for n in names)

    def extra_problems(self, run: Run, result: CheckResult) -> list[str]:
        """Megatron's own state (format, counters, schedule) must agree with our manifest."""
        if result.manifest is None:
            return []
        return cross_check(run.storage, result.step, result.manifest.train_state, result.manifest.expectation)

    def pointer_problems(self, run: Run, results: list[CheckResult], *, whole_run: bool) -> list[str]:
        """The tracker must name an iteration that exists (an iteration's own problems are
        that iteration's, ``framework_save``)."""
        return tracker_problems(run.storage) if whole_run else []

    def framework_save(self, run: Run, step: int, *, deep: bool = False,
                       progress: Callable[[int], None] | None = None) -> FrameworkSave | None:
        """An iteration without our manifest. Megatron's tracker is its commit: an iteration
        newer than the tracker (or with no tracker at all) is a save Megatron did not finish,
        uncommitted and ignored, as Megatron ignores it. Up to the tracker it is Megatron's
        own save: checked from its ``.metadata`` (``check``), unrecorded when sound,
        broken otherwise."""
        try:
            tracker = read_tracker(run.storage)
        except (OSError, ValueError, RuntimeError):
            tracker = None  # its own problem is the pointer's (tracker_problems)
        if tracker is None or step > tracker:
            named = "no iteration" if tracker is None else self.dirname(tracker)
            return FrameworkSave("uncommitted", reason=(
                f"{run.storage.url(self.dirname(step))}: no resume manifest, and Megatron's tracker names "
                f"{named}: a save Megatron did not finish (ignored, as Megatron ignores it)"))
        check = check_save(run.storage, step, deep=deep, progress=progress)
        counters = check.counters
        return FrameworkSave("broken" if check.problems else "unrecorded", list(check.problems),
                             counters.to_dict() if counters else None,
                             dict(counters.megatron) if counters else {},
                             checked=f"{check.summary()}; {UNCAUGHT}")

    def framework_counters(self, run: Run, result: CheckResult) -> dict | None:
        """Megatron's own sample counters of a committed iteration: as recorded at the save,
        else read from its common state."""
        if result.manifest is None:
            return None
        megatron = result.manifest.expectation.get("megatron")
        recorded = megatron.get("samples") if isinstance(megatron, dict) else None
        if not isinstance(recorded, dict):
            try:
                recorded = read_common_state(run.storage, result.step).args
            except (OSError, ValueError, RuntimeError):
                return None
        # Read from the run's files: only the two counters, and only as integers.
        return {k: v if isinstance(v, int) and not isinstance(v, bool) else None
                for k, v in ((k, recorded.get(k)) for k in SAMPLE_COUNTERS)}


MEGATRON_LAYOUT = register_layout(MegatronLayout(
    "megatron", ITERATION_DIR, ITERATION_FORMAT, MANIFEST_NAME, latest=None, pointer=MEGATRON_TRACKER))


def cross_check(storage: Storage, iteration: int, recorded: TrainState, expectation: dict) -> list[str]:
    """Megatron's own state must agree with our manifest: format, counters, scheduler position."""
    try:
        require_torch_dist(storage, iteration)
        common = read_common_state(storage, iteration)
    except (OSError, ValueError, RuntimeError) as e:
        return [str(e)]
    problems = []
    if common.iteration != iteration:
        problems.append(f"{common.source}: common_state.iteration: expected {iteration} (the directory's), "
                        f"actual {common.iteration}")
    if common.scheduler is None:
        # Saved without the optimizer (Megatron saves the scheduler only with it): the updates
        # and the schedule cannot be derived; iteration and samples still can.
        consumed = common.args.get("consumed_train_samples")
        if consumed != recorded.samples_read:
            problems.append(f"{common.source}: samples_read: expected {recorded.samples_read} (manifest), "
                            f"actual {consumed} (Megatron's consumed_train_samples)")
        return problems
    try:
        derived = common.counters()
    except (ManifestError, InvariantError) as e:
        return [*problems, str(e)]
    for name in ("iteration", "samples_read", "updates_successful", "updates_skipped"):
        if getattr(derived, name) != getattr(recorded, name):
            problems.append(f"{common.source}: {name}: expected {getattr(recorded, name)} (manifest), "
                            f"actual {getattr(derived, name)} (Megatron's state)")
    position = (expectation.get("megatron") or {}).get("scheduler_position")
    if position is not None and position != common.scheduler_position:
        problems.append(f"{common.source}: opt_param_scheduler.num_steps: expected {position} (manifest), "
                        f"actual {common.scheduler_position}")
    recorded_lr = (expectation.get("megatron") or {}).get("lr_schedule_ahead")
    if recorded_lr and not problems:
        try:
            schedule = common.schedule()
        except ManifestError as e:
            return [str(e)]
        gbs = common.args["global_batch_size"]
        lrs = [row[0] for row in schedule.lr_ahead(common.scheduler_position, gbs, len(recorded_lr))]
        if lrs != recorded_lr:
            problems.append(f"{common.source}: opt_param_scheduler: expected the LR ahead {recorded_lr} "
                            f"(manifest), actual {lrs} from the saved schedule")
    return problems
