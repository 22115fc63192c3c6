"""The coordinator: the small library wrapper around the training loop.

    coord = Coordinator(run_url, adapter, global_batch=..., every=200, keep=3)
    coord.restore()                  # newest committed checkpoint or a fresh start; checks continuity
    for batch in coord.batches():    # knows the next batch without consuming it
        ...forward/backward/step...
        coord.update(applied=...)    # successful vs skipped; saves when due, on request or on a signal
        if coord.should_stop:
            break
    coord.close()

It is the loop's surface: it counts, decides at each iteration boundary whether to
save (``resume.policy``), and drives the save (``resume.commit``, in the background
with ``resume.background``) and the restore (``resume.restore``). Every rank makes
every call; ``resume.collective`` keeps the ranks in agreement. It never imports a
framework: everything framework-specific goes through the ``Adapter``. Its settings
are ``resume.config.CoordinatorConfig``.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

from . import faults
from .adapter import Adapter
from .background import BackgroundSave
from .changes import AcceptChanges
from .collective import Collective
from .commit import StepCommit, rank_state_name
from .config import CoordinatorConfig, as_json
from .continuity import Expectation, matched
from .control import ControlArea
from .errors import DamagedShardsError, ResumeError, SaveFailedError, StorageAccessError, UsageError
from .journal import Journal, UpdateRecorder
from .layout import layout_topology
from .lease import Lease
from .lookahead import END, NextIteration
from .manifest import Manifest
from .restore import Restored, Restorer, check_counters, check_first_update, check_lrs
from .rng import RngRegistry
from .run import Run
from .skips import Skips
from .state import TrainState
from .storage import open_storage
from .stragglers import summarize
from .trigger import SaveTrigger
from .warmstart import WarmStart, warm_start
from .watchdog import Watchdog, process_watchdog, seconds_or_none

__all__ = ["Coordinator", "CoordinatorConfig"]

log = logging.getLogger("resume")

class Coordinator:
    """Save, restore and continuity for one training loop. Every rank makes every call."""

    def __init__(self, run_url: str, adapter: Adapter, *, settings: CoordinatorConfig | None = None,
                 clock: Callable[[], float] = time.monotonic, **fields: Any) -> None:
        """``run_url``: the run's home, a local path or an fsspec URL. ``adapter``: the framework
        adapter (model, optimizers, schedulers, data). The settings, as a ``CoordinatorConfig``
        or as its fields (``global_batch=…, every=…``), are documented there. ``clock``:
        injectable monotonic clock."""
        if settings is not None and fields:
            raise UsageError(f"Coordinator: expected settings= or its fields, actual both ({sorted(fields)})")
        self.settings = settings or CoordinatorConfig.from_settings(fields)
        self.adapter = adapter
        self.comm = adapter.comm
        self.rank = self.comm.rank
        self.coll = Collective(self.comm)
        self.global_batch = self.settings.global_batch
        self.clock = clock
        self.accept = AcceptChanges.parse(self.settings.accept_changes)
        self.retention = self.settings.retention()
        self.user: dict[str, Any] = {}
        """The program's own JSON values (a training stage, a curriculum position), saved in
        every manifest; ``peek()`` reads them before the shards load, ``restore()`` sets them."""
        self.changes: list[dict] = []
        """Settings changed on purpose at restarts, ``{step, item, from, to}`` (manifest ``changes``)."""
        self.rewinds: list[dict] = []
        """The rewinds this line of the run went through (manifest ``rewinds``; ``resume.rewind``)."""
        self.warm_start, self.origin = WarmStart.parse(self.settings.warm_start) or WarmStart.from_env(), None
        self._skips = Skips()
        self.rng = RngRegistry()
        self.state = TrainState()
        self.should_stop = False
        self.last_committed_step: int | None = None
        self.restored_from: int | None = None
        self.async_save = self.settings.async_save and adapter.can_stage()
        self._stage_ahead = self.async_save  # prepare_staging() at the first applied update

        self._tolerance = self.settings.failure_tolerance()
        self._next = NextIteration(adapter, self.rng, lr_lookahead=self.settings.lr_lookahead,
                                   accumulation=self.settings.accumulation)
        self._first_after_restore: Expectation | None = None
        self._peeked: tuple[Manifest | None] | None = None
        self._restore_done = False
        self._looked_for_state = False  # the first save warns of stateful objects nothing registered
        self._in_flight: BackgroundSave | None = None
        # Background collectives run on their own group, never interleaved with training's.
        self._save_coll = Collective(self.comm.fork()) if self.async_save else None
        self.watchdog: Watchdog = process_watchdog()
        """This process's hang detection (``resume.watchdog``): ``coord.watchdog.expect(s, what)``
        declares a long phase; ``settings.hang`` overrides its bounds."""
        self._progress = self.watchdog.progress

        self._open_run(run_url)

    def _open_run(self, run_url: str) -> None:
        # Rank 0 creates the run; the others never list or probe storage
        # (5,120 ranks must not hammer an object store).
        self.run = Run(open_storage(run_url))
        self.coll.on_rank0(self.run.ensure_exists)
        self._restorer = Restorer(self.run, self.adapter, self.coll, settings=self.settings, rng=self.rng,
                                  accept=self.accept)
        # One writer per run: rank 0 holds the lease (a second job is refused here, on every rank).
        self._lease: Lease | None = None
        if self.settings.lease_ttl_s is not None:
            ttl_s = self.settings.lease_ttl_s

            def take_lease() -> None:
                self._lease = Lease.take(self.run.storage, ttl_s=ttl_s, job_id=self.adapter.job_id)
            self.coll.on_rank0(take_lease)
        self._trigger = SaveTrigger(
            self.comm, ControlArea(self.run, poll_s=self.settings.control_poll_s, clock=self.clock),
            self.settings.save_policy(), handle_signals=self.settings.handle_signals)
        self.journal = Journal(self.run.storage, clock=self.clock) if self.rank == 0 and self.settings.journal else None
        """Rank 0's update journal (``resume.journal``); None elsewhere or with ``journal=False``."""
        self._recorder = UpdateRecorder(self.journal, self.adapter) if self.journal is not None else None
        self.watchdog.attach(self.run.storage, rank=self.rank, world_size=self.comm.world_size,
                             bounds=self.settings.hang)
        self.watchdog.start()

    # -- public surface ---------------------------------------------------------------

    @property
    def iteration(self) -> int:
        return self.state.iteration

    @property
    def save_failures(self) -> int:
        """Scheduled saves failed in a row (``on_save_failure="continue"``)."""
        return self._tolerance.failures

    def register_rng(self, name: str, generator: Any) -> None:
        """Save and restore a generator of the user's along with the global ones."""
        self.rng.register(name, generator)

    def register(self, name: str, obj: Any) -> None:
        """Save and restore ``obj``, any object with ``state_dict()`` / ``load_state_dict()`` (a
        loss scaler, an EMA of the weights, a counter of the program's own), under ``name``: its
        tensors with the shards (sharded where they are DTensors), the rest as JSON; its state is
        compared after a restore like the moments. Before ``restore()``, on every rank."""
        if self.restored_from is not None or self._restore_done:
            raise UsageError(f"register({name!r}): expected before coord.restore() (it loads the state), "
                             "actual after: register every object first")
        self.adapter.register_state(name, obj)

    def request_save(self, *, stop: bool = False) -> None:
        """Save at the next iteration boundary (and stop afterwards when ``stop``)."""
        self._trigger.request(stop=stop)

    def peek(self) -> Manifest | None:
        """Collective: the checkpoint ``restore()`` will load (found and verified now, not
        again by ``restore()``), or None for a fresh start. Nothing is loaded.

        Its ``user`` holds the values the program saved in ``coord.user``, so the program
        can build the structure the checkpoint holds (a stage's param groups, untied
        weights) before ``restore()`` loads into it.
        """
        if self._peeked is None:
            self._peeked = (self._restorer.choose(layout=False),)
        return self._peeked[0]

    def restore(self) -> TrainState:
        """Load the newest committed checkpoint (or start fresh) and check continuity."""
        # Without a peek() first, the objects are made ready to be loaded into while the
        # checkpoint's files are verified (after a peek() the program may still rebuild them).
        with self.watchdog.phase("restore", measure="restore"):
            manifest = self._peeked[0] if self._peeked is not None else self._restorer.choose(prepare=True)
            self._peeked = None
            try:
                while manifest is not None:
                    try:
                        self._restored(self._restorer.load(manifest, self._expectation_after_load))
                        break
                    except DamagedShardsError as e:  # found by the load's checksums: the one before
                        manifest = self._restorer.choose(prepare=True, damaged=(manifest.step, str(e)))
                if manifest is None:
                    self._restorer.discard_prepared()
                    self._start_fresh()
            except BaseException:
                self._restorer.discard_prepared()
                raise
        self._restore_done = True
        return self.state

    def batches(self) -> Iterator[Any]:
        """This rank's batches, from where the run stands; stops when ``should_stop`` or when the
        run is complete (``total_iterations``), also right after a restore at its end."""
        while not self.should_stop and not self.complete:
            batch = self._next.take()
            if batch is END:
                return
            first = self._first_after_restore
            if first is not None and not self.adapter.lr_set_by_loop:
                # The LR is in the groups before the step: refused before any update.
                check_lrs(self.adapter, first, 0, self.adapter.current_lrs(), "lr at the first update",
                          rank=self.rank)
            if self._recorder is not None:
                self._recorder.batch(batch)
            yield batch

    @property
    def complete(self) -> bool:
        """Whether the run reached its end (``total_iterations``; never without one)."""
        return self._reached_end(self.state.iteration)

    def _reached_end(self, iteration: int) -> bool:
        total = self.settings.total_iterations
        return total is not None and iteration >= total

    def update(self, *, applied: bool = True, samples: int | None = None, tokens: int | None = None,
               tokens_in_loss: int | None = None, loss: Any = None, grad_norm: Any = None,
               clipped: bool | None = None) -> bool:
        """Count one iteration; save when due, requested or signalled. True if it saved.

        ``loss``, ``grad_norm`` (before clipping) and ``clipped`` go into the update journal
        (``resume.journal``) as given: floats (a tensor is read with ``float()``, a device sync)."""
        self._next.updated()
        n = self.global_batch if samples is None else samples
        first, _, passed_over = self._skips.take(self.state.samples_read, n)
        self.state.advance(applied=applied, samples=n, tokens=tokens, tokens_in_loss=tokens_in_loss,
                           passed_over=passed_over)
        if self._recorder is not None:
            self._recorder.update(self.state, first=first, n=n, passed_over=passed_over, applied=applied,
                                  extra={"loss": loss, "grad_norm": grad_norm, "clipped": clipped, "tokens": tokens})
        check_counters(self.adapter, self.state, applied=applied, where="update")
        if self._first_after_restore is not None and applied:
            check_first_update(self.adapter, self._first_after_restore, rank=self.rank)
            self._first_after_restore = None
        self._progress.progress(self.state.iteration)
        saved = self._maybe_save_at_boundary()
        if applied and self._stage_ahead:
            # The first asynchronous save's host buffers, made while the loop runs, not in its stall.
            self._stage_ahead = False
            self.adapter.prepare_staging()
        return saved

    def save(self, *, blocking: bool = True) -> int:
        """Collective: save the state at the current iteration and commit it. Returns the step.

        With ``async_save`` and ``blocking=False`` it returns once the state is staged;
        the write and the commit finish in the background (``maybe_wait_for_save``).
        """
        try:
            self.maybe_wait_for_save()
        except ResumeError as e:
            # The failed save committed nothing; this one (perhaps the save before a
            # preemption) must still be tried. The error is not lost: it is logged here.
            log.error("resume: the previous asynchronous save failed, saving again now: %s", e)
        step = self.state.iteration
        if self.last_committed_step == step:
            return step
        self._next.refuse_untracked_batches(self.state.iteration)
        self._next.check_accumulation()
        faults.set_context(rank=self.rank, step=step)
        commit = StepCommit(self.run, step, lease=self._lease)
        try:
            with self.watchdog.phase("save", measure="save"):
                return self._save_step(commit, background=self.async_save and not blocking)
        except (ResumeError, OSError) as e:
            self._abandon(commit)
            if isinstance(e, OSError) and not isinstance(e, SaveFailedError | StorageAccessError):
                # The storage's own error (read-only, EIO, retries exhausted), as a failed save.
                raise SaveFailedError(f"{commit.url}: save failed: {type(e).__name__}: {e}") from e
            raise

    def maybe_wait_for_save(self) -> None:
        """Wait for the save in flight, if any; raise its error (on every rank)."""
        in_flight = self._in_flight
        if in_flight is None:
            return
        with self.watchdog.phase("save"):
            in_flight.join()
        self._in_flight = None  # only once it has ended: an interrupted wait can wait again
        in_flight.result()
        self.last_committed_step = in_flight.step
        self._tolerance.succeeded()

    def close(self) -> None:
        """Wait for a save in flight (raising its error), release the lease, restore the
        signal handlers."""
        try:
            self.maybe_wait_for_save()
        finally:
            self._trigger.close()
            self.watchdog.close()
            if self.journal is not None:
                self.journal.close()
            if self._lease is not None:
                lease, self._lease = self._lease, None
                try:
                    lease.release()
                except OSError as e:  # it goes stale by itself
                    log.warning("resume: cannot release %s: %s", lease.url, e)

    # -- the iteration boundary -----------------------------------------------------------

    def _maybe_save_at_boundary(self) -> bool:
        decision, requests = self._trigger.decide(self.state.iteration)
        self._progress.synced()
        if not decision.save:
            return False
        # Only a scheduled save runs in the background (an asker waits for the commit), and a
        # background save that failed counts under the policy before the next one starts.
        background = decision.scheduled_only
        if background:
            try:
                self.maybe_wait_for_save()
            except (ResumeError, OSError) as e:
                if not self._tolerance.tolerate(e, self.state.iteration):
                    raise
        try:
            step = self.save(blocking=not background)
        except (ResumeError, OSError) as e:
            self._trigger.answer(requests, step=None, error=str(e))
            if background and self._tolerance.tolerate(e, self.state.iteration):
                return False
            raise
        if self._in_flight is None:  # committed (a background save counts when it commits)
            self._tolerance.succeeded()
        self._trigger.answer(requests, step=step)
        self.should_stop = self.should_stop or decision.stop
        return True

    # -- save -------------------------------------------------------------------------------

    def _save_step(self, commit: StepCommit, *, background: bool) -> int:
        started = self.clock()
        if not self._looked_for_state and self.rank == 0:
            self._looked_for_state = True
            for line in self.adapter.unregistered_state():
                log.warning("resume: %s", line)
        record = {"user": as_json(self.user, "user"), "changes": list(self.changes), "rewinds": list(self.rewinds),
                  "origin": self.origin}
        journal_lines = self.journal.snapshot(commit.step) if self.journal is not None else None
        if self.coll.on_rank0(commit.prepare):
            self.last_committed_step = commit.step
            return commit.step
        self.comm.barrier()
        # Phase 1, local, no collectives: what this rank contributes. An asynchronous save takes
        # the moments' fingerprint from the staged copy, in the background: the loop waits for
        # the copy alone. The rank's state file is written with the shards, never gathered.
        moments_later = background and self.adapter.can_fingerprint_staged()
        local: dict[str, Any] = {}
        # Rank 0 alone receives every rank's part and assembles the expectation (None elsewhere:
        # only the manifest needs it); each rank sends its own part, O(1) per rank.
        world = self.comm.world_size
        assembled = self.coll.gather(lambda: self._rank_part(local, moments=not moments_later),
                                     f"{commit.url} (counters, RNG and moments)", saving=True,
                                     combine=lambda parts: (Expectation.assemble(parts, world_size=world),
                                                            summarize(parts),
                                                            layout_topology([p["layout"] for p in parts],
                                                                            world_size=world)))
        expectation, record["stragglers"], record["layout"] = assembled if assembled is not None else (None,) * 3
        state = TrainState.from_dict(self.state.to_dict())  # a background commit comes later
        if background:
            # Phase 2a, local: a memory copy of the shards; the loop goes on after it.
            self.coll.each(lambda: local.update(staged=self.adapter.stage_shards()),
                           f"{commit.url} (a copy of the shards)", saving=True)
            manifest_of = self._manifest_of(commit.step, expectation, state, record, started,
                                            stall=self.clock() - started, journal_lines=journal_lines)
            self._progress.background(True)
            self._in_flight = BackgroundSave.start(
                commit.step, commit.url, lambda: self._write_staged(commit, local, manifest_of, moments_later),
                on_failure=lambda: self._abandon(commit))
            return commit.step
        # Phase 2, collective: the adapter's shards (DCP reports errors on every rank); phase 3,
        # rank 0: the manifest, last and atomically, then retention.
        commit.write_and_finalize(
            self.coll, lambda: {"files": commit.write(
                local["rank_file"], lambda: self.adapter.save_shards(self.run.storage, commit.dirname))},
            self._manifest_of(commit.step, expectation, state, record, started, journal_lines=journal_lines),
            keep=self.retention)
        self.last_committed_step = commit.step
        return commit.step

    def _write_staged(self, commit: StepCommit, local: dict, manifest_of: Callable[[list[dict]], Manifest],
                      moments_later: bool) -> None:
        """Phases 2 and 3 of an asynchronous save, on the save group (its own thread); the watchdog's
        background phase ends with it, whatever ends it."""
        coll = self._save_coll
        if coll is None:
            self._progress.background(False)
            raise SaveFailedError("asynchronous save without a save group")
        staged = local.pop("staged")

        def write() -> dict:
            files = commit.write(local["rank_file"], lambda: self.adapter.write_staged(
                staged, self.run.storage, commit.dirname, coll.comm))
            return {"files": files, "optimizer": self.adapter.fingerprint_staged(staged) if moments_later else None}
        try:
            commit.write_and_finalize(coll, write, manifest_of, keep=self.retention)
        except SaveFailedError:  # a lost lease stays what it is (never tolerated)
            raise
        except Exception as e:  # anything else in the commit failed the save
            raise SaveFailedError(f"{commit.url}: commit failed: {type(e).__name__}: {e}") from e
        finally:
            self._progress.background(False)

    def _rank_part(self, local: dict, *, moments: bool) -> dict:
        """Phase 1 of a save on this rank: its share of the Expectation; its state file, kept in ``local``."""
        self.state.check_invariants(global_batch=self.global_batch)
        part = self._next.expectation_part(moments=moments)
        # This rank's iteration times since the last save travel with the gather (stragglers).
        part.update(times=self._progress.take_times(), node=self.watchdog.node, layout=self.adapter.layout_part())
        rank_state = self._next.rank_state()
        local["rank_file"] = (rank_state_name(self.rank), json.dumps(rank_state, allow_nan=False).encode())
        return part

    def _manifest_of(self, step: int, expectation: Expectation | None, state: TrainState, record: dict,
                     started: float, *, stall: float | None = None,
                     journal_lines: list[bytes] | None = None) -> Callable[[list[dict]], Manifest]:
        """The manifest, once every rank reported (a fingerprint taken from a staged copy comes
        then); built on rank 0 only, the one that has the ``expectation``. The journal's records up
        to ``step`` are sealed here, just before the manifest that names their segment."""
        layout = record.pop("layout", None)  # what the topology records of it (rank 0)
        # The loop's accumulation where it is not 1: a restore on a changed global batch names it.
        accumulation = {"accumulation": self.settings.accumulation} if self.settings.accumulation != 1 else {}

        def build(reports: list[dict]) -> Manifest:
            assert expectation is not None, "the manifest is built on rank 0"
            if self.journal is not None and journal_lines is not None:
                record["journal"] = self.journal.seal(step, journal_lines)
            if expectation.optimizer[0] is None:
                expectation.optimizer = [r["optimizer"] for r in reports]
            timing = {"save_s": round(self.clock() - started, 3),
                      **({"stall_s": round(stall, 3)} if stall is not None else {})}
            return Manifest(step=step, train_state=state, files={}, expectation=expectation.to_dict(),
                            topology={**self.adapter.topology(), **(layout or {}), **accumulation},
                            config=self.settings.recorded_config(), timing=timing, adapter=self.adapter.name,
                            complete=self._reached_end(state.iteration), **record)
        return build

    def _abandon(self, commit: StepCommit) -> None:
        if self.rank == 0:
            commit.abandon()

    # -- restore --------------------------------------------------------------------------

    def _start_fresh(self) -> None:
        if self.warm_start is not None:  # verified and loaded before anything of the run is written
            self.origin = warm_start(self.warm_start, self.adapter, self.comm)

        def write_info() -> None:
            if self.run.read_info() is None:
                self.run.write_info({"config": self.settings.recorded_config(), "adapter": self.adapter.name,
                                     "topology": self.adapter.topology(),
                                     **({"origin": self.origin} if self.origin else {})})
        self.coll.on_rank0(write_info)
        if self.journal is not None:
            self.journal.start(None, None)
        self._next.start(self.state.iteration)
        log.info("resume: %s: no checkpoint, starting fresh", self.run.url)

    def _restored(self, restored: Restored) -> None:
        self.state = restored.state
        self.last_committed_step = self.restored_from = restored.manifest.step
        self._first_after_restore = restored.expected
        self.user = dict(restored.manifest.user)
        self.watchdog.measured_save_s = seconds_or_none(restored.manifest.timing.get("save_s"))
        self.changes = restored.changes
        self.rewinds, self._skips = restored.rewinds, restored.skips
        self.origin = restored.manifest.origin  # the run's own checkpoint: its source is never read again
        if self.warm_start is not None and self.rank == 0:
            log.info("resume: warm start from %s not used: the run has its own checkpoint", self.warm_start.source)
        if self.journal is not None:
            self.journal.start(restored.manifest.journal, restored.manifest.step)
        self._next.start(self.state.iteration)
        # Rank 0 at WARNING: seen with Python's default logging, once per job; the others at INFO.
        resized = int(restored.manifest.topology.get("world_size", 1)) != self.comm.world_size
        log.log(logging.WARNING if self.comm.rank == 0 else logging.INFO,
                "resume: restored %s (iteration %d, %d successful, %d skipped updates, %d samples); "
                "continuity ok: %s", self.run.dirname(restored.manifest.step), self.state.iteration,
                self.state.updates_successful, self.state.updates_skipped, self.state.samples_read,
                matched(restored.expected, resized=resized, relaid=restored.layout_change is not None))

    def _expectation_after_load(self, schedule: list[dict]) -> Expectation:
        """Collective, right after a load: the Expectation recomputed from the live objects,
        assembled on rank 0, which compares it (each rank sends its own part, O(1) per rank);
        on the others, from their own part alone (its LR ahead, the same on every rank)."""
        self._next.reset()
        own: dict = {}
        world = self.comm.world_size
        assembled = self.coll.gather(lambda: own.setdefault("part", self._next.expectation_part(schedule)),
                                     "continuity check",
                                     combine=lambda parts: Expectation.assemble(parts, world_size=world,
                                                                                to_compare=True))
        return assembled if self.rank == 0 else Expectation.assemble([own["part"]], world_size=world)
