"""Hang detection inside each rank: what the rank is doing (its phase), since when it last made
progress, and the bound past which it counts as hung.

Every process that imports ``resume`` under the Slurm hook (``RESUME_HANG`` set) is watched from
its start; a ``Coordinator`` (or the Megatron integration) takes the same watchdog over. Phases:

- ``start-up``: process start until ``restore()``; ``restore``: the restore;
- ``iteration``: between two ``update()`` calls; ``save``: a blocking save or the wait for one;
- ``save-background``: the write and commit of an asynchronous save (its own clock);
- ``declared``: ``expect(seconds, what)``, the program saying the next N seconds are expected;
- ``closed``: after ``close()``, nothing is watched.

The bound of a phase is ``max(floor_s, factor × the slowest measured)`` of its kind (iterations,
saves, background saves of this process; the restored manifest's save time), ``first_s`` before
anything is measured, and the hook's measured start-up for ``start-up`` and ``restore``.

What it writes (every file under the run, each bounded): past a bound, each rank writes its
report once, ``RUN/cluster/hangs/launch-<L>/rank-<R>.txt`` (a JSON line with where it was,
then the stack of every thread); a rank quiet for half its bound also answers the hook's
request file (``…/launch-<L>/dump``) with its report. Rank 0 writes ``RUN/cluster/progress.json``
(its phases and bounds) at most every ``beat_s`` when something changed: the hook reads it.
Nothing else is written while the run is healthy; ``progress()`` costs a clock read and a few
stores. A rank whose Python threads cannot run (a native call holding the GIL) writes no report;
under the hook faulthandler's own thread then prints its stacks to stderr (the job's output).
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import linecache
import logging
import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, replace
from typing import Any, NamedTuple

from .errors import UsageError
from .text import clip

__all__ = [
    "FIRST_BOUND_S",
    "HANGS",
    "HANG_ENV",
    "HANG_FACTOR",
    "HANG_FLOOR_S",
    "LAUNCH_ENV",
    "NODE_ENV",
    "NOT_WAITING_IN",
    "PROGRESS",
    "REPORT_CAP",
    "RUN_ENV",
    "TASK_PID_ENV",
    "WAITING_IN",
    "Declared",
    "HangBounds",
    "Phase",
    "Progress",
    "Watchdog",
    "expect",
    "process_watchdog",
    "report_path",
    "seconds_or_none",
    "watch_from_start",
]

log = logging.getLogger("resume")

HANG_FLOOR_S = 300.0
"""No phase's bound is below this (seconds): a slow collective or a storage hiccup is no hang."""
HANG_FACTOR = 5.0
"""A phase's bound is this many times the slowest of its kind measured so far."""
FIRST_BOUND_S = 1800.0
"""The bound of a phase nothing has measured yet (start-up, the first restore, save, iteration)."""
TICK_S = 1.0
"""How often the watchdog thread looks."""
BEAT_S = 5.0
"""Rank 0 writes its progress at most this often (only when it changed)."""
HANG_ENV = "RESUME_HANG"
"""``floor=S,factor=F,first=S,startup=S,beat=S,tick=S`` or ``off``: the hook's settings for the ranks."""
RUN_ENV = "RESUME_HANG_RUN"
"""The run whose ``cluster/`` area receives the reports (set by the hook)."""
LAUNCH_ENV = "RESUME_LAUNCH"
TASK_PID_ENV = "RESUME_TASK_PID"
"""The pid of the task srun started (``cluster/task.py``): only it is watched from its start."""
NODE_ENV = "RESUME_NODE"
PROGRESS = "cluster/progress.json"
HANGS = "cluster/hangs"
REPORT_CAP = 1 << 20
"""Bytes of one rank's report: the stacks beyond it are cut."""
WAITING_IN = ("torch/distributed/", "torch/autograd/", "megatron/core/distributed/",
              "megatron/core/pipeline_parallel/p2p_communication.py")
"""Where a thread waits for its peers (its innermost Python frame): a collective, a rendezvous, a
backward that DDP's reducer holds; a rank whose thread is elsewhere was not waiting for the others."""
NOT_WAITING_IN = ("torch/distributed/checkpoint/filesystem.py", "torch/distributed/checkpoint/_fsspec_filesystem.py")
"""torch.distributed's own storage I/O: a thread there waits for the storage, not for its peers."""


