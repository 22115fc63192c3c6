"""Save requests from outside the job: small files under the run's ``control/``.

``resume save`` (or the Slurm hook) writes ``control/save-<id>.request``;
rank 0 of the running job polls at iteration boundaries, the ranks agree, save,
and rank 0 answers with ``control/save-<id>.result`` (JSON: step or error) and
removes the request.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .errors import SaveFailedError, SaveTimeoutError
from .run import CONTROL, Run, utc_now
from .storage import join

__all__ = ["ControlArea", "SaveRequest", "SignalFlag", "answer_request", "pending_requests", "post_save_request",
           "wait_for_answer"]

log = logging.getLogger("resume")

REQUEST_SUFFIX = ".request"
RESULT_SUFFIX = ".result"


@dataclass(frozen=True)
class SaveRequest:
    request_id: str
    stop: bool = False
    reason: str = ""


def post_save_request(run: Run, *, stop: bool = False, reason: str = "resume save") -> SaveRequest:
    request = SaveRequest(request_id=f"save-{int(time.time())}-{uuid.uuid4().hex[:8]}", stop=stop,
                          reason=reason)
    body = {"requested_at": utc_now(), "stop": stop, "reason": reason, "host": os.uname().nodename,
            "pid": os.getpid()}
    run.storage.write_bytes_atomic(join(CONTROL, request.request_id + REQUEST_SUFFIX),
                                   json.dumps(body).encode())
    return request


def pending_requests(run: Run) -> list[SaveRequest]:
    """Requests not answered yet (rank 0 only)."""
    try:
        names = run.storage.listdir(CONTROL)
    except FileNotFoundError:
        return []
    requests = []
    for name in names:
        if not name.endswith(REQUEST_SUFFIX):
            continue
        request_id = name[: -len(REQUEST_SUFFIX)]
        try:
            body = json.loads(run.storage.read_bytes(join(CONTROL, name)))
            if not isinstance(body, dict):
                continue
        except (OSError, ValueError):
            continue  # withdrawn, being written, or not a file: look again at the next boundary
        requests.append(SaveRequest(request_id, bool(body.get("stop", False)), str(body.get("reason", ""))))
    return requests


def answer_request(run: Run, request: SaveRequest, *, step: int | None, error: str | None = None) -> None:
    body = {"answered_at": utc_now(), "step": step, "error": error}
    run.storage.write_bytes_atomic(join(CONTROL, request.request_id + RESULT_SUFFIX),
                                   json.dumps(body).encode())
    run.storage.delete(join(CONTROL, request.request_id + REQUEST_SUFFIX))


class ControlArea:
    """A running job's side of ``control/`` (rank 0 only): polled at most every ``poll_s`` at
    iteration boundaries, answered after the save. Neither call ever stops training: a
    broken control area is logged, and an asker that gets no answer times out."""

    def __init__(self, run: Run, *, poll_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.run = run
        self.poll_s = poll_s
        self.clock = clock
        self._last_poll = float("-inf")

    def poll(self) -> list[SaveRequest]:
        """The pending requests, when a poll is due; else none."""
        if self.clock() - self._last_poll < self.poll_s:
            return []
        self._last_poll = self.clock()
        try:
            return pending_requests(self.run)
        except Exception as e:  # noqa: BLE001 - a broken control area must not stop training
            log.warning("resume: cannot read save requests under %s: %s", self.run.url, e)
            return []

    def answer(self, requests: list[SaveRequest], *, step: int | None, error: str | None = None) -> None:
        for request in requests:
            try:
                answer_request(self.run, request, step=step, error=error)
            except Exception as e:  # noqa: BLE001 - the save is done; the asker will time out
                log.warning("resume: cannot answer save request %s: %s", request.request_id, e)


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


def withdraw_request(run: Run, request: SaveRequest) -> None:
    """Take back a request nobody answered (the job may see it later and act on it)."""
    run.storage.delete(join(CONTROL, request.request_id + REQUEST_SUFFIX))


def wait_for_answer(run: Run, request: SaveRequest, *, timeout: float, poll: float = 0.5,
                    clock: Callable[[], float] = time.monotonic,
                    sleep: Callable[[float], None] = time.sleep,
                    on_wait: Callable[[float], None] | None = None) -> int:
    """Block until the job answers; the committed step. Withdraws the request on timeout."""
    deadline = clock() + timeout
    result_path = join(CONTROL, request.request_id + RESULT_SUFFIX)
    while True:
        try:
            body = json.loads(run.storage.read_bytes(result_path))
        except FileNotFoundError:
            body = None
        if body is not None:
            run.storage.delete(result_path)
            if body.get("error"):
                raise SaveFailedError(f"{run.storage.url(result_path)}: error: expected none, "
                                      f"actual {body['error']}")
            return int(body["step"])
        remaining = deadline - clock()
        if remaining <= 0:
            withdraw_request(run, request)
            raise SaveTimeoutError(f"{run.url}: expected a checkpoint committed within {timeout:g}s "
                                   "of the save request, actual none (is the job running?)")
        if on_wait is not None:
            on_wait(remaining)
        sleep(min(poll, remaining))
