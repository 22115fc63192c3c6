"""Jobs of real gloo processes that crash inside a save, and what a restart finds afterwards.

A job is ``world`` processes forked from a fork server that has torch and the
workload imported already (a job starts in well under a second). Each rank
arms its fault (resume.faults), restores, trains to ``until`` and saves every
``EVERY`` iterations. When a rank dies, the others are killed after a short
grace, as Slurm ends a step whose task died. Every rank writes what it
restored from as soon as the restore returns (it may die afterwards), and
its final state when it reaches the end.
"""

from __future__ import annotations

import faulthandler
import json
import multiprocessing as mp
import os
import tempfile
import time
from dataclasses import dataclass, field

from resume import faults
from resume.run import Run
from support.ranks import end_like_slurm, init_gloo
from support.shared import once
from support.workloads import Setup, build, moment_digests, param_digests, train

EVERY = 2
UNTIL = 8
GRACE_S = 0.5
ABSENT = "absent"
HANG_S = 20.0


@dataclass
class Job:
    codes: list[int | None]
    restored: list[int | None | str]
    """Per rank: the step restored from (None: a fresh start), an error's text, or ABSENT
    when the rank died before its restore returned."""
    final: list[dict | None]
    seconds: float
    logs: list[str] = field(default_factory=list, repr=False)
    """The end of each rank's stderr."""

    def __str__(self) -> str:
        tails = "".join(f"\n--- rank {r} stderr (end) ---\n{log}" for r, log in enumerate(self.logs))
        return f"{self!r}{tails}"


def _rank_main(rank: int, world: int, store: str, out: str, run_url: str, env: dict, fault: str,
               until: int, keep: int, on_save_failure: str) -> None:
    os.environ.update(env)
    # This rank's stderr (tracebacks of the crash it saw, our log lines) into the job's folder.
    log_fd = os.open(os.path.join(out, f"rank-{rank}.log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(log_fd, 2)
    faulthandler.dump_traceback_later(HANG_S, exit=True)  # a hung rank says where
    faults.arm(fault)
    init_gloo(rank, world, store, timeout_s=60)
    coord, parts = build(rank, world, run_url, Setup(every=EVERY, keep=keep, total_updates=UNTIL,
                                                      on_save_failure=on_save_failure))
    try:
        coord.restore()
        _write(out, f"restored-{rank}", {"step": coord.restored_from})
    except Exception as e:
        _write(out, f"restored-{rank}", {"error": f"{type(e).__name__}: {e}"})
        raise
    while coord.iteration < until:  # several passes over the data
        train(coord, parts, until=until)
    coord.close()
    _write(out, f"final-{rank}", {"iteration": coord.iteration, "params": param_digests(parts["model"]),
                                  "moments": moment_digests(parts["opt"]), "fired": faults.fired()})
    # Out without tearing down DDP and gloo (their destructors can wait on a peer that
    # already left); the results are on disk.
    os._exit(0)


def _write(out: str, name: str, body: dict) -> None:
    tmp = os.path.join(out, f".{name}.tmp")
    with open(tmp, "w") as f:
        json.dump(body, f)
    os.replace(tmp, os.path.join(out, f"{name}.json"))


def _read(out: str, name: str) -> dict | None:
    try:
        with open(os.path.join(out, f"{name}.json")) as f:
            return json.load(f)
    except FileNotFoundError:
        return None


def context() -> mp.context.BaseContext:
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["support.crash_jobs"])
    return ctx


def run_job(run_url: str, *, world: int = 2, fault: str = "", until: int = UNTIL, keep: int = 10,
            env: dict | None = None, on_save_failure: str = "raise", timeout_s: float = 120.0) -> Job:
    """One job: every rank restores, trains to ``until``, saves every EVERY; ``fault`` armed."""
    ctx = context()
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="resume-crash-") as out:
        store = os.path.join(out, "store")
        procs = [ctx.Process(target=_rank_main, name=f"rank{rank}",
                             args=(rank, world, store, out, run_url, env or {}, fault, until, keep,
                                   on_save_failure))
                 for rank in range(world)]
        for p in procs:
            p.start()
        timed_out = end_like_slurm([procs], grace_s=GRACE_S, timeout_s=timeout_s)
        restored = []
        for rank in range(world):
            body = _read(out, f"restored-{rank}")
            restored.append(ABSENT if body is None else body["step"] if "step" in body else body["error"])
        job = Job(codes=[p.exitcode for p in procs], restored=restored,
                  final=[_read(out, f"final-{rank}") for rank in range(world)],
                  seconds=time.monotonic() - started,
                  logs=[_tail(os.path.join(out, f"rank-{rank}.log")) for rank in range(world)])
        if timed_out:
            raise TimeoutError(f"job on {run_url} ran past {timeout_s} s: exit codes {job.codes}")
        return job


def uninterrupted(tmp_path_factory, world: int = 2) -> list[dict]:
    """Each rank's final state in a job that runs to the end without a fault (``run_job``'s
    defaults): once per test session."""

    def compute(where) -> list[dict]:
        job = run_job(str(where / "run"), world=world)
        assert job.codes == [0] * world, job
        return job.final

    return once(tmp_path_factory, f"uninterrupted-{world}-ranks", compute)


def _tail(path: str, size: int = 4000) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.path.getsize(path) - size))
            return f.read().decode(errors="replace")
    except FileNotFoundError:
        return ""


