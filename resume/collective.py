"""Rank agreement, written once: run on rank 0 or on every rank, raise the same error everywhere.

Every collective phase of a save or a restore has one shape: a local step that must not leave
the other ranks waiting when it fails, then one small exchange after which every rank knows every
outcome. Errors travel as records (class name and fields, ``ResumeError.fields()``), never as
message strings to be parsed, and are built again on each rank::

    coll = Collective(comm)
    names = coll.on_rank0(run.step_dirs)                        # rank 0 reads, all get it
    files = coll.gather(write_my_shards, "save of step-…")      # all ranks; rank 0 receives, all agree
"""

from __future__ import annotations

import builtins
import contextlib
import gc
import logging
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from . import errors as _errors
from .comm import Comm
from .errors import ContinuityError, ResumeError, SaveFailedError, StorageError

__all__ = ["Collective", "Failure", "concat", "rebuild"]

log = logging.getLogger("resume")


@dataclass(frozen=True, slots=True)
class Failure:
    """One rank's error, as it travels between ranks."""

    rank: int
    kind: str
    """The class name: one of ``resume.errors``, else a builtin's (``OSError``, ``ValueError``)."""
    fields: dict
    """``ResumeError.fields()`` for ours, ``{"message": str(e)}`` for any other."""

    @classmethod
    def of(cls, error: BaseException, rank: int) -> Failure:
        fields = error.fields() if isinstance(error, ResumeError) else {"message": str(error)}
        return cls(rank, type(error).__name__, fields)

    @property
    def message(self) -> str:
        return str(self.fields.get("message") or rebuild(self))

    def describe(self) -> str:
        return f"rank {self.rank}: {self.kind}: {self.message}"


def error_class(kind: str) -> type[ResumeError]:
    """Our class of that name; StorageError for an OSError of the standard library; else ResumeError."""
    cls = getattr(_errors, kind, None)
    if isinstance(cls, type) and issubclass(cls, ResumeError):
        return cls
    builtin = getattr(builtins, kind, None)
    return StorageError if isinstance(builtin, type) and issubclass(builtin, OSError) else ResumeError


def rebuild(failure: Failure) -> ResumeError:
    """The error another rank raised, raised here too: the same class and fields when it is
    ours; else the nearest class of ours, with the message and the fields every error has."""
    return error_class(failure.kind).from_fields(failure.fields)


