"""The hook's side of hang detection: rank 0's progress as the hook reads it, the ranks' reports
once a hang is declared, and the suspect (the ranks that were not where the others were).

- ``HangWatch.poll``: one read of ``RUN/cluster/progress.json`` (rank 0's phases and their
  bounds, ``resume/watchdog.py``) per poll; a hang when a phase goes on past its bound (plus one
  beat, so the ranks' own reports come first), or when no progress of this launch arrives
  within the start-up bound, once the run is known to report progress (a program that never
  imports ``resume`` writes none, and is not watched).
- ``collect``: asks every rank for its report (``…/launch-<L>/dump``) and waits up to
  ``COLLECT_S`` for all of them.
- ``find_suspects``: ranks that did not answer; else those at another iteration or phase than
  the most; else those whose watched thread was not waiting for its peers; else those whose
  innermost frame differs from the most's. None when nothing tells them apart.

Every file read here is untrusted: capped, parsed as JSON, checked in shape; a bad one is
treated as absent (a bad progress record) or as no answer (a bad report).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from resume.storage import SMALL_FILE_CAP, Storage
from resume.text import clip, parse_json, short
from resume.watchdog import HANGS, NOT_WAITING_IN, PROGRESS, REPORT_CAP, WAITING_IN, HangBounds, report_path

__all__ = ["COLLECT_S", "STOP_STAGES", "Hang", "HangWatch", "RankReport", "collect", "find_suspects", "parse_report"]

COLLECT_S = 30.0
"""After a hang is declared, how long the hook waits for every rank's report."""
STOP_STAGES = (("SIGTERM", 10.0), ("SIGKILL to the Slurm step", 10.0), ("SIGKILL", 5.0))
"""How the hook ends a step, each stage with its patience (``Supervisor._stop_step``): TERM to srun
(passed on to every task), KILL to every task of the Slurm step (a stopped one too), KILL to srun."""
MAX_PHASES = 4
MAX_LISTED = 64
"""Suspects and their nodes listed in an event at most (``suspect_count`` says how many)."""


@dataclass(frozen=True)
class Hang:
    """A phase past its bound, as the hook saw it."""

    phase: str
    quiet_s: float
    bound_s: float
    iteration: int | None = None
    what: str = ""


@dataclass
class RankReport:
    rank: int
    node: str
    iteration: int | None
    phase: str
    quiet_s: float
    last_progress_at: float
    threads: dict[str, list[list]] = field(default_factory=dict)

    def watched_thread(self, phase: str) -> list[list]:
        """The stack of the thread the hung ``phase`` runs on (innermost first)."""
        if phase == "save-background":
            for name, frames in self.threads.items():
                if name.startswith("resume-save-"):
                    return frames
        return self.threads.get("MainThread", [])

    def waiting(self, phase: str) -> bool:
        """Whether the thread of ``phase`` was waiting for its peers (its innermost frame)."""
        frames = self.watched_thread(phase)
        if not frames:
            return False
        where = str(frames[0][0]).replace("\\", "/")
        return any(m in where for m in WAITING_IN) and not any(m in where for m in NOT_WAITING_IN)

    def top(self, phase: str) -> str:
        frames = self.watched_thread(phase)
        return f"{frames[0][0]}:{frames[0][1]} in {frames[0][2]}" if frames else "?"


def _is_num(x: Any) -> bool:
    """A finite JSON number a float holds (a 400-digit integer is none: no OverflowError later)."""
    if isinstance(x, bool) or not isinstance(x, int | float):
        return False
    return math.isfinite(x) if isinstance(x, float) else -1e18 < x < 1e18


def parse_progress(data: bytes, launch: int) -> dict | None:
    """Rank 0's progress record of ``launch``; None when it is of another launch or malformed."""
    try:
        rec = parse_json(data)
    except ValueError:
        return None
    if not (isinstance(rec, dict) and rec.get("launch") == launch and isinstance(rec.get("seq"), int)):
        return None
    phases = rec.get("phases")
    if not (isinstance(phases, list) and len(phases) <= MAX_PHASES and all(
            isinstance(p, dict) and isinstance(p.get("phase"), str) and _is_num(p.get("bound_s"))
            and p["bound_s"] > 0 and _is_num(p.get("quiet_s")) and p["quiet_s"] >= 0 for p in phases)):
        return None
    if rec.get("iteration") is not None and not isinstance(rec["iteration"], int):
        return None
    return rec


