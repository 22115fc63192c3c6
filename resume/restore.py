"""Restore and continuity: choose the checkpoint, verify it, load it, prove the run continues.

    restorer = Restorer(run, adapter, collective, settings=..., rng=..., accept=...)
    manifest = restorer.choose(prepare=True)  # collective: newest committed checkpoint whose files
                                              # verify (rank 0 discovers, every rank checksums its
                                              # share); damaged ones moved aside; None: fresh start
    restored = restorer.load(manifest, expectation_now)   # settings first, then shards, rank
                                              # state, RNG; then every recorded item recomputed
                                              # and compared (ContinuityError before any update)

After the first update, ``check_first_update`` confirms the LR actually applied.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import logging
import math
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from .adapter import Adapter
from .changes import AcceptChanges, Change, check_structure, refuse, schedule_changes, setting_changes
from .collective import Collective, concat
from .commit import rank_state_name
from .config import CoordinatorConfig
from .continuity import Expectation, compare, compare_config, state_changes
from .errors import (
    ContinuityError,
    CorruptCheckpointError,
    ManifestError,
    NoValidCheckpointError,
    ResumeError,
)
from .layout import ParallelLayout, assemble_layout, layout_change
from .manifest import Manifest
from .rewind import carried, expect_declared_break, pending_rewind
from .rng import RngRegistry, check_state
from .run import Run
from .skips import Skips
from .state import TrainState
from .storage import join
from .text import clip, short

__all__ = ["Choice", "Restored", "Restorer", "check_counters", "check_first_update", "check_lrs",
           "check_rank_state", "choose_verified", "rank_state_problems", "read_rank_state", "verify_share"]

log = logging.getLogger("resume")


@dataclass
class Restored:
    manifest: Manifest
    state: TrainState
    expected: Expectation
    """What the first update must show (the LR it applies)."""
    changes: list[dict]
    rewinds: list[dict]
    """The rewinds this line went through, with the one this restore applied (``resume.rewind``)."""
    skips: Skips
    """Every sample range they pass over (``resume.skips``)."""
    layout_change: str | None = None
    """The layout change this restore let through, in words (``resume.layout``); None: none."""


class Restorer:
    """One restart's discovery, verification and load, collective over every rank."""

    def __init__(self, run: Run, adapter: Adapter, collective: Collective, *, settings: CoordinatorConfig,
                 rng: RngRegistry, accept: AcceptChanges) -> None:
        self.run = run
        self.adapter = adapter
        self.coll = collective
        self.settings = settings
        self.rng = rng
        self.accept = accept
        self.prepared: tuple[Any] | None = None  # what adapter.prepare_load() returned
        self._rank_state: tuple[int, dict] | None = None  # (step, this rank's state), checked
        self.layout_checked: int | None = None
        """The step whose layout was checked last (every rank)."""
        self.layouts: tuple[ParallelLayout | None, ParallelLayout | None] = (None, None)
        """(saved, live) as that check found them (rank 0 only)."""
        self.changed_layout: dict | None = None
        """The layout change let through (``{"text", "record"}``, every rank); None: none."""

    # -- choosing -------------------------------------------------------------------------------

    def choose(self, *, prepare: bool = False, layout: bool = True,
               damaged: tuple[int, str] | None = None) -> Manifest | None:
        """The newest committed checkpoint whose files all verify; None for a fresh start.

        Rank 0 discovers (``Run.find_latest``: the commit check, newest first, stopping at the
        first committed one) and sends every rank the manifest; then, with ``verify_on_restore``,
        every rank reads its share of its files and compares checksums, so a corrupt newest
        checkpoint is passed over for the previous one. With ``prepare`` the reads overlap the
        adapter's ``prepare_load()``. With ``layout``, each candidate's layout is checked first,
        before its files are read (``coord.peek()`` leaves it to the load: the program may
        rebuild its stage after the peek). ``damaged``: (step, why) of a checkpoint whose load
        found its shards damaged (``DamagedShardsError``): moved aside, and the choice goes on below it.
        """
        def problems(manifest: Manifest) -> list[str]:
            if layout:  # before any file is read: a refusal, not a problem
                self._check_layout(manifest)
            found = self.verify_share(manifest, prepare=prepare) if self.settings.verify_on_restore else []
            if self.settings.verify_on_restore and not found:
                found = self._rank_state_problems(manifest) or self.coll.on_rank0(
                    lambda m=manifest: self.adapter.shard_problems(self.run.storage, self.run.dirname(m.step), m))
            return found
        choice = choose_verified(self.run, self.coll, problems, below=damaged[0] if damaged else None)
        broken = [(step, why) for step, why, had in choice.passed_over if had]  # damaged checkpoints
        broken = [damaged, *broken] if damaged is not None else broken
        torn = [(step, why) for step, why, had in choice.passed_over if not had]  # saves never finished
        self._after_choice(choice.manifest, broken, torn)
        return choice.manifest

    def _after_choice(self, chosen: Manifest | None, broken: list, torn: list) -> None:
        if self.coll.rank == 0:
            for step, why in torn + broken:
                log.warning("resume: passing over %s: %s", self.run.dirname(step), why)
        if chosen is None and broken and not self.settings.allow_fresh_start:
            raise NoValidCheckpointError(
                f"{self.run.url}: expected a committed checkpoint among {len(broken) + len(torn)} step "
                f"directories, actual none valid ("
                f"{'; '.join(f'{self.run.dirname(s)}: {w}' for s, w in broken[:3])}); refusing to "
                "start from scratch (allow_fresh_start=True to override)")
        if broken:
            # Out of the way of retention and of the next save of the same
            # step, kept for the operator: nothing a user saved is deleted.
            self.coll.on_rank0(lambda: self._quarantine(broken, chosen))

    def _quarantine(self, broken: list[tuple[int, str]], chosen: Manifest | None) -> None:
        for step, why in broken:
            try:
                self.run.quarantine_step(step, why)
            except OSError as e:  # left in place: discovery passes over it again next time
                log.error("resume: cannot move broken %s aside: %s", self.run.dirname(step), e)
        if chosen is not None:
            try:  # the hint follows: it must not name a checkpoint that was moved aside
                self.run.point_latest(chosen.step)
            except OSError as e:
                log.warning("resume: cannot point LATEST at %s: %s", self.run.dirname(chosen.step), e)

    def _check_layout(self, manifest: Manifest) -> None:
        """Collective: the checkpoint's layout against every rank's (``resume.layout``), compared on
        rank 0. Another layout whose shards load exactly is let through (kept for the comparison
        of the moments and the next manifests); one that cannot is refused here, on every rank,
        before any file of the checkpoint is read."""
        source = self.run.storage.url(join(self.run.dirname(manifest.step), "manifest.json"))

        def compare_layouts(parts: list[dict | None]) -> dict | None:
            raw = manifest.topology.get("layout")
            saved = ParallelLayout.from_dict(raw, source=source) if raw is not None else None
            live = assemble_layout(parts, world_size=self.coll.world_size)
            change = layout_change(saved, live)
            self.layouts = (saved, live)
            return None if change is None else {"text": change.describe(), "record": change.record(manifest.step)}
        self.changed_layout = self.coll.gather(self.adapter.layout_part, f"layout check of {source}",
                                              combine=compare_layouts, everywhere=True)
        self.layout_checked = manifest.step
        if self.changed_layout is not None and self.coll.rank == 0:
            log.warning("resume: %s: %s", self.run.dirname(manifest.step), self.changed_layout["text"])

    def verify_share(self, manifest: Manifest, *, prepare: bool = False) -> list[str]:
        """``verify_share``; with ``prepare`` the reads run beside the adapter's ``prepare_load()``
        (a fresh optimizer's state made ready to be loaded into): I/O and compute overlap."""
        def prepare_load() -> None:
            self.prepared = (self.adapter.prepare_load(),)
        needed = prepare and self.prepared is None
        # The files the load checks from the bytes it reads are not read for their checksums here.
        by_load = self.adapter.verify_while_loading(manifest, self.run.storage, self.run.dirname(manifest.step))
        return verify_share(self.run, self.coll, manifest, alongside=prepare_load if needed else None,
                            skip=by_load)

    def discard_prepared(self) -> None:
        """Nothing will be loaded: put back what ``prepare_load()`` made (a fresh start stays fresh)."""
        if self.prepared is not None:
            token, self.prepared = self.prepared[0], None
            self.adapter.discard_prepared(token)

    # -- loading ----------------------------------------------------------------------------------

    def load(self, manifest: Manifest, expectation_now: Callable[[list[dict]], Expectation]) -> Restored:
        """Settings, shards, rank state; then the continuity check (``expectation_now(schedule)``
        recomputes the expectation from the live objects: every rank's on rank 0, the rank's
        own elsewhere)."""
        step_dir = self.run.dirname(manifest.step)
        source = self.run.storage.url(join(step_dir, "manifest.json"))
        expected = Expectation.from_dict(manifest.expectation, source=source)
        # Config first: a changed global batch or seed is named before anything is loaded.
        try:
            compare_config(manifest.config, self.settings.recorded_config())
        except ContinuityError as e:
            raise e if e.item != "config.global_batch" else ContinuityError(
                e.item, e.expected, e.actual, self._batch_hint(manifest)) from None
        if self.layout_checked != manifest.step:  # chosen by a peek
            self._check_layout(manifest)
        # A rewind to this checkpoint (resume rewind): its accepted names and skips apply now.
        rewind = self.coll.on_rank0(lambda: pending_rewind(self.run, manifest))
        rewinds = list(manifest.rewinds) + ([carried(rewind)] if rewind is not None else [])
        if rewind is not None and self.coll.rank == 0:
            log.warning("resume: applying rewind %d to %s (%s): skipping samples %s, accepting %s", rewind["n"],
                        step_dir, clip(rewind.get("reason", ""), 200), rewind.get("skips") or "none",
                        rewind.get("accept") or "nothing")
        skips = Skips([tuple(r) for rw in rewinds for r in rw.get("skips", [])])
        declared_schedule = self.adapter.describe_schedule()
        # Then the optimizers' structure and every setting, still before anything is loaded.
        accepted = self._check_settings(expected, declared_schedule,
                                        extra=rewind.get("accept", []) if rewind is not None else ())
        self._load_objects(manifest, accepted, skips)
        state = TrainState.from_dict(manifest.train_state.to_dict(), source=source)
        state.check_invariants(global_batch=self.settings.global_batch, where=source)
        check_counters(self.adapter, state, applied=True, where=f"restore of {step_dir}")
        actual = expectation_now(declared_schedule)
        if "layout" in manifest.topology:  # written since replicas are folded: no older form to try
            actual.before_replicas = None
        if accepted and expected.lr_ahead != actual.lr_ahead and any(_moves_lr(c.item) for c in accepted):
            # The accepted change moves the LR: what is ahead now is the new schedule's (recorded
            # with the change), and the first update is checked against it.
            if self.coll.rank == 0:
                log.warning("resume: LR ahead after the accepted changes: %s (the checkpoint had %s)",
                            actual.lr_ahead, expected.lr_ahead)
            expected.lr_ahead, expected.lr_groups = actual.lr_ahead, actual.lr_groups
        state_accepted = self._compare(manifest, expected, actual, rewind)
        relaid = self.changed_layout if self.layout_checked == manifest.step else None
        return Restored(manifest, state, expected,
                        list(manifest.changes) + [c.record(manifest.step) for c in accepted] + state_accepted
                        + ([relaid["record"]] if relaid is not None else []),
                        rewinds, skips, relaid["text"] if relaid is not None else None)

    def _compare(self, manifest: Manifest, expected: Expectation, actual: Expectation,
                 rewind: dict | None) -> list[dict]:
        """Rank 0 alone holds every rank's part (``expectation_now``): it compares, and its
        verdict (a ContinuityError with its fields) is every rank's. The registered objects'
        changes it accepted (rank 0's list: the manifests are its)."""
        saved_world = int(manifest.topology.get("world_size", 1))
        state_accepted: list[dict] = []

        def check() -> None:
            if rewind is not None:
                expect_declared_break(expected, actual, rewind)
            resized = saved_world != self.coll.world_size
            state_accepted.extend(self._accept_state_changes(expected, actual, manifest.step, resized=resized,
                                                             extra=rewind.get("accept", []) if rewind else ()))
            compare(expected, actual, resized=resized, stages=self._stage_maps(manifest))
        self.coll.on_rank0(check)
        return state_accepted

    def _stage_maps(self, manifest: Manifest) -> tuple[list[int], list[int]] | None:
        """Rank 0, after a layout change or on another world size: each rank's pipeline stage,
        saved and now, to compare the moments as global totals; None: per rank, as before."""
        saved, live = self.layouts if self.layout_checked == manifest.step else (None, None)
        if saved is None or live is None or (self.changed_layout is None and saved.world_size == live.world_size):
            return None
        return saved.stage_of_rank(), live.stage_of_rank()

    def _load_objects(self, manifest: Manifest, accepted: list[Change], skips: Skips) -> None:
        """Rank state read and agreed on first (a bad file on one rank fails every rank instead
        of leaving the others in a collective), then the shards, then the local state."""
        step_dir = self.run.dirname(manifest.step)
        code_settings = self.adapter.snapshot_settings() if accepted else None
        saved_world = int(manifest.topology.get("world_size", 1))
        # Each rank keeps its own state file; only the outcome is agreed on (O(1) per rank).
        rank_state = self.coll.agree(lambda: self._read_rank_state(manifest, saved_world),
                                     f"restore of {step_dir}")
        self.adapter.load_shards(self.run.storage, step_dir, manifest)

        def load_local() -> None:
            # Data before RNG: a restored loader must not draw from the restored generators.
            if skips:  # before the loader's position: a loader may fetch ahead as it is restored
                self.adapter.skip_samples(skips)
            with _damage_as_corrupt(f"{self.run.storage.url(step_dir)}: rank state"):
                self.adapter.load_state_dict(rank_state["adapter"])
                self.adapter.load_data_state(rank_state["data"])
                self.rng.restore(rank_state["rng"])
            if accepted:
                self.adapter.apply_changes([c.item for c in accepted], code_settings)
        # A refusal on one rank (a loader state it cannot take) is raised on every rank.
        self.coll.agree(load_local, f"restore of {step_dir}")
        self.prepared = self._rank_state = None

    def _check_settings(self, expected: Expectation, declared_schedule: list[dict], *,
                        extra: Any = ()) -> list[Change]:
        """Structure and settings of the code against the checkpoint: a structure mismatch or a
        changed setting that was not accepted (``extra``: by a rewind) raises ContinuityError; the
        accepted changes."""
        accept = AcceptChanges(self.accept.names + tuple(extra))
        changes = schedule_changes(expected.schedule, declared_schedule)
        if expected.structure:  # not recorded by an older resume
            live = self.adapter.describe_structure()
            check_structure(expected.structure, live)
            changes = setting_changes(expected.structure, live) + changes
        for change in changes:
            if not accept.accepts(change.item):
                raise refuse(change)
        if changes and self.coll.rank == 0:
            for change in changes:
                log.warning("resume: accepted change %s: %r -> %r (recorded in the next manifest)",
                            change.item, change.saved, change.live)
        # Accepted: the schedule compared below is the code's.
        expected.schedule = declared_schedule
        return changes

    def _batch_hint(self, manifest: Manifest) -> str:
        """What a changed global batch is made of, saved and now: micro-batch × accumulation ×
        data-parallel size (now's data-parallel size as the saved one scaled by the world size:
        the model-parallel degrees kept)."""
        def number(value: Any, default: int) -> int:
            return value if type(value) is int and value > 0 else default
        topology = manifest.topology
        saved_world = number(topology.get("world_size"), 1)
        saved_dp = number(topology.get("data_parallel"), saved_world)
        now_dp = max(1, saved_dp * self.coll.world_size // saved_world)
        saved_acc, now_acc = number(topology.get("accumulation"), 1), self.settings.accumulation
        saved_batch, now_batch = manifest.config.get("global_batch"), self.settings.global_batch

        def micro(batch: Any, acc: int, dp: int) -> str:
            whole = type(batch) is int and batch % (acc * dp) == 0
            return str(batch // (acc * dp)) if whole else f"{batch}/{acc * dp}"
        hint = (f"global batch = micro-batch x accumulation x data-parallel size: saved "
                f"{micro(saved_batch, saved_acc, saved_dp)} x {saved_acc} x {saved_dp} = {saved_batch}, now "
                f"{micro(now_batch, now_acc, now_dp)} x {now_acc} x {now_dp} = {now_batch}")
        if saved_acc != now_acc:
            hint += f"; the accumulation changed ({saved_acc} -> {now_acc})"
        if saved_dp != now_dp and (saved_acc * saved_dp) % now_dp == 0:
            hint += (f"; on {now_dp} data-parallel ranks, accumulation={saved_acc * saved_dp // now_dp} keeps "
                     f"the global batch")
        return hint

    def _accept_state_changes(self, expected: Expectation, actual: Expectation, step: int, *, resized: bool,
                              extra: Any = ()) -> list[dict]:
        """Rank 0: the registered objects whose state after the load differs from the state saved
        (``continuity.state_changes``): refused unless accepted (``state.NAME``); accepted, the
        live state is what the comparison expects, and the change is recorded."""
        accept = AcceptChanges(self.accept.names + tuple(extra))
        records = []
        for name, error in state_changes(expected, actual, resized=resized):
            if not accept.accepts(f"state.{name}"):
                raise error
            log.warning("resume: accepted change state.%s: %s -> %s (recorded in the next manifest)", name,
                        error.expected, error.actual)
            records.append({"step": step, "item": f"state.{name}", "from": error.expected, "to": error.actual})
        if records:
            expected.state, expected.state_shown = actual.state, actual.state_shown
        return records

    def _read_rank_state(self, manifest: Manifest, saved_world: int) -> dict:
        """This rank's state file, read no further than the manifest's size and checked in shape
        and bounds (``check_rank_state``) before anything uses it; read once per restore."""
        if self._rank_state is not None and self._rank_state[0] == manifest.step:
            return self._rank_state[1]
        own = rank_state_name(self.coll.rank if self.coll.rank < saved_world else 0)
        if own not in manifest.files:
            raise ManifestError(f"{self.run.storage.url(join(self.run.dirname(manifest.step), 'manifest.json'))}: "
                                f"files: expected an entry for {own}, actual missing")
        rank_state = read_rank_state(self.run, manifest, own)
        source = self.run.storage.url(join(self.run.dirname(manifest.step), own))
        self.adapter.check_state(rank_state["adapter"], source=source)
        self._rank_state = (manifest.step, rank_state)
        return rank_state

    def _rank_state_problems(self, manifest: Manifest) -> list[str]:
        """Part of the choice's verification: every rank reads and checks its own state file,
        so a malformed one is passed over like a bad checksum (storage errors still raise)."""
        def check() -> list[str]:
            try:
                self._read_rank_state(manifest, int(manifest.topology.get("world_size", 1)))
            except (CorruptCheckpointError, ManifestError) as e:
                return [str(e)]
            return []
        return self.coll.gather(check, f"rank state check of {self.run.dirname(manifest.step)}",
                                combine=concat, everywhere=True)


def read_rank_state(run: Run, manifest: Manifest, rel: str) -> dict:
    """The rank state file ``rel`` of ``manifest``'s step, read no further than its listed size,
    parsed (NaN and Infinity refused) and checked (``check_rank_state``)."""
    path = join(run.dirname(manifest.step), rel)
    url = run.storage.url(path)
    text = run.storage.read_bytes(path, limit=manifest.files[rel].size)
    try:
        rank_state = json.loads(text, parse_constant=_refuse_constant)
    except RecursionError as e:
        raise CorruptCheckpointError(f"{url}: expected JSON, actual nested too deep") from e
    except ValueError as e:
        raise ManifestError(f"{url}: expected JSON, actual {clip(str(e), 200)}") from e
    check_rank_state(rank_state, source=url)
    return rank_state


def rank_state_problems(run: Run, manifest: Manifest) -> list[str]:
    """``verify --deep``: every rank state file of the checkpoint read and checked as a restore
    will (one problem per bad file; storage errors raise)."""
    problems = []
    for rel in sorted(manifest.files):
        if _RANK_STATE_FILE.fullmatch(rel):
            try:
                read_rank_state(run, manifest, rel)
            except (CorruptCheckpointError, ManifestError) as e:
                problems.append(str(e))
    return problems


_RANK_STATE_FILE = re.compile(r"rank-\d{5,}\.json")
_RANK_STATE_DEPTH = 64
_RANK_STATE_INT = 2**128
"""Integers of a rank state (a numpy PCG64 state holds 128-bit ones)."""


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number JSON allows")


def check_rank_state(rank_state: Any, *, source: str) -> None:
    """A rank state file's shape and bounds: an object with ``rng``, ``data`` and ``adapter``;
    no value nested deeper than 64 levels; integers below 2**128; the generators' states as
    ``rng.check_state`` wants them. ManifestError for missing fields (as before),
    CorruptCheckpointError naming ``source`` and the field for the rest."""
    missing = {"rng", "data", "adapter"} - set(rank_state if isinstance(rank_state, dict) else ())
    if missing:
        raise ManifestError(f"{source}: expected fields rng, data, adapter, actual missing {sorted(missing)}")
    pending: list[tuple[Any, str, int]] = [(rank_state, "", 0)]
    while pending:
        value, field, depth = pending.pop()
        if depth > _RANK_STATE_DEPTH:
            raise CorruptCheckpointError(f"{source}: {field}: expected at most {_RANK_STATE_DEPTH} "
                                         "levels of nesting, actual more")
        if isinstance(value, dict) and "__tensor__" in value:
            _check_tensor(value, field, source)
        elif isinstance(value, dict):
            # JSON keys are strings: named as they are, or cut short.
            pending.extend((v, f"{field}.{k if len(k) <= 40 else short(k, 40)}".lstrip("."), depth + 1)
                           for k, v in value.items())
        elif isinstance(value, list):
            pending.extend((v, f"{field}[{i}]", depth + 1) for i, v in enumerate(value))
        elif type(value) is int and not -_RANK_STATE_INT < value < _RANK_STATE_INT:
            raise CorruptCheckpointError(f"{source}: {field}: expected an integer below 2**128, "
                                         f"actual {short(value)}")
    check_state(rank_state["rng"], source=source)
    for name in ("adapter",):
        if not isinstance(rank_state[name], dict):
            raise CorruptCheckpointError(f"{source}: {name}: expected an object, actual {short(rank_state[name])}")


def _check_tensor(value: dict, field: str, source: str) -> None:
    """A tensor in a rank's JSON state (``resume.adapters.jsonstate``): a shape no larger than
    the bytes it carries (every element takes a byte at least), checked before anything is
    allocated for it; the exact size is checked where it is decoded."""
    shape, data, dtype = value.get("shape"), value["__tensor__"], value.get("dtype")
    if not (isinstance(shape, list) and len(shape) <= 64 and all(type(n) is int and n >= 0 for n in shape)):
        raise CorruptCheckpointError(f"{source}: {field}.shape: expected a list of at most 64 sizes, "
                                     f"actual {short(shape)}")
    if not (isinstance(data, str) and isinstance(dtype, str) and len(dtype) <= 40):
        raise CorruptCheckpointError(f"{source}: {field}: expected a tensor's dtype and base64 data, "
                                     f"actual {short({k: v for k, v in value.items() if k != '__tensor__'})}")
    carried = len(data) * 3 // 4
    if math.prod(shape) > carried:
        raise CorruptCheckpointError(f"{source}: {field}: expected a tensor of at most {carried} elements (the "
                                     f"bytes it carries), actual shape {short(shape)}")


def verify_share(run: Run, coll: Collective, manifest: Manifest, *,
                 alongside: Callable[[], None] | None = None, skip: set[str] = frozenset()) -> list[str]:
    """Collective: every rank checksums its share of the checkpoint's files; every problem found,
    on every rank. Storage that refuses a read raises on every rank instead: it says nothing
    about the checkpoint, which must not be passed over for it. ``alongside`` runs on every
    rank while its reads do (its error, after the reads', is agreed on like theirs). ``skip``:
    files checked elsewhere (by the load, from the bytes it reads)."""
    share = sorted(set(manifest.files) - skip)[coll.rank::coll.world_size]

    def verify() -> list[str]:
        return run.verify_checksums(manifest, share, raise_unreadable=True)

    def verify_beside() -> list[str]:
        with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="resume-verify") as pool:
            pending = pool.submit(verify)
            try:
                alongside()
            finally:  # the reads' error first, else the other's
                problems = pending.result()
        return problems
    # Only the problems travel (rank 0 gathers them, every rank gets the list back).
    return coll.gather(verify if alongside is None else verify_beside, "checksum verification",
                       combine=concat, everywhere=True)


@dataclass
class Choice:
    """What ``choose_verified`` found: the checkpoint chosen (None: none), and what it passed over."""

    manifest: Manifest | None
    passed_over: list[tuple[int, str, bool]]
    """(step, why, had a manifest), newest first."""


def choose_verified(run: Run, coll: Collective, problems: Callable[[Manifest], list[str]], *,
                    only: int | None = None, below: int | None = None) -> Choice:
    """Collective: the newest committed checkpoint in which ``problems`` (collective, the same list
    on every rank) finds none. Rank 0 discovers (``Run.find_latest``) and every rank is told; a
    checkpoint with problems is passed over for the next older one (``only``: that step alone;
    ``below``: older than that step only)."""
    passed_over: list[tuple[int, str, bool]] = []
    while True:
        manifest, rejected = coll.on_rank0(lambda b=below: _find_latest(run, b, only))
        passed_over += rejected
        if manifest is None:
            return Choice(None, passed_over)
        found = problems(manifest)
        if not found:
            return Choice(manifest, passed_over)
        passed_over.append((manifest.step, "; ".join(found), True))
        if only is not None:
            return Choice(None, passed_over)
        below = manifest.step


def _find_latest(run: Run, below: int | None, only: int | None) -> tuple[Manifest | None, list[tuple]]:
    """Rank 0: ``Run.find_latest``, what it passed over as (step, why, had a manifest): small to send."""
    manifest, rejected = run.find_latest(below=below, only=only)
    return manifest, [(r.step, r.reason, r.has_manifest) for r in rejected]


@contextlib.contextmanager
def _damage_as_corrupt(where: str) -> Iterator[None]:
    """What a well-formed but wrong rank state makes a loader or generator raise (a NaN
    offset's ValueError, an OverflowError) is the documented CorruptCheckpointError."""
    try:
        yield
    except (ResumeError, MemoryError):
        raise
    except (ValueError, TypeError, KeyError, IndexError, AttributeError, OverflowError, RecursionError) as e:
        raise CorruptCheckpointError(f"{where}: {type(e).__name__}: {clip(str(e), 200)}") from e


def _moves_lr(item: str) -> bool:
    """Whether an accepted change can move the LR ahead (the peak, any schedule setting)."""
    return item.startswith("schedule") or item.rsplit(".", 1)[-1] in ("initial_lr", "lr", "base_lrs")


# -- the continuity of the loop after a restart ------------------------------------------------------


def check_counters(adapter: Adapter, state: TrainState, *, applied: bool, where: str) -> None:
    """Every optimizer's step count and scheduler's position equal ``updates_successful``."""
    successful = state.updates_successful
    for kind, values in (("optimizer", adapter.optimizer_steps()), ("scheduler", adapter.scheduler_positions())):
        for i, value in enumerate(values):
            if value == successful:
                continue
            if where != "update":
                hint = f"{where}: the saved counters and the {kind} disagree"
            elif not applied and value > successful:
                hint = f"the {kind} stepped on an update reported as skipped"
            elif applied and value < successful:
                hint = f"update(applied=True) was reported but the {kind} did not step"
            else:
                hint = f"the {kind} stepped more than once per update"
            raise ContinuityError(f"{kind}[{i}].{'steps' if kind == 'optimizer' else 'position'}",
                                  f"{successful} (updates_successful)", value, hint)


def check_first_update(adapter: Adapter, expected: Expectation, *, rank: int) -> None:
    """After the first applied update: the LR it applied is the one recorded, and (torch
    schedulers) the groups now hold the LR recorded for the update after it."""
    applied = adapter.applied_lrs()
    if applied is not None:
        check_lrs(adapter, expected, 0, applied, "lr applied at the first update", rank=rank)
    if not adapter.lr_set_by_loop and len(expected.lr_ahead) > 1:
        check_lrs(adapter, expected, 1, adapter.current_lrs(), "lr after the first update", rank=rank)


def check_lrs(adapter: Adapter, expected: Expectation, ahead: int, actual: list[float | None], item: str, *,
              rank: int) -> None:
    """The recorded groups' LRs (row ``ahead`` of the LR ahead) against ``actual``. A group
    added since (a stage change in this iteration) is named in the log, not refused."""
    recorded = expected.lr_ahead[ahead]
    live_labels = adapter.lr_groups()
    labels = expected.lr_groups or live_labels[:len(recorded)]
    if not expected.lr_groups and len(live_labels) != len(recorded):
        raise ContinuityError(item, recorded, actual, "another number of param groups than recorded")
    position = {label: i for i, label in enumerate(live_labels)}
    wanted, got = [], []
    for label, lr in zip(labels, recorded):
        i = position.get(label)
        if i is None:
            raise ContinuityError(f"{item}: {label}", lr, "no such param group",
                                  "a param group recorded at the save is gone")
        if actual[i] is not None:  # None: its optimizer did not step in this update
            wanted.append(lr)
            got.append(actual[i])
    if wanted != got:
        hint = "the LR applied is not the one recorded"
        if not adapter.lr_set_by_loop and not adapter.describe_schedule():
            hint += ("; an LR set by hand in the loop? declare its schedule: NativeTorchAdapter(..., "
                     "schedulers=lr_at) with lr_at(updates) -> LRs (resume.schedule)")
        raise ContinuityError(item, wanted, got, hint)
    added = [f"{label} (lr {actual[i]})" for label, i in position.items()
             if label not in set(labels) and actual[i] is not None]
    if added and rank == 0:
        log.info("resume: %s: param groups added since the checkpoint, not checked: %s", item, ", ".join(added))