def seconds_or_none(value: Any) -> float | None:
    """A measured duration read from a file (untrusted): a finite number >= 0, else None."""
    if isinstance(value, int | float) and not isinstance(value, bool) and 0 <= value < 1e9:
        return float(value)
    return None


def report_path(launch: int, rank: int) -> str:
    return f"{HANGS}/launch-{launch}/rank-{rank}.txt"


@dataclass(frozen=True, kw_only=True)
class HangBounds:
    """How long each phase may make no progress. ``Coordinator(hang=HangBounds(...))`` or the
    hook's ``--hang-floor``/``--hang-factor``/``--hang-first`` (``RESUME_HANG``)."""

    floor_s: float = HANG_FLOOR_S
    """No bound below this."""
    factor: float = HANG_FACTOR
    """Bound = factor × the slowest measured of the phase's kind."""
    first_s: float = FIRST_BOUND_S
    """The bound before anything of that kind was measured."""
    startup_s: float | None = None
    """The start-up and restore bound (the hook's, from earlier launches); None: ``first_s``."""
    beat_s: float = BEAT_S
    tick_s: float = TICK_S
    enabled: bool = True

    def __post_init__(self) -> None:
        for name in ("floor_s", "factor", "first_s", "beat_s", "tick_s"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or isinstance(value, bool) or not value > 0:
                raise UsageError(f"hang bounds: {name}: expected a number > 0, actual {value!r}")
        if self.factor < 1:
            raise UsageError(f"hang bounds: factor: expected >= 1, actual {self.factor}")
        s = self.startup_s
        if s is not None and (not isinstance(s, int | float) or isinstance(s, bool) or not s > 0):
            raise UsageError(f"hang bounds: startup_s: expected > 0 or None, actual {self.startup_s!r}")

    def bound(self, measured: float | None) -> float:
        """The bound of a phase whose slowest measured instance took ``measured`` seconds."""
        if measured is None:
            return max(self.floor_s, self.first_s)
        return max(self.floor_s, self.factor * measured)

    def startup(self) -> float:
        return max(self.floor_s, self.startup_s if self.startup_s is not None else self.first_s)

    def to_env(self) -> str:
        if not self.enabled:
            return "off"
        parts = {"floor": self.floor_s, "factor": self.factor, "first": self.first_s,
                 "beat": self.beat_s, "tick": self.tick_s}
        if self.startup_s is not None:
            parts["startup"] = self.startup_s
        return ",".join(f"{k}={float(v)!r}" for k, v in parts.items())

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> HangBounds:
        """The hook's settings (``RESUME_HANG``), or the defaults; a bad value is a UsageError."""
        text = env.get(HANG_ENV, "").strip()
        if not text:
            return cls()
        if text == "off":
            return cls(enabled=False)
        names = {"floor": "floor_s", "factor": "factor", "first": "first_s", "startup": "startup_s",
                 "beat": "beat_s", "tick": "tick_s"}
        fields: dict[str, float] = {}
        for item in text.split(","):
            key, _, value = item.partition("=")
            if key.strip() not in names:
                raise UsageError(f"{HANG_ENV}: expected names among {sorted(names)}, actual {clip(key)!r}")
            try:
                fields[names[key.strip()]] = float(value)
            except ValueError:
                raise UsageError(f"{HANG_ENV}: {key}: expected a number, actual {clip(value)!r}") from None
        return cls(**fields)  # type: ignore[arg-type]

    def merged(self, **overrides: Any) -> HangBounds:
        """These bounds with the fields given (not None) replaced."""
        return replace(self, **{k: v for k, v in overrides.items() if v is not None})


class Phase(NamedTuple):
    """What a rank is doing: one value, replaced whole (the watchdog thread reads it untorn)."""

    name: str
    what: str
    bound: float | None
    """A declared phase's bound (``expect``); None: derived."""
    since: float
    """When it began or last progressed (the clock's seconds)."""


class Progress:
    """What one rank is doing: written by the loop (cheap stores), read by the watchdog thread.

    ``now`` is replaced whole at every change, so a reader never sees one phase's name with
    another's start; ``seq`` changes at every progress.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.now = Phase("start-up", "", None, clock())
        self.seq = 0
        self.iteration: int | None = None
        self.background_since: float | None = None
        self.times: list[float] = []
        """This rank's own time of each iteration since the last save (its straggler figures): from
        the last boundary's agreement to its arrival at this boundary, without its wait there."""
        self.slowest: dict[str, float] = {}
        """The slowest measured of each kind: iteration, save, save-background, restore."""
        self._last_update: float | None = None
        self._last_synced: float | None = None

    @property
    def phase(self) -> str:
        return self.now.name

    @property
    def since(self) -> float:
        return self.now.since

    def progress(self, iteration: int) -> None:
        """One iteration ended: this rank arrived at the boundary (``update()``)."""
        now = self.clock()
        last = self._last_update
        if last is not None and self.now.name == "iteration":
            dt = now - last
            if dt > self.slowest.get("iteration", 0.0):
                self.slowest["iteration"] = dt
            if self._last_synced is not None:
                self.times.append(now - self._last_synced)
        self._last_update = now
        self.iteration = iteration
        self.now = Phase("iteration", "", None, now)
        self.seq += 1

    def synced(self) -> None:
        """The ranks agreed at the boundary: what follows until the next is this rank's own time."""
        self._last_synced = self.clock()

    def enter(self, phase: str, *, what: str = "", bound: float | None = None) -> tuple[Phase, float]:
        """Begin ``phase``; returns what ``leave`` needs to go back to the phase before."""
        before, now = self.now, self.clock()
        self.now = Phase(phase, what, bound, now)
        self.seq += 1
        return before, now

    def leave(self, token: tuple[Phase, float], *, measure: str | None = None) -> None:
        before, started = token
        now = self.clock()
        if measure is not None:
            self.slowest[measure] = max(self.slowest.get(measure, 0.0), now - started)
        if before.name == "iteration":
            # The time spent elsewhere (a save, a declared phase) is no iteration's time.
            self._last_update = self._last_synced = None
        self.now = before._replace(since=now)
        self.seq += 1

    def background(self, started: bool) -> None:
        now = self.clock()
        if started:
            self.background_since = now
        elif self.background_since is not None:
            dt = now - self.background_since
            self.slowest["save-background"] = max(self.slowest.get("save-background", 0.0), dt)
            self.background_since = None
        self.seq += 1

    def take_times(self) -> dict:
        """This rank's iteration times since the last call (median, slowest, count), reset."""
        times, self.times = self.times, []
        if not times:
            return {"count": 0}
        ordered = sorted(times)
        return {"count": len(ordered), "median_s": round(ordered[len(ordered) // 2], 6),
                "max_s": round(ordered[-1], 6)}


class Declared(contextlib.AbstractContextManager):
    """A declared long phase; its ``with`` block's end goes back to the phase before."""

    def __init__(self, progress: Progress, token: tuple) -> None:
        self.progress = progress
        self.token = token

    def __exit__(self, *exc: object) -> None:
        self.progress.leave(self.token)


class Watchdog:
    """One rank's watchdog thread over its ``Progress``; see the module's docstring."""

    def __init__(self, bounds: HangBounds, *, rank: int = 0, world_size: int = 1, launch: int = 0,
                 node: str | None = None, clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], float] = time.time) -> None:
        self.bounds = bounds
        self.given_bounds = bounds
        """The bounds it was made with (the hook's ``RESUME_HANG``, or the defaults)."""
        self.rank = rank
        self.world_size = world_size
        self.launch = launch
        self.node = node or socket.gethostname()
        self.clock = clock
        self.wall = wall
        self.progress = Progress(clock)
        self.storage: Any = None
        """Where reports go (the run's Storage); None: logged only."""
        self.heartbeat = False
        """Rank 0 writes its progress for the hook (set where the hook armed the watchdog)."""
        self.measured_save_s: float | None = None
        """A restored manifest's save time: the first save's bound before this process saved."""
        self._reported: set[tuple] = set()
        self._written: tuple | None = None
        self._last_write = -1e30
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._dump_looked = -1e30
        self._backstop = True
        self.reports = 0

    # -- set up ------------------------------------------------------------------------

    def attach(self, storage: Any, *, rank: int, world_size: int, bounds: HangBounds | None = None) -> None:
        """This rank's place and the run that receives its reports (a Coordinator's, unless the
        hook named the run); ``bounds``: the program's own, instead of the hook's."""
        if self.storage is None or not self.heartbeat:  # the run the hook named stays
            self.storage = storage
        self.rank, self.world_size = rank, world_size
        self.bounds = bounds if bounds is not None else self.given_bounds
        if self.progress.phase == "closed":  # a second Coordinator in this process
            self.progress.enter("start-up")

    def start(self) -> None:
        """The watchdog thread (also with detection off where the hook reads rank 0's progress:
        it then says that nothing is watched)."""
        if self._thread is None and (self.bounds.enabled or self.heartbeat):
            self._stop = threading.Event()
            self._thread = threading.Thread(target=self._loop, name="resume-watchdog", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5.0)
        self._thread = None

    # -- the loop's side ---------------------------------------------------------------

    @contextlib.contextmanager
    def phase(self, name: str, *, measure: str | None = None, what: str = "",
              bound: float | None = None) -> Iterator[None]:
        token = self.progress.enter(name, what=what, bound=bound)
        try:
            yield
        finally:
            self.progress.leave(token, measure=measure)

    def expect(self, seconds: float, what: str = "") -> contextlib.AbstractContextManager[None]:
        """The next ``seconds`` are expected without progress (an evaluation, a data-set rebuild):
        a ``with`` block, or (called plainly) until the next ``update()``."""
        if not (isinstance(seconds, int | float) and not isinstance(seconds, bool) and seconds > 0):
            raise UsageError(f"expect: seconds: expected a number > 0, actual {seconds!r}")
        token = self.progress.enter("declared", what=what, bound=max(float(seconds), self.bounds.floor_s))
        return Declared(self.progress, token)

    def close(self) -> None:
        self.progress.enter("closed")
        if self.rank == 0 and self.heartbeat:
            try:
                self._beat(force=True)
            except OSError as e:
                log.warning("resume: watchdog: progress not written: %s", clip(str(e)))
        self.stop()

    # -- bounds ------------------------------------------------------------------------

    def bound_of(self, phase: str, declared: float | None = None) -> float | None:
        """The bound of ``phase`` now (None: not watched)."""
        b, slowest = self.bounds, dict(self.progress.slowest)
        if declared is not None:
            return declared
        if phase in ("start-up", "restore"):
            return b.startup()
        if phase == "iteration":
            # The first iterations after a start (compilation, warm caches) are start-up's.
            measured = slowest.get("iteration")
            return b.startup() if measured is None else b.bound(measured)
        if phase == "save":
            measured = max(slowest.get("save", 0.0), slowest.get("save-background", 0.0),
                           self.measured_save_s or 0.0) or None
            return b.bound(measured)
        if phase == "save-background":
            measured = max(slowest.get("save-background", 0.0), self.measured_save_s or 0.0) or None
            return b.bound(measured)
        return None

    def open_phases(self) -> list[dict]:
        """The phases now watched: the loop's and, during an asynchronous save, the background's;
        none when detection is off (rank 0 then tells the hook so: its progress lists none)."""
        p = self.progress
        out: list[dict] = []
        if not self.bounds.enabled:
            return out
        now = p.now
        bound = self.bound_of(now.name, now.bound)
        if bound is not None:
            out.append({"phase": now.name, "what": now.what, "since": now.since, "bound_s": round(bound, 3)})
        since = p.background_since
        if since is not None:
            out.append({"phase": "save-background", "what": "", "since": since,
                        "bound_s": round(self.bound_of("save-background") or 0.0, 3)})
        return out

    # -- the watchdog thread -----------------------------------------------------------

    def _loop(self) -> None:
        try:
            while not self._stop.wait(self.bounds.tick_s):
                try:
                    self.check()
                    self._arm_backstop()
                except Exception as e:  # noqa: BLE001 - the watchdog never stops the training
                    log.warning("resume: watchdog: %s: %s", type(e).__name__, clip(str(e)))
        finally:
            if self.heartbeat:
                faulthandler.cancel_dump_traceback_later()

    def _arm_backstop(self) -> None:
        """Under the hook: if this thread stops ticking (a native call holding the GIL), Python's
        faulthandler prints every thread's stack to stderr (the job's output) a few ticks after the
        phase's bound, from a thread that needs no GIL. Re-armed at every tick; process-wide, so
        only where the hook named the run."""
        if not (self.heartbeat and self._backstop):
            return
        phases = self.open_phases()
        try:
            if not phases:
                faulthandler.cancel_dump_traceback_later()
                return
            due = min(ph["since"] + ph["bound_s"] for ph in phases) - self.clock()
            faulthandler.dump_traceback_later(max(due, 0.0) + 3 * self.bounds.tick_s, repeat=False,
                                              file=sys.__stderr__)
        except (AttributeError, ValueError, RuntimeError, OSError) as e:  # no stderr with a descriptor
            self._backstop = False
            log.warning("resume: watchdog: no stack dump to stderr for a frozen interpreter: %s", clip(str(e)))

    def check(self) -> list[dict]:
        """One look (the thread's tick): report each phase past its bound, or quiet for half of
        it while the hook asks; rank 0 writes its progress. Returns the phases reported now."""
        now = self.clock()
        reported = []
        for ph in self.open_phases():
            quiet = now - ph["since"]
            key = (ph["phase"], ph["since"])
            if key in self._reported:
                continue
            if quiet > ph["bound_s"] or (quiet > ph["bound_s"] / 2 and self._dump_requested()):
                self._reported.add(key)
                self.report(ph, quiet)
                reported.append(ph)
        if self.rank == 0 and self.heartbeat:
            self._beat()
        return reported

    def _dump_requested(self) -> bool:
        """Whether the hook asks for the reports; looked at most every ``beat_s`` (only a rank
        quiet for half its bound looks: every rank during a long phase, not at every tick)."""
        now = self.clock()
        if self.storage is None or now - self._dump_looked < self.bounds.beat_s:
            return False
        self._dump_looked = now
        try:
            return bool(self.storage.exists(f"{HANGS}/launch-{self.launch}/dump"))
        except OSError:
            return False

    def position(self, ph: dict | None = None, quiet: float | None = None) -> dict:
        p = self.progress
        ph = ph or {"phase": p.now.name, "what": p.now.what, "since": p.now.since}
        now_m, now_w = self.clock(), self.wall()
        return {"rank": self.rank, "world_size": self.world_size, "node": self.node,
                "host": socket.gethostname(), "pid": os.getpid(), "launch": self.launch,
                "iteration": p.iteration, "phase": ph["phase"], "what": ph.get("what", ""),
                "quiet_s": round(now_m - ph["since"] if quiet is None else quiet, 3),
                "bound_s": ph.get("bound_s"),
                "last_progress_at": round(now_w - (now_m - ph["since"]), 3), "reported_at": round(now_w, 3)}

    def report(self, ph: dict, quiet: float) -> None:
        """This rank's report: where it was, then the stack of every thread."""
        frames = thread_frames()
        head = dict(self.position(ph, quiet), threads=frames)
        body = json.dumps(head, sort_keys=True).encode() + b"\n" + stacks(frames)
        self.reports += 1
        log.error("resume: rank %d: no progress in %s for %.0fs (bound %.0fs): stacks %s", self.rank,
                  ph["phase"], quiet, ph["bound_s"],
                  self.storage.url(report_path(self.launch, self.rank)) if self.storage else "not kept (no run)")
        if self.storage is not None:
            self.storage.write_bytes_atomic(report_path(self.launch, self.rank), body[:REPORT_CAP])

    def _beat(self, *, force: bool = False) -> None:
        """Rank 0: its phases and bounds for the hook, when changed, at most every ``beat_s``."""
        if self.storage is None:
            return
        p = self.progress
        now = self.clock()
        phase = p.now.name
        state = (p.seq, phase)
        if not force and (state == self._written or now - self._last_write < self.bounds.beat_s):
            return
        wall = self.wall()
        phases = [dict(ph, quiet_s=round(max(0.0, now - ph.pop("since")), 3)) for ph in self.open_phases()]
        if phase == "closed":
            phases = []
        record = {"launch": self.launch, "seq": p.seq, "iteration": p.iteration, "phase": phase,
                  "phases": phases, "world_size": self.world_size, "written_at": round(wall, 3),
                  "slowest": {k: round(v, 3) for k, v in dict(p.slowest).items()}}
        self.storage.write_bytes_atomic(PROGRESS, json.dumps(record).encode())
        self._written, self._last_write = state, now


MAX_THREADS = 64
MAX_FRAMES = 40


def thread_frames() -> dict[str, list[list]]:
    """Every thread's stack, innermost frame first: ``{name: [[file, line, function], ...]}``,
    bounded (``MAX_THREADS`` threads, ``MAX_FRAMES`` frames each)."""
    names = {t.ident: t.name for t in threading.enumerate()}
    out: dict[str, list[list]] = {}
    for ident, frame in list(sys._current_frames().items())[:MAX_THREADS]:
        frames: list[list] = []
        f: Any = frame
        while f is not None and len(frames) < MAX_FRAMES:
            frames.append([f.f_code.co_filename[-300:], f.f_lineno, f.f_code.co_name[:100]])
            f = f.f_back
        name = names.get(ident, f"thread-{ident}")
        out[name if name not in out else f"{name}-{ident}"] = frames
    return out


def stacks(frames: dict[str, list[list]]) -> bytes:
    """``frames`` as text, a traceback per thread, outermost call first (as Python prints them)."""
    lines = []
    for name, stack in frames.items():
        lines.append(f"--- thread {name} (most recent call last) ---")
        for file, line, function in reversed(stack):
            lines.append(f'  File "{file}", line {line}, in {function}')
            source = linecache.getline(file, line).strip()
            if source:
                lines.append(f"    {source}")
        lines.append("")
    return "\n".join(lines).encode(errors="replace")


_PROCESS: Watchdog | None = None
_PROCESS_LOCK = threading.Lock()


def process_watchdog(env: Mapping[str, str] | None = None) -> Watchdog:
    """This process's watchdog (made on first use, from ``RESUME_HANG``; started under the hook,
    where ``RESUME_HANG_RUN`` names the run, from the first import of ``resume``)."""
    global _PROCESS
    with _PROCESS_LOCK:
        if _PROCESS is None:
            env = os.environ if env is None else env
            bounds = HangBounds.from_env(env)
            launch = env.get(LAUNCH_ENV, "0")
            rank = env.get("RANK", "0")
            _PROCESS = Watchdog(bounds, launch=int(launch) if launch.isdigit() else 0,
                                rank=int(rank) if rank.isdigit() else 0, node=env.get(NODE_ENV) or None)
            run = env.get(RUN_ENV)
            if run and bounds.enabled:
                from .storage import open_storage
                try:
                    _PROCESS.storage = open_storage(run)
                    _PROCESS.heartbeat = True
                except Exception as e:  # noqa: BLE001 - watching never stops the training
                    log.warning("resume: watchdog: %s: %s", run, clip(str(e)))
                _PROCESS.start()
        return _PROCESS


def watch_from_start(env: Mapping[str, str] | None = None) -> None:
    """Start this process's watchdog now when the hook named the run (``RESUME_HANG_RUN``) and this
    is the task srun started (``RESUME_TASK_PID``, kept across the task's exec): a program that
    hangs before its Coordinator exists (in the rendezvous) is watched too. Its children (data
    loader workers spawned anew import ``resume`` too) are not: they make no progress of their own."""
    env = os.environ if env is None else env
    task = env.get(TASK_PID_ENV)
    if env.get(RUN_ENV) and (task is None or task == str(os.getpid())):
        process_watchdog(env)


def expect(seconds: float, what: str = "") -> contextlib.AbstractContextManager[None]:
    """``with resume.expect(3600, "evaluation"):``: the next ``seconds`` are expected without
    progress; the hook does not count them as a hang. Called plainly: until the next ``update()``."""
    return process_watchdog().expect(seconds, what)