def committed_deep(run_url: str) -> set[int]:
    """The steps whose checkpoints pass the deep commit check (every checksum)."""
    run = Run.open(run_url)
    return {s for s in run.step_dirs() if run.check(s, deep=True).committed}


@dataclass
class SoakReport:
    cycles: int = 0
    campaigns: int = 0
    faults: dict = field(default_factory=dict)
    """(point, action) -> how many jobs that fault ended or failed a save of."""
    not_reached: int = 0
    """Jobs that finished before their fault's point came (the campaign ends there)."""
    restores: dict = field(default_factory=dict)
    """'newest' (the newest complete checkpoint), 'fresh' (none yet)."""
    lost: int = 0
    torn_loads: int = 0
    """Restores that loaded anything but the newest complete checkpoint (or failed)."""
    mismatched_finals: int = 0
    seconds: float = 0.0

    def table(self) -> str:
        rows = [("scenarios run (jobs)", self.cycles), ("campaigns (run to the end)", self.campaigns),
                ("faults injected", sum(self.faults.values())), ("faults not reached", self.not_reached),
                *[(f"  {p} : {a}", n) for (p, a), n in sorted(self.faults.items())],
                ("restores of the newest complete checkpoint", self.restores.get("newest", 0)),
                ("fresh starts (nothing committed yet)", self.restores.get("fresh", 0)),
                ("checkpoints lost", self.lost), ("torn loads", self.torn_loads),
                ("final states unlike the uninterrupted run", self.mismatched_finals),
                ("seconds", round(self.seconds, 1))]
        width = max(len(k) for k, _ in rows)
        return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


ACTIONS_DRAWN = ("kill", "kill", "kill", "raise", "enospc", "eio")


def soak(cycles: int, *, root: str, seed: int = 0, reference: list | None = None,
         s3: tuple[str, dict] | None = None, log=print) -> SoakReport:
    """Save/kill/restore cycles at random points, ranks, actions and policies until ``cycles`` jobs
    ran; each campaign (a fresh run) goes on until a job reaches the end, whose state must equal
    the uninterrupted run's. ``s3``: (bucket URL prefix, environment) to put every third campaign
    on an object store (behind a fault proxy, for storage faults)."""
    import random

    rng = random.Random(seed)
    report = SoakReport()
    started = time.monotonic()
    if reference is None:
        reference = run_job(os.path.join(root, "reference")).final
    while report.cycles < cycles:
        report.campaigns += 1
        on_s3 = s3 is not None and report.campaigns % 3 == 0
        url = f"{s3[0]}/soak-{seed}-{report.campaigns}" if on_s3 else os.path.join(root, f"c{report.campaigns}")
        env = s3[1] if on_s3 else {}
        keep = rng.choice((2, 3))
        while report.cycles < 4 * cycles:  # a run that never finishes (a bug) ends the soak too
            before = committed_deep(url) if _exists(url) else set()
            point = rng.choice(faults.POINTS)
            rank = 0 if point in faults.RANK0_POINTS else rng.randrange(2)
            action = rng.choice(ACTIONS_DRAWN)
            policy = rng.choice(("raise", "continue"))
            # At one of the saves still ahead of this run (each job gets further than the last).
            ahead = [step for step in range(EVERY, UNTIL + 1, EVERY) if step > max(before, default=0)]
            on = "" if action != "kill" and point in faults.COLLECTIVE_EDGE else f" rank={rank}"
            spec = f"{point}:{action}{on} step={rng.choice(ahead)}" if ahead else ""
            job = run_job(url, fault=spec, keep=keep, env=env, on_save_failure=policy)
            report.cycles += 1
            after = committed_deep(url)
            expected = max(before) if before else None
            for restored in job.restored:
                if restored == ABSENT:
                    continue  # killed before its restore returned
                if restored != expected:  # another step, or an error instead of the newest
                    report.torn_loads += 1
                    log(f"cycle {report.cycles}: {spec}: restored {restored}, newest complete {expected}: {job!s}")
            kind = "fresh" if expected is None else "newest"
            report.restores[kind] = report.restores.get(kind, 0) + 1
            # A checkpoint may go only by retention: when `keep` newer ones are committed.
            lost = sorted(s for s in before - after if sum(a > s for a in after) < keep)
            if lost:
                report.lost += len(lost)
                log(f"cycle {report.cycles}: {spec}: lost {lost}: {job!s}")
            finished = job.codes == [0, 0] and all(f is not None for f in job.final)
            fired = not finished or _saves_failed(job)
            if fired:
                report.faults[(point, action)] = report.faults.get((point, action), 0) + 1
            else:
                report.not_reached += 1
            if finished:
                if [f["params"] for f in job.final] != [r["params"] for r in reference] or \
                        [f["moments"] for f in job.final] != [r["moments"] for r in reference]:
                    report.mismatched_finals += 1
                    log(f"cycle {report.cycles}: {spec}: final state differs from the uninterrupted run")
                break
    report.seconds = time.monotonic() - started
    return report


def _exists(url: str) -> bool:
    try:
        Run.open(url)
    except FileNotFoundError:
        return False
    return True


def _saves_failed(job: Job) -> bool:
    """A finished job whose fault still fired: a save failed and training went on."""
    return any(f and f.get("fired") for f in job.final)
