"""Save requests from outside the job: small files under the run's ``control/``.

``resume save`` (or the Slurm hook) writes ``control/save-<id>.request``;
rank 0 of the running job polls at iteration boundaries, the ranks agree, save,
and rank 0 answers with ``control/save-<id>.result`` (JSON: the request id, and
the committed step or the error) and removes the request.

Anyone who can write the run can write ``control/``, so both kinds of file are
data, never trust (DESIGN.md, Security). They are read through
``Storage.read_bytes`` (regular files only, no symbolic link, never blocking on a
FIFO, at most ``SMALL_FILE_CAP`` bytes) and checked against a schema: ``stop`` is a
JSON boolean, strings are short, no unknown field. A request whose name or body
fails is ignored with one warning for as long as it stays there, and never keeps
the real requests beside it from being served. An answer counts only when it names
the request's id and, for ``resume save``, a step that is committed; any other is
ignored with a warning, and the asker waits on until its timeout.
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .errors import BadControlFile, SaveFailedError, SaveTimeoutError
from .run import CONTROL, CheckResult, Run, utc_now
from .storage import SMALL_FILE_CAP, is_damage, join

if TYPE_CHECKING:
    from .comm import Comm

__all__ = ["ControlArea", "SaveRequest", "SignalFlag", "answer_request", "pending_requests",
           "poll_everywhere", "post_save_request", "wait_for_answer"]

log = logging.getLogger("resume")

REQUEST_SUFFIX = ".request"
RESULT_SUFFIX = ".result"

_REQUEST_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,99}")
"""A request id (the file name less its suffix): what ``post_save_request`` makes, and
nothing that could name another path."""

TEXT_MAX = 200
"""The longest string field of a request (reason, host, time)."""

ERROR_MAX = 2000
"""The longest error an answer carries (the job's message is cut there)."""

_REQUEST_FIELDS: dict[str, tuple[type, ...]] = {
    "requested_at": (str,), "stop": (bool,), "reason": (str,), "host": (str,), "pid": (int,)}
_ANSWER_FIELDS: dict[str, tuple[type, ...]] = {
    "request_id": (str,), "answered_at": (str,), "step": (int, type(None)), "error": (str, type(None))}


@dataclass(frozen=True)
class SaveRequest:
    request_id: str
    stop: bool = False
    reason: str = ""


def is_request_id(text: str) -> bool:
    return _REQUEST_ID.fullmatch(text) is not None


def post_save_request(run: Run, *, stop: bool = False, reason: str = "resume save") -> SaveRequest:
    request = SaveRequest(request_id=f"save-{int(time.time())}-{uuid.uuid4().hex[:8]}", stop=stop,
                          reason=reason[:TEXT_MAX])
    body = {"requested_at": utc_now(), "stop": stop, "reason": request.reason,
            "host": os.uname().nodename[:TEXT_MAX], "pid": os.getpid()}
    run.storage.write_bytes_atomic(join(CONTROL, request.request_id + REQUEST_SUFFIX),
                                   json.dumps(body).encode())
    return request


# -- reading a control file: capped, never blocking, checked against a schema -------------


def _read_object(run: Run, path: str, fields: dict[str, tuple[type, ...]], text_max: int) -> dict:
    """The JSON object in the control file ``path``, its fields checked. FileNotFoundError when
    it is not there; BadControlFile (naming the file) when it is not a small regular file
    holding such an object."""
    source = run.storage.url(path)
    try:
        data = run.storage.read_bytes(path, limit=SMALL_FILE_CAP)
    except FileNotFoundError:
        raise
    except OSError as e:
        if not is_damage(e):
            raise  # storage trouble (EIO, access, an outage): the file may be fine
        raise BadControlFile(str(e) if source in str(e) else f"{source}: {type(e).__name__}: {e}") from e
    try:
        body = json.loads(data)
    except (ValueError, RecursionError) as e:  # not UTF-8, not JSON, nested too deep
        raise BadControlFile(f"{source}: expected JSON, actual {type(e).__name__}") from e
    if not isinstance(body, dict):
        raise BadControlFile(f"{source}: expected a JSON object, actual {type(body).__name__}")
    _check_fields(source, body, fields, text_max)
    return body


def _check_fields(source: str, body: dict, fields: dict[str, tuple[type, ...]], text_max: int) -> None:
    """BadControlFile naming the first unknown or mistyped field (a bool is no int here)."""
    for name, value in body.items():
        types = fields.get(name)
        if types is None:
            raise BadControlFile(f"{source}: field {name[:40]!r}: expected one of {sorted(fields)}, "
                                 "actual unknown")
        if isinstance(value, bool) and bool not in types or not isinstance(value, types):
            expected = " or ".join("null" if t is type(None) else t.__name__ for t in types)
            raise BadControlFile(f"{source}: {name}: expected {expected}, actual {type(value).__name__}")
        if isinstance(value, str) and len(value) > text_max:
            raise BadControlFile(f"{source}: {name}: expected at most {text_max} characters, "
                                 f"actual {len(value)}")


def read_request(run: Run, name: str) -> SaveRequest:
    """The request in ``control/NAME``; BadControlFile when its name or body is not one."""
    request_id = name.removesuffix(REQUEST_SUFFIX)
    if not name.endswith(REQUEST_SUFFIX) or not is_request_id(request_id):
        raise BadControlFile(f"{run.storage.url(CONTROL)}: {name[:120]!a}: name: expected <id>"
                             f"{REQUEST_SUFFIX}, the id of at most 100 letters, digits, '-' or '_'")
    body = _read_object(run, join(CONTROL, name), _REQUEST_FIELDS, TEXT_MAX)
    return SaveRequest(request_id, body.get("stop", False), body.get("reason", ""))


def pending_requests(run: Run) -> list[SaveRequest]:
    """Requests not answered yet; a bad request file is skipped with a warning."""
    return ControlArea(run, poll_s=0.0).pending()


def answer_request(run: Run, request: SaveRequest, *, step: int | None, error: str | None = None) -> None:
    body = {"request_id": request.request_id, "answered_at": utc_now(), "step": step,
            "error": None if error is None else error[:ERROR_MAX]}
    run.storage.write_bytes_atomic(join(CONTROL, request.request_id + RESULT_SUFFIX),
                                   json.dumps(body).encode())
    run.storage.delete(join(CONTROL, request.request_id + REQUEST_SUFFIX))


class ControlArea:
    """A running job's side of ``control/`` (rank 0 only): polled at most every ``poll_s`` at
    iteration boundaries, answered after the save. Neither call ever stops or blocks training:
    a broken control area is logged, and an asker that gets no answer times out.

    A bad request file is warned about once and then skipped while it stays (its name is
    remembered), so a poll costs one listing and one capped read per new file."""

    def __init__(self, run: Run, *, poll_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.run = run
        self.poll_s = poll_s
        self.clock = clock
        self._last_poll = float("-inf")
        self._ignored: set[str] = set()
        """Request files found bad, skipped while they are there."""
        self._warned: set[str] = set()
        """Request files already warned about: one warning each, not one per poll."""
        self._area_problem: str | None = None

    def poll(self) -> list[SaveRequest]:
        """The pending requests, when a poll is due; else none."""
        if self.clock() - self._last_poll < self.poll_s:
            return []
        self._last_poll = self.clock()
        try:
            return self.pending()
        except Exception as e:  # noqa: BLE001 - a broken control area must not stop training
            if str(e) != self._area_problem:  # once per problem, not once per poll
                self._area_problem = str(e)
                log.warning("resume: cannot read save requests under %s: %s", self.run.url, e)
            return []

    def pending(self) -> list[SaveRequest]:
        """Every request not answered yet, bad files left out (warned about once)."""
        try:
            names = [n for n in self.run.storage.listdir(CONTROL) if n.endswith(REQUEST_SUFFIX)]
        except FileNotFoundError:
            return []
        self._ignored.intersection_update(names)  # a bad file removed, and its name free again
        self._warned.intersection_update(names)
        self._area_problem = None
        requests = []
        for name in names:
            if name in self._ignored:
                continue
            try:
                requests.append(read_request(self.run, name))
            except FileNotFoundError:
                continue  # withdrawn meanwhile
            except BadControlFile as e:
                self._ignored.add(name)
                self._warn_once(name, "resume: save request ignored: %s", e)
            except OSError as e:  # storage trouble: look again at the next poll
                self._warn_once(name, "resume: %s: cannot read save request: %s", self._url(name), e)
        return requests

    def answer(self, requests: list[SaveRequest], *, step: int | None, error: str | None = None) -> None:
        for request in requests:
            try:
                answer_request(self.run, request, step=step, error=error)
            except Exception as e:  # noqa: BLE001 - the save is done; the asker will time out
                log.warning("resume: cannot answer save request %s: %s", request.request_id, e)

    def _url(self, name: str) -> str:
        return self.run.storage.url(join(CONTROL, name))

    def _warn_once(self, key: str, message: str, *args: Any) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning(message, *args)


def poll_everywhere(control: ControlArea, comm: Comm,
                    flags: Sequence[bool] = ()) -> tuple[list[SaveRequest], list[int]]:
    """Collective: rank 0 polls ``control``; one all-reduce (max) carries ``flags`` and whether
    there are requests, which travel only when there are some. Returns the requests (alike on
    every rank) and the flags maxed over the ranks."""
    requests = control.poll() if comm.rank == 0 else []
    *maxed, has_requests = comm.max_flags([*flags, bool(requests)])
    if has_requests:
        requests = comm.broadcast_object(requests, src=0)
    return requests, maxed


class SignalFlag:
    """SIGUSR1 (time limit ahead) and SIGTERM (preemption) only set a flag: the save and the
    stop happen at the next iteration boundary, agreed on by every rank."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # Python delivers signals to the main thread only
        for signum in (signal.SIGUSR1, signal.SIGTERM):
            self._previous[signum] = signal.signal(signum, self._on_signal)

    def uninstall(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()

    def _on_signal(self, signum: int, frame: Any) -> None:
        self.signum = signum


# -- the asker's side -------------------------------------------------------------------------


def withdraw_request(run: Run, request: SaveRequest) -> None:
    """Take back a request nobody answered (the job may see it later and act on it)."""
    run.storage.delete(join(CONTROL, request.request_id + REQUEST_SUFFIX))


def wait_for_answer(run: Run, request: SaveRequest, *, timeout: float, poll: float = 0.5,
                    clock: Callable[[], float] = time.monotonic,
                    sleep: Callable[[float], None] = time.sleep,
                    on_wait: Callable[[float], None] | None = None,
                    check: Callable[[int], CheckResult] | None = None) -> int:
    """Block until the job answers; the committed step. Withdraws the request on timeout.

    ``check``: the commit check of the step an answer names (``Run.check``); an answer whose
    step fails it is not taken. An answer that is not this request's (another id, a bad
    body, a special file) is ignored with one warning, and the wait goes on: the real one
    replaces it, or the timeout ends the wait."""
    deadline = clock() + timeout
    ignored: str | None = None
    while True:
        step, problem = _take_answer(run, request, check)
        if step is not None:
            return step
        if problem is not None and problem != ignored:
            log.warning("resume: answer ignored: %s", problem)
            ignored = problem
        remaining = deadline - clock()
        if remaining <= 0:
            withdraw_request(run, request)
            raise SaveTimeoutError(f"{run.url}: expected a checkpoint committed within {timeout:g}s "
                                   "of the save request, actual none (is the job running?)"
                                   + (f"; an answer was ignored: {ignored}" if ignored else ""))
        if on_wait is not None:
            on_wait(remaining)
        sleep(min(poll, remaining))


def _take_answer(run: Run, request: SaveRequest,
                 check: Callable[[int], CheckResult] | None) -> tuple[int | None, str | None]:
    """(the committed step, None) for this request's answer, which is then removed; (None, why)
    for an answer not taken; (None, None) while there is none. SaveFailedError for the job's error."""
    path = join(CONTROL, request.request_id + RESULT_SUFFIX)
    source = run.storage.url(path)
    try:
        body = _read_object(run, path, _ANSWER_FIELDS, ERROR_MAX)
    except FileNotFoundError:
        return None, None
    except BadControlFile as e:
        return None, str(e)
    except OSError as e:  # storage trouble: look again at the next poll
        return None, f"{source}: {type(e).__name__}: {e}"
    if body.get("request_id") != request.request_id:
        return None, f"{source}: request_id: expected {request.request_id}, actual another or none"
    step, error = body.get("step"), body.get("error")
    if error is not None:
        run.storage.delete(path)
        raise SaveFailedError(f"{source}: error: expected none, actual {' '.join(error.split())}")
    if step is None or not 0 <= step < 1 << 63:
        return None, f"{source}: step: expected a step number >= 0 (or an error), actual {str(step)[:40]}"
    problem = _commit_problem(step, check)
    if problem is not None:
        return None, f"{source}: step {step}: expected a committed checkpoint, actual {problem}"
    run.storage.delete(path)
    return step, None


def _commit_problem(step: int, check: Callable[[int], CheckResult] | None) -> str | None:
    if check is None:
        return None
    try:
        result = check(step)
    except (OSError, ValueError) as e:  # the run unreadable for now: not taken yet
        return f"{type(e).__name__}: {e}"
    return None if result.committed else result.reason
