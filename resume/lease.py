"""One writer per run: a lease file with the holder's job id and a heartbeat.

Rank 0 of a writing job holds ``RUN/lease.json`` (job id, host, pid, token, heartbeat,
``ttl_s``) and rewrites it every ``ttl_s / 4`` seconds from a thread. Another job is refused
with :class:`RunBusyError` naming the holder unless the lease is stale: no heartbeat for
``ttl_s``, a holder process on this host that no longer exists, or a lease that would lock the
run out for good (a heartbeat more than ``ttl_s`` ahead, ``ttl_s`` above ``MAX_TTL_S``, a pid
above ``PID_MAX``). A requeued copy of the same job (same job id) takes over its own at once.
The job id is the caller's (the adapter's ``job_id``, else ``RESUME_JOB_ID``, else
``host:pid``): this module reads no cluster's variables. The file is untrusted input, read
capped and never blocking. Invariant: every commit checks first that the lease is still its
own, so of two jobs racing for a stale lease the loser stops with :class:`LeaseLostError`
before it writes a manifest.
"""

from __future__ import annotations

import json
import logging
import math
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from .errors import LeaseLostError, RunBusyError, UsageError
from .storage import SMALL_FILE_CAP, is_damage

__all__ = ["JOB_ID_ENV", "LEASE_NAME", "MAX_TTL_S", "Holder", "Lease", "pid_namespace", "read_holder"]

log = logging.getLogger("resume")

LEASE_NAME = "lease.json"
JOB_ID_ENV = "RESUME_JOB_ID"
"""Set by hand, it names the job for the lease whatever the cluster says."""

MAX_TTL_S = 86400.0
"""The longest lease ttl (one day): a longer one would lock a run for that long after its
holder died. Our own is refused above it; a foreign lease beyond it is stale."""

PID_MAX = 1 << 22
"""Linux's largest possible pid (PID_MAX_LIMIT); a larger one is no process."""


def pid_namespace() -> int | None:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return None


@dataclass
class Holder:
    job_id: str
    host: str
    pid: int
    token: str
    acquired_at: float
    heartbeat_at: float
    ttl_s: float
    pid_namespace: int | None = None
    """The holder's pid namespace (inode of /proc/self/ns/pid): a pid means the same
    process only in the same namespace (containers on one host share its name)."""

    def describe(self, now: float) -> str:
        age = now - self.heartbeat_at
        heartbeat = f"{age:.0f} s ago" if age >= 0 else f"{-age:.0f} s in the future"
        return (f"job {self.job_id} (host {self.host}, pid {self.pid}), heartbeat "
                f"{heartbeat}, stale after {self.ttl_s:g} s")

    def stale_because(self, now: float, *, host: str) -> str | None:
        """Why this lease may be taken over, or None while its holder is alive."""
        if self.ttl_s > MAX_TTL_S:
            return f"ttl {self.ttl_s:g} s, above the longest allowed, {MAX_TTL_S:g} s"
        if now - self.heartbeat_at > self.ttl_s:
            return f"heartbeat {now - self.heartbeat_at:.0f} s old (ttl {self.ttl_s:g} s)"
        if self.heartbeat_at - now > self.ttl_s:
            return (f"heartbeat {self.heartbeat_at - now:.0f} s in the future: the holder's clock is "
                    f"ahead of this host's by more than the ttl ({self.ttl_s:g} s)")
        if self.host == host and self.pid_namespace in (None, pid_namespace()) and not _pid_alive(self.pid):
            return f"process {self.pid} on this host is gone"
        return None


def read_holder(storage: Any) -> Holder | None:
    """The lease's holder; None when there is none.

    A damaged lease file is no lease. Ours are written atomically, so a reader never
    sees a torn one; refusing every job until someone deletes a foreign or damaged
    file would stop the run, and a live holder whose file was damaged finds it is no
    longer its own at its next heartbeat or commit and stops before committing.
    """
    try:
        body = json.loads(storage.read_bytes(LEASE_NAME, limit=SMALL_FILE_CAP))
        holder = Holder(**{k: body[k] for k in Holder.__dataclass_fields__ if k != "pid_namespace"},
                        pid_namespace=body.get("pid_namespace"))
        _check_fields(holder)
    except FileNotFoundError:
        return None
    except (ValueError, TypeError, KeyError, RecursionError, OSError) as e:
        if isinstance(e, OSError) and not is_damage(e):
            raise  # storage trouble, not a damaged lease
        log.warning("resume: %s: unreadable lease, treated as none: %s: %s", storage.url(LEASE_NAME),
                    type(e).__name__, str(e)[:200])
        return None
    return holder


def _check_fields(holder: Holder) -> None:
    """TypeError/ValueError unless every field has a usable value.

    A heartbeat of "soon" would fail later comparisons, one of NaN would never go
    stale, and pid 0 or -1 would ask ``kill`` about a whole process group.
    """
    for name in ("job_id", "host", "token"):
        if not isinstance(getattr(holder, name), str):
            raise TypeError(f"{name}: expected a string, actual {getattr(holder, name)!r}")
    if isinstance(holder.pid, bool) or not isinstance(holder.pid, int) or holder.pid < 1:
        raise ValueError(f"pid: expected a positive integer, actual {holder.pid!r}")
    for name in ("acquired_at", "heartbeat_at", "ttl_s"):
        value = getattr(holder, name)
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            raise ValueError(f"{name}: expected a finite number, actual {value!r}")
    if holder.pid_namespace is not None and (isinstance(holder.pid_namespace, bool)
                                             or not isinstance(holder.pid_namespace, int)):
        raise ValueError(f"pid_namespace: expected an integer, actual {holder.pid_namespace!r}")
    if holder.ttl_s <= 0:
        raise ValueError(f"ttl_s: expected > 0, actual {holder.ttl_s!r}")


