"""Hang detection in Megatron's own loop (megatron.training.training.train()) through the integration.

``install()`` drives the process watchdog (``resume.watchdog``) from the calls it wraps
(``resume.adapters.megatron.watch``). End to end, on 2 CPU ranks (gloo), each a fresh process
(support.megatron_train_loop) under the Slurm hook's environment (``RESUME_HANG``,
``RESUME_HANG_RUN`` = the save directory, ``RESUME_LAUNCH``): rank 1 blocks inside a
``train_step`` after the first save; both ranks report past the iteration bound, the hook's
``collect`` and ``find_suspects`` name rank 1, and after the kill a relaunch without the fault
resumes from the last committed save and ends with an uninterrupted run's weights.
The phases' bookkeeping (evaluation, an async save in flight) is checked on its own, with a
clock the test moves.
"""

from __future__ import annotations

import json
import os
import time

import pytest
from support.megatron import require_megatron

from resume.watchdog import HangBounds, Watchdog

WORLD, ITERATIONS, SAVE_INTERVAL = 2, 6, 2
HOLD_AT = 3
"""0-based: rank 1 blocks in the 4th iteration's forward step; the save at 2 is committed, 3 is done and lost."""
NO_DROPOUT = ("--hidden-dropout", "0", "--attention-dropout", "0")
TIGHT = "floor=2,factor=2,first=60,beat=0.5,tick=0.2"
"""The bounds of the launch that hangs: an iteration (tens of ms on CPU here) is hung after 2 s."""
EASY = "floor=60,factor=2,first=120,beat=0.5,tick=0.2"
"""The healthy launches' bounds: no report is expected of them, even on a busy machine."""
REPORTED_WITHIN_S = 30.0
"""From rank 1's block to both reports: the 2 s bound, a tick, and slack for a loaded machine."""


def _flags(save_dir: str) -> list[str]:
    from support.megatron_train_loop import argv_for

    return argv_for(save_dir, ITERATIONS, SAVE_INTERVAL, NO_DROPOUT)


def _hook_env(save_dir: str, launch: int, bounds: str) -> dict[str, str]:
    """What the Slurm hook puts in each rank's environment (resume/watchdog.py)."""
    return {"RESUME_HANG": bounds, "RESUME_HANG_RUN": save_dir, "RESUME_LAUNCH": str(launch)}


def _committed(save_dir: str) -> list[int]:
    from resume.adapters.megatron import MEGATRON_LAYOUT

    from resume.run import Run

    return Run.open(save_dir, layout=MEGATRON_LAYOUT).committed_steps()


def _hangs(save_dir: str, launch: int) -> list[str]:
    folder = os.path.join(save_dir, "cluster", "hangs", f"launch-{launch}")
    return sorted(n for n in os.listdir(folder) if n.startswith("rank-")) if os.path.isdir(folder) else []


def _progress(save_dir: str) -> dict:
    with open(os.path.join(save_dir, "cluster", "progress.json")) as f:
        return json.load(f)


def _reference(tmp: str) -> tuple[str, list[dict]]:
    """An uninterrupted run on 2 ranks through train(), watched (healthy bounds): saves at 2, 4, 6."""
    from support.megatron_train_loop import start_ranks, wait_ranks

    save_dir = os.path.join(tmp, "reference")
    procs = start_ranks(tmp, "reference", WORLD, env=_hook_env(save_dir, 1, EASY), save_dir=save_dir,
                        extra=_flags(save_dir))
    return save_dir, wait_ranks(tmp, "reference", procs)


def _wait_for_hold(tmp: str, procs: list, timeout_s: float = 180) -> float:
    """When rank 1 began to block (its ``.holding`` mark), by this process's clock."""
    from support.megatron_train_loop import kill, log_tail

    deadline = time.monotonic() + timeout_s
    while not os.path.exists(procs[1][1] + ".holding"):
        if any(proc.poll() is not None for proc, _ in procs) or time.monotonic() > deadline:
            codes = kill(procs)
            raise AssertionError(f"rank 1 did not block at iteration {HOLD_AT} (exit codes {codes})\n"
                                 f"{log_tail(tmp, 'hung-rank1')}")
        time.sleep(0.05)
    return time.monotonic()


