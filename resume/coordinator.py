"""The coordinator: the small library wrapper around the training loop.

    coord = Coordinator(run_url, adapter, global_batch=..., every=200, keep=3)
    coord.restore()                  # newest committed checkpoint or a fresh start; checks continuity
    for batch in coord.batches():    # knows the next batch without consuming it
        ...forward/backward/step...
        coord.update(applied=...)    # successful vs skipped; saves when due, on request or on a signal
        if coord.should_stop:
            break
    coord.close()

It owns when and where to save, the commit protocol, retention, signals and
save requests, and the continuity check on restore. It never imports a
framework: everything framework-specific goes through the ``Adapter``.
"""

from __future__ import annotations

import builtins
import concurrent.futures
import json
import logging
import signal
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from . import errors as _errors
from . import faults
from .adapter import Adapter
from .changes import AcceptChanges, Change, check_structure, refuse, schedule_changes, setting_changes
from .checksum import checksum_bytes, checksum_file
from .comm import Comm
from .continuity import Expectation, compare, compare_config, merge_batch_descriptions
from .control import SaveRequest, answer_request, pending_requests
from .errors import (
    ContinuityError,
    LeaseLostError,
    NoValidCheckpointError,
    ResumeError,
    SaveFailedError,
    StorageAccessError,
    StorageError,
    UsageError,
)
from .lease import Lease
from .manifest import FileEntry, Manifest
from .rng import RngRegistry
from .run import CheckResult, KeepPolicy, Run, step_dirname
from .state import TrainState
from .storage import join, open_storage

__all__ = ["Coordinator"]

log = logging.getLogger("resume")

_END = object()


def rank_state_name(rank: int) -> str:
    return f"rank-{rank:05d}.json"


@dataclass
class _InFlight:
    step: int
    thread: threading.Thread | None = None
    error: BaseException | None = None
    ok: bool = False


@dataclass
class _Lookahead:
    """The next batch, fetched early, with the state from just before it was fetched."""

    batch: Any
    rng_state: dict
    data_state: Any


