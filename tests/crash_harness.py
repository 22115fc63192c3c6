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

import datetime
import faulthandler
import json
import multiprocessing as mp
import os
import signal
import tempfile
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from workloads import Setup, build, moment_digests, param_digests, train

from resume import faults
from resume.run import Run

EVERY = 2
UNTIL = 8
GRACE_S = 0.5
HANG_S = 20.0


@dataclass
class Job:
    codes: list[int | None]
    restored: list[int | None | str]
    """Per rank: the step restored from (None: a fresh start), an error's text, or absent
    when the rank died before its restore returned."""
    final: list[dict | None]
    seconds: float
    killed_by_fault: list[int] = field(default_factory=list)


def _rank_main(rank: int, world: int, store: str, out: str, run_url: str, env: dict, fault: str,
               until: int, keep: int, on_save_failure: str) -> None:
    os.environ.update(env)
    faulthandler.dump_traceback_later(HANG_S, exit=True)  # a hung rank says where
    torch.set_num_threads(1)
    faults.arm(fault)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
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
                                  "moments": moment_digests(parts["opt"])})
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
    ctx.set_forkserver_preload(["crash_harness"])
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
        first_death: float | None = None
        timed_out = False
        while any(p.is_alive() for p in procs):
            now = time.monotonic()
            if first_death is None and any(p.exitcode not in (None, 0) for p in procs):
                first_death = now
            timed_out = now - started > timeout_s
            if first_death is not None and now - first_death > GRACE_S or timed_out:
                for p in procs:
                    if p.is_alive():
                        os.kill(p.pid, signal.SIGKILL)
            time.sleep(0.02)
        for p in procs:
            p.join()
        restored = []
        for rank in range(world):
            body = _read(out, f"restored-{rank}")
            restored.append(None if body is None else body.get("step", body.get("error")))
        job = Job(codes=[p.exitcode for p in procs], restored=restored,
                  final=[_read(out, f"final-{rank}") for rank in range(world)],
                  seconds=time.monotonic() - started)
        if timed_out:
            raise TimeoutError(f"job on {run_url} ran past {timeout_s} s: exit codes {job.codes}")
        return job


def committed_deep(run_url: str) -> set[int]:
    """The steps whose checkpoints pass the deep commit check (every checksum)."""
    run = Run.open(run_url)
    return {s for s in run.step_dirs() if run.check(s, deep=True).committed}