@pytest.mark.megatron
@pytest.mark.multiprocess
def test_a_rank_blocked_in_megatrons_train_loop_is_named_and_the_run_resumes(tmp_path):
    """Also: a healthy run is not reported, ``train()``'s end closes the watchdog, and each save
    records the ranks' iteration times (stragglers) with the recorder's own gather."""
    require_megatron()
    from resume.cluster.hangs import collect, find_suspects
    from support.megatron_train_loop import kill, start_ranks, wait_ranks

    from resume.storage import open_storage

    tmp = str(tmp_path)
    ref_dir, expected = _reference(tmp)
    assert [r["iteration"] for r in expected] == [ITERATIONS] * WORLD
    assert _hangs(ref_dir, 1) == [] and _progress(ref_dir)["phase"] == "closed"
    assert {"restore", "iteration", "save"} <= set(_progress(ref_dir)["slowest"])
    with open(os.path.join(ref_dir, "iter_0000004", "resume-manifest.json")) as f:
        stragglers = json.load(f)["stragglers"]
    assert stragglers["ranks"] == WORLD and {s["rank"] for s in stragglers["slowest"]} == {0, 1}

    save_dir = os.path.join(tmp, "save")
    procs = start_ranks(tmp, "hung", WORLD, env=_hook_env(save_dir, 1, TIGHT), save_dir=save_dir,
                        extra=_flags(save_dir), hold_at=HOLD_AT, hold_rank=1)
    held = _wait_for_hold(tmp, procs)
    try:
        # The hook's side, as cluster/hooks.py does once a hang is declared.
        reports = collect(open_storage(save_dir), launch=1, world_size=WORLD, clock=time.monotonic,
                          sleep=time.sleep, window_s=REPORTED_WITHIN_S)
        reported_in = time.monotonic() - held
    finally:
        codes = kill(procs)  # as the hook ends the hung step
    assert sorted(reports) == [0, 1] and reported_in < REPORTED_WITHIN_S, (sorted(reports), reported_in)
    assert codes == [-9, -9]
    assert {(r.iteration, r.phase) for r in reports.values()} == {(HOLD_AT, "iteration")}
    suspects, why = find_suspects(reports, WORLD, "iteration")
    assert suspects == [1], why
    assert "not waiting for its peers" in why
    # Rank 1's stack: the blocking frame, inside Megatron's own train() and train_step; rank 0
    # waits in the gradients' all-reduce.
    stack = reports[1].threads["MainThread"]
    assert stack[0][2] == "hold" and stack[0][0].endswith("support/megatron_train_loop.py"), stack[:3]
    in_megatron = {f[2] for f in stack if f[0].endswith("megatron/training/training.py")}
    assert {"train", "train_step"} <= in_megatron, stack
    assert reports[0].waiting("iteration"), reports[0].top("iteration")
    with open(os.path.join(save_dir, "cluster", "hangs", "launch-1", "rank-1.txt")) as f:
        assert "in hold" in f.read()  # the report's text: every thread's stack, as Python prints it
    assert _committed(save_dir) == [SAVE_INTERVAL]

    resumed = wait_ranks(tmp, "resumed", start_ranks(tmp, "resumed", WORLD, env=_hook_env(save_dir, 2, EASY),
                                                     save_dir=save_dir, extra=_flags(save_dir)))
    for rank, out in enumerate(resumed):
        assert "error" not in out, out
        assert out["loaded"] == SAVE_INTERVAL and out["start_iteration"] == SAVE_INTERVAL, out
        assert out["iteration"] == ITERATIONS
        assert out["params"] == expected[rank]["params"]  # as if never interrupted
    assert _committed(save_dir) == [2, 4, 6]
    assert _hangs(save_dir, 2) == []


# -- the phases' bookkeeping, on a clock the test moves ---------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _watchdog(clock: Clock) -> Watchdog:
    return Watchdog(HangBounds(floor_s=10, factor=3, first_s=100), clock=clock, wall=clock)


def test_megatrons_evaluation_is_bounded_by_the_slowest_evaluation_measured():
    from resume.adapters.megatron.watch import EVALUATION, LoopWatch

    clock = Clock()
    watch = LoopWatch(_watchdog(clock))
    watch.progress.progress(7)
    with watch.evaluation():
        assert watch.watchdog.open_phases()[0] == {"phase": "declared", "what": EVALUATION, "since": clock.now,
                                                   "bound_s": 100}  # first_s: none measured yet
        clock.now += 40
    assert watch.progress.phase == "iteration" and watch.progress.slowest[EVALUATION] == 40
    with watch.evaluation():
        assert watch.watchdog.open_phases()[0]["bound_s"] == 120  # factor x the slowest
        clock.now += 2
    with watch.evaluation():
        assert watch.watchdog.open_phases()[0]["bound_s"] == 120