class Coordinator:
    """Save, restore and continuity for one training loop. Every rank makes every call."""

    def __init__(
        self,
        run_url: str,
        adapter: Adapter,
        *,
        global_batch: int,
        every: int = 200,
        keep: int = 3,
        keep_every: int | None = None,
        seq_len: int | None = None,
        config: dict | None = None,
        lr_lookahead: int = 3,
        allow_fresh_start: bool = False,
        verify_on_restore: bool = True,
        handle_signals: bool = True,
        control_poll_s: float = 1.0,
        async_save: bool = False,
        on_save_failure: str = "raise",
        max_save_failures: int = 3,
        lease_ttl_s: float | None = 120.0,
        accept_changes: Iterable[str] | str | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """
        Args:
            run_url: the run's home, a local path or an fsspec URL.
            adapter: the framework adapter (owns model, optimizers, schedulers, data).
            global_batch: samples per iteration over all ranks.
            every: save every N iterations (0: only on request or signal).
            keep: newest committed checkpoints kept by retention (>= 2).
            keep_every: also keep every checkpoint whose step is a multiple of M, forever.
            seq_len: sequence length, recorded and checked on restore.
            config: further JSON values that must not change across restarts (seed, ...).
            lr_lookahead: how many successful updates ahead the LR is recorded (>= 2).
            allow_fresh_start: start from scratch even when step directories exist but
                none holds a valid checkpoint. Off by default: that loses the run.
            verify_on_restore: check every file's checksum before loading it.
            handle_signals: SIGUSR1/SIGTERM request save-and-stop at the next boundary.
            control_poll_s: how often rank 0 looks for save requests under ``control/``.
            async_save: scheduled saves block the loop only while the state is copied
                (staged); the shards are written and committed in the background, at most
                one save in flight. The next save, a requested save and ``close()`` wait
                for it and raise its error. Needs an adapter that can stage
                (``Adapter.stage_shards``); saves asked for by a request or a signal are
                synchronous (the asker waits for the commit anyway).
            on_save_failure: what a failed scheduled save does (a full disk, storage down):
                ``"raise"`` (SaveFailedError out of ``update()``: the job stops and is
                restarted) or ``"continue"`` (logged; training goes on and the next
                scheduled save tries again; the ``max_save_failures``-th failure in a row
                raises). A save asked for by a request or a signal always raises.
            lease_ttl_s: rank 0 holds ``RUN/lease.json`` while the coordinator lives, with a
                heartbeat; another job is refused (RunBusyError) until the lease is older
                than this. None: no lease (only for a run nothing else can reach).
            accept_changes: settings the code may change against the checkpoint at this
                restart (``"weight_decay"``, ``"initial_lr"``, ``"optimizer[1]"``,
                ``"schedule"``; resume.changes). Any other changed param-group or schedule
                setting is refused with ContinuityError. An accepted change keeps the code's
                value and is recorded in the next manifest (``changes``). The environment's
                ``RESUME_ACCEPT_CHANGES`` (comma-separated) adds to it, for a requeued job.
            clock: injectable monotonic clock.
        """
        if not isinstance(global_batch, int) or global_batch < 1:
            raise UsageError(f"global_batch: expected a positive integer, actual {global_batch!r}")
        if every < 0:
            raise UsageError(f"every: expected >= 0 iterations (0 = only on request), actual {every}")
        if lr_lookahead < 2:
            raise UsageError(f"lr_lookahead: expected >= 2 updates, actual {lr_lookahead}")
        if on_save_failure not in ("raise", "continue"):
            raise UsageError(f"on_save_failure: expected 'raise' or 'continue', actual {on_save_failure!r}")
        if max_save_failures < 1:
            raise UsageError(f"max_save_failures: expected >= 1, actual {max_save_failures}")
        if lease_ttl_s is not None and lease_ttl_s <= 0:
            raise UsageError(f"lease_ttl_s: expected > 0 seconds or None, actual {lease_ttl_s}")
        self.adapter = adapter
        self.comm = adapter.comm
        self.rank = self.comm.rank
        self.global_batch = global_batch
        self.every = every
        self.keep = KeepPolicy(keep_last=keep, keep_every=keep_every)
        # Kept as JSON gives it back, so that tuples, int keys and the like
        # compare equal to what a manifest holds.
        self.config = _as_json({"global_batch": global_batch, "seq_len": seq_len, **(config or {})},
                               "config")
        self.lr_lookahead = lr_lookahead
        self.allow_fresh_start = allow_fresh_start
        self.verify_on_restore = verify_on_restore
        self.control_poll_s = control_poll_s
        self.on_save_failure = on_save_failure
        self.max_save_failures = max_save_failures
        self.save_failures = 0
        """Scheduled saves failed in a row (``on_save_failure="continue"``)."""
        self.clock = clock
        self.accept = AcceptChanges.parse(accept_changes)
        self.user: dict[str, Any] = {}
        """The program's own JSON values (a training stage, a curriculum position), saved in
        every manifest; ``peek()`` reads them before the shards load, ``restore()`` sets them."""
        self.changes: list[dict] = []
        """Settings changed on purpose at restarts, ``{step, item, from, to}`` (manifest ``changes``)."""

        self.rng = RngRegistry()
        self.state = TrainState()
        self.should_stop = False
        self.last_committed_step: int | None = None
        self.restored_from: int | None = None

        self._iterator: Iterator[Any] | None = None
        self._lookahead: _Lookahead | None = None
        self._save_requested = False
        self._stop_requested = False
        self._signal: int | None = None
        self._last_poll = float("-inf")
        self._first_after_restore: Expectation | None = None
        self._peeked: tuple[Manifest | None] | None = None
        self._prepared: tuple[Any] | None = None  # what adapter.prepare_load() returned
        self._drawn = False  # a batch went out through batches() since the start or the restore
        self._start_iteration = 0
        self._previous_handlers: dict[int, Any] = {}
        self.async_save = async_save and adapter.can_stage()
        self._in_flight: _InFlight | None = None
        # Background collectives run on their own group, never interleaved with training's.
        self._save_comm: Comm | None = self.comm.fork() if self.async_save else None

        # Rank 0 creates the run; the others never list or probe storage
        # (5,120 ranks must not hammer an object store).
        self.run = Run(open_storage(run_url))
        self._on_rank0(self.run.ensure_exists)
        # One writer per run: rank 0 holds the lease (a second job is refused here,
        # on every rank, before it touches anything).
        self._lease: Lease | None = None
        if lease_ttl_s is not None:
            self._on_rank0(lambda: self._take_lease(lease_ttl_s))
        if handle_signals:
            self._install_signal_handlers()

    # -- public surface ---------------------------------------------------------------

    @property
    def iteration(self) -> int:
        return self.state.iteration

    def register_rng(self, name: str, generator: Any) -> None:
        """Save and restore a generator of the user's along with the global ones."""
        self.rng.register(name, generator)

    def request_save(self, *, stop: bool = False) -> None:
        """Save at the next iteration boundary (and stop afterwards when ``stop``)."""
        self._save_requested = True
        self._stop_requested = self._stop_requested or stop

    def peek(self) -> Manifest | None:
        """Collective: the checkpoint ``restore()`` will load (found and verified now, not
        again by ``restore()``), or None for a fresh start. Nothing is loaded.

        Its ``user`` holds the values the program saved in ``coord.user``, so the program
        can build the structure the checkpoint holds (a stage's param groups, untied
        weights) before ``restore()`` loads into it.
        """
        if self._peeked is None:
            self._peeked = (self._discover(),)
        return self._peeked[0]

    def restore(self) -> TrainState:
        """Load the newest committed checkpoint (or start fresh) and check continuity."""
        # Without a peek() first, the objects are made ready to be loaded into while the
        # checkpoint's files are verified (after a peek() the program may still rebuild them).
        manifest = self._peeked[0] if self._peeked is not None else self._discover(prepare=True)
        self._peeked = None
        try:
            if manifest is None:
                self._discard_prepared()
                self._start_fresh()
                return self.state
            self._load(manifest)
        except BaseException:
            self._discard_prepared()
            raise
        self._prepared = None
        return self.state

    def batches(self) -> Iterator[Any]:
        """This rank's batches, from where the run stands; stops when ``should_stop``."""
        while not self.should_stop:
            if self._lookahead is not None:
                batch, self._lookahead = self._lookahead.batch, None
            else:
                batch = next(self._data_iterator(), _END)
            if batch is _END:
                self._iterator = None  # the next batches() starts the next pass
                return
            self._drawn = True
            first = self._first_after_restore
            if first is not None and not self.adapter.lr_set_by_loop:
                # The LR is in the groups before the step: refused before any update.
                self._check_lrs(first, 0, self.adapter.current_lrs(), "lr at the first update")
            yield batch

    def update(self, *, applied: bool = True, samples: int | None = None, tokens: int | None = None,
               tokens_in_loss: int | None = None) -> bool:
        """Count one iteration; save when due, requested or signalled. True if it saved."""
        self.state.advance(applied=applied, samples=self.global_batch if samples is None else samples,
                           tokens=tokens, tokens_in_loss=tokens_in_loss)
        self._check_counters(applied=applied, where="update")
        if self._first_after_restore is not None and applied:
            self._check_first_update(self._first_after_restore)
            self._first_after_restore = None
        return self._maybe_save_at_boundary()

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
        self._refuse_untracked_batches()
        faults.set_context(rank=self.rank, step=step)
        try:
            return self._save_step(step, blocking=blocking)
        except (ResumeError, OSError) as e:
            self._drop_uncommitted(step)
            if isinstance(e, OSError) and not isinstance(e, (SaveFailedError, StorageAccessError)):
                # The storage's own error (read-only, EIO, retries exhausted), as a failed save.
                raise SaveFailedError(f"{self.run.storage.url(step_dirname(step))}: save failed: "
                                      f"{type(e).__name__}: {e}") from e
            raise

    def _refuse_untracked_batches(self) -> None:
        """A loop that draws its batches around ``batches()`` would make every checkpoint record
        a wrong next batch (the loader's first, each time): refused at the first save."""
        counted = self.state.iteration - self._start_iteration
        if counted and not self._drawn and self.adapter.has_data():
            raise UsageError(
                "next_batch: expected the training loop to draw its batches through coord.batches() "
                f"(the checkpoint records the next batch from it), actual {counted} iterations counted "
                "by update() and no batch drawn through it; write `for batch in coord.batches():`, or "
                "build the adapter with data=None to save without the next-batch check (the loader's "
                "position is then the program's to keep, e.g. in coord.user)")

    def _save_step(self, step: int, *, blocking: bool) -> int:
        started = self.clock()
        step_dir = step_dirname(step)
        record = {"user": _as_json(self.user, "user"), "changes": list(self.changes)}
        already = self._on_rank0(lambda: self._prepare_step_dir(step))
        if already:
            self.last_committed_step = step
            return step
        self.comm.barrier()

        # Phase 1, local, no collectives: what this rank contributes. A failure
        # here must not leave the other ranks waiting in a collective.
        # An asynchronous save takes the moments' fingerprint from the staged copy, in the
        # background: the loop waits for the copy alone.
        moments_later = self.async_save and not blocking and self.adapter.can_fingerprint_staged()
        staged = self._guarded(lambda: self._stage_rank_part(step_dir, moments=not moments_later))
        rank_file = staged.pop("rank_file", None)  # written with the shards, never gathered
        gathered = self._agree(self.comm.all_gather_object(staged), step_dir, saving=True)
        expectation = self._assemble_expectation([g["part"] for g in gathered])
        if self.async_save and not blocking:
            # Phase 2a, local: a memory copy of the shards; the loop goes on after it.
            shards = self._guarded(lambda: {"staged": self.adapter.stage_shards()})
            self._agree(self.comm.all_gather_object({k: v for k, v in shards.items() if k != "staged"}),
                        step_dir, saving=True)
            stall = self.clock() - started
            in_flight = _InFlight(step)
            # Not a daemon: a script that ends without close() still finishes the write.
            in_flight.thread = threading.Thread(
                target=self._write_in_background, name=f"resume-save-{step}",
                args=(in_flight, step_dir, shards["staged"], rank_file, staged["files"], expectation, started, stall,
                      TrainState.from_dict(self.state.to_dict()), record))
            self._in_flight = in_flight
            in_flight.thread.start()
            return step
        # Phase 2, collective: the adapter's shards (DCP reports errors on every rank).
        report = self._guarded(lambda: self._write_shards(step_dir, rank_file, staged["files"]))
        reports = self._agree(self.comm.all_gather_object(report), step_dir, saving=True)
        faults.point("save.after_gather")
        # Phase 3, rank 0: the manifest, last and atomically, then retention.
        self._on_rank0(lambda: self._commit(step, reports, expectation, self.clock() - started, record=record))
        self.last_committed_step = step
        return step

    def maybe_wait_for_save(self) -> None:
        """Wait for the save in flight, if any; raise its error (on every rank)."""
        in_flight = self._in_flight
        if in_flight is None:
            return
        assert in_flight.thread is not None
        in_flight.thread.join()
        self._in_flight = None  # only once it has ended: an interrupted wait can wait again
        if in_flight.error is not None:
            raise in_flight.error
        if not in_flight.ok:
            raise SaveFailedError(f"{self.run.storage.url(step_dirname(in_flight.step))}: the background "
                                  "write ended without committing")
        self.last_committed_step = in_flight.step
        self.save_failures = 0

    def _write_in_background(self, in_flight: _InFlight, step_dir: str, staged: Any,
                             rank_file: tuple[str, bytes], files: dict,
                             expectation: Expectation, started: float, stall: float,
                             state: TrainState, record: dict) -> None:
        """Phases 2 and 3 of an asynchronous save, on the save group; errors kept for the wait."""
        step = in_flight.step
        comm = self._save_comm
        try:
            if comm is None:
                raise SaveFailedError("asynchronous save without a save group")
            def write() -> dict:
                self.run.storage.write_bytes_atomic(join(step_dir, rank_file[0]), rank_file[1])
                faults.point("save.before_shards")
                written = self.adapter.write_staged(staged, self.run.storage, step_dir, comm)
                faults.point("save.after_shards")
                moments = self.adapter.fingerprint_staged(staged) if expectation.optimizer[0] is None else None
                return {"files": {**files, **self._file_records(step_dir, written)}, "optimizer": moments}
            report = self._guarded(write)
            reports = self._agree(comm.all_gather_object(report), step_dir, saving=True)
            if expectation.optimizer[0] is None:
                expectation.optimizer = [r["optimizer"] for r in reports]
            faults.point("save.after_gather")
            outcome: Any = None
            if comm.rank == 0:
                try:
                    self._commit(step, reports, expectation, self.clock() - started, stall_s=stall,
                                 state=state, record=record)
                    outcome = ("ok",)
                except Exception as e:  # noqa: BLE001 - every rank must hear of it
                    outcome = ("error", type(e).__name__, str(e))
            outcome = comm.broadcast_object(outcome, src=0)
            if outcome[0] != "ok":
                # A lost lease stays what it is (never tolerated); anything else failed the save.
                cls = LeaseLostError if outcome[1] == "LeaseLostError" else SaveFailedError
                raise cls(f"{self.run.storage.url(step_dir)}: commit failed: {outcome[1]}: {outcome[2]}")
            in_flight.ok = True
        except BaseException as e:  # noqa: BLE001 - raised by the next wait, on this rank
            self._drop_uncommitted(step)
            in_flight.error = e if isinstance(e, Exception) else SaveFailedError(
                f"{self.run.storage.url(step_dir)}: background write interrupted: {e!r}")

    def close(self) -> None:
        """Wait for a save in flight (raising its error), release the lease, restore the
        signal handlers."""
        try:
            self.maybe_wait_for_save()
        finally:
            for signum, handler in self._previous_handlers.items():
                signal.signal(signum, handler)
            self._previous_handlers.clear()
            if self._lease is not None:
                lease, self._lease = self._lease, None
                try:
                    lease.release()
                except OSError as e:  # it goes stale by itself
                    log.warning("resume: cannot release %s: %s", lease.url, e)

    def _drop_uncommitted(self, step: int) -> None:
        """Rank 0, after a failed save: remove what it left unless it committed (frees a full disk)."""
        if self.rank != 0:
            return
        try:
            if self._lease is not None:
                self._lease.check()  # after a takeover it may be the new holder's save in progress
            if not self.run.storage.isdir(step_dirname(step)):
                return
            try:
                self.run.storage.size(self.run.manifest_path(step))
                return  # committed after all (the failure came later): never removed here
            except FileNotFoundError:
                pass
            self.run.delete_step(step)
            log.warning("resume: removed %s, left uncommitted by the failed save", step_dirname(step))
        except (OSError, LeaseLostError) as e:  # left: discovery passes over it, retention sweeps it
            log.warning("resume: %s left as it is: %s", step_dirname(step), e)

    def _take_lease(self, ttl_s: float) -> None:
        self._lease = Lease.take(self.run.storage, ttl_s=ttl_s)

    # -- restore -------------------------------------------------------------------------

    def _discover(self, *, prepare: bool = False) -> Manifest | None:
        """The newest committed checkpoint whose files all verify; None for a fresh start.

        Rank 0 lists once and runs the commit check (manifest valid, sizes
        right); then, with ``verify_on_restore``, every rank reads its share of
        the candidate's files and compares checksums, so a corrupt newest
        checkpoint is passed over for the previous one.
        """
        candidates = self._on_rank0(self._list_candidates)
        broken: list[tuple[int, str]] = []  # a manifest exists, but the checkpoint is damaged
        torn: list[tuple[int, str]] = []    # no manifest: a save that never finished
        chosen: Manifest | None = None
        for step, text, reason, has_manifest in candidates:
            if text is None:
                (broken if has_manifest else torn).append((step, reason))
                continue
            manifest = Manifest.from_json(text, source=self.run.storage.url(step_dirname(step)))
            if self.verify_on_restore:
                problems = self._verify_share(manifest, prepare=prepare)
                if problems:
                    broken.append((step, "; ".join(problems)))
                    continue
            chosen = manifest
            break
        if self.rank == 0:
            for step, why in torn + broken:
                log.warning("resume: passing over %s: %s", step_dirname(step), why)
        if chosen is None and broken and not self.allow_fresh_start:
            raise NoValidCheckpointError(
                f"{self.run.url}: expected a committed checkpoint among {len(candidates)} step "
                f"directories, actual none valid ("
                f"{'; '.join(f'{step_dirname(s)}: {w}' for s, w in broken[:3])}); refusing to "
                "start from scratch (allow_fresh_start=True to override)")
        if broken:
            # Out of the way of retention and of the next save of the same
            # step, kept for the operator: nothing a user saved is deleted.
            self._on_rank0(lambda: self._quarantine(broken, chosen))
        return chosen

    def _quarantine(self, broken: list[tuple[int, str]], chosen: Manifest | None) -> None:
        for step, why in broken:
            try:
                self.run.quarantine_step(step, why)
            except OSError as e:  # left in place: discovery passes over it again next time
                log.error("resume: cannot move broken %s aside: %s", step_dirname(step), e)
        if chosen is not None:
            try:  # the hint follows: it must not name a checkpoint that was moved aside
                self.run.point_latest(chosen.step)
            except OSError as e:
                log.warning("resume: cannot point LATEST at %s: %s", step_dirname(chosen.step), e)

    def _verify_share(self, manifest: Manifest, *, prepare: bool = False) -> list[str]:
        """Collective: every rank checksums its share of the files; all problems, on every rank.

        With ``prepare`` the reads run beside the adapter's ``prepare_load()`` (a fresh
        optimizer's state made ready to be loaded into): the file I/O and that compute
        overlap instead of adding up.
        """
        share = sorted(manifest.files)[self.rank::self.comm.world_size]

        def verify() -> dict:
            return self._guarded(lambda: {"problems": self.run.verify_checksums(
                manifest, share, raise_unreadable=True)})
        if prepare and self._prepared is None:
            with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="resume-verify") as pool:
                pending = pool.submit(verify)
                prepared = self._guarded(lambda: {"token": self.adapter.prepare_load()})
                staged = pending.result()
            if prepared["ok"]:
                self._prepared = (prepared["token"],)
            elif staged["ok"]:
                staged = prepared
        else:
            staged = verify()
        gathered = self._agree(self.comm.all_gather_object(staged), "checksum verification")
        return [p for g in gathered for p in g["problems"]]

    def _discard_prepared(self) -> None:
        """Nothing will be loaded: put back what ``prepare_load()`` made (a fresh start stays fresh)."""
        if self._prepared is not None:
            token, self._prepared = self._prepared[0], None
            self.adapter.discard_prepared(token)

    def _list_candidates(self) -> list[tuple[int, str | None, str, bool]]:
        """Rank 0: every step directory, newest first, with its manifest if it passes the check."""
        out = []
        for step in reversed(self.run.step_dirs()):
            result = self.run.check(step)
            _refuse_unreadable(result, self.run)
            out.append((step, result.manifest.to_json() if result.committed else None, result.reason,
                        result.has_manifest))
        return out

    def _start_fresh(self) -> None:
        def write_info() -> None:
            if self.run.read_info() is None:
                self.run.write_info({"config": self.config, "adapter": self.adapter.name,
                                     "topology": self.adapter.topology()})
        self._on_rank0(write_info)
        self._drawn = False
        self._start_iteration = self.state.iteration
        log.info("resume: %s: no checkpoint, starting fresh", self.run.url)

    def _load(self, manifest: Manifest) -> None:
        step, step_dir = manifest.step, step_dirname(manifest.step)
        source = self.run.storage.url(join(step_dir, "manifest.json"))
        expected = Expectation.from_dict(manifest.expectation, source=source)
        # Config first: a changed global batch or seed is named before anything is loaded.
        compare_config(manifest.config, self.config)
        declared_schedule = self.adapter.describe_schedule()
        # Then the optimizers' structure and every setting, still before anything is loaded:
        # another structure or a changed setting is named here, never found inside the load.
        accepted = self._check_settings(expected, declared_schedule)
        code_settings = self.adapter.snapshot_settings() if accepted else None

        saved_world = int(manifest.topology.get("world_size", 1))
        # Local reads first, agreed on by all ranks, so that a bad file on one
        # rank fails every rank instead of leaving them in a collective.
        staged = self._guarded(lambda: {"state": self._read_rank_state(manifest, saved_world)})
        rank_state = self._agree(self.comm.all_gather_object(staged),
                                 f"restore of {step_dir}")[self.rank]["state"]
        self.adapter.load_shards(self.run.storage, step_dir)

        def load_local() -> dict:
            # Data before RNG: a restored loader must not draw from the restored generators.
            self.adapter.load_state_dict(rank_state["adapter"])
            self.adapter.load_data_state(rank_state["data"])
            self.rng.restore(rank_state["rng"])
            if accepted:
                self.adapter.apply_changes([c.item for c in accepted], code_settings)
            return {}
        # A refusal on one rank (a loader state it cannot take) is raised on every rank, not
        # left for the others to find as a hang in the next collective.
        self._agree(self.comm.all_gather_object(self._guarded(load_local)), f"restore of {step_dir}")
        self.state = TrainState.from_dict(manifest.train_state.to_dict(), source=source)
        self._iterator = None
        self._lookahead = None

        self.state.check_invariants(global_batch=self.global_batch, where=source)
        self._check_counters(applied=True, where=f"restore of {step_dir}")
        actual = self._expectation_now(schedule=declared_schedule)
        if accepted and expected.lr_ahead != actual.lr_ahead and any(_moves_lr(c.item) for c in accepted):
            # The accepted change moves the LR: what is ahead now is the new schedule's (recorded
            # with the change), and the first update is checked against it.
            if self.rank == 0:
                log.warning("resume: LR ahead after the accepted changes: %s (the checkpoint had %s)",
                            actual.lr_ahead, expected.lr_ahead)
            expected.lr_ahead, expected.lr_groups = actual.lr_ahead, actual.lr_groups
        compare(expected, actual, resized=saved_world != self.comm.world_size)
        self.last_committed_step = step
        self.restored_from = step
        self._first_after_restore = expected
        self.user = dict(manifest.user)
        self.changes = list(manifest.changes) + [c.record(step) for c in accepted]
        self._drawn = False
        self._start_iteration = self.state.iteration
        log.info("resume: restored %s (iteration %d, %d successful, %d skipped); continuity ok",
                 step_dir, self.state.iteration, self.state.updates_successful,
                 self.state.updates_skipped)

    def _check_settings(self, expected: Expectation, declared_schedule: list[dict]) -> list[Change]:
        """Structure and settings of the code against the checkpoint: a structure mismatch or a
        changed setting that was not accepted raises ContinuityError; the accepted changes."""
        changes = schedule_changes(expected.schedule, declared_schedule)
        if expected.structure:  # not recorded by an older resume
            live = self.adapter.describe_structure()
            check_structure(expected.structure, live)
            changes = setting_changes(expected.structure, live) + changes
        for change in changes:
            if not self.accept.accepts(change.item):
                raise refuse(change)
        if changes and self.rank == 0:
            for change in changes:
                log.warning("resume: accepted change %s: %r -> %r (recorded in the next manifest)",
                            change.item, change.saved, change.live)
        # Accepted: the schedule compared below is the code's.
        expected.schedule = declared_schedule
        return changes

    def _read_rank_state(self, manifest: Manifest, saved_world: int) -> dict:
        step_dir = step_dirname(manifest.step)
        own = rank_state_name(self.rank if self.rank < saved_world else 0)
        if own not in manifest.files:
            raise _errors.ManifestError(f"{self.run.storage.url(join(step_dir, 'manifest.json'))}: "
                                        f"files: expected an entry for {own}, actual missing")
        url = self.run.storage.url(join(step_dir, own))
        try:
            rank_state = json.loads(self.run.storage.read_bytes(join(step_dir, own)))
        except ValueError as e:
            raise _errors.ManifestError(f"{url}: expected JSON, actual {e}") from e
        missing = {"rng", "data", "adapter"} - set(rank_state if isinstance(rank_state, dict) else ())
        if missing:
            raise _errors.ManifestError(f"{url}: expected fields rng, data, adapter, "
                                        f"actual missing {sorted(missing)}")
        return rank_state

    # -- continuity ---------------------------------------------------------------------------

    def _data_iterator(self) -> Iterator[Any]:
        if self._iterator is None:
            self._iterator = iter(self.adapter.data_iterator())
        return self._iterator

    def _ensure_lookahead(self) -> _Lookahead:
        # RNG and data position are snapshotted BEFORE the fetch: a restarted
        # run re-fetches this batch from the snapshot, consuming randomness
        # exactly as the uninterrupted run did.
        if not self.adapter.has_data():  # nothing to look ahead into; nothing kept between saves
            return _Lookahead(_END, self.rng.capture(), None)
        if self._lookahead is None:
            rng_state = self.rng.capture()
            data_state = self.adapter.data_state()
            batch = next(self._data_iterator(), _END)
            if batch is _END:
                self._iterator = None
            self._lookahead = _Lookahead(batch, rng_state, data_state)
        return self._lookahead

    def _local_expectation_part(self, schedule: list[dict] | None = None, *, moments: bool = True) -> dict:
        """This rank's share of the Expectation (no collectives)."""
        ahead = self._ensure_lookahead()
        return {
            "batch": [] if ahead.batch is _END else self.adapter.describe_batch(ahead.batch),
            "rng": RngRegistry.digest(ahead.rng_state),
            "optimizer": self.adapter.optimizer_fingerprint() if moments else None,
            "lr_ahead": self.adapter.lr_ahead(self.lr_lookahead),
            "lr_groups": self.adapter.lr_groups(),
            "schedule": self.adapter.describe_schedule() if schedule is None else schedule,
            "structure": self.adapter.describe_structure(),
            "optimizer_steps": self.adapter.optimizer_steps(),
        }

    def _assemble_expectation(self, parts: list[dict]) -> Expectation:
        # LR, schedule and step counts are the same on every rank; rank 0's stand.
        return Expectation(
            next_batch=merge_batch_descriptions([p["batch"] for p in parts]),
            lr_ahead=parts[0]["lr_ahead"],
            lr_groups=parts[0]["lr_groups"],
            structure=parts[0]["structure"],
            schedule=parts[0]["schedule"],
            optimizer_steps=parts[0]["optimizer_steps"],
            optimizer=[p["optimizer"] for p in parts],
            rng=[p["rng"] for p in parts],
            world_size=self.comm.world_size,
        )

    def _expectation_now(self, *, schedule: list[dict] | None = None) -> Expectation:
        """Collective: the Expectation recomputed from the live objects."""
        staged = self._guarded(lambda: {"part": self._local_expectation_part(schedule)})
        gathered = self._agree(self.comm.all_gather_object(staged), "continuity check")
        return self._assemble_expectation([g["part"] for g in gathered])

    def _check_counters(self, *, applied: bool, where: str) -> None:
        successful = self.state.updates_successful
        for kind, values in (("optimizer", self.adapter.optimizer_steps()),
                             ("scheduler", self.adapter.scheduler_positions())):
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

    def _check_first_update(self, expected: Expectation) -> None:
        """After the first applied update: the LR it applied is the one recorded, and (torch
        schedulers) the groups now hold the LR recorded for the update after it."""
        applied = self.adapter.applied_lrs()
        if applied is not None:
            self._check_lrs(expected, 0, applied, "lr applied at the first update")
        if not self.adapter.lr_set_by_loop and len(expected.lr_ahead) > 1:
            self._check_lrs(expected, 1, self.adapter.current_lrs(), "lr after the first update")

    def _check_lrs(self, expected: Expectation, ahead: int, actual: list[float | None], item: str) -> None:
        """The recorded groups' LRs (row ``ahead`` of the LR ahead) against ``actual``. A group
        added since (a stage change in this iteration) is named in the log, not refused."""
        recorded = expected.lr_ahead[ahead]
        live_labels = self.adapter.lr_groups()
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
            if actual[i] is None:  # its optimizer did not step in this update
                continue
            wanted.append(lr)
            got.append(actual[i])
        if wanted != got:
            hint = "the LR applied is not the one recorded"
            if not self.adapter.lr_set_by_loop and not self.adapter.describe_schedule():
                hint += ("; an LR set by hand in the loop? declare its schedule: NativeTorchAdapter(..., "
                         "schedulers=lr_at) with lr_at(updates) -> LRs (resume.schedule)")
            raise ContinuityError(item, wanted, got, hint)
        added = [f"{label} (lr {actual[i]})" for label, i in position.items()
                 if label not in set(labels) and actual[i] is not None]
        if added and self.rank == 0:
            log.info("resume: %s: param groups added since the checkpoint, not checked: %s", item,
                     ", ".join(added))

    # -- save ----------------------------------------------------------------------------------

    def _maybe_save_at_boundary(self) -> bool:
        requests: list[SaveRequest] = []
        if self.rank == 0 and self.clock() - self._last_poll >= self.control_poll_s:
            self._last_poll = self.clock()
            try:
                requests = pending_requests(self.run)
            except Exception as e:  # noqa: BLE001 - a broken control area must not stop training
                log.warning("resume: cannot read save requests under %s: %s", self.run.url, e)
        # One small all-reduce per iteration: every rank learns every flag, so
        # all ranks save the same iteration. The requests themselves travel
        # only when there are some.
        wants_save, wants_stop, has_requests = self.comm.max_flags([
            self._save_requested, self._stop_requested or self._signal is not None, bool(requests)])
        if has_requests:
            requests = self.comm.broadcast_object(requests, src=0)
        stop = bool(wants_stop) or any(r.stop for r in requests)
        due = self.every > 0 and self.state.iteration % self.every == 0
        save = due or stop or bool(requests) or bool(wants_save)
        self._save_requested = False
        if not save:
            return False
        # Only a scheduled save runs in the background: an asker waits for the commit.
        scheduled_only = due and not (stop or requests or wants_save)
        if scheduled_only:
            # A background save that failed counts under the policy, before the next one starts
            # (a requested save goes ahead regardless: save() logs the earlier failure).
            try:
                self.maybe_wait_for_save()
            except (ResumeError, OSError) as e:
                if not self._tolerate_save_failure(e):
                    raise
        try:
            step = self.save(blocking=not scheduled_only)
        except (ResumeError, OSError) as e:
            self._answer(requests, step=None, error=str(e))
            if scheduled_only and self._tolerate_save_failure(e):
                return False
            raise
        if self._in_flight is None:  # committed (a background save counts when it commits)
            self.save_failures = 0
        self._answer(requests, step=step)
        if stop:
            self.should_stop = True
        return True

    def _tolerate_save_failure(self, error: BaseException) -> bool:
        """With ``on_save_failure="continue"``: True while training may go on without this save."""
        storage_trouble = isinstance(error, (SaveFailedError, OSError)) and not isinstance(error, LeaseLostError)
        if self.on_save_failure != "continue" or not storage_trouble:
            return False
        self.save_failures += 1
        if self.save_failures >= self.max_save_failures:
            log.error("resume: %d scheduled saves failed in a row (max_save_failures=%d); stopping",
                      self.save_failures, self.max_save_failures)
            return False
        log.error("resume: the save of step %d failed (%d in a row, stopping at %d); training goes on "
                  "and the next scheduled save tries again: %s", self.state.iteration, self.save_failures,
                  self.max_save_failures, error)
        return True

    def _answer(self, requests: list[SaveRequest], *, step: int | None, error: str | None = None) -> None:
        if self.rank != 0:
            return
        for request in requests:
            try:
                answer_request(self.run, request, step=step, error=error)
            except Exception as e:  # noqa: BLE001 - the save is done; the asker will time out
                log.warning("resume: cannot answer save request %s: %s", request.request_id, e)

    def _prepare_step_dir(self, step: int) -> bool:
        """Rank 0: True if ``step`` is already committed; removes a torn leftover of it."""
        if self._lease is not None:
            self._lease.check()  # a job that was taken over must not write or remove anything
        if step in self.run.step_dirs():
            result = self.run.check(step)
            _refuse_unreadable(result, self.run)
            if result.committed:
                return True
            if result.has_manifest:  # a damaged checkpoint, not a leftover: moved aside, never deleted
                self.run.quarantine_step(step, result.reason)
                committed = self.run.committed_steps()
                if committed:  # the hint must not name what was moved aside
                    self.run.point_latest(committed[-1])
            else:
                log.warning("resume: removing uncommitted leftover %s", step_dirname(step))
                self.run.delete_step(step)
        self.run.storage.makedirs(step_dirname(step))
        return False

    def _stage_rank_part(self, step_dir: str, *, moments: bool = True) -> dict:
        """Phase 1 of a save on this rank: expectation share and the small JSON state file."""
        self.state.check_invariants(global_batch=self.global_batch)
        part = self._local_expectation_part(moments=moments)
        ahead = self._ensure_lookahead()
        rank_state = {"rng": ahead.rng_state, "data": ahead.data_state,
                      "adapter": self.adapter.state_dict()}
        body = json.dumps(rank_state, allow_nan=False).encode()
        name = rank_state_name(self.rank)
        # Written in phase 2 with the shards: its fsyncs are no part of an asynchronous save's stall.
        return {"part": part, "files": {name: (len(body), checksum_bytes(body))}, "rank_file": (name, body)}

    def _write_shards(self, step_dir: str, rank_file: tuple[str, bytes], files: dict) -> dict:
        """Phase 2 (collective): this rank's state file and the adapter's shards, and its file records."""
        self.run.storage.write_bytes_atomic(join(step_dir, rank_file[0]), rank_file[1])
        faults.point("save.before_shards")
        written = self.adapter.save_shards(self.run.storage, step_dir)
        faults.point("save.after_shards")
        return {"files": {**files, **self._file_records(step_dir, written)}}

    def _file_records(self, step_dir: str, written: Any) -> dict:
        """(size, checksum) per file: as the adapter took them while writing, else read back."""
        out = {}
        for rel in written:
            known = written.get(rel) if isinstance(written, dict) else None
            out[rel] = tuple(known) if known else checksum_file(self.run.storage, join(step_dir, rel))
        return out

    def _guarded(self, fn: Callable[[], dict]) -> dict:
        """Run a local phase; an error becomes a report every rank will see."""
        try:
            return {"ok": True, **fn()}
        except Exception as e:
            log.exception("resume: rank %d failed", self.rank)
            return {"ok": False, "error": f"rank {self.rank}: {type(e).__name__}: {e}",
                    "kind": type(e).__name__, "message": str(e)}

    def _agree(self, reports: list[dict], what: str, *, saving: bool = False) -> list[dict]:
        """Raise the same error on every rank if any rank failed."""
        failures = [r for r in reports if not r["ok"]]
        if not failures:
            return reports
        first = failures[0]
        if first["kind"] == "ContinuityError" or len(failures) == len(reports) and all(
                f["message"] == first["message"] for f in failures):
            # The same error everywhere (a continuity or invariant check): raise it as such.
            raise _rebuild_error(first["kind"], first["message"])
        detail = "; ".join(f["error"] for f in failures)
        if saving:
            raise SaveFailedError(f"{self.run.storage.url(what)}: save failed on "
                                  f"{len(failures)} of {len(reports)} ranks, nothing committed: {detail}")
        raise _rebuild_error(first["kind"], f"{what} failed on {len(failures)} of {len(reports)} "
                                            f"ranks: {detail}")

    def _commit(self, step: int, reports: list[dict], expectation: Expectation,
                elapsed_s: float, *, stall_s: float | None = None, state: TrainState | None = None,
                record: dict | None = None) -> None:
        files: dict[str, FileEntry] = {}
        for report in reports:
            for rel, (size, checksum) in report["files"].items():
                files[rel] = FileEntry(size, checksum)
        # An asynchronous save commits while the loop has moved on: the counters
        # are those of the staged state, snapshotted at the save.
        state = state or TrainState.from_dict(self.state.to_dict())
        # The shards' directory entries are durable before the manifest names them
        # (one sync here, not one per rank and file).
        self.run.storage.sync_dir(step_dirname(step))
        if self._lease is not None:
            self._lease.check()  # a job whose lease was taken over must not commit
        faults.point("save.before_manifest")
        manifest = Manifest(step=step, train_state=state,
                            files=files, expectation=expectation.to_dict(),
                            topology=self.adapter.topology(), config=self.config,
                            timing={"save_s": round(elapsed_s, 3),
                                    **({"stall_s": round(stall_s, 3)} if stall_s is not None else {})},
                            adapter=self.adapter.name, **(record or {}))
        self.run.write_manifest(manifest)
        log.info("resume: committed %s (%d files, %d bytes)", step_dirname(step), len(files),
                 manifest.total_bytes)
        try:
            deleted = self.run.apply_retention(self.keep)
        except OSError as e:  # retention must never fail a committed save
            log.warning("resume: retention failed after committing step %d: %s", step, e)
        else:
            if deleted:
                log.info("resume: retention removed %s", ", ".join(map(step_dirname, deleted)))

    # -- plumbing -------------------------------------------------------------------------------

    def _on_rank0(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` on rank 0 only; every rank gets its result or raises its error."""
        outcome: Any = None
        error: BaseException | None = None
        if self.rank == 0:
            try:
                outcome = ("ok", fn())
            except Exception as e:  # noqa: BLE001 - every rank must hear of it, or they hang
                error = e
                outcome = ("error", type(e).__name__, str(e))
        outcome = self.comm.broadcast_object(outcome, src=0)
        if outcome[0] == "ok":
            return outcome[1]
        if error is not None:
            raise error
        raise _rebuild_error(outcome[1], outcome[2])

    def _install_signal_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for signum in (signal.SIGUSR1, signal.SIGTERM):
            self._previous_handlers[signum] = signal.signal(signum, self._on_signal)

    def _on_signal(self, signum: int, frame: Any) -> None:
        # Only a flag: the save happens at the next iteration boundary.
        self._signal = signum


def _refuse_unreadable(result: CheckResult, run: Run) -> None:
    """Storage that refuses a read says nothing about a checkpoint: stop (StorageError) rather
    than pass over a good one or move it aside."""
    if result.unreadable:
        raise StorageError(f"{run.storage.url(run.dirname(result.step))}: expected readable storage, "
                           f"actual {result.reason} (nothing passed over or moved; try again)")


def _rebuild_error(name: str, message: str) -> ResumeError:
    """The error another rank raised, raised here too (same class when it is one of ours)."""
    cls = getattr(_errors, name, None)
    if not (isinstance(cls, type) and issubclass(cls, ResumeError)):
        builtin = getattr(builtins, name, None)
        is_os = isinstance(builtin, type) and issubclass(builtin, OSError)
        cls = StorageError if is_os else ResumeError
    exc = cls.__new__(cls)
    Exception.__init__(exc, message)
    if cls is ContinuityError:  # keep .item for callers; the message already says it all
        exc.item = message.split(": ", 2)[1] if message.count(": ") >= 2 else ""
        exc.expected = exc.actual = None
        exc.hint = ""
    return exc


def _moves_lr(item: str) -> bool:
    """Whether an accepted change can move the LR ahead (the peak, any schedule setting)."""
    return item.startswith("schedule") or item.rsplit(".", 1)[-1] in ("initial_lr", "lr", "base_lrs")


def _as_json(value: Any, name: str) -> Any:
    try:
        return json.loads(json.dumps(value, allow_nan=False))
    except (TypeError, ValueError) as e:
        raise UsageError(f"{name}: expected JSON-serialisable values, actual {e}") from e