def _pid_alive(pid: int) -> bool:
    if not 0 < pid <= PID_MAX:
        return False  # no process has it: "not this process", never an OverflowError from kill
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError, ValueError):
        return False
    except PermissionError:
        return True
    return True


class Lease:
    """Rank 0's hold on a run (acquire, heartbeat, check before a commit, release)."""

    def __init__(self, storage: Any, *, ttl_s: float = 120.0, job_id: str | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        if not 0 < ttl_s <= MAX_TTL_S:  # NaN too
            raise UsageError(f"lease ttl: expected > 0 s and <= {MAX_TTL_S:g} s, actual {ttl_s}")
        self.storage = storage
        self.ttl_s = ttl_s
        self.clock = clock
        self.host = socket.gethostname()
        self.job_id = job_id or os.environ.get(JOB_ID_ENV) or f"{self.host}:{os.getpid()}"
        self.token = uuid.uuid4().hex
        self.lost: str | None = None
        self._acquired_at = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    @property
    def url(self) -> str:
        return self.storage.url(LEASE_NAME)

    def acquire(self) -> None:
        """Take the lease, or raise ``RunBusyError`` naming the live holder."""
        now = self.clock()
        if self.storage.isdir(LEASE_NAME):  # no lease, and none can be written in its place
            raise RunBusyError(f"{self.url}: expected the run's lease file or none, actual a directory: no "
                               f"job can hold this run until it is removed (job {self.job_id} refused; see "
                               "runbooks/two-jobs.md)")
        holder = read_holder(self.storage)
        if holder is not None and holder.token != self.token:
            stale = holder.stale_because(now, host=self.host)
            if holder.job_id == self.job_id:
                log.info("resume: %s: taking over the lease of this job's earlier copy (%s)",
                         self.url, holder.describe(now))
            elif stale:
                # A holder that died (its heartbeat stopped, its process is gone) is the normal
                # case after a crash: one line at INFO. A lease no live holder could have written
                # (a clock far ahead, a ttl beyond the longest, a pid no process has) needs a
                # look: WARNING.
                odd = (holder.ttl_s > MAX_TTL_S or holder.heartbeat_at - now > holder.ttl_s
                       or not 0 < holder.pid <= PID_MAX)
                log.log(logging.WARNING if odd else logging.INFO, "resume: %s: taking over a stale lease: %s (%s)",
                        self.url, holder.describe(now), stale)
            else:
                raise RunBusyError(f"{self.url}: expected no other job writing this run, actual "
                                   f"{holder.describe(now)} (job {self.job_id} refused; see "
                                   "runbooks/two-jobs.md)")
        self._acquired_at = now
        self.lost = None
        self._write(now)
        # Read back: of two jobs that took a stale lease together, the last writer holds it.
        mine = read_holder(self.storage)
        if mine is None or mine.token != self.token:
            other = mine.describe(self.clock()) if mine else "nobody"
            raise RunBusyError(f"{self.url}: expected to hold the lease after writing it, actual {other}")

    @classmethod
    def take(cls, storage: Any, *, ttl_s: float, job_id: str | None = None) -> Lease:
        """Acquire a lease and keep it beating (rank 0 of a writing job). ``job_id``: the
        job's identity kept across its restarts (``Adapter.job_id``); None: see the module."""
        lease = cls(storage, ttl_s=ttl_s, job_id=job_id)
        lease.acquire()
        lease.start_heartbeat()
        return lease

    def start_heartbeat(self) -> None:
        if self._thread is None:
            self._stop.clear()  # a lease released and acquired again beats again
            self._thread = threading.Thread(target=self._beat, name="resume-lease", daemon=True)
            self._thread.start()

    def _beat(self) -> None:
        while not self._stop.wait(self.ttl_s / 4):
            try:
                self.refresh()
            except LeaseLostError as e:
                log.error("resume: %s", e)
                return
            except Exception as e:  # noqa: BLE001 - storage down for a moment: the next beat tries
                # again. A heartbeat thread that died would let the lease go stale under a live job.
                log.warning("resume: %s: heartbeat failed: %s: %s", self.url, type(e).__name__, e)

    def refresh(self) -> None:
        """Rewrite the heartbeat if the lease is still ours; ``LeaseLostError`` if not."""
        with self._lock:
            self.check()
            self._write(self.clock())

    def check(self) -> None:
        """Raise ``LeaseLostError`` unless the lease file is ours (before every commit)."""
        if self.lost is None:
            holder = read_holder(self.storage)
            if holder is None or holder.token != self.token:
                self.lost = holder.describe(self.clock()) if holder else "no readable lease file"
        if self.lost is not None:
            raise LeaseLostError(f"{self.url}: expected this job's lease (job {self.job_id}), actual "
                                 f"{self.lost}: another job took over this run; nothing committed")

    def release(self) -> None:
        """Stop the heartbeat and remove the lease if it is still ours."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        with self._lock:
            holder = read_holder(self.storage)
            if holder is not None and holder.token == self.token:
                self.storage.delete(LEASE_NAME)

    def _write(self, now: float) -> None:
        holder = Holder(job_id=self.job_id, host=self.host, pid=os.getpid(), token=self.token,
                        acquired_at=self._acquired_at, heartbeat_at=now, ttl_s=self.ttl_s,
                        pid_namespace=pid_namespace())
        self.storage.write_bytes_atomic(LEASE_NAME, (json.dumps(asdict(holder)) + "\n").encode())