def test_an_async_save_is_in_the_background_from_scheduled_to_committed():
    import types

    from resume.adapters.megatron.asyncsave import AsyncCommits, SaveSnapshot

    clock = Clock()
    watchdog = _watchdog(clock)
    seen: list[str] = []
    recorder = types.SimpleNamespace(
        run=None, before_save=lambda iteration: None,
        snapshot_save=lambda iteration, *a: SaveSnapshot(iteration, None, clock.now),
        commit_save=lambda snapshot, args: seen.append(watchdog.progress.phase))
    request = types.SimpleNamespace(finalize_fns=["megatron's"])
    request.add_finalize_fn = request.finalize_fns.append
    commits = AsyncCommits(lambda r: None, lambda **kw: None, watchdog=watchdog)
    watchdog.progress.progress(4)
    commits.save(recorder, 4, None, None, None, lambda: commits.schedule_async_save(request))
    assert watchdog.progress.background_since == clock.now
    assert [p["phase"] for p in watchdog.open_phases()] == ["iteration", "save-background"]
    clock.now += 30
    request.finalize_fns[-1]()  # Megatron's finalize step runs the commit
    assert seen == ["save"] and watchdog.progress.background_since is None
    assert watchdog.progress.slowest["save-background"] == 30 and watchdog.progress.phase == "iteration"


def test_each_wrapped_megatron_call_sets_its_phase_and_train_closes_the_watch():
    """install()'s wrappers (over stand-ins for megatron.training's functions, which record the
    phase they run in): load -> restore, save -> save, evaluation -> declared, a blocking finalize
    -> save, a counted train_step -> the iteration's progress, train()'s end -> closed."""
    import types

    from resume.adapters.megatron.install import _Wiring
    from resume.adapters.megatron.watch import LoopWatch

    clock = Clock()
    watch = LoopWatch(_watchdog(clock))
    seen: dict[str, str] = {}

    def megatron(name, result=None):
        def call(*a, **kw):
            seen[name] = watch.progress.phase
            return result
        return call

    checkpointing = types.SimpleNamespace(save_checkpoint=megatron("save"), load_checkpoint=megatron("load", (0, 0)))
    training = types.SimpleNamespace(
        train_step=megatron("train_step", ({}, False, False, False, 0, None, None, None)),
        checkpoint_and_decide_exit=megatron("decide", False), evaluate_and_print_results=megatron("evaluate"),
        maybe_finalize_async_save=megatron("finalize"), train=megatron("train", (6, 0)))
    args = types.SimpleNamespace(save=None, load=None, curr_iteration=4)
    wiring = _Wiring(checkpointing, training, lambda: args, None, {}, watch)

    wiring.load_checkpoint(None, None, None)
    wiring.train_step()
    assert watch.progress.phase == "iteration" and watch.progress.iteration == 5
    wiring.save_checkpoint(5, None, None, None, 0.0)
    wiring.evaluate_and_print_results("iteration 5", None, None, None, 5, None, None)
    wiring.maybe_finalize_async_save(blocking=False)
    assert seen["finalize"] == "iteration"
    wiring.maybe_finalize_async_save(blocking=True, terminate=True)
    assert seen == {"load": "restore", "train_step": "start-up", "save": "save", "evaluate": "declared",
                    "finalize": "save"}
    assert {"restore", "save", "evaluation"} <= set(watch.progress.slowest)
    assert wiring.train() == (6, 0) and seen["train"] == "iteration"
    assert watch.progress.phase == "closed"


def test_a_second_train_is_watched_again_with_the_same_run_and_bounds(tmp_path, monkeypatch):
    from resume.adapters.megatron import watch as watch_module

    from resume.storage import open_storage

    monkeypatch.setattr(watch_module, "_rank_and_world", lambda: (1, 2))
    own = HangBounds(floor_s=7, first_s=70)
    storage = open_storage(str(tmp_path / "save"))
    watch = watch_module.LoopWatch(_watchdog(Clock()), bounds=own)
    watch.maybe_attach(storage)
    w = watch.watchdog
    try:
        assert (w.rank, w.world_size, w.storage, w.bounds) == (1, 2, storage, own) and w._thread is not None
        watch.close()
        assert w.progress.phase == "closed" and w._thread is None
        watch.reopen()
        assert w.progress.phase == "start-up" and (w.storage, w.bounds) == (storage, own) and w._thread is not None
    finally:
        w.stop()