class HangWatch:
    """The hook's view of one launch: ``poll`` says when a phase went on past its bound."""

    def __init__(self, storage: Storage, *, launch: int, bounds: HangBounds,
                 clock: Callable[[], float], expect_progress: bool = True) -> None:
        """``expect_progress``: no progress within the start-up bound is a hang (the program is
        known to run the watchdog); otherwise only once a first progress record came."""
        self.storage = storage
        self.launch = launch
        self.bounds = bounds
        self.clock = clock
        self.started = clock()
        self.record: dict | None = None
        self._seen: dict[tuple, float] = {}
        """(phase, seq-at-start) -> when the hook first saw it, by its own clock."""
        self._seq: int | None = None
        self._seq_at = self.started
        self.startup_s: float | None = None
        """Launch to the first iteration's progress, by the hook's clock (None: not yet)."""
        self.expect_progress = expect_progress

    def poll(self) -> Hang | None:
        if not self.bounds.enabled:
            return None
        self._read()
        now = self.clock()
        rec = self.record
        if rec is None:
            if not self.expect_progress:  # a program that never imported resume is not watched
                return None
            bound = self.bounds.startup()
            quiet = now - self.started
            return Hang("start-up", round(quiet, 3), bound) if quiet > bound + self.bounds.beat_s else None
        if rec["seq"] != self._seq:
            self._seq, self._seq_at = rec["seq"], now
            if self.startup_s is None and rec.get("phase") in ("iteration", "save"):
                self.startup_s = round(now - self.started, 3)
        for ph in rec["phases"]:
            # Quiet when written, plus since the hook saw that record; a beat of slack for the write.
            quiet = ph["quiet_s"] + (now - self._seq_at)
            if quiet > ph["bound_s"] + self.bounds.beat_s + self.bounds.tick_s:
                return Hang(ph["phase"], round(quiet, 3), ph["bound_s"], rec.get("iteration"),
                            clip(str(ph.get("what", "")), 80))
        return None

    def _read(self) -> None:
        try:
            data = self.storage.read_bytes(PROGRESS, limit=SMALL_FILE_CAP)
        except (OSError, ValueError):
            return
        rec = parse_progress(data, self.launch)
        if rec is not None:
            self.record = rec


def parse_report(data: bytes, *, rank: int) -> RankReport | None:
    """A rank's report (its first line, JSON); None when it is not one (no answer)."""
    head, _, _ = data[:REPORT_CAP].partition(b"\n")
    try:
        rec = parse_json(head)
    except ValueError:
        return None
    if not isinstance(rec, dict) or rec.get("rank") != rank:
        return None
    threads = rec.get("threads", {})
    if not (isinstance(threads, dict) and all(
            isinstance(k, str) and isinstance(v, list) and all(isinstance(f, list) and len(f) == 3 for f in v)
            for k, v in threads.items())):
        threads = {}
    iteration = rec.get("iteration")
    return RankReport(rank=rank, node=clip(str(rec.get("node", "?")), 255),
                      iteration=iteration if isinstance(iteration, int) and not isinstance(iteration, bool) else None,
                      phase=clip(str(rec.get("phase", "?")), 40),
                      quiet_s=float(rec["quiet_s"]) if _is_num(rec.get("quiet_s")) else -1.0,
                      last_progress_at=float(rec["last_progress_at"]) if _is_num(rec.get("last_progress_at")) else 0.0,
                      threads=threads)


def request_reports(storage: Storage, launch: int) -> None:
    """Ask the ranks still quiet to report (each rank's watchdog looks for this file)."""
    storage.write_bytes_atomic(f"{HANGS}/launch-{launch}/dump", b"{}\n")


def collect(storage: Storage, *, launch: int, world_size: int, clock: Callable[[], float],
            sleep: Callable[[float], None], window_s: float = COLLECT_S,
            poll_s: float = 0.5) -> dict[int, RankReport]:
    """The ranks' reports of ``launch``: asked for, then waited for up to ``window_s``."""
    try:
        request_reports(storage, launch)
    except OSError:
        pass  # the ranks past their own bound report anyway
    deadline = clock() + window_s
    reports: dict[int, RankReport] = {}
    tried: set[int] = set()
    while True:
        # One listing per look; each report read once (5,120 ranks: no open of every missing one).
        for rank in sorted(_listed_ranks(storage, launch, world_size) - tried):
            tried.add(rank)
            try:
                data = storage.read_bytes(report_path(launch, rank), limit=REPORT_CAP)
            except (OSError, ValueError):
                tried.discard(rank)  # half-written or refused: the next look tries again
                continue
            report = parse_report(data, rank=rank)
            if report is not None:
                reports[rank] = report
            else:
                tried.discard(rank)  # not a report (yet): the rank's own may replace it
        if len(reports) == world_size or clock() >= deadline:
            return reports
        sleep(poll_s)


