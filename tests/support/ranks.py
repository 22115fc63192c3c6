"""Run a function on several real processes with torch.distributed (gloo); end a job's processes
as Slurm ends a step."""

from __future__ import annotations

import datetime
import gc
import glob
import json
import os
import signal
import tempfile
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# A rank that skips (pytest.skip, e.g. require_megatron without megatron-core) writes
# skip-<rank>.json and exits with this code: non-zero, so that spawn stops the other
# ranks (which would otherwise wait for it at their next collective), and distinct
# from the 1 of a rank that raised.
SKIPPED_EXIT_CODE = 75


def _write_json(out_dir: str, name: str, body: object) -> None:
    with open(os.path.join(out_dir, name), "w") as f:
        json.dump(body, f)


def init_gloo(rank: int, world: int, store: str, *, timeout_s: float | None = None) -> None:
    """This process as ``rank`` of a gloo group of ``world`` on the file store ``store``, on one
    CPU thread (``timeout_s``: of the group's collectives; torch's default without)."""
    torch.set_num_threads(1)
    timeout = {} if timeout_s is None else {"timeout": datetime.timedelta(seconds=timeout_s)}
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world, **timeout)


def end_like_slurm(jobs: list[list], *, grace_s: float, timeout_s: float) -> bool:
    """Wait until every process of every job has ended. As Slurm ends a step whose task died, the
    other processes of a job are SIGKILLed ``grace_s`` after one of them exits non-zero; past
    ``timeout_s`` every process is. True when the timeout was reached."""
    started, first_death = time.monotonic(), {}
    overdue = False
    while any(p.is_alive() for procs in jobs for p in procs):
        now = time.monotonic()
        overdue = now - started > timeout_s
        for job, procs in enumerate(jobs):
            if job not in first_death and any(p.exitcode not in (None, 0) for p in procs):
                first_death[job] = now
            if overdue or job in first_death and now - first_death[job] > grace_s:
                for p in procs:
                    if p.is_alive():
                        try:
                            os.kill(p.pid, signal.SIGKILL)
                        except ProcessLookupError:  # it ended between the look and the kill
                            pass
        time.sleep(0.02)
    for procs in jobs:
        for p in procs:
            p.join()
    return overdue


def _entry(rank: int, world: int, store: str, fn, args: tuple, out_dir: str) -> None:
    init_gloo(rank, world, store)
    try:
        result = fn(rank, world, *args)
        _write_json(out_dir, f"result-{rank}.json", result)
        del result
        # DDP/FSDP objects caught in reference cycles (optimizer hooks) must
        # die before the process group does, or gloo can abort at exit.
        gc.collect()
        dist.barrier()
    except pytest.skip.Exception as e:
        # Skipped is a BaseException: torch's spawn wrapper would let it escape as a bare
        # "exit code 1". The reason travels as data and the parent skips with it.
        _write_json(out_dir, f"skip-{rank}.json", {"rank": rank, "reason": e.msg})
        raise SystemExit(SKIPPED_EXIT_CODE) from None
    finally:
        dist.destroy_process_group()


def _skip_reasons(out_dir: str) -> list[dict]:
    reasons = []
    for path in glob.glob(os.path.join(out_dir, "skip-*.json")):
        with open(path) as f:
            reasons.append(json.load(f))
    return sorted(reasons, key=lambda r: r["rank"])


def run_ranks(fn, world: int, *args) -> list:
    """Call ``fn(rank, world, *args)`` in ``world`` spawned processes; their JSON results.

    A rank that calls ``pytest.skip`` skips the calling test with the same reason (the
    lowest such rank's); any other failure of a rank fails it as before.
    """
    with tempfile.TemporaryDirectory(prefix="resume-mp-") as tmp:
        store = os.path.join(tmp, "store")
        try:
            mp.spawn(_entry, args=(world, store, fn, args, tmp), nprocs=world, join=True)
        except (mp.ProcessExitedException, mp.ProcessRaisedException):
            # Any skipping rank decides: the others may have failed only because it left.
            skipped = _skip_reasons(tmp)
            if skipped:
                pytest.skip(skipped[0]["reason"])
            raise
        results = []
        for rank in range(world):
            with open(os.path.join(tmp, f"result-{rank}.json")) as f:
                results.append(json.load(f))
        return results


def join_all(procs: list, *, timeout_s: float) -> list[int | None]:
    """Start ``procs`` (one job's processes), wait for each up to ``timeout_s``, kill what is left;
    their exit codes (-9: killed)."""
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=timeout_s)
    for p in procs:
        if p.is_alive():
            p.kill()
    return [p.exitcode for p in procs]
