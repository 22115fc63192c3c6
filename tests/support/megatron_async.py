"""megatron.training's real ``--async-save`` on CPU, with resume installed: the jobs of
tests/test_megatron_async_save.py.

The whole async path is Megatron's: ``save_checkpoint``'s async branch builds the request
(dist_checkpointing's ``async_save`` with ``--async-strategy mcore``; nvidia-resiliency-ext,
the default strategy, is not installed for the tests), ``schedule_async_save`` hands it to
the persistent worker (``--use-persistent-ckpt-worker``, without which ``validate_args``
turns ``--async-save`` off), and ``maybe_finalize_async_save`` finalizes it through
``AsyncCallsQueue``.

Test-only stand-ins, only when CUDA is absent, beyond support.megatron_training_run's:
- the persistent worker is started by the test with the ``fork`` start method, as
  ``AsyncCallsQueue.warmup_persistent_caller(rank, mp_mode="fork")``; Megatron's
  initialize.py starts it with ``forkserver``, whose fresh child would not have
  support.megatron's CPU stand-ins (its ``torch.cuda.current_device()`` in the
  completion all-reduce, ``torch.cuda.synchronize()``);
- while it is forked, ``torch.cuda.device_count`` returns 1 and ``torch.cuda.set_device``
  does nothing: the worker's first line is ``torch.cuda.set_device(rank %
  torch.cuda.device_count())`` (a ZeroDivisionError on CPU). The training process gets
  its own functions back at once.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable

import torch

ASYNC_ARGS = ("--async-save", "--use-persistent-ckpt-worker", "--async-strategy", "mcore")


def start_persistent_worker(rank: int) -> None:
    """The persistent checkpoint worker, as initialize.py starts it (forked on CPU: module docstring)."""
    if torch.cuda.is_available():
        from megatron.training.async_utils import init_persistent_async_worker

        init_persistent_async_worker(rank, "forkserver")
        return
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

    saved = torch.cuda.device_count, torch.cuda.set_device
    torch.cuda.device_count = lambda: 1
    torch.cuda.set_device = lambda device: None
    try:
        AsyncCallsQueue.warmup_persistent_caller(rank, mp_mode="fork")
    finally:
        torch.cuda.device_count, torch.cuda.set_device = saved


def wait_until_written(count: int, timeout_s: float = 60.0) -> None:
    """Until the persistent worker has finished writing ``count`` requests, without taking its
    completion notes (Megatron's finalize reads them; ``qsize`` only looks)."""
    from megatron.core.dist_checkpointing.strategies.async_utils import PersistentAsyncCaller

    deadline = time.monotonic() + timeout_s
    while PersistentAsyncCaller._persistent_comp_q.qsize() < count:
        if time.monotonic() > deadline:
            raise TimeoutError(f"the async checkpoint worker wrote fewer than {count} requests in {timeout_s} s")
        time.sleep(0.05)


def finalize(*, blocking: bool, terminate: bool = False) -> None:
    """As train() calls it: each iteration without waiting, at the end waiting (and terminating)."""
    from megatron.training.async_utils import maybe_finalize_async_save

    with contextlib.redirect_stdout(io.StringIO()):
        maybe_finalize_async_save(blocking=blocking, terminate=terminate)


def look(save_dir: str, iteration: int) -> dict:
    """What an observer sees of ``iter_<iteration>`` now."""
    from resume.adapters.megatron import MEGATRON_LAYOUT

    from resume.run import Run

    d = os.path.join(save_dir, f"iter_{iteration:07d}")
    tracker = os.path.join(save_dir, "latest_checkpointed_iteration.txt")
    files = sorted(os.listdir(d)) if os.path.isdir(d) else []
    with open(tracker) if os.path.exists(tracker) else contextlib.nullcontext() as f:
        tracked = f.read().strip() if f else None
    return {"files": files, "manifest": "resume-manifest.json" in files, "tracker": tracked,
            "committed": Run.open(save_dir, layout=MEGATRON_LAYOUT).committed_steps()}


def killed_job(save_dir: str, out: str) -> None:
    """A job that saves asynchronously, is finalized, saves again and is SIGKILLed (with its
    worker: the whole process group, as Slurm ends a step) before that save is finalized.

    Saves at 2 (looked at after the worker wrote it, before the finalize), at 3 while 2 is
    still pending, then training goes on to 4 before both are finalized at once; the save at 5
    is written by the worker and never finalized.
    """
    seen: dict = {}

    def note(key: str, value: object) -> None:
        seen[key] = value
        with open(out + ".tmp", "w") as f:
            json.dump(seen, f)
        os.replace(out + ".tmp", out)

    try:
        _killed_job(save_dir, note)
    except BaseException:  # noqa: BLE001 - the test reads it; exiting would wait for the worker
        note("error", traceback.format_exc())
    os.killpg(os.getpgid(0), signal.SIGKILL)


def _killed_job(save_dir: str, note: Callable[[str, object], None]) -> None:
    from resume.adapters.megatron import install

    from support import megatron_training_run as m

    args, model, optimizer, scheduler = m.fresh(save_dir, ASYNC_ARGS)
    recorder = install()
    start_persistent_worker(0)
    m.load(args, model, optimizer, scheduler)
    it = m.train(args, model, optimizer, scheduler, recorder, until=2, start=0)
    lr_at = {2: scheduler.get_lr(optimizer.param_groups[0])}
    m.save(it, model, optimizer, scheduler)
    note("2 scheduled", look(save_dir, 2))
    wait_until_written(1)
    note("2 written", look(save_dir, 2))
    it = m.train(args, model, optimizer, scheduler, recorder, until=3, start=it)
    lr_at[3] = scheduler.get_lr(optimizer.param_groups[0])
    m.save(it, model, optimizer, scheduler)  # while 2 is pending
    it = m.train(args, model, optimizer, scheduler, recorder, until=4, start=it)
    note("3 scheduled, 2 pending", look(save_dir, 2))
    finalize(blocking=True)
    note("finalized", {"2": look(save_dir, 2), "3": look(save_dir, 3), "lr_at": lr_at,
                       "consumed_now": args.consumed_train_samples})
    it = m.train(args, model, optimizer, scheduler, recorder, until=5, start=it)
    m.save(it, model, optimizer, scheduler)
    wait_until_written(1)  # 2 and 3's notes were taken by the finalize
    note("5 written", look(save_dir, 5))


def restart_and_save(rank: int, world: int, save_dir: str) -> dict:
    """A restart with resume installed: load, check, train to 5, save asynchronously, end as
    train() ends (a waiting finalize that terminates the worker)."""
    from resume.adapters.megatron import install

    from support import megatron_training_run as m

    recorder = install()
    args, model, optimizer, scheduler = m.fresh(save_dir, ASYNC_ARGS)
    start_persistent_worker(rank)
    iteration = m.load(args, model, optimizer, scheduler)
    loaded = recorder.loaded.manifest.step if recorder.loaded else None
    it = m.train(args, model, optimizer, scheduler, recorder, until=5, start=iteration)
    m.save(it, model, optimizer, scheduler)
    before = look(save_dir, 5)
    finalize(blocking=True, terminate=True)
    return {"iteration": iteration, "loaded": loaded, "consumed": args.consumed_train_samples,
            "before_finalize": before, "after_finalize": look(save_dir, 5)}


def request_answered_after_commit(rank: int, world: int, save_dir: str) -> dict:
    """A `resume save` request under --async-save, handled by the installed
    checkpoint_and_decide_exit: what is on disk when it returns (the answer written)."""
    from resume.adapters.megatron import MEGATRON_LAYOUT, install

    from resume.control import post_save_request
    from resume.run import Run
    from support import megatron_training_run as m

    recorder = install(control_poll_s=0.0)
    args, model, optimizer, scheduler = m.fresh(save_dir, ASYNC_ARGS)
    from megatron.training import training  # after fresh(): needs the typing.override alias

    start_persistent_worker(rank)
    m.load(args, model, optimizer, scheduler)
    it = m.train(args, model, optimizer, scheduler, recorder, until=2, start=0)
    run = Run.open(save_dir, create=True, layout=MEGATRON_LAYOUT)
    request = post_save_request(run, stop=False, reason="test")
    with contextlib.redirect_stdout(io.StringIO()):
        stop = training.checkpoint_and_decide_exit(model, optimizer, scheduler, it, 0.0, {}, None)
    with open(os.path.join(save_dir, "control", request.request_id + ".result")) as f:
        answer = json.load(f)
    at_answer = look(save_dir, 2)
    finalize(blocking=True, terminate=True)
    return {"answer": answer, "at_answer": at_answer, "stop": stop}


if __name__ == "__main__":  # python -m support.megatron_async SAVE_DIR OUT (cwd: tests/)
    killed_job(sys.argv[1], sys.argv[2])