def _listed_ranks(storage: Storage, launch: int, world_size: int) -> set[int]:
    """The ranks whose report ``launch``'s directory lists (names of the form ``rank-<R>.txt``)."""
    try:
        names = storage.listdir(f"{HANGS}/launch-{launch}")
    except (OSError, ValueError):
        return set()
    out = set()
    for name in names:
        base = name.rsplit("/", 1)[-1]
        digits = base[len("rank-"):-len(".txt")] if base.startswith("rank-") and base.endswith(".txt") else ""
        if digits.isascii() and digits.isdigit() and int(digits) < world_size:
            out.add(int(digits))
    return out


def _minority(groups: Mapping[int, Any]) -> list[int] | None:
    """The ranks outside the one most common value, when there is exactly one such value."""
    counts = Counter(groups.values()).most_common()
    if len(counts) < 2 or counts[0][1] == counts[1][1]:
        return None
    common = counts[0][0]
    return sorted(r for r, v in groups.items() if v != common)


def find_suspects(reports: Mapping[int, RankReport], world_size: int, phase: str) -> tuple[list[int], str]:
    """The ranks that were not where the others were, and why; ``([], reason)`` when none stand out."""
    missing = [r for r in range(world_size) if r not in reports]
    if reports and missing:
        return missing, "no report: the process did not answer (stopped, frozen in native code, or gone)"
    if not reports:
        return [], "no rank reported (none had started watching)"
    at = {r: (rep.iteration, rep.phase) for r, rep in reports.items()}
    odd = _minority(at)
    if odd:
        common = Counter(at.values()).most_common(1)[0][0]
        return odd, (f"at another iteration or phase ({', '.join(f'rank {r}: {short(at[r])}' for r in odd[:8])}) "
                     f"than the others ({short(common)})")
    idle = [r for r, rep in reports.items() if not rep.waiting(phase)]
    if 0 < len(idle) < len(reports):
        where = reports[idle[0]].top(phase)
        return sorted(idle), f"not waiting for its peers (rank {idle[0]} in {where}) while the others waited"
    odd = _minority({r: rep.top(phase) for r, rep in reports.items()})
    if odd:
        return odd, f"elsewhere than the others (rank {odd[0]} in {reports[odd[0]].top(phase)})"
    return [], "every rank was at the same place: no single suspect"


def suspect_nodes(suspects: list[int], reports: Mapping[int, RankReport], nodes: list[str],
                  tasks_per_node: int) -> list[str]:
    """The suspects' nodes: as each reported, else by srun's block placement."""
    out = []
    for r in suspects:
        node = reports[r].node if r in reports else (nodes[r // tasks_per_node]
                                                        if r // tasks_per_node < len(nodes) else "?")
        if node not in out:
            out.append(node)
    return out


def hang_summary(hang: Hang, reports: Mapping[int, RankReport], suspects: list[int], why: str,
                 nodes: list[str], tasks_per_node: int, where: str) -> dict[str, Any]:
    """The ``hang`` event's fields."""
    late = sorted(reports.values(), key=lambda r: r.last_progress_at)[:3]
    return {"phase": hang.phase, "what": hang.what, "iteration": hang.iteration, "quiet_s": hang.quiet_s,
            "bound_s": hang.bound_s, "suspects": suspects[:MAX_LISTED], "suspect_count": len(suspects),
            "suspect_nodes": suspect_nodes(suspects, reports, nodes, tasks_per_node)[:MAX_LISTED],
            "reports": len(reports), "stacks": where,
            "earliest": [{"rank": r.rank, "node": r.node, "iteration": r.iteration, "phase": r.phase,
                          "last_progress_at": r.last_progress_at} for r in late],
            "reason": f"no progress in {hang.phase} for {hang.quiet_s:.0f}s (bound {hang.bound_s:.0f}s); "
                      f"suspect: {why}"}