_pause_lock = threading.Lock()
_pauses = 0
_resume_collector = False


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector held off for rank 0's part of a save (receiving every rank's
    part, assembling them, the manifest, retention): that work makes objects in proportion to the
    ranks, nearly all dying with the save, which would otherwise set off full collections of the
    whole process. Cycles made inside are collected after. Nested and threads: the outermost pause
    turns it back on, and only if it was on before."""
    global _pauses, _resume_collector
    with _pause_lock:
        if _pauses == 0:
            _resume_collector = gc.isenabled()
            gc.disable()
        _pauses += 1
    try:
        yield
    finally:
        with _pause_lock:
            _pauses -= 1
            if _pauses == 0 and _resume_collector:
                gc.enable()


class Collective:
    """The two shapes of rank agreement over one ``Comm``."""

    def __init__(self, comm: Comm) -> None:
        self.comm = comm
        self.rank = comm.rank
        self.world_size = comm.world_size

    def on_rank0(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` on rank 0 only; every rank returns its value or raises its error
        (rank 0 its own, with its traceback; the others one built from the record)."""
        outcome: tuple = ("ok", None)
        error: BaseException | None = None
        if self.rank == 0:
            try:
                outcome = ("ok", fn())
            except Exception as e:  # noqa: BLE001 - every rank must hear of it, or they hang
                error, outcome = e, ("error", Failure.of(e, 0))
        outcome = self.comm.broadcast_object(outcome, src=0)
        if outcome[0] == "ok":
            return outcome[1]
        if error is not None:
            raise error
        raise rebuild(outcome[1])

    def scatter(self, fn: Callable[[], list[Any]], what: str, *, saving: bool = False) -> Any:
        """Run ``fn`` on rank 0 only: a list with one value per rank; each rank returns its own
        (O(1) per rank, where ``on_rank0`` would send the whole list to every rank). An error in
        ``fn`` is raised on every rank alike."""
        shares: list[Any] | None = None
        error: BaseException | None = None
        if self.rank == 0:
            try:
                values = fn()
                if len(values) != self.world_size:
                    raise ValueError(f"{what}: expected one value per rank ({self.world_size}), "
                                     f"actual {len(values)}")
                shares = [("ok", v) for v in values]
            except Exception as e:  # noqa: BLE001 - every rank must hear of it, or they hang
                error = e
                shares = [("failed", [Failure.of(e, 0)], self.world_size)] * self.world_size
        scatter = getattr(self.comm, "scatter_object", None)
        if scatter is not None:
            mine = scatter(shares, src=0)
        else:  # a Comm of a program's own without scatter: the whole list, each takes its own
            mine = self.comm.broadcast_object(shares, src=0)[self.rank]
        if mine[0] == "ok":
            return mine[1]
        raise agreed_error(mine[1], mine[2], what, saving=saving) from error

    def each(self, fn: Callable[[], Any], what: str, *, saving: bool = False) -> list[Any]:
        """Run the local step ``fn`` on every rank (no collectives inside), then agree: every
        rank gets every rank's value, or every rank raises the same error (``agreed_error``).
        Every rank receives every rank's value: use ``gather`` where only rank 0 needs them."""
        local, report = self._run_local(fn)
        reports = self.comm.all_gather_object(report)
        failures = [r[1] for r in reports if r[0] != "ok"]
        if not failures:
            return [r[1] for r in reports]
        raise agreed_error(failures, len(reports), what, saving=saving) from local

    def gather(self, fn: Callable[[], Any], what: str, *, saving: bool = False,
               combine: Callable[[list[Any]], Any] | None = None, everywhere: bool = False) -> Any:
        """Run the local step ``fn`` on every rank, then agree as ``each`` does, but only rank 0
        receives the values: each rank sends its own (O(1) per rank), and what comes back to
        every rank is one small broadcast (ok, or the failures). Rank 0 returns
        ``combine(values)`` (the list itself without ``combine``); the others None, or the same
        result with ``everywhere`` (it rides on that broadcast: keep it small). An error in
        ``combine`` is rank 0's failure, raised on every rank alike."""
        local, report = self._run_local(fn)
        return self._agree_on_rank0(report, local, what, saving=saving, combine=combine, everywhere=everywhere)

    def agree(self, fn: Callable[[], Any], what: str, *, saving: bool = False) -> Any:
        """Run the local step ``fn`` on every rank and agree on the outcome only: each rank
        keeps its own value (returned), nothing of it is sent; a failure anywhere is raised on
        every rank alike."""
        local, report = self._run_local(fn)
        self._agree_on_rank0(("ok", None) if report[0] == "ok" else report, local, what, saving=saving)
        return report[1]

    def _agree_on_rank0(self, report: tuple, local: BaseException | None, what: str, *, saving: bool,
                        combine: Callable[[list[Any]], Any] | None = None, everywhere: bool = False) -> Any:
        with collector_paused() if self.rank == 0 else contextlib.nullcontext():
            return self._gathered(report, local, what, saving=saving, combine=combine, everywhere=everywhere)

    def _gathered(self, report: tuple, local: BaseException | None, what: str, *, saving: bool,
                  combine: Callable[[list[Any]], Any] | None, everywhere: bool) -> Any:
        reports = self.comm.gather_object(report, dst=0)
        result, verdict = None, None
        if self.rank == 0:
            assert reports is not None
            failures = [r[1] for r in reports if r[0] != "ok"]
            verdict = ("failed", failures, len(reports)) if failures else ("ok", None)
            if not failures:
                try:
                    values = [r[1] for r in reports]
                    result = combine(values) if combine is not None else values
                    verdict = ("ok", result if everywhere else None)
                except Exception as e:  # noqa: BLE001 - every rank must hear of it, or they hang
                    local, verdict = e, ("failed", [Failure.of(e, 0)], len(reports))
        verdict = self.comm.broadcast_object(verdict, src=0)
        if verdict[0] == "ok":
            return result if self.rank == 0 else verdict[1]
        raise agreed_error(verdict[1], verdict[2], what, saving=saving) from local

    def _run_local(self, fn: Callable[[], Any]) -> tuple[BaseException | None, tuple]:
        try:
            return None, ("ok", fn())
        except Exception as e:  # raised on every rank by the caller
            if isinstance(e, ResumeError):  # a refusal of ours says it all in one line
                log.error("resume: rank %d: %s", self.rank, e)
            else:
                log.exception("resume: rank %d failed", self.rank)
            return e, ("error", Failure.of(e, self.rank))


def concat(lists: list[list[Any]]) -> list[Any]:
    """Every rank's list, one after the other (a ``combine`` for ``gather``)."""
    return [item for items in lists for item in items]


def agreed_error(failures: list[Failure], ranks: int, what: str, *, saving: bool = False) -> ResumeError:
    """The one error every rank raises when ``failures`` happened on some of ``ranks``.

    A continuity error, or the same error of ours on every rank (an invariant every rank
    checks), stays what it is. The same foreign error on every rank (a framework's
    ``AttributeError`` in a save) keeps its class name in the message, with ``what`` (the
    phase and step) and the ranks; it is a ``ResumeError`` (a ``StorageError`` for an
    ``OSError``), never a save failure a policy would retry. A failure on some ranks only:
    a save is a SaveFailedError naming each failed rank (nothing was committed); anything
    else keeps the first failure's class. The raising rank chains its own exception.
    """
    first = failures[0]
    same_everywhere = len(failures) == ranks and all(
        f.fields == first.fields and f.kind == first.kind for f in failures)
    if first.kind == ContinuityError.__name__ or (same_everywhere and error_class(first.kind).__name__ == first.kind):
        return rebuild(first)
    if same_everywhere:
        where = f"on every rank ({ranks})" if ranks > 1 else f"on rank {first.rank}"
        return error_class(first.kind)(f"{what}: {'save ' if saving else ''}failed {where}: "
                                       f"{first.kind}: {first.message}")
    detail = "; ".join(f.describe() for f in failures)
    if saving:
        return SaveFailedError(f"{what}: save failed on {len(failures)} of {ranks} ranks, nothing "
                               f"committed: {detail}")
    return error_class(first.kind)(f"{what} failed on {len(failures)} of {ranks} ranks: {detail}")
